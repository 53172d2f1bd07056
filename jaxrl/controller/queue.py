"""Host-side plumbing between sampler and learner: group assembly, the bounded rollout queue, the staleness
policy, the weight publisher, and the ledger that accounts for every sample."""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable

from jaxrl.config import ON_STALE
from jaxrl.rollout import Rollout
from jaxrl.sharding import Versioned, transfer


class Stopped(Exception):
  """The run is stopping (another thread failed, or the step budget is spent)."""


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
  """Bounds staleness = learner step - oldest token version, at admission and again at batch assembly.

  Admission: if groups are consumed in submission order, the g-th admitted group is trained at step
  g // groups_per_step; submitting it while the sampler holds version v keeps its staleness <= k when
  g < (v + k + 1) * groups_per_step. Completion order can differ from submission order (continuous batching),
  so batch assembly checks again. What is over the bound there is dropped with a counted reason
  (`on_stale="drop"`: a hard bound, but the dropped groups are the slow ones, which are mostly the long ones: a
  length bias the ledger reports), or trained anyway and counted (`on_stale="keep"`: no length bias; the bound is
  then the admission target, and the loss's importance weights correct the extra staleness).
  """

  max_staleness: int
  groups_per_step: int
  on_stale: str = "drop"
  # Bound used for admission only (rl.max_staleness="auto" moves it within [k_min, max_staleness]); None: the
  # same as max_staleness. Batch assembly always checks max_staleness, the hard bound.
  admit_staleness: int | None = None

  def __post_init__(self):
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
    if self.groups_per_step < 1:
      raise ValueError(f"groups_per_step must be >= 1, got {self.groups_per_step}")
    if self.on_stale not in ON_STALE:
      raise ValueError(f"on_stale must be one of {ON_STALE}, got {self.on_stale!r}")

  def may_admit(self, groups_live: int, sampler_version: int) -> bool:
    """groups_live: groups admitted so far minus groups dropped (the ones the learner will consume)."""
    k = self.max_staleness if self.admit_staleness is None else self.admit_staleness
    return groups_live < (sampler_version + k + 1) * self.groups_per_step

  @staticmethod
  def staleness(group: list[Rollout], learner_step: int) -> int:
    versions = [r.min_version for r in group if len(r.versions)]
    return learner_step - min(versions) if versions else 0

  def is_fresh(self, group: list[Rollout], learner_step: int) -> bool:
    return self.staleness(group, learner_step) <= self.max_staleness

  def verdict(self, group: list[Rollout], learner_step: int) -> str:
    """"fresh", "keep" (over the bound, trained anyway) or "drop" (over the bound)."""
    if self.is_fresh(group, learner_step):
      return "fresh"
    return self.on_stale


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

  def get(self) -> list[Rollout]:
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

  def qsize(self) -> int:
    return self._q.qsize()


class WeightPublisher:
  """Holds the newest params for the sampler: the learner publishes, the sampler takes between decode steps."""

  def __init__(self, dst_shardings, dtype=None, on_publish: Callable[[Versioned], None] | None = None):
    self._dst = dst_shardings
    self._dtype = dtype
    self._lock = threading.Lock()
    self._latest: Versioned | None = None
    self._on_publish = on_publish
    self.published = 0

  def publish(self, params, version: int) -> Versioned:
    moved = transfer(params, version, self._dst, self._dtype)
    with self._lock:
      if self._latest is not None and version <= self._latest.version:
        raise ValueError(f"published version {version} is not newer than {self._latest.version}")
      self._latest = moved
      self.published += 1
    if self._on_publish is not None:
      self._on_publish(moved)
    return moved

  def take_newer(self, version: int) -> Versioned | None:
    """The latest params if newer than `version`, else None."""
    with self._lock:
      latest = self._latest
    return latest if latest is not None and latest.version > version else None


def _completion_tokens(samples: list[Rollout]) -> int:
  return sum(len(r.completion_tokens) for r in samples)


@dataclasses.dataclass
class Ledger:
  """Counts every sample: generated = trained + dropped (by reason) + in flight. Checkpointed with the run.

  Completion tokens are counted alongside samples, per fate, so that the length bias of what was dropped (stale
  groups are mostly long ones) is measured rather than guessed: see `length_bias`.
  """

  groups_admitted: int = 0
  samples_generated: int = 0
  samples_trained: int = 0
  samples_regenerated: int = 0  # in flight at a checkpoint, generated again after a resume
  dropped: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  dropped_groups: int = 0
  reward_failures: int = 0
  skipped_prompts: int = 0
  skipped_updates: int = 0  # non-finite updates the learner skipped; their samples are dropped as "update_skipped"
  zero_advantage_groups: int = 0  # trained or skipped groups whose rewards were all equal (no learning signal)
  tokens_trained: int = 0  # completion tokens of the trained samples
  dropped_tokens: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  kept_stale: int = 0  # trained samples over the staleness bound (on_stale="keep"), also in samples_trained
  kept_stale_tokens: int = 0

  def drop(self, group: list[Rollout], reason: str) -> None:
    self.dropped[reason] += len(group)
    self.dropped_tokens[reason] += _completion_tokens(group)
    self.dropped_groups += 1

  def trained(self, samples: list[Rollout]) -> None:
    self.samples_trained += len(samples)
    self.tokens_trained += _completion_tokens(samples)

  def keep_stale(self, group: list[Rollout]) -> None:
    self.kept_stale += len(group)
    self.kept_stale_tokens += _completion_tokens(group)

  @property
  def samples_dropped(self) -> int:
    return sum(self.dropped.values())

  def length_bias(self) -> dict[str, float]:
    """Mean completion length of the trained samples, of the dropped ones per reason, and of the kept stale ones;
    `stale_over_trained` > 1 says dropping stale groups biased training towards short answers."""
    mean = lambda tokens, n: tokens / n if n else float("nan")
    out = {"trained_mean_len": mean(self.tokens_trained, self.samples_trained)}
    for reason, n in sorted(self.dropped.items()):
      out[f"dropped_{reason}_mean_len"] = mean(self.dropped_tokens.get(reason, 0), n)
    if self.kept_stale:
      out["kept_stale_mean_len"] = mean(self.kept_stale_tokens, self.kept_stale)
    if self.dropped.get("stale") and self.samples_trained:
      out["stale_over_trained"] = out["dropped_stale_mean_len"] / out["trained_mean_len"]
    return out

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["dropped"] = dict(self.dropped)
    d["dropped_tokens"] = dict(self.dropped_tokens)
    return d

  @classmethod
  def from_json(cls, d: dict) -> Ledger:
    d = dict(d)
    dropped = collections.defaultdict(int, d.pop("dropped", {}))
    dropped_tokens = collections.defaultdict(int, d.pop("dropped_tokens", {}))
    return cls(dropped=dropped, dropped_tokens=dropped_tokens, **d)
