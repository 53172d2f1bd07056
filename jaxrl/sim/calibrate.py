"""Calibration: fit the decode curve and learner throughput to measurements of a short profiling run.

The decode fit uses the cost model's own form, t(B, S) = overhead + kv * B * S + weights * smax(1, B / knee)
(knee = weights / compute_s_per_seq). For a fixed knee this is linear in (overhead, kv, weights), so the fit
scans the knee on a log grid, solves a non-negative least-squares problem in relative error at each point,
and refines the best knee by golden-section search.

JSON format (`Calibration.save` / `Calibration.load`), format tag "jaxrl.sim.calibration/1":
  {"format": ..., "devices_per_engine": int, "max_batch": int,
   "decode": {"overhead_s", "weights_s", "kv_s_per_token", "compute_s_per_seq", "knee_sharpness" (null: inf)},
   "prefill_s_per_token", "train_tokens_per_s_per_device", "weight_bytes", "link_bandwidth",
   "decode_contention", "train_contention" (1.0 when absent), "update_s", "train_overhead_s", "pull_bandwidth"
   (0.0 when absent),
   "fit": {"n", "rms_rel_error", "max_rel_error", "batch_range", "context_range"},
   "measurements": {"decode": [[batch, context, seconds], ...], "train_tokens_per_s_per_device": ...}}
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence

import numpy as np

from jaxrl.sim.costs import Costs, DecodeCurve, smoothmax

FORMAT = "jaxrl.sim.calibration/1"


@dataclasses.dataclass(frozen=True)
class Measurements:
  """What a profiling run measured on one engine and on the learner."""

  decode: tuple[tuple[int, int, float], ...]  # (batch, context tokens per sequence, seconds per decode step)
  train_tokens_per_s_per_device: float
  max_batch: int  # decode slots the engine had (its KV-cache limit)
  weight_bytes: float  # bytes of one copy of the weights as sent to the sampler
  link_bandwidth: float  # bytes/s per device measured for a weight transfer
  devices_per_engine: int = 1
  prefill_s_per_token: float = 0.0
  knee_sharpness: float = math.inf  # smoothing of the fitted knee (inf: hard roofline)
  # Slowdown of a decode step (a train step) while the learner (the sampler) runs at the same time: > 1 where both
  # share cores or host threads (CPU devices), ~1 on separate chips. Only the pipeline runs both at once.
  decode_contention: float = 1.0
  train_contention: float = 1.0
  # Sampler pause for an in-flight weight update beyond the transfer (jaxrl's on_update="recompute" recomputes the
  # live slots' KV cache). Only the pipeline updates weights under live samples.
  update_s: float = 0.0
  # Learner time per step outside the train step and its waits for data (batch hand-off, coordination, logging).
  train_overhead_s: float = 0.0

  def __post_init__(self):
    rows = tuple(tuple(r) for r in self.decode)
    object.__setattr__(self, "decode", rows)
    if len(rows) < 3:
      raise ValueError(f"need at least 3 decode measurements to fit 3 coefficients (got {len(rows)})")
    for r in rows:
      if len(r) != 3:
        raise ValueError(f"a decode measurement is (batch, context, seconds); got {r}")
      b, s, t = r
      if not (b >= 1 and s >= 0 and t > 0):
        raise ValueError(f"bad decode measurement {r}: need batch >= 1, context >= 0, seconds > 0")
    for name in ("train_tokens_per_s_per_device", "max_batch", "weight_bytes", "link_bandwidth",
                 "devices_per_engine", "knee_sharpness", "decode_contention", "train_contention"):
      if not getattr(self, name) > 0:
        raise ValueError(f"Measurements.{name} must be > 0 (got {getattr(self, name)})")
    for name in ("prefill_s_per_token", "update_s", "train_overhead_s"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"Measurements.{name} must be >= 0 (got {getattr(self, name)})")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """A fitted cost model for one model on one engine shape; `costs()` gives the simulator's input."""

  decode: DecodeCurve
  devices_per_engine: int
  max_batch: int
  prefill_s_per_token: float
  train_tokens_per_s_per_device: float
  weight_bytes: float
  link_bandwidth: float
  fit: dict
  measurements: Measurements | None = None
  decode_contention: float = 1.0  # see Measurements
  train_contention: float = 1.0
  update_s: float = 0.0
  train_overhead_s: float = 0.0  # see Measurements
  pull_bandwidth: float = 0.0  # Costs.pull_bandwidth: samplers pull each version (the weight service); 0: pushed

  def costs(self, **overrides) -> Costs:
    kw = dict(decode=self.decode, devices_per_engine=self.devices_per_engine, max_batch=self.max_batch,
              prefill_s_per_token=self.prefill_s_per_token, train_overhead_s=self.train_overhead_s,
              train_tokens_per_s_per_device=self.train_tokens_per_s_per_device, weight_bytes=self.weight_bytes,
              link_bandwidth=self.link_bandwidth, pull_bandwidth=self.pull_bandwidth)
    kw.update(overrides)
    return Costs(**kw)

  def to_json(self) -> dict:
    d = dataclasses.asdict(self.decode)
    d["knee_sharpness"] = None if math.isinf(d["knee_sharpness"]) else d["knee_sharpness"]
    out = dict(format=FORMAT, devices_per_engine=self.devices_per_engine, max_batch=self.max_batch, decode=d,
               prefill_s_per_token=self.prefill_s_per_token,
               train_tokens_per_s_per_device=self.train_tokens_per_s_per_device, weight_bytes=self.weight_bytes,
               link_bandwidth=self.link_bandwidth, decode_contention=self.decode_contention,
               train_contention=self.train_contention, update_s=self.update_s,
               train_overhead_s=self.train_overhead_s, pull_bandwidth=self.pull_bandwidth, fit=self.fit)
    if self.measurements is not None:
      m = dataclasses.asdict(self.measurements)
      m["decode"] = [list(r) for r in self.measurements.decode]
      m["knee_sharpness"] = None if math.isinf(m["knee_sharpness"]) else m["knee_sharpness"]
      out["measurements"] = m
    return out

  @classmethod
  def from_json(cls, d: dict) -> Calibration:
    if d.get("format") != FORMAT:
      raise ValueError(f"not a calibration file: format is {d.get('format')!r}, expected {FORMAT!r}")
    dec = dict(d["decode"])
    dec["knee_sharpness"] = math.inf if dec["knee_sharpness"] is None else dec["knee_sharpness"]
    m = None
    if d.get("measurements"):
      m = dict(d["measurements"])
      m["knee_sharpness"] = math.inf if m["knee_sharpness"] is None else m["knee_sharpness"]
      m = Measurements(**m)
    return cls(decode=DecodeCurve(**dec), devices_per_engine=d["devices_per_engine"], max_batch=d["max_batch"],
               prefill_s_per_token=d["prefill_s_per_token"],
               train_tokens_per_s_per_device=d["train_tokens_per_s_per_device"], weight_bytes=d["weight_bytes"],
               link_bandwidth=d["link_bandwidth"], fit=d["fit"], measurements=m,
               decode_contention=d.get("decode_contention", 1.0), train_contention=d.get("train_contention", 1.0),
               update_s=d.get("update_s", 0.0), train_overhead_s=d.get("train_overhead_s", 0.0),
               pull_bandwidth=d.get("pull_bandwidth", 0.0))

  def save(self, path: str):
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=2)

  @classmethod
  def load(cls, path: str) -> Calibration:
    with open(path) as f:
      return cls.from_json(json.load(f))


def _nnls_rel(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, float]:
  """min sum(((x @ c) - t) / t)^2 over c >= 0 (3 unknowns: every active set is tried)."""
  a, y = x / t[:, None], np.ones_like(t)
  best, best_err = np.zeros(x.shape[1]), float(np.sum(y**2))
  for k in range(1, x.shape[1] + 1):
    for cols in itertools.combinations(range(x.shape[1]), k):
      sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
      if np.all(sol >= 0):
        c = np.zeros(x.shape[1])
        c[list(cols)] = sol
        err = float(np.sum((a @ c - y) ** 2))
        if err < best_err:
          best, best_err = c, err
  return best, best_err


def _fit_at_knee(b, s, t, knee, p) -> tuple[np.ndarray, float]:
  x = np.stack([np.ones_like(b), b * s, smoothmax(1.0, b / knee, p)], axis=1)
  return _nnls_rel(x, t)


def fit_decode(rows: Sequence[tuple[int, int, float]], knee_sharpness: float = math.inf) -> tuple[DecodeCurve, dict]:
  """Fits a DecodeCurve to (batch, context, seconds) rows; returns it with fit statistics."""
  arr = np.asarray(rows, np.float64)
  b, s, t = arr[:, 0], arr[:, 1], arr[:, 2]
  lo, hi = math.log(b.min() / 4), math.log(b.max() * 4)
  grid = np.linspace(lo, hi, 161)
  errs = [_fit_at_knee(b, s, t, math.exp(g), knee_sharpness)[1] for g in grid]
  i = int(np.argmin(errs))
  a, c = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
  golden = (math.sqrt(5) - 1) / 2
  for _ in range(60):  # golden-section search between the best grid point's neighbours
    x1, x2 = c - golden * (c - a), a + golden * (c - a)
    if _fit_at_knee(b, s, t, math.exp(x1), knee_sharpness)[1] <= _fit_at_knee(b, s, t, math.exp(x2),
                                                                               knee_sharpness)[1]:
      c = x2
    else:
      a = x1
  knee = math.exp((a + c) / 2)
  if errs[i] < _fit_at_knee(b, s, t, knee, knee_sharpness)[1]:
    knee = math.exp(grid[i])
  (overhead, kv, weights), _ = _fit_at_knee(b, s, t, knee, knee_sharpness)
  curve = DecodeCurve(weights_s=float(weights), kv_s_per_token=float(kv), compute_s_per_seq=float(weights / knee),
                      overhead_s=float(overhead), knee_sharpness=knee_sharpness)
  rel = curve.step_time(b, b * s) / t - 1
  stats = dict(n=int(t.size), rms_rel_error=float(np.sqrt(np.mean(rel**2))), max_rel_error=float(np.abs(rel).max()),
               batch_range=[float(b.min()), float(b.max())], context_range=[float(s.min()), float(s.max())])
  return curve, stats


def fit_calibration(measurements: Measurements) -> Calibration:
  """The calibration a profiling run's measurements imply."""
  curve, stats = fit_decode(measurements.decode, measurements.knee_sharpness)
  m = measurements
  return Calibration(decode=curve, devices_per_engine=m.devices_per_engine, max_batch=m.max_batch,
                     prefill_s_per_token=m.prefill_s_per_token,
                     train_tokens_per_s_per_device=m.train_tokens_per_s_per_device, weight_bytes=m.weight_bytes,
                     link_bandwidth=m.link_bandwidth, fit=stats, measurements=m,
                     decode_contention=m.decode_contention, train_contention=m.train_contention, update_s=m.update_s,
                     train_overhead_s=m.train_overhead_s)
