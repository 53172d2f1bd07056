"""Attention kernels: one function per operation, a backend switch inside, an XLA reference on every backend."""

from jaxrl.kernels.cached_attention import cached_attention
from jaxrl.kernels.paged_attention import paged_attention

__all__ = ["cached_attention", "paged_attention"]
