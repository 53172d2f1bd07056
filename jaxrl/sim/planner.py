"""Planner: sweep the sampler/learner split (and batch size, staleness bound) of a fixed pool; predictions.

Each configuration is simulated as a pipeline and compared with the synchronous baseline on the whole pool
(every device samples, then every device trains) at the same batch size. Configurations that cannot hold an
engine, whose learner cannot hold the training state, or whose staleness exceeds the bound are kept in the
table with the reason and never chosen.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxrl.sim.calibrate import Calibration
from jaxrl.sim.costs import Costs
from jaxrl.sim.lengths import Empirical, LengthDist
from jaxrl.sim.simulate import RunSpec, SimResult, simulate_pipeline, simulate_sync


@dataclasses.dataclass(frozen=True)
class PlanRow:
  sampler_devices: int
  learner_devices: int
  batch_size: int
  max_staleness: int
  feasible: bool
  reason: str = ""  # why a configuration was dropped
  step_time_s: float = math.nan
  sync_step_time_s: float = math.nan
  speedup: float = math.nan  # sync step time / pipeline step time at the same batch size
  samples_per_s: float = math.nan
  staleness_mean: float = math.nan
  staleness_max: int = -1
  staleness_length_corr: float = math.nan
  sampler_idle: float = math.nan
  learner_idle: float = math.nan


@dataclasses.dataclass
class Plan:
  pool: int
  rows: list[PlanRow]
  sync: dict[int, SimResult]  # batch size -> synchronous baseline on the whole pool
  results: dict[tuple[int, int, int], SimResult]  # (sampler devices, batch size, k) -> pipeline run

  @property
  def feasible(self) -> list[PlanRow]:
    return [r for r in self.rows if r.feasible]

  @property
  def best(self) -> PlanRow | None:
    """The feasible configuration with the most samples per second."""
    rows = self.feasible
    return max(rows, key=lambda r: r.samples_per_s) if rows else None

  def best_result(self) -> SimResult | None:
    b = self.best
    return None if b is None else self.results[(b.sampler_devices, b.batch_size, b.max_staleness)]

  def table(self) -> str:
    head = (f"{'sampler':>7} {'learner':>7} {'batch':>6} {'k':>3} {'step_s':>9} {'sync_s':>9} {'speedup':>7} "
            f"{'smp/s':>8} {'stale':>6} {'max':>4} {'corr':>6} {'s_idle':>6} {'l_idle':>6}  note")
    lines = [head, "-" * len(head)]
    best = self.best
    for r in self.rows:
      if not r.feasible:
        lines.append(f"{r.sampler_devices:>7} {r.learner_devices:>7} {r.batch_size:>6} {r.max_staleness:>3} "
                     f"{'-':>9} {'-':>9} {'-':>7} {'-':>8} {'-':>6} {'-':>4} {'-':>6} {'-':>6} {'-':>6}  "
                     f"dropped: {r.reason}")
        continue
      note = "<- best" if r is best else ""
      lines.append(f"{r.sampler_devices:>7} {r.learner_devices:>7} {r.batch_size:>6} {r.max_staleness:>3} "
                   f"{r.step_time_s:>9.4g} {r.sync_step_time_s:>9.4g} {r.speedup:>7.3f} {r.samples_per_s:>8.2f} "
                   f"{r.staleness_mean:>6.2f} {r.staleness_max:>4} {r.staleness_length_corr:>6.2f} "
                   f"{r.sampler_idle:>6.2f} {r.learner_idle:>6.2f}  {note}")
    return "\n".join(lines)


def default_splits(pool: int, devices_per_engine: int, learner_min_devices: int) -> list[int]:
  """Sampler sizes that are whole engines and leave the learner at least its minimum."""
  return [s for s in range(devices_per_engine, pool, devices_per_engine) if pool - s >= learner_min_devices]


def plan(costs: Costs, workload: RunSpec, pool: int, *, staleness_bound: int, batch_sizes: Sequence[int] = (),
         ks: Sequence[int] = (), splits: Sequence[int] = (), learner_min_devices: int = 1) -> Plan:
  """Sweeps splits x batch sizes x k; `workload`'s device counts are replaced by each split.

  Empty `batch_sizes` / `ks` mean the workload's own; empty `splits` means every whole-engine split.
  """
  if pool < 2:
    raise ValueError(f"pool must have at least 2 devices to split (got {pool})")
  if staleness_bound < 0:
    raise ValueError(f"staleness_bound must be >= 0 (got {staleness_bound})")
  if learner_min_devices < 1:
    raise ValueError(f"learner_min_devices must be >= 1 (got {learner_min_devices})")
  if pool < learner_min_devices:
    raise ValueError(f"the learner needs {learner_min_devices} devices for its training state; the pool has "
                     f"{pool}")
  splits = list(splits) or default_splits(pool, costs.devices_per_engine, learner_min_devices)
  for s in splits:
    if not 1 <= s < pool:
      raise ValueError(f"split of {s} sampler devices does not fit a pool of {pool} (need 1 <= split < pool, "
                       "leaving the learner at least one device)")
  batch_sizes = list(batch_sizes) or [workload.batch_size]
  ks = list(ks) or [workload.max_staleness]
  rows, sync, results = [], {}, {}
  for b in batch_sizes:
    base = workload.replace(batch_size=b)
    sync[b] = simulate_sync(costs, base.replace(sampler_devices=pool - 1, learner_devices=1), colocated=True)
    for s in splits:
      for k in ks:
        row = dict(sampler_devices=s, learner_devices=pool - s, batch_size=b, max_staleness=k)
        if s < costs.devices_per_engine:
          rows.append(PlanRow(**row, feasible=False, reason=f"an engine needs {costs.devices_per_engine} devices"))
          continue
        if pool - s < learner_min_devices:
          rows.append(PlanRow(**row, feasible=False,
                              reason=f"learner memory needs >= {learner_min_devices} devices"))
          continue
        if k > staleness_bound:
          rows.append(PlanRow(**row, feasible=False, reason=f"k={k} exceeds the staleness bound {staleness_bound}"))
          continue
        r = simulate_pipeline(costs, base.replace(sampler_devices=s, learner_devices=pool - s, max_staleness=k))
        results[(s, b, k)] = r
        summ = r.summary()
        ok = summ["staleness_max"] <= staleness_bound
        rows.append(PlanRow(**row, feasible=ok, reason="" if ok else "observed staleness exceeds the bound",
                            step_time_s=r.step_time_s, sync_step_time_s=sync[b].step_time_s,
                            speedup=sync[b].step_time_s / r.step_time_s, samples_per_s=b / r.step_time_s,
                            staleness_mean=summ["staleness_mean"], staleness_max=summ["staleness_max"],
                            staleness_length_corr=summ["staleness_length_corr"],
                            sampler_idle=r.sampler_idle_frac, learner_idle=r.learner_idle_frac))
  return Plan(pool=pool, rows=rows, sync=sync, results=results)


@dataclasses.dataclass(frozen=True)
class RunDescription:
  """A real run to predict (what bench/pipeline.py runs): devices, batch shape, lengths, staleness bound."""

  sampler_devices: int
  learner_devices: int
  batch_size: int
  group_size: int
  lengths: Sequence[int] | LengthDist  # logged response lengths, or a distribution
  max_staleness: int
  prompt_len: int = 256
  steps: int = 8
  seed: int = 0


@dataclasses.dataclass
class Prediction:
  sync_step_s: float  # synchronous loop on the same split (sampler devices sample, learner devices train)
  sync_colocated_step_s: float  # synchronous loop with every device sampling, then every device training
  pipeline_step_s: float
  speedup: float  # sync_step_s / pipeline_step_s
  sync: SimResult
  sync_colocated: SimResult
  pipeline: SimResult


def predict(calibration: Calibration | Costs, run: RunDescription) -> Prediction:
  """Predicted sync and pipeline step times of a run from a calibration (or any Costs)."""
  costs = calibration.costs() if isinstance(calibration, Calibration) else calibration
  lengths = run.lengths if isinstance(run.lengths, LengthDist) else Empirical(np.asarray(run.lengths))
  spec = RunSpec(sampler_devices=run.sampler_devices, learner_devices=run.learner_devices,
                 batch_size=run.batch_size, group_size=run.group_size, max_staleness=run.max_staleness,
                 lengths=lengths, prompt_len=run.prompt_len, steps=run.steps, seed=run.seed)
  sync = simulate_sync(costs, spec, colocated=False)
  colocated = simulate_sync(costs, spec, colocated=True)
  pipe = simulate_pipeline(costs, spec)
  return Prediction(sync_step_s=sync.step_time_s, sync_colocated_step_s=colocated.step_time_s,
                    pipeline_step_s=pipe.step_time_s, speedup=sync.step_time_s / pipe.step_time_s, sync=sync,
                    sync_colocated=colocated, pipeline=pipe)
