"""Discrete-event simulator of synchronous and pipelined RL on a sampler/learner device split.

Sampler: `sampler_devices // devices_per_engine` engines, each with `max_batch` decode slots and continuous
batching (a freed slot takes the next pending sample after a prefill). Between events an engine's live batch
is fixed and every context grows by one token per step, so the time of n decode steps has the closed form
n * t(B, C) + kv_s_per_token * B * n (n - 1) / 2 and the simulator jumps from event to event.

Controller (the same for both modes; sync is the k = 0 case): the real controller's admission and batch
assembly, jaxrl.controller.assembly.DeadlineBook, one per sampler, driven as the controller drives it
(jaxrl.sim.assembly). In short:
- A group (group_size samples of one prompt) is admitted at policy version v with deadline v + k: it must be
  trained on by learner step v + k. Admission holds while the open groups (admitted, not yet handed to the
  learner) fit the steps left before v + k, none past the run's last step, and (queue_groups) while fewer than
  max(queue_groups / samplers, a share) finished groups wait; so no sample is ever dropped and staleness never
  exceeds k. An engine takes groups while fewer than max_batch of its samples wait for a slot (the sampler
  loop's waiting list).
- Complete-group rule: a group reaches the book when its last sample finishes.
- The learner asks for step s + 1's share as soon as it takes step s's; a share holds the groups whose
  deadlines force them into its step (waiting for any still generating), then finished groups in completion
  order. A step trains once every sampler's share is in.
- After a train step the new weights go to every engine (in-flight update): an engine pauses at its next
  decode-step boundary for the transfer and continues its live samples under the new version (partial rollouts
  carried across versions); the learner is busy for the transfer too.
With k = 0 nothing is admitted between a learner step's start and its publish, which is exactly the
synchronous loop: sample a batch, train, sync weights.

Two variants other frameworks use, selected in RunSpec:
- admission="budget" (AReaL's max_head_offpolicyness, verl's staleness_threshold): an admission budget separate
  from any per-sample deadline. Groups started never exceed (v + 1 + admission_budget) * groups_per_step at
  version v (a fractional budget admits part of a step ahead); an engine takes a group when it has a free slot
  for each of its samples; the learner trains finished groups in completion order and nothing forces a late
  group in, so staleness is measured, not bounded.
- partial_rollouts=False: an engine takes new weights only once its live samples have finished on the old ones,
  starting no new sample meanwhile (no sample spans two versions; the engine drains before each update).

Dynamic sampling (rl.filter_groups): with pass_fraction p < 1 the filter keeps each finished group with probability p
(filter_draws="random", a stream of its own: a real filter's yield varies from step to step, and under the staleness
bound a short step waits) or exactly p of them spread evenly ("even": the n-th finished group is kept when
floor((n + 1) p) > floor(n p)). A filtered group gives its place back and the sampler over-asks by the kept fraction
so far, both through the controller's own book (DeadlineBook.discard, assembly.over_ask); groups over-asked past
their deadline are surplus, as in a run.

Shared devices: `stretch` stretches each process's work (the learner's train steps and publishes, each engine's
decode, prefill and weight take) by a factor; the planner derives it from where the processes run
(jaxrl.sim.placement).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxrl.sim.assembly import Assembly
from jaxrl.sim.costs import Costs
from jaxrl.sim.lengths import LengthDist
from jaxrl.sim.sampler_timeline import SamplerTimeline, busy_in


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """A run to simulate: device split, batch shape, staleness bound and response lengths."""

  sampler_devices: int
  learner_devices: int
  batch_size: int  # samples per learner step
  group_size: int
  max_staleness: int  # k
  lengths: LengthDist
  prompt_len: int = 256
  steps: int = 8  # learner steps measured, after warmup
  warmup_steps: int = -1  # learner steps simulated first and not measured; -1: max_staleness + 1
  queue_groups: int = 0  # finished groups the queue may hold; 0: bounded by admission only
  samplers: int = 1  # sampler loops, each with its own book and its share of a step; engine i is sampler i % samplers
  seed: int = 0
  admission: str = "deadline"  # "deadline" (per-group deadline v + k) | "budget" (see the module docstring)
  admission_budget: float = 0.0  # with admission="budget": steps of groups admitted ahead (may be fractional)
  partial_rollouts: bool = True  # live samples continue on new weights (False: engines drain before updates)
  # Tokens a train step is charged for, from its samples' lengths (prompt + completion): e.g. the packed rows
  # times their length (jaxrl.learner.packing.packed_rows); None charges the real tokens.
  train_tokens: Callable[[np.ndarray], float] | None = None
  # Decode steps a sample holds its slot for, from its lengths (an engine that lets samples leave only between
  # calls of several steps holds them longer than their tokens); None: its length. Tokens trained stay its length.
  slot_steps: Callable[[np.ndarray], np.ndarray] | None = None
  pass_fraction: float = 1.0  # finished groups the filter keeps (rl.filter_groups); 1: no filter
  filter_draws: str = "random"  # "random" (each group kept with probability pass_fraction) | "even" (module doc)
  stretch: tuple[float, ...] = ()  # seconds per second of work of (the learner, engine 0, engine 1, ...); (): all 1

  def __post_init__(self):
    for name in ("sampler_devices", "learner_devices", "batch_size", "group_size", "prompt_len", "steps", "samplers"):
      if not getattr(self, name) >= 1:
        raise ValueError(f"RunSpec.{name} must be >= 1 (got {getattr(self, name)})")
    if self.warmup_steps < -1:
      raise ValueError(f"RunSpec.warmup_steps must be >= 0, or -1 for max_staleness + 1 (got {self.warmup_steps})")
    for name in ("max_staleness", "queue_groups"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"RunSpec.{name} must be >= 0 (got {getattr(self, name)})")
    if self.batch_size % self.group_size:
      raise ValueError(f"batch_size={self.batch_size} is not a multiple of group_size={self.group_size}: "
                       "batches are made of whole groups")
    if not isinstance(self.lengths, LengthDist):
      raise ValueError(f"RunSpec.lengths must be a LengthDist (got {type(self.lengths).__name__})")
    if self.queue_groups and self.queue_groups < self.groups_per_step:
      raise ValueError(f"RunSpec.queue_groups={self.queue_groups} is smaller than the {self.groups_per_step} groups "
                       "of one learner step: no batch could ever be formed (use >= groups_per_step, or 0)")
    if self.groups_per_step % self.samplers:
      raise ValueError(f"RunSpec.samplers={self.samplers} does not divide the {self.groups_per_step} groups of a step")
    if self.admission not in ("deadline", "budget"):
      raise ValueError(f"RunSpec.admission must be 'deadline' or 'budget' (got {self.admission!r})")
    if not self.admission_budget >= 0:
      raise ValueError(f"RunSpec.admission_budget must be >= 0 (got {self.admission_budget})")
    if self.admission == "deadline" and self.admission_budget:
      raise ValueError("RunSpec.admission_budget needs admission='budget' (the deadline rule admits by "
                       "max_staleness)")
    if not 0 < self.pass_fraction <= 1:
      raise ValueError(f"RunSpec.pass_fraction must be in (0, 1], the finished groups the filter keeps (got "
                       f"{self.pass_fraction})")
    if self.filter_draws not in ("random", "even"):
      raise ValueError(f"RunSpec.filter_draws must be 'random' or 'even' (got {self.filter_draws!r})")
    if self.pass_fraction < 1 and self.admission != "deadline":
      raise ValueError("RunSpec.pass_fraction < 1 needs admission='deadline' (the book that gives a filtered "
                       "group's place back)")
    if any(not x >= 1 for x in self.stretch):
      raise ValueError(f"RunSpec.stretch must hold factors >= 1 (got {self.stretch})")

  @property
  def groups_per_step(self) -> int:
    return self.batch_size // self.group_size

  @property
  def lookahead(self) -> int:
    """Whole steps of groups admission may run ahead of the learner."""
    return math.ceil(self.admission_budget) if self.admission == "budget" else self.max_staleness

  @property
  def warmup(self) -> int:
    return self.lookahead + 1 if self.warmup_steps == -1 else self.warmup_steps

  @property
  def total_steps(self) -> int:
    return self.warmup + self.steps

  def replace(self, **kw) -> RunSpec:
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass
class SimResult:
  """What a simulated run did. Times in seconds from the start of the run."""

  mode: str  # "sync" | "sync_colocated" | "pipeline"
  spec: RunSpec
  step_time_s: float  # steady-state seconds per learner step
  step_start_s: np.ndarray  # [steps]
  step_end_s: np.ndarray  # [steps] end of each train step (its weights are published from here)
  samples: dict[str, np.ndarray]  # per sample: length, group, engine, start_s, finish_s, trained_s,
  #                                 start_version, end_version, step and staleness (-1: not trained on)
  timeline: list[tuple[str, str, float, float]]  # (lane, kind, start, end); kinds decode | sync | train
  window_s: tuple[float, float]  # the steady-state window the rates below are measured over
  sampler_idle_frac: float
  learner_idle_frac: float
  device_busy_frac: float  # all devices of the run, busy-seconds over device-seconds
  tokens_per_s: float  # completion tokens trained on per second (steady state)
  decode_tokens: int  # tokens decoded by all engines over the whole run
  decode_busy_s: float  # engine-seconds spent decoding or prefilling over the whole run
  engines: int
  sync_s: float  # one weight publish (the learner's seconds)
  filtered_groups: int = 0  # groups generated and filtered out (pass_fraction < 1)
  surplus_groups: int = 0  # groups generated, kept by the filter, and left out past their deadline

  @property
  def trained(self) -> np.ndarray:
    return self.samples["step"] >= 0

  @property
  def staleness(self) -> np.ndarray:
    """Staleness of every trained sample: learner step minus the oldest version among its tokens."""
    return self.samples["staleness"][self.trained]

  def staleness_length_corr(self) -> float:
    """Pearson correlation between a trained sample's staleness and its length (nan if either is constant)."""
    s, n = self.staleness.astype(np.float64), self.samples["length"][self.trained].astype(np.float64)
    if s.size < 2 or s.std() == 0 or n.std() == 0:
      return math.nan
    return float(np.corrcoef(s, n)[0, 1])

  def queue_wait_s(self) -> np.ndarray:
    """Seconds each trained sample's group waited, complete, for the learner step that used it."""
    tr = self.trained
    group_done = np.zeros(self.samples["group"].max() + 1)
    np.maximum.at(group_done, self.samples["group"][tr], self.samples["finish_s"][tr])
    return self.samples["trained_s"][tr] - group_done[self.samples["group"][tr]]

  def summary(self) -> dict[str, float]:
    s = self.staleness
    return dict(step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
                queue_wait_mean_s=float(self.queue_wait_s().mean()) if s.size else 0.0,
                sampler_idle=self.sampler_idle_frac, learner_idle=self.learner_idle_frac,
                device_busy=self.device_busy_frac, staleness_mean=float(s.mean()) if s.size else 0.0,
                staleness_max=int(s.max()) if s.size else 0, staleness_length_corr=self.staleness_length_corr())


class _Sim:
  """State of one simulated run (kept inside `simulate`; everything outside is pure)."""

  def __init__(self, costs: Costs, spec: RunSpec, engines: int, learner_devices: int, k: int,
               update_s: tuple[float, float], colocated: bool = False):
    self.costs, self.spec, self.k, self.colocated = costs, spec, k, colocated
    self.budget = spec.admission == "budget"
    self.learner_devices = learner_devices
    self.gb, self.g = spec.groups_per_step, spec.group_size
    if spec.stretch and len(spec.stretch) != 1 + engines:
      raise ValueError(f"RunSpec.stretch has {len(spec.stretch)} factors for the learner and {engines} engines "
                       f"(need {1 + engines})")
    self.stretch = spec.stretch or (1.0,) * (1 + engines)
    self.sync_s = update_s[0] * self.stretch[0]  # the learner's publish (Costs.update_times)
    self.take_s = [update_s[1] * x for x in self.stretch[1:]]  # each engine's pause for it
    self.engines = [SamplerTimeline(i, costs.slowed(decode_x=x) if x != 1 else costs, spec.prompt_len)
                    for i, x in enumerate(self.stretch[1:])]
    self.rng = np.random.default_rng(spec.seed)
    self.filter_rng = np.random.default_rng([spec.seed, 1])  # its own stream: the lengths drawn stay the same
    self.blocks: dict[int, np.ndarray] = {}
    if len(self.engines) % spec.samplers:
      raise ValueError(f"{len(self.engines)} engines cannot be shared by {spec.samplers} samplers")
    # Deadline admission stops at the run's last step; the budget rule runs this many groups ahead at most. With a
    # filter, admission goes on while filtered groups give their places back (the arrays grow).
    self.max_groups = (spec.total_steps + (spec.lookahead + 1 if self.budget else 0)) * self.gb
    if spec.pass_fraction < 1:
      self.max_groups = math.inf
    self.s, self.done_count = {}, np.zeros(0, np.int64)
    self._reserve(spec.total_steps * self.gb if math.isinf(self.max_groups) else self.max_groups)
    self.finished_groups = self.filtered_groups = self.surplus_groups = 0
    self.assembly = None if self.budget else Assembly(k, self.gb, spec.total_steps, spec.samplers,
                                                      spec.queue_groups)
    self.finished_fifo: list[int] = []  # admission="budget": finished groups not yet trained on, in completion order
    self.started = 0
    self.consumed = 0  # groups trained on (so the next learner step is consumed // gb)
    self.version = 0
    self.learner_phase, self.learner_until = "idle", 0.0
    self.learner_spans: list[list] = []
    self.step_start: list[float] = []
    self.step_end: list[float] = []
    self.batch_may_be_ready = False
    self.next_t = [math.inf] * engines

  # -- engines ------------------------------------------------------------------------------------------
  def _refresh(self, e: SamplerTimeline):
    self.next_t[e.index] = e.next_finish()

  def _finished(self, e: SamplerTimeline, sids: list[int]):
    s = self.s
    for sid in sids:
      s["finish_s"][sid], s["end_version"][sid] = e.clock, e.version
      g = int(s["group"][sid])
      self.done_count[g] += 1
      if self.done_count[g] == self.g:
        if self.budget:
          self.finished_fifo.append(g)
        else:
          self._settle(self._rank(e), g)
        self.batch_may_be_ready = True

  def _settle(self, rank: int, g: int):
    """A complete group into its sampler's book, or, filtered, its place given back (the sampler loop's _finish)."""
    n, p = self.finished_groups, self.spec.pass_fraction
    self.finished_groups += 1
    if p == 1:
      kept = True
    elif self.spec.filter_draws == "random":
      kept = bool(self.filter_rng.random() < p)
    else:
      kept = math.floor((n + 1) * p + 1e-9) > math.floor(n * p + 1e-9)
    if not kept:
      self.filtered_groups += 1
    self.assembly.settle(rank, g, kept)

  def _fill(self, e: SamplerTimeline):
    if e.update_due and not self.spec.partial_rollouts:
      return  # draining for an update: new samples start on the new weights
    for sid in e.start_pending():
      self.s["start_s"][sid], self.s["start_version"][sid] = e.clock, e.version

  def _sync_engine(self, e: SamplerTimeline, t: float) -> bool:
    """Runs an engine to its first decode-step boundary at or after t; False if that boundary is a sample
    finishing (the engine's own event, handled in time order: whatever waits for t happens there)."""
    if not e.live:
      e.clock = max(e.clock, t)
      return True
    n = e.steps_to_reach(t)
    if n >= e.steps_to_finish():
      return False
    e.decode(n)
    return True

  def _apply_update(self, e: SamplerTimeline):
    """A weight publish that reached the engine between boundaries lands at its next boundary."""
    t, version = e.update_due
    e.stall(t, self.take_s[e.index] + e.costs.rebuild_time(*e.contexts()))
    e.version, e.update_due = version, None

  # -- controller -----------------------------------------------------------------------------------------
  def _rank(self, e: SamplerTimeline) -> int:
    return e.index % self.spec.samplers

  def _takes(self, e: SamplerTimeline) -> bool:
    """Whether an engine takes a new group now: the budget rule's frameworks start a group on free slots; jaxrl's
    sampler loop admits while fewer than max_batch of its samples wait for a slot, if its book has room."""
    if self.budget:
      return e.max_batch - e.load >= min(self.g, self.costs.max_batch)
    return len(e.pending) < e.max_batch and self.assembly.room(self._rank(e), self.version) >= 1

  def _admit(self, t: float):
    while self.started < self.max_groups:
      if self.budget:
        if self.started + 1 > math.floor((self.version + 1 + self.spec.admission_budget) * self.gb + 1e-9):
          return
        if self.spec.queue_groups and len(self.finished_fifo) >= max(self.spec.queue_groups, self.gb):
          return
      free = [e for e in self.engines if self._takes(e)]
      if not free:
        return
      e = min(free, key=lambda x: (x.load, x.index))
      at_boundary = self._sync_engine(e, t)
      g = self.started
      self.started += 1
      self._reserve(self.started)
      if not self.budget:
        self.assembly.admit(self._rank(e), g, self.version)
      lengths = self._group_lengths(g)
      held = self.spec.slot_steps(lengths) if self.spec.slot_steps is not None else lengths
      for i, n in enumerate(lengths):
        sid = g * self.g + i
        self.s["length"][sid], self.s["group"][sid], self.s["engine"][sid] = n, g, e.index
        e.pending.append((sid, int(held[i])))
      if at_boundary:
        self._fill(e)
      self._refresh(e)

  def _reserve(self, groups: int):
    """Room in the per-sample arrays for `groups` groups (doubling: a filtered run admits without a set cap)."""
    have = self.done_count.size
    if groups <= have:
      return
    grow = max(have, groups - have)
    self.done_count = np.concatenate([self.done_count, np.zeros(grow, np.int64)])
    n = grow * self.g
    for key in ("length", "group", "engine", "start_version", "end_version", "step", "staleness"):
      self.s[key] = np.concatenate([self.s.get(key, np.zeros(0, np.int64)), np.full(n, -1, np.int64)])
    for key in ("start_s", "finish_s", "trained_s"):
      self.s[key] = np.concatenate([self.s.get(key, np.zeros(0)), np.full(n, np.nan)])

  def _group_lengths(self, g: int) -> np.ndarray:
    """Lengths are drawn a step's worth of groups at a time, in group order, at the version the first group
    of the block is admitted at; so sync and pipeline runs of one seed see the same lengths (unless the
    distribution changes with the step)."""
    block = g // self.gb
    if block not in self.blocks:
      n = self.gb * self.g
      self.blocks[block] = self.spec.lengths.sample(self.rng, n, step=self.version).reshape(self.gb, self.g)
    return self.blocks[block][g % self.gb]

  def _next_batch(self) -> list[int] | None:
    """The groups of the next learner step, or None while they are not all in."""
    if not self.budget:
      batch = self.assembly.next_batch()
      if batch is not None:
        self.assembly.assemble()  # the samplers take the share it asks for as soon as they can
      return batch
    if not self.batch_may_be_ready or len(self.finished_fifo) < self.gb:
      return None
    batch, self.finished_fifo = self.finished_fifo[: self.gb], self.finished_fifo[self.gb:]
    return batch

  def _try_learn(self, t: float):
    if self.learner_phase != "idle" or len(self.step_start) >= self.spec.total_steps:
      return
    step = self.consumed // self.gb
    batch = self._next_batch()
    self.batch_may_be_ready = False  # until a group finishes or the learner frees up
    if batch is None:
      return
    self.consumed += len(batch)
    sids = (np.asarray(batch)[:, None] * self.g + np.arange(self.g)[None, :]).ravel()
    self.s["step"][sids] = step
    self.s["staleness"][sids] = step - self.s["start_version"][sids]
    self.s["trained_s"][sids] = t
    lengths = self.s["length"][sids] + self.spec.prompt_len
    tokens = self.spec.train_tokens(lengths) if self.spec.train_tokens else int(lengths.sum())
    dt = self.costs.train_time(tokens, self.learner_devices, self.colocated) * self.stretch[0]
    self.step_start.append(t)
    self.learner_spans.append(["train", t, t + dt])
    self.learner_phase, self.learner_until = "train", t + dt

  def _publish(self, t: float):
    """End of a train step: new version, in-flight transfer to every engine."""
    self.step_end.append(t)
    self.version += 1
    for e in self.engines:
      e.update_due = (t, self.version)
      if self.spec.partial_rollouts:
        if self._sync_engine(e, t):
          self._apply_update(e)
      elif not e.live:  # a draining engine takes the update once its live samples are done
        e.clock = max(e.clock, t)
        self._apply_update(e)
        self._fill(e)
      self._refresh(e)
    self.learner_spans.append(["sync", t, t + self.sync_s])
    self.learner_phase, self.learner_until = "sync", t + self.sync_s

  def run(self):
    t = 0.0
    self._admit(t)
    while len(self.step_end) < self.spec.total_steps:
      self._try_learn(t)
      i_eng = min(range(len(self.next_t)), key=self.next_t.__getitem__)
      t_eng = self.next_t[i_eng]
      t_learn = self.learner_until if self.learner_phase != "idle" else math.inf
      t = min(t_eng, t_learn)
      if math.isinf(t):
        waiting = (f"open groups {self.assembly.open_groups()}, finished {self.assembly.finished_groups()}"
                   if self.assembly else f"finished {len(self.finished_fifo)}")
        raise RuntimeError(f"simulation stalled at step {len(self.step_end)}: no sample in flight, learner idle "
                           f"({waiting})")
      if t_learn <= t_eng:
        if self.learner_phase == "train":
          self._publish(t)
        else:
          self.learner_phase, self.batch_may_be_ready = "idle", True
      else:
        e = self.engines[i_eng]
        self._finished(e, e.decode(e.steps_to_finish()))
        if e.update_due and (self.spec.partial_rollouts or not e.live):
          self._apply_update(e)
        self._fill(e)
        self._refresh(e)
      if self.assembly is not None:  # the sampler loop's order: finished groups, shares, then admission
        self.assembly.assemble()
        self.surplus_groups += self.assembly.take_surplus()
      self._admit(t)
    return self


def _window(step_end: np.ndarray, warmup: int) -> tuple[float, float, int]:
  """Measured window: from the end of the last warmup step (or 0) to the end of the last step."""
  if warmup == 0:
    return 0.0, float(step_end[-1]), -1
  return float(step_end[warmup - 1]), float(step_end[-1]), warmup - 1


def _slope(step_end: np.ndarray, w: int) -> float:
  """Seconds per step: least-squares slope of step end times over the measured steps (and the window start).

  A pipeline can settle into bursts of several steps; a fitted slope is far less sensitive to where the
  window cuts a burst than (last - first) / count, and equals it when steps are evenly spaced.
  """
  y = np.concatenate([[0.0] if w < 0 else [], step_end[max(w, 0):]])
  x = np.arange(y.size, dtype=np.float64)
  return float(np.polyfit(x, y, 1)[0])


def _result(sim: _Sim, mode: str, total_devices: int) -> SimResult:
  step_end = np.asarray(sim.step_end)
  lo, hi, w = _window(step_end, sim.spec.warmup)
  span = hi - lo
  sampler_busy = sum(busy_in(e.busy, lo, hi) for e in sim.engines)
  learner_busy = busy_in(sim.learner_spans, lo, hi, ("train",))
  e_count, dpe = len(sim.engines), sim.costs.devices_per_engine
  trained_tokens = int(sim.s["length"][sim.s["step"] > w].sum())
  timeline = [(f"engine {e.index}", k, s, t) for e in sim.engines for k, s, t in e.busy]
  timeline += [("learner", k, s, t) for k, s, t in sim.learner_spans]
  device_busy = (sampler_busy * dpe + learner_busy * sim.learner_devices) / (total_devices * span)
  return SimResult(
      mode=mode, spec=sim.spec, step_time_s=_slope(step_end, w), step_start_s=np.asarray(sim.step_start),
      step_end_s=step_end, samples=sim.s, timeline=timeline, window_s=(lo, hi),
      sampler_idle_frac=1.0 - sampler_busy / (e_count * span), learner_idle_frac=1.0 - learner_busy / span,
      device_busy_frac=device_busy, tokens_per_s=trained_tokens / span,
      decode_tokens=sum(e.tokens for e in sim.engines),
      decode_busy_s=sum(busy_in(e.busy, 0.0, math.inf) for e in sim.engines), engines=e_count,
      sync_s=sim.sync_s, filtered_groups=sim.filtered_groups, surplus_groups=sim.surplus_groups)


def _engines(costs: Costs, devices: int) -> int:
  if devices < costs.devices_per_engine:
    raise ValueError(f"{devices} sampler devices hold no engine of {costs.devices_per_engine} devices")
  return devices // costs.devices_per_engine


def simulate_pipeline(costs: Costs, spec: RunSpec) -> SimResult:
  """Sampler and learner on disjoint devices, running at the same time with staleness bound k."""
  engines = _engines(costs, spec.sampler_devices)
  sim = _Sim(costs, spec, engines, spec.learner_devices, spec.max_staleness,
             costs.update_times(spec.learner_devices, engines * costs.devices_per_engine)).run()
  return _result(sim, "pipeline", spec.sampler_devices + spec.learner_devices)


def simulate_sync(costs: Costs, spec: RunSpec, colocated: bool = True) -> SimResult:
  """The synchronous loop: sample the whole batch, train on it, sync weights, repeat.

  colocated: every device of the run (sampler + learner devices) samples, then every device trains.
  Otherwise the sampler devices sample and the learner devices train, one after the other.
  """
  spec0 = spec.replace(max_staleness=0, admission="deadline", admission_budget=0.0, stretch=())
  if colocated:
    pool = spec.sampler_devices + spec.learner_devices
    engines = _engines(costs, pool)
    sim = _Sim(costs, spec0, engines, pool, 0, costs.update_times(pool, engines * costs.devices_per_engine),
               colocated=True).run()
    return _result(sim, "sync_colocated", pool)
  engines = _engines(costs, spec.sampler_devices)
  sim = _Sim(costs, spec0, engines, spec.learner_devices, 0,
             costs.update_times(spec.learner_devices, engines * costs.devices_per_engine)).run()
  return _result(sim, "sync", spec.sampler_devices + spec.learner_devices)
