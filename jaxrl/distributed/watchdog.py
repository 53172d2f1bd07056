"""Every process heartbeats through the store and watches the others; a silent process or a stop request ends this
process at once, with a message naming the cause, instead of leaving it blocked in a collective or a transfer.

JAX's coordination service also aborts the job when a process stops heartbeating (its heartbeat timeout), but
later and with a generic message; this watchdog is the fast path that says which process and role failed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_STOPPED = 3  # exit status of a process stopped because another one failed


def hard_exit(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # other threads may be blocked in a collective or a transfer that will never complete


class Watchdog:
  """Checks, every `period_s`, the heartbeat counters of all processes and the job's stop reason.

  A process whose counter has not moved for `timeout_s` (measured on this host's clock, so clocks need not agree)
  and that has not announced a clean exit is declared dead: the reason is stored for everyone and this process
  exits. Losing the store itself for `timeout_s` (process 0 runs it) ends this process the same way.
  """

  def __init__(self, store, process_id: int, names: Callable[[int], str], num_processes: int, *,
               period_s: float = 0.5, timeout_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
               on_stop: Callable[[str], None] | None = None, exit: Callable[[int], None] = hard_exit):
    if not 0 < period_s < timeout_s:
      raise ValueError(f"need 0 < period_s < timeout_s (got {period_s}, {timeout_s})")
    self.store, self.process_id, self.names, self.num_processes = store, process_id, names, num_processes
    self.period_s, self.timeout_s, self.clock, self.exit = period_s, timeout_s, clock, exit
    self.on_stop = on_stop or (lambda reason: self.leave(EXIT_STOPPED))
    self.dead: int | None = None  # the process found silent, if any
    self._seen: dict[int, tuple[int, float]] = {}  # process -> (last counter, when it last changed)
    self._store_ok = clock()
    self._closed = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxrl-watchdog", daemon=True)
    self.fired: str | None = None

  def start(self) -> Watchdog:
    self._thread.start()
    return self

  def close(self) -> None:
    """Stops watching (before a clean shutdown); announces this process's exit so that nobody flags it."""
    self._closed.set()
    self._thread.join()
    self.store.set(f"exit/{self.process_id}", True)

  def wait_for_cause(self) -> None:
    """After a local failure, gives the watchdog one timeout to find a dead process or a stop request (it then
    ends this process, naming that cause): an error such as a broken collective is often a peer's death."""
    self._thread.join(self.timeout_s + 2 * self.period_s)
    if self.fired is not None:
      self._thread.join()  # it is ending this process

  def stop_job(self, reason: str) -> None:
    """Asks every process to stop; the first reason stored wins."""
    if self.store.try_get("stop") is None:
      self.store.set("stop", reason)

  def leave(self, code: int) -> None:
    """Exits this process at once. Process 0 runs the store, so it first waits (up to timeout_s) for the others to
    leave: without the store they could not read why the job stopped."""
    try:
      self.store.set(f"gone/{self.process_id}", True)
      others = [p for p in range(1, self.num_processes) if p != self.dead]
      deadline = self.clock() + self.timeout_s
      while self.process_id == 0 and others and self.clock() < deadline:
        others = [p for p in others if self.store.try_get(f"gone/{p}") is None]
        time.sleep(self.period_s / 5)
    finally:
      self.exit(code)

  def check(self) -> str | None:
    """One round: heartbeat, then the reason to stop, if any."""
    now = self.clock()
    try:
      self.store.incr(f"hb/{self.process_id}")
      stop = self.store.try_get("stop")
      if stop is not None:
        return stop
      for p in range(self.num_processes):
        if p == self.process_id:
          continue
        beat = self.store.count(f"hb/{p}")
        last = self._seen.get(p)
        if last is None or beat != last[0]:
          self._seen[p] = (beat, now)
        elif now - last[1] > self.timeout_s and self.store.try_get(f"exit/{p}") is None:
          reason = f"process {p} ({self.names(p)}) sent no heartbeat for {now - last[1]:.0f}s: it died or hangs"
          self.dead = p
          self.stop_job(reason)
          return reason
      self._store_ok = now
    except Exception as e:  # noqa: BLE001 - the store's transport errors have no narrower public type
      if now - self._store_ok > self.timeout_s:
        return f"lost the coordination service for {now - self._store_ok:.0f}s (process 0 runs it): {e}"
    return None

  def _run(self) -> None:
    while not self._closed.wait(self.period_s):
      reason = self.check()
      if reason is not None:
        self.fired = reason
        print(f"jaxrl: process {self.process_id} ({self.names(self.process_id)}) stopping: {reason}",
              file=sys.stderr, flush=True)
        self.on_stop(reason)
        return
