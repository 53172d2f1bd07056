"""The controller: a sampler thread and a learner thread run at once on their two submeshes, joined by the bounded
rollout queue (samples forward) and the weight publisher (params back, taken between decode steps).

The sampler side admits groups and assembles each learner step's share by deadline (controller.assembly); the
learner side takes the shares in order and trains. Sync mode is this same loop with max_staleness 0: a step's
groups are admitted only once the sampler holds that step's params, and trained only once all have finished.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl.controller.adaptive import AdaptiveStaleness
from jaxrl.controller.assembly import DeadlineBook, reject_reason
from jaxrl.controller.queue import GroupAssembler, Ledger, RolloutQueue, Stopped, WeightPublisher
from jaxrl.learner.packing import pack_batch
from jaxrl.rollout import Rollout, check_sampling, make_batch


class SkipPrompt(Exception):
  """A prompt that cannot be used (too long, malformed): skipped and counted, the run goes on."""


@dataclasses.dataclass
class RunRecord:
  """Host-side run position, saved with every checkpoint and restored on resume."""

  next_group_id: int = 0  # data position: the next prompt index to admit
  pending_group_ids: list[int] = dataclasses.field(default_factory=list)  # admitted, not yet trained or dropped
  ledger: Ledger = dataclasses.field(default_factory=Ledger)

  def to_json(self) -> dict:
    return {"next_group_id": self.next_group_id, "pending_group_ids": sorted(self.pending_group_ids),
            "ledger": self.ledger.to_json()}

  @classmethod
  def from_json(cls, d: dict) -> RunRecord:
    return cls(d["next_group_id"], list(d["pending_group_ids"]), Ledger.from_json(d["ledger"]))


@dataclasses.dataclass
class RunSpec:
  """Sizes of one run, shared by both loops."""

  num_steps: int
  group_size: int
  groups_per_step: int
  seq_len: int
  max_staleness: int = 1  # k: every trained token has staleness <= k (0: sync)
  queue_groups: int = 8
  max_new_tokens: int | None = None
  sampling: Any = None  # jaxrl.rollout.SamplingParams
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0
  max_failures_in_a_row: int = 100  # skipped prompts + dropped groups + skipped updates with no applied update
  auto_staleness: Any = None  # jaxrl.controller.adaptive.AutoStaleness: k adapts below max_staleness; None: fixed
  pack: bool = False  # several samples per row of seq_len tokens (jaxrl.learner.packing)
  max_segments: int = 16  # samples per packed row at most
  row_buckets: tuple[int, ...] = ()  # row counts of packed batches (the train step compiles once per bucket)

  @property
  def batch_size(self) -> int:
    return self.group_size * self.groups_per_step

  def make_batch(self, samples: list[Rollout]):
    """The learner's batch of these samples: packed into the smallest row bucket, or one sample per row."""
    if self.pack:
      return pack_batch(samples, self.seq_len, self.row_buckets or (self.batch_size,), self.max_segments)
    return make_batch(samples, self.batch_size, self.seq_len)


class Controller:
  """The sampler loop and the learner loop of one run, and the pieces they share; `run_pipeline` runs both."""

  group_stride = 1  # data positions this controller admits: next_group_id, + stride, ... (samplers share the data)

  def __init__(self, spec: RunSpec, *, sampler, train_step: Callable, state, publisher: WeightPublisher,
               prompts: Callable[[int], tuple[np.ndarray, dict]], score: Callable[[list[Rollout]], None],
               record: RunRecord | None = None, checkpointer=None, metrics=None,
               on_step: Callable[[int, dict], None] | None = None, trace: Callable[[dict], None] | None = None):
    self.spec = spec
    self.sampler, self.train_step, self.state, self.publisher = sampler, train_step, state, publisher
    self.prompts, self.score = prompts, score
    self.record = record or RunRecord()
    self.checkpointer, self.metrics, self.on_step, self.trace = checkpointer, metrics, on_step, trace
    self.book: DeadlineBook | None = None  # the sampler side's batch assembly, made when the sampler loop starts
    self._asked = 0  # shares the learner has asked for (it asks for the next one before taking it)
    self._skipped_at_start = self.ledger.skipped_updates
    # rl.max_staleness="auto": the admission bound moves within [k_min, k_max] from the measured drift; the book's
    # deadlines use it, and k_max (spec.max_staleness) stays the hard bound checked at every train step.
    self.adaptive = None if spec.auto_staleness is None else AdaptiveStaleness(spec.auto_staleness)
    self.assembler = GroupAssembler()
    self._resubmit = list(self.record.pending_group_ids)  # in flight at the checkpoint: generate again
    self._live: set[int] = set()
    self._lock = threading.Lock()  # data position and live groups change together (sampler vs checkpoint)
    self.ledger.samples_regenerated += len(self._resubmit) * spec.group_size
    self.ledger.groups_admitted -= len(self._resubmit)  # counted when first admitted, and admitted again
    self._failures: collections.Counter[str] = collections.Counter()  # since the last applied update
    self.resumed_from: int | None = None  # the checkpoint step this run restored (set by the builder)
    self._applied_since_start = False
    self.stop = threading.Event()
    self.stop_reason: str | None = None  # set by request_stop (e.g. "SIGTERM"): the loops end early, cleanly
    self.errors: list[tuple[str, BaseException, str]] = []
    self.trained_staleness: list[int] = []  # per trained sample, for tests and histograms
    self.busy = {"sampler": 0.0, "learner": 0.0}
    self.step_times: list[float] = []
    self._batch_groups: list[list[Rollout]] = []  # accepted by the learner, not yet trained
    self._leftover: list[list[Rollout]] = []  # complete groups still queued when the run stopped
    self._outbox: list[list[Rollout]] = []  # complete groups the sampler thread has not queued yet
    self._base_key = jax.random.key(spec.seed)

  @property
  def ledger(self) -> Ledger:
    return self.record.ledger

  @property
  def version(self) -> int:
    return int(jax.device_get(self.state.version))

  # ---- shared pieces -------------------------------------------------------------------------------------------

  def _log(self, event: str, **fields) -> None:
    if self.trace is not None:
      self.trace({"event": event, **fields})

  def _failed(self, reason: str) -> None:
    """Counts a failure (call under the lock); too many without an applied update in between stop the run."""
    self._failures[reason] += 1
    if sum(self._failures.values()) >= self.spec.max_failures_in_a_row:
      raise RuntimeError(f"no progress: {sum(self._failures.values())} failures in a row without an applied update "
                         f"({dict(self._failures)}); {self._suspect()}")

  def _suspect(self) -> str:
    """What to blame for failures: the checkpoint just resumed from, if not one update has applied since."""
    if self.resumed_from is not None and not self._applied_since_start:
      return (f"no update has applied since the run resumed from checkpoint {self.resumed_from}: that checkpoint's "
              "state (params or optimizer) is likely broken; resume from an earlier one")
    return "the data, the rewards or the model are broken"

  def _log_start(self, mode: str) -> None:
    self._log("start", mode=mode, version=self.version, next_group_id=self.record.next_group_id,
              regenerate=list(self._resubmit))

  def _admit_one(self) -> bool:
    """Submits the next group (a regenerated one first); False if the prompt was skipped."""
    with self._lock:
      if self._resubmit:
        gid = self._resubmit.pop(0)
      else:
        gid = self.record.next_group_id
        self.record.next_group_id += self.group_stride
      try:
        prompt, meta = self.prompts(gid)
        room = self.sampler.engine.max_len
        if len(prompt) >= room:
          raise SkipPrompt(f"prompt of {len(prompt)} tokens leaves no room to generate in sampler.max_len={room}")
      except SkipPrompt as e:
        self.ledger.skipped_prompts += 1
        print(f"jaxrl: skipping prompt {gid}: {e}", file=sys.stderr)
        self._log("skip_prompt", group=gid, reason=str(e))
        self._failed("skipped_prompt")
        return False
      self.book.admit(gid, self.sampler.version)
      self.sampler.submit(prompt, gid, self.spec.group_size, meta=meta, sampling=self.spec.sampling,
                          max_tokens=self.spec.max_new_tokens, stop_token_ids=self.spec.stop_token_ids)
      self.assembler.expect(gid, self.spec.group_size)
      self._live.add(gid)
      self.ledger.groups_admitted += 1
      return True

  def _complete_groups(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
    """Counts finished samples, releases complete groups with their rewards computed."""
    groups = []
    for r in rollouts:
      self.ledger.samples_generated += 1
      self.ledger.tokens_generated += len(r.completion_tokens)
      group = self.assembler.add(r)
      if group is not None:
        self.score(group)
        groups.append(group)
    return groups

  def _accept(self, group: list[Rollout]) -> bool:
    """The learner's filter: drops (and counts) a group that cannot be trained (the sampler side left it out of
    every share already); never one for its staleness."""
    step = self.version
    reason = reject_reason(group, self.spec.seq_len)
    if reason is None:
      return True
    if reason == "reward_failed":
      self.ledger.reward_failures += sum(not np.isfinite(r.reward) for r in group)
    with self._lock:
      self.ledger.drop(group, reason)
      self._live.discard(group[0].group_id)
      self._log("drop", version=step, group=group[0].group_id, reason=reason)
      self._failed(reason)
    return False

  def _train(self, groups: list[list[Rollout]]) -> dict[str, Any]:
    """One train step on the groups; an update the learner skipped (non-finite) drops them, counted."""
    samples = [r for g in groups for r in g]
    step = self.version
    over = [(r.group_id, step - r.min_version) for r in samples
            if len(r.versions) and step - r.min_version > self.spec.max_staleness]
    if over:
      raise RuntimeError(f"staleness invariant broken at step {step}: (group, staleness) {over[:4]} over "
                         f"max_staleness={self.spec.max_staleness}")
    check_sampling(samples, self.spec.sampling)
    batch = self.spec.make_batch(samples)
    train_step = int(jax.device_get(self.state.step))
    key = jax.random.fold_in(self._base_key, train_step)
    if self.checkpointer is not None:
      # A save still reading the state would keep it alive through this step, which donates it: a second state
      # plus Orbax's host copy (+2.9 GB peak RSS for the main job; docs/BENCHMARKS.md "The main job's memory").
      self.checkpointer.wait()
    state, metrics = self.train_step(self.state, batch, key)
    applied = int(jax.device_get(state.version)) > step
    # The new state and the fate of its groups change together: a checkpoint never sees one without the other.
    with self._lock:
      self.state = state
      for g in groups:
        self._live.discard(g[0].group_id)
        if not applied:
          self.ledger.drop(g, "update_skipped")
      if applied:
        self.ledger.trained(samples)
        self._failures.clear()
        self._applied_since_start = True
      else:
        self.ledger.skipped_updates += 1
      self._log("train", step=train_step, version=step, applied=applied,
                samples=[[r.group_id, r.sample_index, r.min_version, int(r.versions.max(initial=-1))]
                         for r in samples])
      if not applied:
        self._failed("update_skipped")
    if applied:
      self.trained_staleness += [step - r.min_version for r in samples]
    self.ledger.zero_advantage_groups += sum(len({r.reward for r in g}) == 1 for g in groups)
    metrics = dict(jax.device_get(metrics))
    metrics["applied"] = applied
    rewards = np.array([r.reward for r in samples])
    metrics.update(reward_mean=float(rewards.mean()), completion_len=float(np.mean([len(r.completion_tokens)
                                                                                    for r in samples])),
                   staleness_mean=float(np.mean([step - r.min_version for r in samples])),
                   staleness_max=float(max(step - r.min_version for r in samples)))
    accuracy = [r.meta["correct"] for r in samples if "correct" in r.meta]
    if accuracy:
      metrics["accuracy"] = float(np.mean(accuracy))
    return metrics

  def _after_step(self, metrics: dict[str, Any], step_time: float) -> None:
    if not metrics.pop("applied"):
      # Same version, same params: nothing to publish, log under this version, or checkpoint.
      reasons = [k for k in ("skip/reward", "skip/empty", "skip/nonfinite") if metrics.get(k)]
      after = (f", right after resuming from checkpoint {self.resumed_from}" if self.resumed_from is not None
               and not self._applied_since_start else "")
      print(f"jaxrl: update skipped at version {self.version} ({', '.join(reasons)}){after}; its groups are dropped",
            file=sys.stderr)
      return
    version = self.version
    self.publisher.publish(self.state.params, version)
    self.step_times.append(step_time)
    if self.adaptive is not None:  # the adaptive-staleness hook: measured drift in, admission bound out
      k = self.adaptive.observe(metrics["ess_applied_frac"], metrics["kl_behavior"])
      if self.book is not None:
        self.book.admit_k = k  # deadlines of groups admitted from now on (an int store: no lock needed)
      metrics["admit_staleness"] = k
    metrics.update(step_time_s=step_time, version=version, samples_generated=self.ledger.samples_generated,
                   samples_trained=self.ledger.samples_trained, samples_dropped=self.ledger.samples_dropped,
                   updates_skipped_total=self.ledger.skipped_updates,
                   zero_advantage_groups=self.ledger.zero_advantage_groups,
                   **{f"length/{k}": v for k, v in self.ledger.length_bias().items()})
    if self.metrics is not None:
      self.metrics.write(version, metrics)
    if self.on_step is not None:
      self.on_step(version, metrics)
    if self.checkpointer is not None and self.checkpointer.should_save(version):
      self.save_checkpoint()

  def save_checkpoint(self, force: bool = False) -> None:
    """Saves the state and the run record at the current version, unless that version is already saved."""
    if self.checkpointer.latest_step() == self.version:
      return
    with self._lock:
      self.record.pending_group_ids = sorted(self._live | set(self._resubmit))
      record = self.record.to_json()
      self._log("checkpoint", version=self.version, next_group_id=record["next_group_id"],
                pending=record["pending_group_ids"], ledger=record["ledger"])
    self.checkpointer.save(self.version, self.state, record, force=force)

  def finish(self) -> None:
    """Saves the last good state, whatever stopped the run (an interrupted step never reaches the state)."""
    self.save_checkpoint(force=True)
    with self._lock:
      self._log("end", version=self.version, next_group_id=self.record.next_group_id,
                pending=sorted(self._live | set(self._resubmit)), ledger=self.ledger.to_json())

  def samples_in_flight(self) -> int:
    """Finished samples neither trained nor dropped: in open groups, in the queue, or in a batch being built."""
    partial = sum(len(v) for v in self.assembler._open.values())
    queued = self._leftover + self._outbox + self._batch_groups + (self.book.finished if self.book else [])
    return partial + sum(len(g) for g in queued)

  def _done(self) -> bool:
    return self.version >= self.spec.num_steps

  def request_stop(self, reason: str) -> None:
    """Ends the run after the current step (a signal handler may call it): both loops return without an error and
    the caller's finish() checkpoints the last trained state; a resume regenerates what was in flight."""
    if self.stop_reason is None:
      self.stop_reason = reason
    self.stop.set()

  # ---- pipeline ------------------------------------------------------------------------------------------------

  def run_pipeline(self, poll_s: float = 0.05, join_timeout_s: float = 60.0) -> None:
    self._log_start("sync" if self.spec.max_staleness == 0 else "pipeline")
    self.book = DeadlineBook(self.spec.max_staleness, self.spec.groups_per_step, self.version, self.spec.num_steps,
                             self.spec.queue_groups)
    if self.adaptive is not None:
      self.book.admit_k = self.adaptive.k
    rollout_queue = RolloutQueue(self.spec.queue_groups, self.stop, poll_s)
    self.queue = rollout_queue
    self._wake = threading.Event()
    threads = [threading.Thread(target=self._guarded, args=("sampler", self._sampler_loop, rollout_queue, poll_s),
                                name="jaxrl-sampler", daemon=True),
               threading.Thread(target=self._guarded, args=("learner", self._learner_loop,
                                                            [(rollout_queue.get, self.spec.groups_per_step)],
                                                            rollout_queue.qsize),
                                name="jaxrl-learner", daemon=True)]
    for t in threads:
      t.start()
    try:
      while any(t.is_alive() for t in threads) and not self.stop.is_set():
        self.stop.wait(poll_s)
    finally:
      self.stop.set()
      for t in threads:
        t.join(join_timeout_s)
      self._leftover = rollout_queue.drain()
      hung = [t.name for t in threads if t.is_alive()]
      if hung:
        self.errors.append(("controller", TimeoutError(f"threads did not stop within {join_timeout_s}s: {hung}"), ""))
    self.raise_errors()

  def raise_errors(self) -> None:
    if self.errors:
      where, err, tb = self.errors[0]
      msg = f"jaxrl {where} failed: {type(err).__name__}: {err}\n--- original traceback ---\n{tb}"
      raise RuntimeError(msg) from err

  def _guarded(self, name: str, loop: Callable, *args) -> None:
    try:
      loop(*args)
    except Stopped:
      pass
    except BaseException as e:  # noqa: BLE001 - any failure stops the whole run, with its traceback kept
      self.errors.append((name, e, traceback.format_exc()))
    finally:
      self.stop.set()

  def _sampler_loop(self, rollout_queue: RolloutQueue, poll_s: float) -> None:
    while not self.stop.is_set():
      t0 = time.perf_counter()
      newer = self.publisher.take_newer(self.sampler.version)
      if newer is not None:
        self.sampler.update_params(newer.params, newer.version)
      self.book.skipped = self._updates_skipped()
      # Admit while every deadline stays feasible; keep the waiting list short so new versions are used soon.
      while self.sampler.num_waiting < self.sampler.engine.max_slots and self.book.room(self.sampler.version):
        self._admit_one()
      if self.sampler.num_active or self.sampler.num_waiting:
        for g in self._complete_groups(self.sampler.step()):
          if reject_reason(g, self.spec.seq_len) is None:
            self.book.finish(g)
          else:  # sent on its own: the learner drops and counts it
            self.book.discard(g[0].group_id)
            self._outbox.append(g)
      while self.book.shares < self._shares_asked():
        share = self.book.take()
        if share is None:
          break
        self._outbox += share
      self.busy["sampler"] += time.perf_counter() - t0
      if not (self._outbox or self.sampler.num_active or self.sampler.num_waiting):
        self._wake.wait(poll_s)  # no room, or finished groups the learner has not asked for: no spinning
        self._wake.clear()
      while self._outbox:
        rollout_queue.put(self._outbox[0])  # blocks when the learner is behind (back-pressure)
        self._outbox.pop(0)

  def _updates_skipped(self) -> int:
    """Learner updates skipped since this run started (each lets the following shares come a step earlier)."""
    return self.ledger.skipped_updates - self._skipped_at_start

  def _shares_asked(self) -> int:
    return self._asked

  def _ask(self) -> None:
    """The learner is ready for its next share: the sampler side assembles it now, from what has finished."""
    self._asked += 1
    self._wake.set()

  def _take(self, source: Callable[[], list[Rollout]], n: int, groups: list[list[Rollout]]) -> None:
    """Appends the next n trainable groups from source to groups (dropping, counted, the ones that are not)."""
    taken = 0
    while taken < n:
      g = source()
      if self._accept(g):
        groups.append(g)
        taken += 1

  def _learner_loop(self, sources: list[tuple[Callable[[], list[Rollout]], int]], depth: Callable[[], int]) -> None:
    """sources: (next group of a sampler, that sampler's share of every step); depth: groups waiting."""
    last = time.perf_counter()
    while not self._done():
      groups = self._batch_groups = []
      self._ask()
      for source, n in sources:
        self._take(source, n, groups)
      t0 = time.perf_counter()
      metrics = self._train(groups)
      self._batch_groups = []
      self.busy["learner"] += time.perf_counter() - t0
      metrics["queue_depth"] = depth()
      now = time.perf_counter()
      self._after_step(metrics, now - last)
      last = now
      self._wake.set()
