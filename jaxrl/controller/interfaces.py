"""The three interfaces the sampler loop and the learner loop talk through, and the in-process coordinator.

  rollouts     put (sampler; blocks while the learner is behind), get(rank) (learner: the next group of sampler
               `rank`), drain (what is left at the end), depth, unsent
  weights      publish (learner), take_newer (sampler, between decode calls)
  coordinator  stop, the admission room (shares asked, updates skipped, the admission bound), the data position
               and the counts (the run record, failures in a row), each sampler's cost counters (posted by the
               sampler, logged by the learner with every step for jaxrl-profile --from-run)

In one process: `rollouts.RolloutQueue`, `weights.WeightPublisher` and `LocalCoordinator` below, the two loops in two
threads (`controller.local`). Across processes: `jaxrl.distributed.cross_process` (JAX cross-host copies and the
coordination store), one loop per process.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable
from typing import Protocol

from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord
from jaxrl.envs.guard import RewardsBroken
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


class Progress:
  """Failures (skipped prompts, dropped groups, skipped updates) since the last applied update; too many in a row
  stop the run, blaming the checkpoint just resumed from if not one update has applied since. Groups filtered for
  having no signal (rl.filter_groups) are counted apart, against their own, larger bound: many are expected."""

  def __init__(self, max_in_a_row: int, resumed_from: int | None = None, max_filtered_in_a_row: int = 1000):
    self.max_in_a_row, self.resumed_from = max_in_a_row, resumed_from
    self.max_filtered_in_a_row = max_filtered_in_a_row
    self.counts: collections.Counter[str] = collections.Counter()
    self.applied_since_start = False

  def failed(self, reason: str) -> None:
    self.counts[reason] += 1
    filtered = self.counts["filtered"]
    if filtered >= self.max_filtered_in_a_row:
      raise RuntimeError(f"no progress: {filtered} groups in a row filtered out (all their rewards equal) without "
                         "an applied update: every prompt is always solved or always failed by this policy, or the "
                         "reward is constant (rl.max_filtered_in_a_row)")
    if sum(self.counts.values()) - filtered >= self.max_in_a_row:
      raise RuntimeError(f"no progress: {sum(self.counts.values()) - filtered} failures in a row without an applied "
                         f"update ({dict(self.counts)}); {self.suspect()}")

  def applied(self) -> None:
    self.counts.clear()
    self.applied_since_start = True

  def just_resumed(self) -> bool:
    return self.resumed_from is not None and not self.applied_since_start

  def suspect(self) -> str:
    if self.just_resumed():
      return (f"no update has applied since the run resumed from checkpoint {self.resumed_from}: that checkpoint's "
              "state (params or optimizer) is likely broken; resume from an earlier one")
    return "the data, the rewards or the model are broken"


class Coordination:
  """What every coordinator holds: the stop flag and its reason, the errors of this process's threads, the run
  record (data position and ledger) with the lock that changes it, the groups admitted and not yet settled, and
  the failures in a row."""

  def __init__(self, record: RunRecord, max_failures_in_a_row: int, resumed_from: int | None = None,
               max_filtered_in_a_row: int = 1000):
    self.record = record
    self.lock = threading.Lock()  # data position, live groups and ledger change together (sampler vs checkpoint)
    self.live: set[int] = set()  # admitted, not yet trained or dropped
    self.progress = Progress(max_failures_in_a_row, resumed_from, max_filtered_in_a_row)
    self.stop = threading.Event()  # set by any end: the last step, a stop request, an error
    self.abort = threading.Event()  # set by an error only
    self.stop_reason: str | None = None
    self.errors: list[tuple[str, BaseException, str]] = []
    self.admit_k: int | None = None  # rl.max_staleness="auto": the admission bound the learner last chose
    # Sampler side: what it admits before new data positions: groups pending at the checkpoint resumed from
    # (generated again, not counted as admitted twice), then positions no sampler had admitted yet.
    self.regenerate: list[int] = []
    self.unadmitted: list[int] = []
    self.skipped: dict[int, str] = {}  # prompts this sampler skipped, and why (settled: never admitted again)
    self._wake = threading.Event()

  @property
  def ledger(self):
    return self.record.ledger

  def request_stop(self, reason: str) -> None:
    """Ends the run after the current step (a signal handler may call it): the loops return without an error and
    the last trained state is checkpointed; a resume regenerates what was in flight."""
    if self.stop_reason is None:
      self.stop_reason = reason
    self.stop.set()

  def guarded(self, name: str, loop: Callable, *args) -> None:
    """Runs a loop; any failure stops the whole run, with its traceback kept."""
    try:
      loop(*args)
    except Stopped:
      pass
    except BaseException as e:  # noqa: BLE001 - reraised by raise_errors, in the thread that runs the job
      self.errors.append((name, e, traceback.format_exc()))
      self.abort.set()
    finally:
      self.stop.set()

  def raise_errors(self) -> None:
    if self.errors:
      where, err, tb = self.errors[0]
      if isinstance(err, RewardsBroken):  # one line: the reward and its error say what is wrong
        raise err
      msg = f"jaxrl {where} failed: {type(err).__name__}: {err}\n--- original traceback ---\n{tb}"
      raise RuntimeError(msg) from err

  def wake(self) -> None:
    """Something changed for the sampler (a share asked, a step trained, weights arrived)."""
    self._wake.set()

  def idle(self, timeout_s: float) -> None:
    """The sampler has nothing to do: waits for wake() (at most timeout_s)."""
    self._wake.wait(timeout_s)
    self._wake.clear()

  def pending(self) -> list[int]:
    """Groups a checkpoint taken now must generate again (call under the lock)."""
    return sorted(self.live)

  def settle(self, group_id: int) -> None:
    """The learner trained or dropped the group (call under the lock)."""
    self.live.discard(group_id)

  def next_group(self, stride: int) -> tuple[int, bool]:
    """(the next data position to admit, whether it is a group generated again); a regenerated group first, then a
    position no sampler had admitted, then this sampler's next new one (call under the lock)."""
    if self.regenerate:
      return self.regenerate.pop(0), True
    if self.unadmitted:
      return self.unadmitted.pop(0), False
    gid = self.record.next_group_id
    self.record.next_group_id += stride
    return gid, False

  def sending(self, costs: dict) -> None:
    """The sampler is about to put finished groups on the rollout channel; `costs` are its cumulative costs so far
    (jaxrl-profile --from-run reads them from the learner's step records)."""
    self.post_sampler_costs(costs)

  def checkpoint_record(self) -> dict:
    with self.lock:
      self.record.pending_group_ids = self.pending()
      return self.record.to_json()

  def skips_to_trace(self) -> list[tuple[int, str]]:
    """(group, reason) of the prompts samplers in other processes skipped that this process has not traced yet,
    as of its last checkpoint record or sampler costs; none in one process, whose sampler loop traces its own."""
    return []


class LocalCoordinator(Coordination):
  """Both loops in one process: the counters are plain ints, the data position is the record's own. The groups in
  flight at the checkpoint resumed from are generated again first."""

  def __init__(self, record: RunRecord, num_steps: int, group_size: int, max_failures_in_a_row: int,
               resumed_from: int | None = None, max_filtered_in_a_row: int = 1000):
    super().__init__(record, max_failures_in_a_row, resumed_from, max_filtered_in_a_row)
    self.num_steps = num_steps
    self.regenerate = list(record.pending_group_ids)
    self.unadmitted = list(record.unadmitted_group_ids)
    self.ledger.samples_regenerated += len(self.regenerate) * group_size
    self._asked = self._skipped = 0
    self._costs: dict | None = None  # the sampler's last posted costs (post_sampler_costs)

  # learner side
  def go_on(self, version: int) -> bool:
    return version < self.num_steps and not self.stop.is_set()

  def ask(self) -> None:
    self._asked += 1
    self.wake()

  def update_skipped(self) -> None:
    self._skipped += 1

  def sampler_costs(self) -> list[dict]:
    return [self._costs] if self._costs is not None else []

  # sampler side
  def shares_asked(self) -> int:
    return self._asked

  def post_sampler_costs(self, costs: dict) -> None:
    self._costs = costs

  def updates_skipped(self) -> int:
    return self._skipped

  def pending(self) -> list[int]:
    return sorted(self.live | set(self.regenerate))

  def checkpoint_record(self) -> dict:
    with self.lock:
      self.record.unadmitted_group_ids = list(self.unadmitted)
    return super().checkpoint_record()
