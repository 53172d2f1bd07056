"""Planner: sweep the sampler/learner split (and batch size, staleness bound) of a fixed pool; predictions.

Each configuration is simulated as a pipeline and compared with the synchronous baseline on the whole pool
(every device samples, then every device trains) at the same batch size. Configurations that cannot hold an
engine, whose learner cannot hold the training state, or whose staleness exceeds the bound are kept in the
table with the reason and never chosen. The recommendation is the fastest per trained completion token, sync
included: a pipeline that trains shorter completions per sample (the short groups first, under its staleness
bound) is not faster for finishing more samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxrl.learner.packing import packed_rows, row_buckets
from jaxrl.sim.calibrate import Calibration
from jaxrl.sim.costs import Costs
from jaxrl.sim.lengths import Empirical, LengthDist
from jaxrl.sim.placement import Placement
from jaxrl.sim.sampler_timeline import busy_in
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
  tokens_per_s: float = math.nan  # completion tokens trained per second
  token_speedup: float = math.nan  # tokens_per_s over the sync baseline's at the same batch size
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
    """The feasible pipeline configuration that trains the most completion tokens per second."""
    rows = self.feasible
    return max(rows, key=lambda r: r.tokens_per_s) if rows else None

  @property
  def best_sync(self) -> int:
    """The batch size at which the synchronous baseline trains the most completion tokens per second."""
    return max(self.sync, key=lambda b: self.sync[b].tokens_per_s)

  @property
  def recommended(self) -> Recommendation:
    """The fastest per trained token: the best pipeline row if it beats the best sync baseline, else sync."""
    b = self.best_sync
    sync_tps = self.sync[b].tokens_per_s
    best = self.best
    if best is not None and best.tokens_per_s > sync_tps:
      return Recommendation("pipeline", best.batch_size, best.tokens_per_s, best.tokens_per_s / sync_tps, best)
    ratio = best.tokens_per_s / sync_tps if best is not None else math.nan
    return Recommendation("sync", b, sync_tps, ratio, best)

  def best_result(self) -> SimResult | None:
    b = self.best
    return None if b is None else self.results[(b.sampler_devices, b.batch_size, b.max_staleness)]

  def table(self) -> str:
    """One line per pipeline row, then the sync baseline of each batch size; "<- best" marks the recommendation.
    speedup: step time over sync's at the batch size; tok_x: trained tokens per second over sync's."""
    head = (f"{'sampler':>7} {'learner':>7} {'batch':>6} {'k':>3} {'step_s':>9} {'sync_s':>9} {'speedup':>7} "
            f"{'tok_x':>6} {'smp/s':>8} {'tok/s':>9} {'stale':>6} {'max':>4} {'corr':>6} {'s_idle':>6} "
            f"{'l_idle':>6}  note")
    lines = [head, "-" * len(head)]
    rec = self.recommended
    for r in self.rows:
      if not r.feasible:
        lines.append(f"{r.sampler_devices:>7} {r.learner_devices:>7} {r.batch_size:>6} {r.max_staleness:>3} "
                     f"{'-':>9} {'-':>9} {'-':>7} {'-':>6} {'-':>8} {'-':>9} {'-':>6} {'-':>4} {'-':>6} {'-':>6} "
                     f"{'-':>6}  dropped: {r.reason}")
        continue
      note = "<- best" if rec.mode == "pipeline" and r is rec.row else ""
      lines.append(f"{r.sampler_devices:>7} {r.learner_devices:>7} {r.batch_size:>6} {r.max_staleness:>3} "
                   f"{r.step_time_s:>9.4g} {r.sync_step_time_s:>9.4g} {r.speedup:>7.3f} {r.token_speedup:>6.3f} "
                   f"{r.samples_per_s:>8.2f} {r.tokens_per_s:>9.4g} {r.staleness_mean:>6.2f} {r.staleness_max:>4} "
                   f"{r.staleness_length_corr:>6.2f} {r.sampler_idle:>6.2f} {r.learner_idle:>6.2f}  {note}")
    for b, res in self.sync.items():
      note = "<- best" if rec.mode == "sync" and b == rec.batch_size else ""
      lines.append(f"{'sync on all ' + str(self.pool):>15} {b:>6} {0:>3} {res.step_time_s:>9.4g} "
                   f"{res.step_time_s:>9.4g} {1:>7.3f} {1:>6.3f} {b / res.step_time_s:>8.2f} {res.tokens_per_s:>9.4g} "
                   f"{0:>6.2f} {0:>4} {'-':>6} {res.sampler_idle_frac:>6.2f} {res.learner_idle_frac:>6.2f}  {note}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Recommendation:
  """What to run: "sync" (every pool device samples, then trains) or "pipeline" (`row`'s split and k)."""

  mode: str
  batch_size: int
  tokens_per_s: float  # completion tokens trained per second
  ratio: float  # the best pipeline's tokens per second over the best sync's (< 1 where sync is recommended)
  row: PlanRow | None  # the best pipeline row (None if none is feasible)


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
                            tokens_per_s=r.tokens_per_s, token_speedup=r.tokens_per_s / sync[b].tokens_per_s,
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
  queue_groups: int = 0  # finished groups the rollout queue holds (0: bounded by admission only)
  # jaxrl's learner trains fixed-shape batches of batch_size x seq_len tokens (rows right-padded), so a step costs
  # the same whatever the lengths; 0 charges the real prompt + completion tokens instead.
  seq_len: int = 0
  # With seq_len: samples packed into rows of seq_len tokens (rl.pack), a step charged for its packed rows (first-fit
  # decreasing, rounded up to a row bucket) times seq_len; samples longer than seq_len count as seq_len.
  pack: bool = False
  max_segments: int = 16
  # rl.num_minibatches: the learner packs each mini-batch (a shuffled 1/n of the samples) into rows of its own, and
  # every mini-batch gets as many rows as the fullest one (jaxrl.learner.packing).
  num_minibatches: int = 2
  # jaxrl's engine runs this many decode steps per call, and samples leave and join slots only between calls: a
  # sample holds its slot for a whole number of calls (the train charge counts its real tokens).
  steps_per_call: int = 1
  # Calls a finished sample still holds its slot: jaxrl's sampler reads a call's results after dispatching the next
  # one (Sampler(overlap=True), its default), so a finished slot idles one call before it is refilled: 1 for its
  # runs (at the headline's median of 12 tokens and 8 steps per call that is 30% more slot time than the tokens).
  overlap_calls: int = 0
  # Dynamic sampling (rl.filter_groups): the fraction of finished groups the filter keeps (a run log's ledger:
  # runlog.pass_fraction); the samplers generate 1 / pass_fraction of the trained groups. 1: no filter.
  pass_fraction: float = 1.0
  filter_draws: str = "random"  # RunSpec.filter_draws: "random" (the filter's yield varies) | "even" (its mean alone)
  # Which devices the learner and the pipeline's engines compute on, where they share some (jaxrl.sim.placement);
  # None: every engine and the learner on devices of their own. The synchronous baselines keep their own devices.
  placement: Placement | None = None


@dataclasses.dataclass
class Prediction:
  sync_step_s: float  # synchronous loop on the same split (sampler devices sample, learner devices train)
  sync_colocated_step_s: float  # synchronous loop with every device sampling, then every device training
  pipeline_step_s: float
  speedup: float  # sync_step_s / pipeline_step_s
  sync: SimResult
  sync_colocated: SimResult
  pipeline: SimResult
  decode_slowdown: float = 1.0  # contention charged to the pipeline's decode steps (1: none)
  train_slowdown: float = 1.0  # ... and to its train steps
  stretch: tuple[float, ...] = ()  # under a placement: each process's time stretch (learner, engine 0, ...)


def _packed_tokens(run: RunDescription):
  """A step's charge packed as the learner packs it: the samples shuffled (a fixed permutation: which lengths
  share a mini-batch is what matters), mini-batch i % num_minibatches packed on its own, rows x seq_len."""
  if not run.seq_len:
    raise ValueError("RunDescription.pack needs seq_len, the packed row length")
  m = run.num_minibatches
  if m < 1 or run.batch_size % m:
    raise ValueError(f"RunDescription.num_minibatches={m} must divide batch_size={run.batch_size}")
  buckets = row_buckets(run.batch_size, m)
  order = np.random.default_rng(0).permutation(run.batch_size)

  def tokens(lengths):
    shuffled = np.minimum(np.asarray(lengths), run.seq_len)[order]
    return run.seq_len * packed_rows(shuffled.tolist(), run.seq_len, run.max_segments, buckets, m)
  return tokens


def _slowdown(contention: float, other_busy: float) -> float:
  """Time stretch of work that runs at rate 1 / contention while the other side is busy, else at rate 1."""
  return 1 / ((1 - other_busy) + other_busy / contention)


def _contended_pipeline(costs: Costs, spec: RunSpec, decode_c: float, train_c: float,
                        rounds: int = 12) -> tuple[SimResult, float, float]:
  """The pipeline at the fixed point of the mean-field slowdowns: (result, decode stretch, train stretch).

  A slower sampler makes the learner idle more, which slows the sampler less: the decode stretch that reproduces
  itself is found by bisection (plain iteration oscillates); the mild train stretch by iteration inside.
  """

  def run(decode_x):
    train_x = 1.0
    for _ in range(3 if train_c != 1.0 else 1):
      pipe = simulate_pipeline(costs.slowed(decode_x, train_x), spec)
      train_x_next = _slowdown(train_c, 1 - pipe.sampler_idle_frac)
      if train_x_next == train_x:
        break
      train_x = train_x_next
    return pipe, train_x

  lo, hi = 1.0, decode_c
  for _ in range(rounds if decode_c != 1.0 else 0):
    mid = math.sqrt(lo * hi)
    pipe, _ = run(mid)
    if _slowdown(decode_c, 1 - pipe.learner_idle_frac) > mid:
      lo = mid
    else:
      hi = mid
  decode_x = math.sqrt(lo * hi)
  pipe, train_x = run(decode_x)
  return pipe, decode_x, train_x


def _busy(pipe: SimResult, host_s: float) -> np.ndarray:
  """The fraction of the measured window each process (the learner, then each engine) wants its devices: its
  simulated work, and the learner's host work beside it (host_s a step)."""
  lo, hi = pipe.window_s
  lanes = ["learner", *(f"engine {i}" for i in range(pipe.engines))]
  spans = {lane: [] for lane in lanes}
  for lane, kind, start, end in pipe.timeline:
    spans[lane].append((kind, start, end))
  busy = np.array([busy_in(spans[lane], lo, hi, ("decode", "train", "sync")) / (hi - lo) for lane in lanes])
  busy[0] += host_s / pipe.step_time_s
  return np.minimum(busy, 1.0)


def _shared_pipeline(costs: Costs, spec: RunSpec, placement: Placement, decode_c: float, train_c: float,
                     rounds: int = 40) -> tuple[SimResult, np.ndarray]:
  """The pipeline at the fixed point of the placement's time-sharing (and the calibrated contention, as in
  _contended_pipeline): (result, each process's stretch). A stretch slows its process, which frees its devices for
  the others: the stretches are damped (the geometric mean of the last and the implied one) until they hold."""
  stretch = np.ones(1 + len(placement.engines))
  for i in range(rounds):
    pipe = simulate_pipeline(costs, spec.replace(stretch=tuple(stretch)))
    busy = _busy(pipe, placement.learner_host_s * stretch[0])
    implied = 1 / placement.rates(busy)
    implied[1:] *= _slowdown(decode_c, min(busy[0], 1 - pipe.learner_idle_frac))
    implied[0] *= _slowdown(train_c, 1 - pipe.sampler_idle_frac)
    if np.allclose(implied, stretch, rtol=1e-3) or i == rounds - 1:
      return pipe, stretch
    stretch = np.sqrt(stretch * implied)


def predict(calibration: Calibration | Costs, run: RunDescription) -> Prediction:
  """Predicted sync and pipeline step times of a run from a calibration (or any Costs).

  A calibration's update_s (the sampler's KV recompute after an in-flight update) lengthens the pipeline's weight
  syncs. Its contention factors slow the pipeline (the only mode that samples and trains at once) in mean
  field: the sampler runs at rate 1 while the learner idles and 1 / decode_contention while it trains, so over a
  step its decode steps take 1 / ((1 - f) + f / decode_contention) longer, f being the learner's busy fraction;
  likewise train steps with the sampler's busy fraction. Iterated from the uncontended run to a fixed point.
  A placement that shares devices stretches each process by its share of them (jaxrl.sim.placement), found with the
  contention at one fixed point (_shared_pipeline).
  """
  costs = calibration.costs() if isinstance(calibration, Calibration) else calibration
  contention, update_s = (1.0, 1.0), 0.0
  if isinstance(calibration, Calibration):
    contention, update_s = (calibration.decode_contention, calibration.train_contention), calibration.update_s
  if run.steps_per_call < 1 or run.seq_len < 0 or run.overlap_calls < 0:
    raise ValueError(f"RunDescription: steps_per_call must be >= 1, seq_len and overlap_calls >= 0 (got "
                     f"{run.steps_per_call}, {run.seq_len}, {run.overlap_calls})")
  lengths = run.lengths if isinstance(run.lengths, LengthDist) else Empirical(np.asarray(run.lengths))
  k, lag = run.steps_per_call, run.overlap_calls
  slot_steps = None
  if k > 1 or lag:
    slot_steps = lambda n: (-(-np.asarray(n) // k) + lag) * k  # whole calls, plus the call a finished slot idles
  def padded(costs: Costs, learner_devices: int) -> Costs:
    if not run.seq_len or run.pack:
      return costs
    step_s = costs.train_time(run.batch_size * run.seq_len, learner_devices)
    return costs.replace(train_overhead_s=step_s, train_tokens_per_s_per_device=math.inf, train_scaling=(),
                         sync_train_scaling=(), extra_forward_passes=0)

  spec = RunSpec(sampler_devices=run.sampler_devices, learner_devices=run.learner_devices,
                 batch_size=run.batch_size, group_size=run.group_size, max_staleness=run.max_staleness,
                 lengths=lengths, prompt_len=run.prompt_len, steps=run.steps, seed=run.seed,
                 queue_groups=run.queue_groups, train_tokens=_packed_tokens(run) if run.pack else None,
                 slot_steps=slot_steps, pass_fraction=run.pass_fraction,
                 filter_draws=run.filter_draws)
  pool = run.sampler_devices + run.learner_devices
  colocated = simulate_sync(padded(costs, pool), spec, colocated=True)
  costs = padded(costs, run.learner_devices)
  sync = simulate_sync(costs, spec, colocated=False)
  # Only the pipeline updates weights under live samples (sync updates between steps, with empty slots).
  pipe_costs = costs.replace(sync_overhead_s=costs.sync_overhead_s + update_s)
  stretch = ()
  if run.placement is None:
    pipe, decode_x, train_x = _contended_pipeline(pipe_costs, spec, *contention)
  else:
    engines = run.sampler_devices // costs.devices_per_engine
    if len(run.placement.engines) != engines:
      raise ValueError(f"the placement places {len(run.placement.engines)} engines; the run has {engines} "
                       f"({run.sampler_devices} sampler devices, {costs.devices_per_engine} per engine)")
    pipe, stretch = _shared_pipeline(pipe_costs, spec, run.placement, *contention)
    decode_x, train_x, stretch = float(np.mean(stretch[1:])), float(stretch[0]), tuple(map(float, stretch))
  return Prediction(sync_step_s=sync.step_time_s, sync_colocated_step_s=colocated.step_time_s,
                    pipeline_step_s=pipe.step_time_s, speedup=sync.step_time_s / pipe.step_time_s, sync=sync,
                    sync_colocated=colocated, pipeline=pipe, decode_slowdown=decode_x, train_slowdown=train_x,
                    stretch=stretch)
