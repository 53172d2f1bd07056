"""Attention kernels: one function per operation, a backend switch inside, an XLA reference on every backend.

Decode attention over the dense cache (cached_attention) and through page tables (paged_attention); the learner's
full-sequence attention over packed rows is jaxrl.kernels.train_attention.
"""

from jaxrl.kernels.cached_attention import cached_attention
from jaxrl.kernels.paged_attention import paged_attention

__all__ = ["cached_attention", "paged_attention"]
