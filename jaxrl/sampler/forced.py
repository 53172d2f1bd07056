"""Forced completion lengths, for benchmarks: group g generates exactly lengths(g) tokens, EOS and stop ids ignored.

RL's generation has a long tail (a few samples run far longer than the median); a random model's natural lengths do
not, so benchmarks of the pipeline force them (config `sampler.forced_lengths`, off by default). A group's length
depends on (seed, group id) alone: the sync and the pipeline runs of one config generate the same lengths for the
same groups, in one process or several, and a simulator can replay them (`LognormalLengths.of`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxrl.sampler.sampler import Sampler

Z99 = 2.3263  # the standard normal's 99th percentile


@dataclasses.dataclass(frozen=True)
class LognormalLengths:
  """Lognormal completion length per group: median `median`, p99 / median = p99_ratio, clipped to [1, max_len]."""

  median: float
  p99_ratio: float
  max_len: int
  seed: int = 0

  def __post_init__(self):
    if not (self.median > 0 and self.p99_ratio >= 1 and self.max_len >= 1):
      raise ValueError(f"forced lengths need median > 0, p99_ratio >= 1 and max_len >= 1 (got median={self.median}, "
                       f"p99_ratio={self.p99_ratio}, max_len={self.max_len})")

  def __call__(self, group_id: int) -> int:
    z = np.random.default_rng((self.seed, int(group_id))).standard_normal()
    sigma = np.log(self.p99_ratio) / Z99
    return int(np.clip(np.rint(self.median * np.exp(sigma * z)), 1, self.max_len))

  def of(self, group_ids: Sequence[int]) -> np.ndarray:
    return np.array([self(g) for g in group_ids], np.int64)


class ForcedLengths(Sampler):
  """A Sampler whose group g generates exactly length_of(g) tokens (EOS and stop ids ignored)."""

  def __init__(self, length_of: Callable[[int], int], *args, **kw):
    super().__init__(*args, **kw)
    self.length_of = length_of

  def submit(self, prompt_tokens, group_id: int, n: int = 1, meta: dict | None = None, **kw) -> None:
    kw.update(max_tokens=int(self.length_of(group_id)), ignore_eos=True, stop_token_ids=())
    super().submit(prompt_tokens, group_id, n, meta, **kw)
