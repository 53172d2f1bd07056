"""The learner loop: asks for each step's groups, takes them from the rollouts channel (share after share, sampler
by sampler: every learner process of a job builds the same batch), trains, publishes the new params to the weights
channel, checkpoints. It talks to the sampler side only through the three channels (controller.interfaces)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl.controller.adaptive import AdaptiveStaleness
from jaxrl.controller.assembly import LEFT_OUT, reject_reason, scored_alike
from jaxrl.controller.interfaces import Coordinator, Rollouts, Weights
from jaxrl.controller.pass_rate import make_table
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.metrics import sampler_metrics
from jaxrl.rollout import Rollout, check_sampling


class LearnerLoop:
  """One run's learner: the train state and what it needs to take, train, publish and save."""

  def __init__(self, spec: RunSpec, *, train_step: Callable, state, rollouts: Rollouts, weights: Weights,
               coord: Coordinator, num_samplers: int = 1, checkpointer=None, metrics=None,
               on_step: Callable[[int, dict], None] | None = None, trace: Callable[[dict], None] | None = None,
               telemetry: Callable[[dict], dict] | None = None):
    self.spec, self.train_step, self.state = spec, train_step, state
    self.rollouts, self.weights, self.coord = rollouts, weights, coord
    self.share = spec.rl.groups_per_step // num_samplers  # each sampler's part of every step
    self.num_samplers = num_samplers
    self.checkpointer, self.metrics, self.on_step, self.trace = checkpointer, metrics, on_step, trace
    self.telemetry = telemetry  # step metrics -> roofline numbers (jaxrl.telemetry.Telemetry)
    # rl.max_staleness="auto": the admission bound moves within [k_min, k_max] from the measured drift; k_max
    # (spec.max_staleness) stays the hard bound checked at every train step.
    self.adaptive = None if spec.auto_staleness is None else AdaptiveStaleness(spec.auto_staleness)
    if self.adaptive is not None:
      coord.bound(self.adaptive.k)
    self.trained_staleness: list[int] = []  # per trained sample, for tests and histograms
    self.trained_lengths: list[int] = []  # model tokens per trained sample (mode="auto" calibrates on them)
    self.busy = 0.0
    self.step_times: list[float] = []
    self._batch_groups: list[list[Rollout]] = []  # taken, not yet trained
    self.leftover: list[list[Rollout]] = []  # groups still in the channel when the run stopped
    self._base_key = jax.random.key(spec.seed)
    # task.pass_rate_filter: every settled group's outcome, in the run record itself (so the checkpoint holds it)
    self.pass_rate = make_table(spec.task.pass_rate_filter, spec.pass_rate_aside_positions, coord.resumed_pass_rate)

  @property
  def ledger(self):
    return self.coord.ledger

  @property
  def version(self) -> int:
    return int(jax.device_get(self.state.version))

  def _log(self, event: str, **fields) -> None:
    if self.trace is not None:
      self.trace({"event": event, **fields})

  def _log_skips(self) -> None:
    """Traces the prompts samplers of other processes skipped (a local sampler loop traces its own): before the
    checkpoint or end event whose record counts them."""
    for gid, reason in self.coord.skips_to_trace():
      self._log("skip_prompt", group=gid, reason=reason)

  def run(self) -> None:
    """Asks one share ahead: step s's share is asked for as soon as step s - 1's is taken, so that the sampler side
    assembles and sends it while step s - 1 trains (asked only once step s - 1 is trained, the learner waited a
    decode call plus the share's encoding and copy every step). Which
    groups a share holds does not depend on when it is asked (the deadlines decide; then completion order); a
    sampler that hears of a skipped update one ask late counts its next share one step later than the learner
    trains it, which only lowers its groups' staleness."""
    last = time.perf_counter()
    rounds = asked = 0
    while self.coord.go_on(self.version):
      rounds += 1
      groups = self._batch_groups = []
      if asked < rounds:  # the first step's share (or the next one after a skipped update)
        self.coord.ask()
        asked += 1
      waited = time.perf_counter()
      for rank in range(self.num_samplers):
        self._take(rank, groups)
      if self.version + 1 < self.spec.num_steps:  # the next step's share, while this one trains
        self.coord.ask()
        asked += 1
      t0 = time.perf_counter()
      metrics = self._train(groups)
      self._batch_groups = []
      metrics.update(train_s=time.perf_counter() - t0, wait_s=t0 - waited)  # --from-run
      self.busy += metrics["train_s"]
      metrics["queue_depth"] = self.rollouts.depth()
      now = time.perf_counter()
      self._after_step(metrics, now - last)
      last = now
      self.coord.wake()

  def _take(self, rank: int, groups: list[list[Rollout]]) -> None:
    """Appends sampler `rank`'s next share to groups (dropping, counted, the groups that cannot be trained)."""
    taken = 0
    while taken < self.share:
      g = self.rollouts.get(rank)
      if self._accept(g):
        groups.append(g)
        taken += 1

  def _accept(self, group: list[Rollout]) -> bool:
    """Drops (and counts) a group that cannot be trained (the sampler side left it out of every share already);
    never one for its staleness."""
    reason = reject_reason(group, self.spec.rl.seq_len, self.spec.rl.filter_groups)
    if reason is None:
      return True
    if reason == "reward_failed":
      self.ledger.reward_failures += sum(not np.isfinite(r.reward) for r in group)
    self._settle([group], reason)
    self._log("drop", version=self.version, group=group[0].group_id, reason=reason)
    if reason not in LEFT_OUT:  # left out by dynamic sampling: its cost, not a failure to progress
      self.coord.fail(reason)
    return False

  def _settle(self, groups: list[list[Rollout]], dropped: str | None = None) -> None:
    if self.pass_rate is not None:
      for g in groups:
        self.pass_rate.observe(g)
    self.coord.settle(groups, dropped)

  def _train(self, groups: list[list[Rollout]]) -> dict[str, Any]:
    """One train step on the groups; an update the learner skipped (non-finite) drops them, counted."""
    samples = [r for g in groups for r in g]
    step = self.version
    over = [(r.group_id, step - r.min_version) for r in samples
            if len(r.versions) and step - r.min_version > self.spec.max_staleness]
    if over:
      raise RuntimeError(f"staleness invariant broken at step {step}: (group, staleness) {over[:4]} over "
                         f"max_staleness={self.spec.max_staleness}")
    check_sampling(samples, self.spec.sampler.sampling)
    train_step = int(jax.device_get(self.state.step))
    batch = self.spec.make_batch(samples, train_step)
    if self.checkpointer is not None:
      # A save still reading the state would keep it alive through this step, which donates it: a second state
      # plus Orbax's host copy (docs/BENCHMARKS_HISTORY.md, "The main job's memory (issue 14)").
      self.checkpointer.wait()
    state, metrics = self.train_step(self.state, batch, jax.random.fold_in(self._base_key, train_step))
    applied = int(jax.device_get(state.version)) > step
    metrics = dict(jax.device_get(metrics))
    # The new state and the fate of its groups change together (this thread takes the checkpoints).
    self.state = state
    self._settle(groups, None if applied else "update_skipped")
    self._log("train", step=train_step, version=step, applied=applied,
              samples=[[r.group_id, r.sample_index, r.min_version, int(r.versions.max(initial=-1))]
                       for r in samples], lengths=[r.num_model_tokens for r in samples])
    # A skipped update is a failure; the samplers' next shares come a step earlier.
    self.coord.update_done(applied, partial=bool(metrics["updates_nonfinite"] > 0))
    if applied:
      self.trained_staleness += [step - r.min_version for r in samples]
      self.trained_lengths += [r.num_model_tokens for r in samples]
    self.ledger.zero_advantage_groups += sum(map(scored_alike, groups))
    metrics.update(sample_metrics(samples, step), applied=applied,
                   train_tokens=float(batch.tokens_BxL.size))  # what the step computed over (padding included)
    if self.spec.routing is not None:
      metrics["routing_recorded"] = routing_recorded(samples)
    return metrics

  def _after_step(self, metrics: dict[str, Any], step_time: float) -> None:
    if not metrics.pop("applied"):
      # Same version, same params: nothing to publish, log under this version, or checkpoint.
      reasons = [k for k in ("skip/reward", "skip/empty", "skip/nonfinite") if metrics.get(k)]
      resumed = self.coord.just_resumed_from()
      after = f", right after resuming from checkpoint {resumed}" if resumed is not None else ""
      print(f"jaxrl: update skipped at version {self.version} ({', '.join(reasons)}){after}; its groups are dropped",
            file=sys.stderr)
      return
    version = self.version
    t0 = time.perf_counter()
    self.weights.publish(self.state.params, version)
    # Every sampler's cumulative costs (SamplerStats and loop busy time), for jaxrl-profile --from-run.
    metrics.update(publish_s=time.perf_counter() - t0, **sampler_metrics(self.coord.sampler_costs()))
    self._log_skips()
    if self.telemetry is not None:
      metrics.update(self.telemetry(metrics))
    self.step_times.append(step_time)
    if self.adaptive is not None:  # the adaptive-staleness hook: measured drift in, admission bound out
      metrics["admit_staleness"] = self.adaptive.observe(metrics["ess_applied_frac"], metrics["kl_behavior"])
      self.coord.bound(metrics["admit_staleness"])
    led = self.ledger
    metrics.update(step_time_s=step_time, version=version, samples_generated=led.samples_generated,
                   samples_trained=led.samples_trained, samples_dropped=led.samples_dropped,
                   updates_skipped_total=led.skipped_updates, partial_steps_total=led.partial_steps,
                   zero_advantage_groups=led.zero_advantage_groups, reward_failures_total=led.reward_failures,
                   filtered_groups=led.filtered_groups, samples_cancelled=led.dropped.get("cancelled", 0),
                   **{f"length/{k}": v for k, v in led.length_bias().items()})
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
    record = self.coord.checkpoint_record()
    self._log_skips()
    self._log("checkpoint", version=self.version, next_group_id=record["next_group_id"],
              pending=record["pending_group_ids"], unadmitted=record["unadmitted_group_ids"], ledger=record["ledger"])
    self.checkpointer.save(self.version, self.state, record, force=force)

  def finish(self) -> None:
    """Saves the last good state, whatever stopped the run (an interrupted step never reaches the state)."""
    self.save_checkpoint(force=True)
    record = self.coord.checkpoint_record()
    self._log_skips()
    self._log("end", version=self.version, next_group_id=record["next_group_id"], pending=record["pending_group_ids"],
              unadmitted=record["unadmitted_group_ids"], ledger=record["ledger"])

  def log_start(self, mode: str, record: RunRecord) -> None:
    """The trace's first event of a run (or of each resume): where it starts (the record resumed from) and what it
    generates again."""
    self._log("start", mode=mode, version=self.version, next_group_id=record.next_group_id,
              regenerate=sorted(record.pending_group_ids), unadmitted=sorted(record.unadmitted_group_ids))

  def drain(self) -> None:
    """Keeps, for the in-flight count, the groups left in the channel once the run stopped."""
    self.leftover += self.rollouts.drain()

  def samples_in_flight(self) -> int:
    return sum(len(g) for g in self.leftover + self._batch_groups)


def sample_metrics(samples: list[Rollout], step: int) -> dict[str, float]:
  """The host's per-sample metrics of a step's samples: completion length, staleness (learner step - the sample's
  oldest token's version, beside the step's per-token staleness_mean/max) and, where the reward says, accuracy."""
  staleness = [step - r.min_version for r in samples]
  out = dict(completion_len=float(np.mean([r.num_model_tokens for r in samples])),
             sample_staleness_mean=float(np.mean(staleness)), sample_staleness_max=float(max(staleness)))
  accuracy = [r.meta["correct"] for r in samples if "correct" in r.meta]
  if accuracy:
    out["accuracy"] = float(np.mean(accuracy))
  return out


def routing_recorded(samples: list[Rollout]) -> float:
  """A mixture-of-experts run: the fraction of the inputs the learner replays the routing of (the prompt's, the
  model's tokens') that the sampler recorded; an unrecorded one is routed afresh by the learner, silently off the
  sampler's routing. An environment's observation tokens are not counted (never recorded)."""
  recorded = total = 0
  for r in samples:
    mask = r.model_mask
    total += int(mask.sum()) + len(r.prompt_tokens) - 1
    if r.experts is not None:
      recorded += int((np.asarray(r.experts) >= 0).any(axis=(1, 2))[mask].sum())
    if r.prompt_experts is not None:
      recorded += int((np.asarray(r.prompt_experts) >= 0).any(axis=(1, 2)).sum())
  return recorded / max(total, 1)
