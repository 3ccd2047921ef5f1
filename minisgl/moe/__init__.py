"""Mixture-of-experts compute backends (chosen by name through a registry)."""

from minisgl.moe.base import BaseMoeBackend, create_moe_backend

__all__ = ["BaseMoeBackend", "create_moe_backend"]
