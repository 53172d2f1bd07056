"""A sampler program's channels to the learner's hub (distributed.hub), over rpc: the Coordinator and the sampler's
end of the Rollouts that the unchanged SamplerLoop runs on (controller.interfaces).

One `RemoteCoordinator` is one registration with one learner: its sampler id, the learner's incarnation and the
fencing tokens of the groups it holds. It ends (`ended`, and the loop's stop) when the run is done, when the hub
says the lease expired (the sampler was stopped or cut off past its lease: its groups went to others), or when
the learner cannot be reached (killed, restarted); the program then registers again and starts a new loop
(distributed.sampler_main). Every call is bounded by timeout_s and its failure names the learner and the call.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable

from jaxrl.controller.assembly import DeadlineBook
from jaxrl.controller.coordinator import Coordination
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.pass_rate import SetAside
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord
from jaxrl.distributed import packets, rpc
from jaxrl.rollout import Rollout

# No sampler-side failure budget: the hub counts the failures of every sampler against the run's own.
_UNBOUNDED = 1 << 62


def register(address: str, *, secret: bytes, timeout_s: float, reconnect_s: float, poll_s: float = 0.05,
             stopping: Callable[[], bool] = lambda: False) -> RemoteCoordinator | None:
  """Registers with the learner at address (proving the run's secret), trying again while it cannot be reached (a
  learner restarting from its checkpoint) for up to reconnect_s; then RpcError names the learner and the wait; at
  once if the learner refuses the secret. None once `stopping()`."""
  t0 = time.monotonic()
  while not stopping():
    try:
      reply = rpc.call(address, "register", {"host": socket.gethostname()}, timeout_s=timeout_s, secret=secret)
      if not reply.get("stopping"):
        return RemoteCoordinator(address, reply, secret=secret, timeout_s=timeout_s, poll_s=poll_s)
      e = rpc.RpcError(address, "register", "reply", "the learner is stopping")
    except rpc.RpcError as error:
      e = error
    if e.waited_for in ("handler", "auth"):
      raise e
    if time.monotonic() - t0 > reconnect_s:
      raise rpc.RpcError(address, "register", e.waited_for,
                         f"the learner did not take a registration for {reconnect_s:g}s ({e})") from None
    time.sleep(min(1.0, reconnect_s / 10))
  return None


class RemoteCoordinator(Coordination):
  """The sampler side of controller.interfaces.Coordinator for one registration with the hub."""

  def __init__(self, address: str, registered: dict, *, secret: bytes, timeout_s: float, poll_s: float = 0.05):
    super().__init__(RunRecord(), _UNBOUNDED, max_filtered_in_a_row=_UNBOUNDED)
    self.address, self.secret, self.timeout_s, self.poll_s = address, secret, timeout_s, poll_s
    self.sampler, self.incarnation = registered["sampler"], registered["incarnation"]
    self.resumed_pass_rate = registered["pass_rate"]
    self.resumed_filter = tuple(registered["filter"])
    self.tokens: dict[int, int] = {}  # group -> fencing token, for the groups this registration holds
    self.weights_at: str | None = registered.get("weights_at")  # the learner process to pull from (None: this one)
    self.costs: dict = {}
    self.ended: str | None = "done" if registered["done"] else None  # "done", "expired" or "lost"
    # Every sampler hears every ask (with its part of each share); one that joins late counts from the share the
    # learner waits for now.
    self._seen = registered["asks"]
    self._offset = self._seen[0] - min(self._seen[0], 1)
    self._asks = self._told(self._seen)
    self.book: Callable[[], DeadlineBook | None] = lambda: None  # the sampler loop's deadline book (sampler_main)

  def call(self, method: str, *, allow_expired: bool = False, at: str | None = None, **request) -> dict:
    """The hub's reply (or that of the learner process at `at`); a learner that cannot be reached or an expired
    lease ends this registration (Stopped)."""
    try:
      reply = rpc.call(at or self.address, method,
                       {"sampler": self.sampler, "incarnation": self.incarnation, **request}, timeout_s=self.timeout_s,
                       secret=self.secret)
    except rpc.RpcError as e:
      if e.waited_for in ("handler", "auth"):
        raise
      self.end("lost", str(e))
      raise Stopped from None
    if reply.get("expired") and not allow_expired:
      self.end("expired", f"the learner at {self.address} dropped sampler {self.sampler} (lease expired)")
      raise Stopped
    return reply

  def end(self, why: str, detail: str = "") -> None:
    if self.ended is None:
      self.ended = why
      if detail:
        print(f"jaxrl-sampler: {detail}", file=sys.stderr, flush=True)
    self.stop.set()

  def beat(self) -> None:
    """The heartbeat (a thread): renews the lease, follows the learner's asks (held by the hub until one comes)."""
    while not self.stop.is_set():
      book = self.book()
      reply = self.call("heartbeat", allow_expired=True, seen=self._seen, book_step=None if book is None else book.step,
                        pending=None if book is None else self._asks.shares - book.shares)
      if reply["done"]:
        self.end("done")
        return
      if reply["expired"]:
        self.end("expired", f"the learner at {self.address} dropped sampler {self.sampler} (lease expired)")
        return
      self._seen = reply["asks"]
      self._asks = self._told(self._seen)
      self.wake()

  def _told(self, asks: list) -> Asks:
    """The hub's asks (distributed.hub.Hub._asks_of) counted from this registration's first share."""
    shares, skipped, admit_k, part = asks
    return Asks(shares - self._offset, skipped, admit_k, part)

  def start_beating(self) -> threading.Thread:
    thread = threading.Thread(target=self.guarded, args=("heartbeat", self.beat), name="jaxrl-heartbeat",
                              daemon=True)
    thread.start()
    return thread

  def progress(self) -> Asks:
    return self._asks

  def admit(self, start) -> bool:
    reply = self.call("admit")
    gid, again, token = reply["group"], reply["again"], reply["token"]
    with self._lock:
      self.tokens[gid] = token
      skipped = start(gid, again)
    if skipped is None:
      return True
    self.tokens.pop(gid)
    self.call("skipped", group=gid, token=token, reason=str(skipped), set_aside=isinstance(skipped, SetAside))
    return False

  def sending(self, costs: dict) -> None:
    self.costs = costs  # goes with the groups (deliver)


class RemoteRollouts:
  """The sampler's end of the rollouts channel: each put_all delivers its groups to the hub in packets of up to
  `capacity` groups (distributed.packets), sending again while the hub answers that its pool is full."""

  def __init__(self, coord: RemoteCoordinator, capacity: int, max_len: int):
    self.coord, self.capacity, self.max_len = coord, capacity, max_len
    self.send_s = 0.0

  def put(self, group: list[Rollout]) -> None:
    self.put_all([group])

  def put_all(self, groups: list[list[Rollout]]) -> None:
    coord = self.coord
    while groups:
      t0 = time.perf_counter()
      chunk = groups[: self.capacity]
      packet = packets.encode(chunk, self.max_len)
      tokens = [[g[0].group_id, coord.tokens.get(g[0].group_id)] for g in chunk]
      while True:
        sent = time.perf_counter()
        reply = coord.call("deliver", allow_expired=True, packet=packet, tokens=tokens, costs=coord.costs)
        if not reply["full"]:
          break
        t0 += time.perf_counter() - sent  # waiting for room is not sending work
        if coord.stop.is_set():
          raise Stopped
      for gid, _ in tokens:
        coord.tokens.pop(gid, None)
      del groups[: len(chunk)]
      self.send_s += time.perf_counter() - t0
      if reply["expired"]:  # the hub counted this packet's groups as refused; this registration is over
        coord.end("expired", f"the learner at {coord.address} dropped sampler {coord.sampler} (lease expired)")
        raise Stopped

  def get(self, rank: int) -> list[Rollout]:
    raise TypeError("a sampler program sends rollouts; the learner's hub takes them")

  def drain(self) -> list[list[Rollout]]:
    return []

  def depth(self) -> int:
    return 0

  def unsent(self) -> int:
    return 0
