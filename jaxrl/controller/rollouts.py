"""The sampler-to-learner path inside one process: group assembly (a GRPO group leaves when all its samples are
done) and the bounded rollout queue."""

from __future__ import annotations

import queue
import threading

from jaxrl.rollout import Rollout


class Stopped(Exception):
  """The run is stopping (another thread failed, or the step budget is spent)."""


class GroupAssembler:
  """Collects finished samples; a GRPO group is released only when all its samples are done."""

  def __init__(self):
    self._open: dict[int, list[Rollout]] = {}
    self._size: dict[int, int] = {}

  def expect(self, group_id: int, n: int) -> None:
    if group_id in self._size:
      raise ValueError(f"group {group_id} is already open")
    self._size[group_id] = n
    self._open[group_id] = []

  def add(self, rollout: Rollout) -> list[Rollout] | None:
    gid = rollout.group_id
    if gid not in self._size:
      raise KeyError(f"rollout for unknown group {gid}")
    self._open[gid].append(rollout)
    if len(self._open[gid]) < self._size[gid]:
      return None
    del self._size[gid]
    return sorted(self._open.pop(gid), key=lambda r: r.sample_index)

  @property
  def open_groups(self) -> list[int]:
    return sorted(self._size)


class RolloutQueue:
  """Bounded FIFO of complete groups. A full queue blocks the producer (back-pressure); both sides wake on stop."""

  def __init__(self, max_groups: int, stop: threading.Event, poll_s: float = 0.05):
    if max_groups < 1:
      raise ValueError(f"queue size must be >= 1, got {max_groups}")
    self._q: queue.Queue[list[Rollout]] = queue.Queue(max_groups)
    self._stop = stop
    self._poll_s = poll_s
    self.max_depth = 0

  def put(self, group: list[Rollout]) -> None:
    while True:
      if self._stop.is_set():
        raise Stopped
      try:
        self._q.put(group, timeout=self._poll_s)
        self.max_depth = max(self.max_depth, self._q.qsize())
        return
      except queue.Full:
        continue

  send_s = 0.0  # in-process: a put hands over references (Rollouts.send_s)

  def put_all(self, groups: list[list[Rollout]]) -> None:
    while groups:
      self.put(groups[0])
      groups.pop(0)

  def get(self, rank: int = 0) -> list[Rollout]:
    """The next group (one sampler in this process: `rank` is always 0)."""
    while True:
      if self._stop.is_set():
        raise Stopped
      try:
        return self._q.get(timeout=self._poll_s)
      except queue.Empty:
        continue

  def drain(self) -> list[list[Rollout]]:
    out = []
    while True:
      try:
        out.append(self._q.get_nowait())
      except queue.Empty:
        return out

  def depth(self) -> int:
    return self._q.qsize()

  def unsent(self) -> int:
    return 0  # a group is on the learner's side as soon as it is put
