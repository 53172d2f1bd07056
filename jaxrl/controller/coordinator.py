"""The coordinator's shared bookkeeping and its in-process implementation (controller.interfaces.Coordinator).

`Coordination` holds what every coordinator needs behind the protocol's verbs: the stop flag, the run record (data
position and ledger) and the lock that changes it with the groups admitted and not yet settled, the failures in a
row, and the errors of this process's threads. `LocalCoordinator` adds the learner's messages to a sampler in the
same process (plain counters); jaxrl.distributed.cross_process.StoreCoordinator adds them through the store.
"""

from __future__ import annotations

import collections
import threading
import traceback
from collections.abc import Callable

from jaxrl.controller.assembly import scored_groups
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.ledger import Ledger
from jaxrl.controller.pass_rate import SetAside
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord
from jaxrl.envs.guard import RewardsBroken
from jaxrl.rollout import Rollout


class Failures:
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
  """The bookkeeping every coordinator shares: the verbs both sides call that do not depend on where the other side
  runs (admit, settle, fail, checkpoint_record, request_stop, idle / wake), and the run's stop and errors.

  stride: the data positions this process's sampler admits are rank, rank + stride, ... (1 in one process)."""

  def __init__(self, record: RunRecord, max_failures_in_a_row: int, resumed_from: int | None = None,
               max_filtered_in_a_row: int = 1000, stride: int = 1):
    self._record = record
    self._lock = threading.Lock()  # data position, live groups and ledger change together (sampler vs checkpoint)
    self._live: set[int] = set()  # admitted, not yet trained or dropped
    self._failures = Failures(max_failures_in_a_row, resumed_from, max_filtered_in_a_row)
    self._stride = stride
    # Sampler side: what it admits before new data positions: groups pending at the checkpoint resumed from
    # (generated again, not counted as admitted twice), then positions no sampler had admitted yet.
    self._regenerate: list[int] = []
    self._unadmitted: list[int] = []
    self._skipped: dict[int, str] = {}  # prompts this sampler skipped, and why (settled: never admitted again)
    # The pass-rate table resumed from: the record's own on the learner side (its table changes it in place, so the
    # checkpoint holds it); a sampler process's comes with the learner's resume point (sampler_started)
    self.resumed_pass_rate: dict = record.pass_rate
    # (rejected, finished) groups the run had scored when it resumed (assembly.scored_groups): where over_ask starts;
    # set by a coordinator that knows the group size (a sampler process's: with the resume point)
    self.resumed_filter: tuple[int, int] = (0, 0)
    self._wake = threading.Event()
    self.stop = threading.Event()  # set by any end: the last step, a stop request, an error
    self.abort = threading.Event()  # set by an error only
    self.stop_reason: str | None = None
    self.errors: list[tuple[str, BaseException, str]] = []

  @property
  def ledger(self) -> Ledger:
    return self._record.ledger

  @property
  def resumed_from(self) -> int | None:
    return self._failures.resumed_from

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
    self._wake.set()

  def idle(self, timeout_s: float) -> None:
    self._wake.wait(timeout_s)
    self._wake.clear()

  def admit(self, start: Callable[[int, bool], str | None]) -> bool:
    with self._lock:
      gid, again = self._next_group()
      skipped = start(gid, again)
      if skipped is not None:
        self._skip(gid, skipped, isinstance(skipped, SetAside))
        return False
      self._admitted(gid, again)
      return True

  def _resume_here(self, group_size: int) -> None:
    """This coordinator owns the record's data positions: the groups pending at the checkpoint resumed from are
    generated again first, then the positions no sampler reached; over-asking starts at the record's filter rate."""
    self._regenerate = list(self._record.pending_group_ids)
    self._unadmitted = list(self._record.unadmitted_group_ids)
    self.ledger.samples_regenerated += len(self._regenerate) * group_size
    self.resumed_filter = scored_groups(self.ledger, group_size)

  def _admitted(self, gid: int, again: bool) -> None:
    """The group is submitted: live until settled (call under the lock)."""
    self._live.add(gid)
    self.ledger.groups_admitted += not again  # a regenerated group was counted when it was first admitted

  def _skip(self, gid: int, reason: str, set_aside: bool) -> None:
    """The position's prompt is skipped for good, counted (call under the lock); a failure unless the pass-rate
    filter set it aside."""
    self.ledger.skipped_prompts += 1
    self._skipped[gid] = reason
    if set_aside:  # the filter working, not a prompt that cannot be used
      self.ledger.prompts_set_aside += 1
    else:
      self._failures.failed("skipped_prompt")

  def _next_group(self) -> tuple[int, bool]:
    """(the next data position to admit, whether it is a group generated again); a regenerated group first, then a
    position no sampler had admitted, then this sampler's next new one (call under the lock)."""
    if self._regenerate:
      return self._regenerate.pop(0), True
    if self._unadmitted:
      return self._unadmitted.pop(0), False
    gid = self._record.next_group_id
    self._record.next_group_id += self._stride
    return gid, False

  def settle(self, groups: list[list[Rollout]], dropped: str | None = None) -> None:
    with self._lock:
      for g in groups:
        self._live.discard(g[0].group_id)
        if dropped is not None:
          self.ledger.drop(g, dropped)
          self.ledger.filtered_groups += dropped == "filtered"
      if dropped is None:
        self.ledger.trained([r for g in groups for r in g])

  def fail(self, reason: str) -> None:
    with self._lock:
      self._failures.failed(reason)

  def just_resumed_from(self) -> int | None:
    return self._failures.resumed_from if self._failures.just_resumed() else None

  def _applied(self, partial: bool) -> None:
    with self._lock:
      self.ledger.partial_steps += partial
      self._failures.applied()

  def checkpoint_record(self) -> dict:
    with self._lock:
      self._record.pending_group_ids = sorted(self._live)
      return self._record.to_json()


class LocalCoordinator(Coordination):
  """Both loops in one process: the learner's messages to the sampler are plain fields, the data position is the
  record's own. The groups in flight at the checkpoint resumed from are generated again first."""

  def __init__(self, record: RunRecord, num_steps: int, group_size: int, max_failures_in_a_row: int,
               resumed_from: int | None = None, max_filtered_in_a_row: int = 1000):
    super().__init__(record, max_failures_in_a_row, resumed_from, max_filtered_in_a_row)
    self.num_steps = num_steps
    self._resume_here(group_size)
    self._asks = Asks(0, 0, None)
    self._costs: dict | None = None  # the sampler's last posted costs (sending)

  # learner side
  def go_on(self, version: int) -> bool:
    return version < self.num_steps and not self.stop.is_set()

  def ask(self) -> None:
    self._asks = self._asks._replace(shares=self._asks.shares + 1)
    self.wake()

  def bound(self, admit_k: int | None) -> None:
    self._asks = self._asks._replace(admit_k=admit_k)

  def update_done(self, applied: bool, partial: bool = False) -> None:
    if applied:
      self._applied(partial)
      return
    self.ledger.skipped_updates += 1
    self._asks = self._asks._replace(updates_skipped=self._asks.updates_skipped + 1)
    self.fail("update_skipped")

  def sampler_costs(self) -> list[dict]:
    return [self._costs] if self._costs is not None else []

  def skips_to_trace(self) -> list[tuple[int, str]]:
    return []  # the sampler loop in this process traces its own

  # sampler side
  def progress(self) -> Asks:
    return self._asks

  def sending(self, costs: dict) -> None:
    self._costs = costs

  def checkpoint_record(self) -> dict:
    with self._lock:
      self._record.unadmitted_group_ids = list(self._unadmitted)
      self._record.pending_group_ids = sorted(self._live | set(self._regenerate))
      return self._record.to_json()
