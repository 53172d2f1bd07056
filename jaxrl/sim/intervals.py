"""Predictions as intervals: step time over seeds (which lengths are drawn) and over windows of a run.

One simulated run gives one step time for one draw of lengths; a real run of the same configuration sees other
draws, and over a short window a pipeline's steps come in bursts. `step_time_interval` reruns the simulation
over seeds and reports the spread of the per-run step time and of the step time over windows of
lookahead + 1 steps (one burst), pooled over the seeds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl.sim.simulate import RunSpec, SimResult


@dataclasses.dataclass(frozen=True)
class Interval:
  """Step time in seconds: the median run and the [q, 1 - q] quantiles over seeds and over windows."""

  median: float
  lo: float  # quantile q of the per-seed step times
  hi: float  # quantile 1 - q of the per-seed step times
  window_lo: float  # quantile q of the step time over windows of `window` steps, pooled over seeds
  window_hi: float
  window: int
  per_seed: tuple[float, ...]

  def __str__(self) -> str:
    return (f"{self.median:.4g} s/step (seeds: {self.lo:.4g}-{self.hi:.4g}; windows of {self.window} steps: "
            f"{self.window_lo:.4g}-{self.window_hi:.4g})")


def window_step_times(result: SimResult, window: int) -> np.ndarray:
  """Mean step time over consecutive non-overlapping windows of `window` measured steps."""
  end = result.step_end_s
  w0 = result.spec.warmup
  start = np.concatenate([[0.0], end])[w0:]  # the measured steps' boundaries
  n = (start.size - 1) // window
  if n < 1:
    raise ValueError(f"a window of {window} steps needs at least that many measured steps (got {start.size - 1})")
  edges = start[: n * window + 1 : window]
  return np.diff(edges) / window


def step_time_interval(simulate: Callable[[RunSpec], SimResult], spec: RunSpec, seeds: int = 8,
                       q: float = 0.1) -> Interval:
  """Runs `simulate(spec)` for seeds spec.seed .. spec.seed + seeds - 1 and summarises the step times."""
  if seeds < 1 or not 0 <= q < 0.5:
    raise ValueError(f"need seeds >= 1 and 0 <= q < 0.5 (got {seeds}, {q})")
  window = spec.lookahead + 1
  per_seed, windows = [], []
  for i in range(seeds):
    r = simulate(spec.replace(seed=spec.seed + i))
    per_seed.append(r.step_time_s)
    windows.append(window_step_times(r, window))
  per_seed_a, windows_a = np.asarray(per_seed), np.concatenate(windows)
  return Interval(median=float(np.median(per_seed_a)), lo=float(np.quantile(per_seed_a, q)),
                  hi=float(np.quantile(per_seed_a, 1 - q)), window_lo=float(np.quantile(windows_a, q)),
                  window_hi=float(np.quantile(windows_a, 1 - q)), window=window, per_seed=tuple(per_seed))
