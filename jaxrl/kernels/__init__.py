"""Attention kernels: one function per operation, a backend switch inside, an XLA reference on every backend."""

from jaxrl.kernels.cached_attention import cached_attention

__all__ = ["cached_attention"]
