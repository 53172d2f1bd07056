"""The learner processes of one jaxrl-learner that spans several hosts (jax.distributed among themselves): the lead
(process 0) runs the hub; every other learner process follows it, training exactly the lead's batches.

The learner loop is SPMD: every learner process must take the same groups in the same order and stop after the
same step, or the train step's collectives would mix different batches (or wait for ever). The lead's loop runs on
`LeadHub`, which records, in order, what the loop decides and takes (`FollowLog`): each go_on decision (with the
version it was made at), each group (a packet, distributed.packets) and the end. A follower's loop runs on
`Follower`, whose go_on and get return the lead's entries one by one, fetched over the lead's rpc server ("follow").
The verbs that count (settle, fail, ask, bound, update_done, the checkpoint record) are the lead's alone: a
follower's record is never saved, its failures never stop the run (the lead decides when to stop).

Every learner process takes part in every train step's collectives, so a follower is at most a step behind the lead
and the lead holds about two steps' entries: an entry is dropped once every follower has fetched it. Every wait is
bounded and its one-line error names the lead and the entry waited for.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable

from jaxrl.controller.coordinator import Coordination
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord
from jaxrl.distributed import packets, rpc
from jaxrl.distributed.hub import Hub
from jaxrl.rollout import Rollout

_UNBOUNDED = 1 << 62  # a follower counts no failures: the lead's count stops the run, and it tells the followers


class FollowLog:
  """The lead's record of its learner loop for the followers (learner process ids): entries [kind, value], numbered
  from 0; `serve` is the rpc method "follow"."""

  def __init__(self, followers: Iterable[int], max_len: int, *, hold_s: float = 1.0, end_wait_s: float = 30.0):
    self.max_len, self.hold_s, self.end_wait_s = max_len, hold_s, end_wait_s
    self._cond = threading.Condition()
    self._entries: list[list] = []  # entries first, first + 1, ...
    self.first = 0
    self._fetched = {int(f): 0 for f in followers}  # follower -> the entries it has (all below this number)
    self._end_at: int | None = None  # the end's entry

  def went_on(self, version: int, decision: bool) -> None:
    self._append(["go_on", [int(version), bool(decision)]])

  def took(self, group: list[Rollout]) -> None:
    self._append(["group", packets.encode([group], self.max_len)])

  def end(self, why: str) -> None:
    self._end_at = self._append(["end", why])

  def _append(self, entry: list) -> int:
    """Appends the entry; its number."""
    with self._cond:
      self._entries.append(entry)
      at = self.first + len(self._entries) - 1
      self._drop_fetched()
      self._cond.notify_all()
      return at

  def held(self) -> int:
    """Entries kept (not yet fetched by every follower)."""
    with self._cond:
      return len(self._entries)

  def wait_fetched(self) -> list[int]:
    """After end(): waits up to end_wait_s until every follower has every entry before the end (a follower that stopped,
    at a go_on the lead decided False or at the end, acks what it has); the followers that have not. The lead's rpc
    server must outlive that: a stop that needs no last checkpoint (one was saved at that step) let the lead close
    before a follower fetched its end, which then failed on a refused connection and took the job down with it
    (jax.distributed aborts the others)."""
    end = time.monotonic() + self.end_wait_s
    with self._cond:
      if self._end_at is None:
        raise RuntimeError("wait_fetched before the lead's end")
      while True:
        behind = sorted(f for f, n in self._fetched.items() if n < self._end_at)
        if not behind or time.monotonic() >= end:
          return behind
        self._cond.wait(end - time.monotonic())

  def _drop_fetched(self) -> None:
    upto = min(self._fetched.values(), default=self.first + len(self._entries))
    del self._entries[: max(0, upto - self.first)]
    self.first = max(self.first, upto)

  def serve(self, request: dict) -> dict:
    """{"follower", "next"} -> {"first": next, "entries": the entries from `next` on} (held up to hold_s until there
    is one; possibly none). The follower has every entry below `next`: those are dropped once all have them."""
    follower, n = int(request["follower"]), int(request["next"])
    with self._cond:
      if follower not in self._fetched:
        raise ValueError(f"learner process {follower} is not a follower of this lead ({sorted(self._fetched)})")
      if n < self.first:
        raise LookupError(f"learner process {follower} asked for entry {n}, dropped (the lead keeps entries from "
                          f"{self.first}): a follower cannot rejoin a running lead; relaunch every learner process")
      if n > self.first + len(self._entries):  # it cannot have entries not yet made: they would be dropped unread
        raise ValueError(f"learner process {follower} asked for entry {n}, past the lead's last "
                         f"({self.first + len(self._entries) - 1})")
      self._fetched[follower] = max(self._fetched[follower], n)
      self._drop_fetched()
      self._cond.notify_all()  # wait_fetched
      end = time.monotonic() + self.hold_s
      while n >= self.first + len(self._entries) and time.monotonic() < end:
        self._cond.wait(end - time.monotonic())
      return {"first": n, "entries": self._entries[n - self.first :]}


class LeadHub(Hub):
  """The lead's hub: its learner loop's go_on decisions and groups are recorded for the followers (log)."""

  def __init__(self, *args, log: FollowLog, **kwargs):
    super().__init__(*args, **kwargs)
    self.log = log

  def go_on(self, version: int) -> bool:
    decision = super().go_on(version)
    self.log.went_on(version, decision)
    return decision

  def get(self, rank: int = 0) -> list[Rollout]:
    group = super().get(rank)
    self.log.took(group)
    return group


class Lead:
  """A follower's reader of the lead's FollowLog at `address`: next() is the next entry, fetched in batches.
  timeout_s bounds a silent lead (no answer at all), wait_s the wait for one entry from a lead that answers (it may
  itself wait for samplers up to its orphan_s)."""

  def __init__(self, address: str, follower: int, *, secret: bytes, timeout_s: float = 30.0, wait_s: float = 660.0):
    self.address, self.follower, self.timeout_s, self.wait_s = address, int(follower), timeout_s, wait_s
    self.secret = secret
    self._next = 0
    self._batch: list[list] = []

  def next(self, want: str, stop: threading.Event) -> list:
    """The next entry ([kind, value]); `want` (what the caller waits for) goes into the errors. Stopped once
    `stop` is set."""
    waiting_since = heard = time.monotonic()
    while not self._batch:
      if stop.is_set():
        raise Stopped
      try:
        reply = self._follow()
      except rpc.RpcError as e:
        if e.waited_for in ("handler", "auth"):
          raise RuntimeError(f"follow: {e}") from None
        if time.monotonic() - heard > self.timeout_s:
          raise TimeoutError(f"follow: learner process {self.follower} heard nothing from the lead learner at "
                             f"{self.address} for {self.timeout_s:g}s while waiting for entry {self._next} ({want}): "
                             f"{e}") from None
        time.sleep(min(0.5, self.timeout_s / 10))
        continue
      heard = time.monotonic()
      self._batch = list(reply["entries"])
      if not self._batch and heard - waiting_since > self.wait_s:
        raise TimeoutError(f"follow: the lead learner at {self.address} sent learner process {self.follower} no "
                           f"entry {self._next} ({want}) in {self.wait_s:g}s")
    self._next += 1
    return self._batch.pop(0)

  def _follow(self) -> dict:
    """The lead's entries from the next one on; the call also tells it this follower has every entry before."""
    return rpc.call(self.address, "follow", {"follower": self.follower, "next": self._next}, timeout_s=self.timeout_s,
                    secret=self.secret)

  def ack(self) -> None:
    """Tells the lead this follower has every entry so far (after the end: the lead then closes); best effort."""
    try:
      self._follow()
    except rpc.RpcError as e:
      print(f"jaxrl-learner: learner process {self.follower} could not tell the lead it has the end: {e}",
            file=sys.stderr, flush=True)


class Follower(Coordination):
  """A follower's coordinator and rollouts (controller.interfaces) for its learner loop: the lead's decisions and
  groups, in the lead's order; every counting verb is the lead's."""

  def __init__(self, lead: Lead, record: RunRecord, max_len: int, resumed_from: int | None = None):
    super().__init__(record, _UNBOUNDED, resumed_from, _UNBOUNDED)
    self.lead, self.max_len = lead, max_len

  def _next(self, want: str) -> list:
    kind, value = self.lead.next(want, self.stop)
    if kind == "end":
      self.lead.ack()
      self.request_stop(f"the lead learner ended ({value})")
      raise Stopped
    if kind != want:
      raise RuntimeError(f"follow: learner process {self.lead.follower} waited for a {want} and the lead learner "
                         f"at {self.lead.address} sent a {kind}: the learner processes are not in lock step")
    return value

  # the Coordinator's verbs
  def go_on(self, version: int) -> bool:
    try:
      lead_version, decision = self._next("go_on")
    except Stopped:
      return False
    if lead_version != version:
      raise RuntimeError(f"follow: learner process {self.lead.follower} is at version {version}, the lead learner "
                         f"at {self.lead.address} at {lead_version}: the learner processes are not in lock step")
    if not decision:
      self.lead.ack()  # the loop stops here: the lead may close once every follower has its decision
    return decision

  def ask(self) -> None:
    pass

  def bound(self, admit_k: int | None) -> None:
    pass

  def settle(self, groups: list[list[Rollout]], dropped: str | None = None) -> None:
    pass

  def fail(self, reason: str) -> None:
    pass

  def update_done(self, applied: bool, partial: bool = False) -> None:
    pass

  def sampler_costs(self) -> list[dict]:
    return []

  def skips_to_trace(self) -> list[tuple[int, str]]:
    return []

  def progress(self) -> Asks:
    raise TypeError("a follower learner process runs no sampler")

  # the Rollouts' verbs of a learner's end
  def get(self, rank: int = 0) -> list[Rollout]:
    (group,) = packets.decode(self._next("group"), self.max_len)
    return group

  def drain(self) -> list[list[Rollout]]:
    return []

  def depth(self) -> int:
    return 0
