"""Mixture-of-experts compute backends (chosen by name through a registry)."""

from minisgl.moe.base import BaseMoeBackend, MoeCap
from minisgl.moe.registry import MOE_BACKENDS, create_moe_backend

__all__ = ["BaseMoeBackend", "MOE_BACKENDS", "MoeCap", "create_moe_backend"]
