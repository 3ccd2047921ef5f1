"""Small fused ops with torch fallbacks. CUDA kernels are imported lazily, only on CUDA tensors."""

from minisgl.kernel.store import store_kv

__all__ = ["store_kv"]
