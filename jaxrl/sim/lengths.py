"""Response-length distributions: empirical, lognormal, mixtures, and lengths that grow over training.

Every distribution draws integer lengths in [1, max_len]; mass above max_len lands on max_len, as a sampler
that stops at the length limit would make it. `sample(rng, n, step)` takes the learner step (policy version)
the samples are started at, so a distribution can change over training.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np


class LengthDist(abc.ABC):
  """Base class: integer response lengths in [1, max_len]."""

  max_len: int

  def sample(self, rng: np.random.Generator, n: int, step: int = 0) -> np.ndarray:
    if n < 0:
      raise ValueError(f"cannot draw a negative number of lengths (got {n})")
    raw = self._draw(rng, n, step)
    return np.clip(np.rint(raw), 1, self.max_len).astype(np.int64)

  @abc.abstractmethod
  def _draw(self, rng: np.random.Generator, n: int, step: int) -> np.ndarray:
    """n raw (unrounded, unclipped) lengths at training step `step`."""

  def mean(self, step: int = 0, n: int = 200_000, seed: int = 0) -> float:
    """Monte-Carlo mean of the clipped lengths (the quantity the simulator sees)."""
    return float(self.sample(np.random.default_rng(seed), n, step).mean())


def _check_max_len(owner: str, max_len: int):
  if not max_len >= 1:
    raise ValueError(f"{owner}: max_len must be >= 1 (got {max_len}); a distribution needs mass on [1, max_len]")


@dataclasses.dataclass(frozen=True)
class Empirical(LengthDist):
  """Resamples a run's logged lengths (uniformly, with replacement)."""

  lengths: tuple[int, ...]
  max_len: int = 0  # 0: the largest logged length

  def __init__(self, lengths: Sequence[int], max_len: int = 0):
    arr = np.asarray(lengths, np.float64).ravel()
    if arr.size == 0:
      raise ValueError("Empirical lengths: no lengths given; the distribution has no mass")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
      raise ValueError("Empirical lengths must be finite and >= 0")
    if not np.any(arr >= 1):
      raise ValueError("Empirical lengths: every length is 0; the distribution has no mass on lengths >= 1")
    object.__setattr__(self, "lengths", tuple(int(x) for x in arr))
    object.__setattr__(self, "max_len", int(max_len) if max_len else int(arr.max()))
    _check_max_len("Empirical", self.max_len)

  def _draw(self, rng, n, step):
    return np.asarray(self.lengths, np.float64)[rng.integers(0, len(self.lengths), n)]


@dataclasses.dataclass(frozen=True)
class LogNormal(LengthDist):
  """exp(N(log median, sigma^2)), clipped to [1, max_len]."""

  median: float
  sigma: float
  max_len: int

  def __post_init__(self):
    if not self.median > 0:
      raise ValueError(f"LogNormal: median must be > 0 (got {self.median})")
    if not self.sigma >= 0:
      raise ValueError(f"LogNormal: sigma must be >= 0 (got {self.sigma})")
    _check_max_len("LogNormal", self.max_len)

  def _draw(self, rng, n, step):
    return self.median * np.exp(self.sigma * rng.standard_normal(n))


@dataclasses.dataclass(frozen=True)
class Mixture(LengthDist):
  """Draws each length from component i with probability weights[i] / sum(weights)."""

  components: tuple[LengthDist, ...]
  weights: tuple[float, ...]

  def __init__(self, components: Sequence[LengthDist], weights: Sequence[float]):
    if len(components) == 0 or len(components) != len(weights):
      raise ValueError(f"Mixture needs one weight per component (got {len(components)} components, "
                       f"{len(weights)} weights)")
    w = np.asarray(weights, np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
      raise ValueError(f"Mixture weights must be finite and >= 0 (got {list(weights)})")
    if not w.sum() > 0:
      raise ValueError("Mixture weights sum to 0; the distribution has no mass")
    object.__setattr__(self, "components", tuple(components))
    object.__setattr__(self, "weights", tuple(float(x) for x in w / w.sum()))

  @property
  def max_len(self) -> int:
    return max(c.max_len for c in self.components)

  def _draw(self, rng, n, step):
    which = rng.choice(len(self.components), size=n, p=self.weights)
    out = np.empty(n, np.float64)
    for i, c in enumerate(self.components):
      idx = np.flatnonzero(which == i)
      out[idx] = c.sample(rng, idx.size, step)
    return out


@dataclasses.dataclass(frozen=True)
class Growing(LengthDist):
  """Lengths of `base` scaled by (1 + rate * step): responses get longer as training goes on."""

  base: LengthDist
  rate: float
  max_len: int

  def __post_init__(self):
    if not self.rate >= 0:
      raise ValueError(f"Growing: rate must be >= 0 (got {self.rate})")
    _check_max_len("Growing", self.max_len)

  def _draw(self, rng, n, step):
    if step < 0:
      raise ValueError(f"Growing: step must be >= 0 (got {step})")
    return self.base.sample(rng, n, step) * (1.0 + self.rate * step)


@dataclasses.dataclass(frozen=True)
class Scaled(LengthDist):
  """`base` with every length multiplied by `factor` (for sweeps over the mean response length)."""

  base: LengthDist
  factor: float
  max_len: int

  def __post_init__(self):
    if not self.factor > 0:
      raise ValueError(f"Scaled: factor must be > 0 (got {self.factor})")
    _check_max_len("Scaled", self.max_len)

  def _draw(self, rng, n, step):
    return self.base.sample(rng, n, step) * self.factor


def from_config(cfg) -> LengthDist:
  """A distribution from a config dict: kind = lognormal | mixture | empirical (+ growth_rate)."""
  kind = cfg["kind"]
  if kind == "lognormal":
    dist = LogNormal(cfg["median"], cfg["sigma"], cfg["max_len"])
  elif kind == "mixture":
    dist = Mixture([from_config(c) for c in cfg["components"]], cfg["weights"])
  elif kind == "empirical":
    if "path" in cfg and cfg["path"]:
      lengths = np.loadtxt(cfg["path"], ndmin=1)
    else:
      lengths = cfg["lengths"]
    dist = Empirical(lengths, cfg.get("max_len", 0))
  else:
    raise ValueError(f"unknown length distribution kind {kind!r}; use lognormal, mixture or empirical")
  if cfg.get("growth_rate", 0):
    dist = Growing(dist, cfg["growth_rate"], cfg.get("growth_max_len", dist.max_len))
  return dist


class Replay(LengthDist):
  """A run's own lengths, in group order, for the simulator: one per group ([groups]: forced lengths, the samples
  of a group share one) or one per sample ([groups, group_size]: natural lengths).

  The simulator draws a step's worth of groups at a time, in group order, with one fresh rng per simulated run:
  a new rng restarts the replay.
  """

  def __init__(self, lengths: np.ndarray, group_size: int):
    self.lengths, self.group_size = np.asarray(lengths, np.int64), group_size
    if self.lengths.ndim == 2 and self.lengths.shape[1] != group_size:
      raise ValueError(f"Replay: per-sample lengths of {self.lengths.shape[1]} samples a group, not {group_size}")
    if self.lengths.ndim not in (1, 2) or not self.lengths.size:
      raise ValueError(f"Replay: lengths must be [groups] or [groups, group_size] (got shape {self.lengths.shape})")
    self.max_len = int(self.lengths.max())
    self._rng, self._next = None, 0

  def _draw(self, rng, n, step):
    if n % self.group_size:
      raise ValueError(f"Replay draws whole groups: {n} is not a multiple of group_size={self.group_size}")
    if rng is not self._rng:
      self._rng, self._next = rng, 0
    groups = n // self.group_size
    if self._next + groups > len(self.lengths):
      raise ValueError(f"Replay ran out of groups: the simulation wants more than the {len(self.lengths)} logged")
    out = self.lengths[self._next: self._next + groups]
    self._next += groups
    return out.ravel() if out.ndim == 2 else np.repeat(out, self.group_size)
