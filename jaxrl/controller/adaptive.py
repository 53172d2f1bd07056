"""rl.max_staleness="auto": the staleness bound k moves within [k_min, k_max] from the drift measured in training.

Version counts say how old a sample is, not how far the policy moved since it was drawn; the learner measures
that directly every step: the effective sample size of the importance weights it applied (ess_applied_frac) and
KL(mu || pi) on the trained tokens (kl_behavior). When both say the drift is small the sampler may run further
ahead (more overlap, more throughput); when either says it is large, k comes down. A decision uses the mean of
the steps since the last change, and waits `window` steps after a change so that it sees data sampled under the
new bound.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AutoStaleness:
  """Bounds and thresholds of the adaptive staleness bound (the run config's rl.auto_staleness)."""

  k_min: int = 0
  k_max: int = 4
  ess_low: float = 0.7  # mean ESS fraction below this: k - 1
  ess_high: float = 0.9  # mean ESS fraction above this, and KL below kl_high / 2: k + 1
  kl_high: float = 0.05  # mean per-token KL(mu || pi) above this: k - 1
  window: int = 3  # steps measured before a decision (and after each change)

  def __post_init__(self):
    if not 0 <= self.k_min <= self.k_max:
      raise ValueError(f"need 0 <= k_min <= k_max (got {self.k_min}, {self.k_max})")
    if not 0 < self.ess_low < self.ess_high <= 1:
      raise ValueError(f"need 0 < ess_low < ess_high <= 1 (got {self.ess_low}, {self.ess_high})")
    if not self.kl_high > 0:
      raise ValueError(f"kl_high must be > 0 (got {self.kl_high})")
    if self.window < 1:
      raise ValueError(f"window must be >= 1 (got {self.window})")


def decide(k: int, ess: float, kl: float, cfg: AutoStaleness) -> int:
  """The next k from the current one and the mean measured ESS fraction and KL(mu || pi)."""
  if ess < cfg.ess_low or kl > cfg.kl_high:
    return max(cfg.k_min, k - 1)
  if ess > cfg.ess_high and kl < 0.5 * cfg.kl_high:
    return min(cfg.k_max, k + 1)
  return k


class AdaptiveStaleness:
  """Feeds per-step measurements to `decide`; `k` is the bound to admit under now (it starts at k_min)."""

  def __init__(self, cfg: AutoStaleness):
    self.cfg = cfg
    self.k = cfg.k_min
    self._ess: list[float] = []
    self._kl: list[float] = []

  def observe(self, ess_applied_frac: float, kl_behavior: float) -> int:
    """Records one learner step's measurements; returns k for the next admissions."""
    self._ess.append(float(ess_applied_frac))
    self._kl.append(float(kl_behavior))
    if len(self._ess) >= self.cfg.window:
      k = decide(self.k, sum(self._ess) / len(self._ess), sum(self._kl) / len(self._kl), self.cfg)
      if k != self.k:
        self.k, self._ess, self._kl = k, [], []
      else:  # keep a sliding window while nothing changes
        self._ess, self._kl = self._ess[1:], self._kl[1:]
    return self.k
