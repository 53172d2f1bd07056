"""The three interfaces the sampler loop and the learner loop talk through; the loops reach nothing else of the
other side.

  rollouts     put (sampler; blocks while the learner is behind), get(rank) (learner: the next group of sampler
               `rank`), drain (what is left at the end), depth, unsent
  weights      publish (learner), take_newer (sampler, between decode calls)
  coordinator  stop; the data positions (admit, settle), the counts (fail, update_done, the ledger), the checkpoint
               record; what the learner tells the samplers (ask, bound, update_done -> progress) and what they
               tell it (sending -> sampler_costs, skips_to_trace)

In one process: `rollouts.RolloutQueue`, `weights.WeightPublisher` and `coordinator.LocalCoordinator`, the two loops
in two threads (`controller.local`). Across processes: `jaxrl.distributed.cross_process` (JAX cross-host copies and
the coordination store), one loop per process. With independent sampler programs that join and leave:
`jaxrl.distributed.hub` (the learner's coordinator and rollouts, served over rpc), `jaxrl.distributed.remote` (the
samplers') and `jaxrl.distributed.weight_service` (weights over jax.experimental.transfer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol

from jaxrl.controller.ledger import Ledger
from jaxrl.rollout import Rollout
from jaxrl.sharding import Versioned


class Rollouts(Protocol):
  def put(self, group: list[Rollout]) -> None: ...
  # Puts the groups in order and removes each from `groups` once it is on its way (a Stopped leaves exactly the
  # ones not sent there); a cross-process channel sends them together.
  def put_all(self, groups: list[list[Rollout]]) -> None: ...
  def get(self, rank: int) -> list[Rollout]: ...
  def drain(self) -> list[list[Rollout]]: ...
  def depth(self) -> int: ...  # groups waiting for the learner
  def unsent(self) -> int: ...  # samples put on this side and not yet on their way (counted as in flight)
  send_s: float  # seconds the sending side spent in put / put_all doing work (not waiting for room)


class Weights(Protocol):
  def publish(self, params, version: int) -> object: ...
  def take_newer(self, version: int) -> Versioned | None: ...


class Asks(NamedTuple):
  """What the learner has told the samplers so far (Coordinator.progress): the shares it asked for, the updates it
  skipped (a skipped update trains no version: the shares after it count one step earlier) and the admission bound
  it chose (rl.max_staleness="auto"; None: the hard bound); and the groups of each share asked of this sampler (an
  independent sampler: its part of groups_per_step, which the hub assigns and re-makes as samplers come and go;
  None: the sampler's fixed part)."""

  shares: int
  updates_skipped: int
  admit_k: int | None
  groups: int | None = None


class Coordinator(Protocol):
  """Everything the loops share besides rollouts and weights. An implementation keeps its lock and run record
  (data position, ledger, groups admitted and not settled) private; these members are all a loop may reach, and all
  a new topology has to provide (`coordinator.Coordination` has the bookkeeping that does not depend on where the
  other side runs: admit, settle, fail, checkpoint_record, idle / wake, request_stop).

  Every admitted group is settled exactly once (trained, or dropped with its reason); a checkpoint record taken at
  any time holds the admitted groups not yet settled as pending, and its ledger counts the same moment."""

  stop: threading.Event  # set by any end of the run (the last step, a stop request, an error); channels wait on it
  resumed_pass_rate: dict  # the pass-rate table's state the run resumed from (RunRecord.pass_rate; a sampler
  #                          process: from the learner's resume point, once sampler_started returned)
  resumed_filter: tuple[int, int]  # (rejected, finished) groups scored when the run resumed: over_ask's start (a
  #                                  sampler process: from the resume point too)
  ledger: Ledger  # the run's counts: the verbs count what a checkpoint must see with the data position; each loop
  #                 adds what it alone sees (samples generated, reward failures, zero-advantage groups) and reads
  #                 the rest for its metrics

  def request_stop(self, reason: str) -> None: ...  # ends the run after the current step, with a checkpoint

  # learner side
  def go_on(self, version: int) -> bool: ...  # train another step? (num_steps, a stop request)
  def ask(self) -> None: ...  # every sampler: assemble and send your next share
  def bound(self, admit_k: int | None) -> None: ...  # the admission bound for new groups (rl.max_staleness="auto")
  def settle(self, groups: list[list[Rollout]], dropped: str | None = None) -> None:
    """The groups were trained (dropped None) or dropped for that reason: they leave the pending set, counted."""
  def fail(self, reason: str) -> None:
    """One more failure without an applied update (a dropped group, ...); too many in a row raise."""
  def update_done(self, applied: bool, partial: bool = False) -> None:
    """A train step ended: applied (failures in a row reset; partial: part of it skipped as non-finite) or skipped
    (counted, a failure; the samplers' next shares count one step earlier)."""
  def just_resumed_from(self) -> int | None: ...  # the checkpoint resumed from while no update has applied since
  def checkpoint_record(self) -> dict: ...  # the run record to save with the state now (RunRecord.to_json)
  def sampler_costs(self) -> list[dict]: ...  # every sampler's last posted costs (jaxrl-profile --from-run)
  def skips_to_trace(self) -> list[tuple[int, str]]: ...  # (group, reason): prompts other processes skipped, once

  # sampler side
  def admit(self, start: Callable[[int, bool], str | None]) -> bool:
    """Takes the next data position (a group pending at the checkpoint resumed from first, then a position no
    sampler reached, then a new one) and calls start(group_id, again) on it under the lock (again: a pending group
    generated again), so that a checkpoint sees the
    position taken only with the group admitted: start returns None once the group is submitted, or the reason
    its prompt is skipped (counted, settled for good, a failure unless a pass_rate.SetAside). True if the group
    was admitted."""
  def progress(self) -> Asks: ...  # what the learner has told the samplers so far
  def sending(self, costs: dict) -> None: ...  # before finished groups leave: the sampler's cumulative costs
  def idle(self, timeout_s: float) -> None: ...  # nothing to do: wait for wake() (at most timeout_s)
  def wake(self) -> None: ...  # something changed for the sampler (a share asked, a step trained, weights arrived)
