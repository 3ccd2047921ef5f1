"""Where the CPU path's big buffers live: transparent huge pages for the KV pool and the weights
the GEMMs stream, the projections optionally in the AMX tile (VNNI) layout.

Decode attention reads each request's slots scattered over the pool, and a decode step streams
every weight once: on 4 KiB pages nearly every access of both is a TLB miss, which also stalls
the kernels' software prefetches. Linux gives huge pages (THP in madvise mode) to a buffer that
asks for them before its first write.
"""

from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterable, List, Tuple

import torch

from minisgl.kvcache.pool import KVCachePool
from minisgl.layers.quant import QuantWeight, vnni_pack, vnni_packable


def advise_huge(buf: torch.Tensor) -> None:
    """Ask Linux (THP in madvise mode) for huge pages under `buf`, before its first write, so its
    pages fault in huge; a no-op where madvise is unavailable."""
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        huge = 2 << 20
        start = -(-buf.data_ptr() // huge) * huge
        end = (buf.data_ptr() + buf.numel() * buf.element_size()) // huge * huge
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)  # MADV_HUGEPAGE
    except (OSError, AttributeError):
        pass


def release_freed() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim): a freed weight that came from
    the heap, not its own mapping, would otherwise stay resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def hugepage_pool(kv_cache: KVCachePool) -> None:
    """Re-allocate the KV pool on transparent huge pages.

    Decode attention reads each request's slots, which the allocator scatters over the pool:
    on 4 KiB pages nearly every 128-byte key row costs a TLB miss, even with the kernel's
    prefetching (docs/PERFORMANCE.md, "CPU forward")."""
    if kv_cache.nbytes < (64 << 20):
        return
    for name in ("buffer", "scales"):  # (an int8 pool's scales are read per key as well)
        old = getattr(kv_cache, name)
        if old is None:
            continue
        shape, dtype = old.shape, old.dtype
        del old
        setattr(kv_cache, name, torch.empty(0, dtype=dtype))  # free the old one first: no 2x peak
        buf = torch.empty(shape, dtype=dtype)
        advise_huge(buf)
        setattr(kv_cache, name, buf.zero_())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


class _HugeArena:
    """One buffer advised for transparent huge pages, handed out as 64-byte-aligned copies."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes + (2 << 20), dtype=torch.uint8)
        advise_huge(self.buf)
        self.off = -self.buf.data_ptr() % 64

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        view = self.buf[self.off : self.off + nbytes].view(t.dtype).view(t.shape).copy_(t)
        self.off += _aligned(nbytes)
        return view


def place_weights(model: Any, vnni_names: Iterable[str] = ()) -> None:
    """Move the 2-D weights a step streams (the projections, the LM head, the embedding) onto
    transparent huge pages; the parameters named in `vnni_names` land in the AMX tile layout
    (layers/quant.py vnni_pack), which the C GEMMs read in place instead of re-packing the plain
    weight on every call. One weight at a time: each old storage is freed (and handed back) as
    its copy lands, so memory peaks at one weight above 1x."""
    vnni = set(vnni_names)
    groups: Dict[int, List[Tuple[str, torch.nn.Parameter]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight")) and p.dim() == 2:
            # a tied head is a second parameter on the embedding's storage: both move together
            group = groups.setdefault(p.data_ptr(), [])
            if all(q is not p for _, q in group):
                group.append((name, p))

    def placed(name: str, t: torch.Tensor) -> torch.Tensor:
        return vnni_pack(t) if name in vnni and vnni_packable(t) else t

    total = sum(_aligned(g[0][1].numel() * g[0][1].element_size()) for g in groups.values())
    arena = _HugeArena(total) if total >= (16 << 20) else None
    for group in groups.values():
        name, first = group[0]
        t = placed(name, first.data)
        view = arena.copy(t) if arena is not None else t
        for _, p in group:
            p.data = view
        del t
        release_freed()


def hugepage_records(quant: Dict[str, QuantWeight]) -> None:
    """Move the quantized weights' records onto transparent huge pages: a batch-1 step streams
    all of them, and on 4 KiB pages every 4 KiB of the stream is a TLB miss, which
    also stalls the kernel's software prefetches."""
    unique = list({id(q): q for q in quant.values()}.values())  # a tied head is listed twice
    total = sum(_aligned(q.records.numel()) for q in unique)
    if total < (16 << 20):
        return
    arena = _HugeArena(total)
    for q in unique:
        q.records = arena.copy(q.records)
    release_freed()
