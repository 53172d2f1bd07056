"""Host-side plumbing between sampler and learner: group assembly, the bounded rollout queue, the weight
publisher, and the ledger that accounts for every sample."""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from collections.abc import Callable

from jaxrl.rollout import Rollout
from jaxrl.sharding import Versioned, transfer


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


class WeightPublisher:
  """Holds the newest params for the sampler: the learner publishes, the sampler takes between decode steps."""

  def __init__(self, dst_shardings, dtype=None, on_publish: Callable[[Versioned], None] | None = None,
               weight_dtype: str = "float"):
    self._dst = dst_shardings
    self._dtype, self._weight_dtype = dtype, weight_dtype
    self._lock = threading.Lock()
    self._latest: Versioned | None = None
    self._on_publish = on_publish
    self.published = 0

  def publish(self, params, version: int) -> Versioned:
    moved = transfer(params, version, self._dst, self._dtype, self._weight_dtype)
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
  return sum(r.num_model_tokens for r in samples)  # the model's: an environment's observations are not generated


@dataclasses.dataclass
class Ledger:
  """Counts every sample: generated = trained + dropped (by reason) + discarded at resume + in flight.
  Checkpointed with the run; no count is ever reset.

  Completion tokens are counted alongside samples, per fate, so that a length bias (what is trained against what
  is generated) is measured rather than guessed: see `length_bias`.
  """

  groups_admitted: int = 0
  samples_generated: int = 0
  tokens_generated: int = 0  # completion tokens of the generated samples
  samples_trained: int = 0
  samples_regenerated: int = 0  # in flight at a checkpoint, generated again after a resume
  # Finished samples the checkpoint resumed from held neither trained nor dropped: a resume discards them (their
  # groups are regenerated). generated = trained + dropped + discarded at resume + in flight, at any time.
  samples_discarded_at_resume: int = 0
  dropped: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  dropped_groups: int = 0
  reward_failures: int = 0
  skipped_prompts: int = 0
  skipped_updates: int = 0  # non-finite updates the learner skipped; their samples are dropped as "update_skipped"
  # applied steps of which a non-finite update was skipped alone (rl.atomic_step=False): their samples are trained
  partial_steps: int = 0
  zero_advantage_groups: int = 0  # trained or skipped groups whose rewards were all equal (no learning signal)
  tokens_trained: int = 0  # completion tokens of the trained samples
  dropped_tokens: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

  def drop(self, group: list[Rollout], reason: str) -> None:
    self.dropped[reason] += len(group)
    self.dropped_tokens[reason] += _completion_tokens(group)
    self.dropped_groups += 1

  def trained(self, samples: list[Rollout]) -> None:
    self.samples_trained += len(samples)
    self.tokens_trained += _completion_tokens(samples)

  @property
  def samples_dropped(self) -> int:
    return sum(self.dropped.values())

  def held_at_checkpoint(self) -> int:
    """Finished samples neither trained, dropped nor already discarded: in flight when this ledger was saved."""
    return self.samples_generated - self.samples_trained - self.samples_dropped - self.samples_discarded_at_resume

  def length_bias(self) -> dict[str, float]:
    """Mean completion length of the generated samples, of the trained ones and of the dropped ones per reason;
    `trained_over_generated` away from 1 says training saw a biased share of the answers' lengths."""
    mean = lambda tokens, n: tokens / n if n else float("nan")
    out = {"generated_mean_len": mean(self.tokens_generated, self.samples_generated),
           "trained_mean_len": mean(self.tokens_trained, self.samples_trained)}
    for reason, n in sorted(self.dropped.items()):
      out[f"dropped_{reason}_mean_len"] = mean(self.dropped_tokens.get(reason, 0), n)
    if self.samples_generated and self.samples_trained:
      out["trained_over_generated"] = out["trained_mean_len"] / out["generated_mean_len"]
    return out

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["dropped"] = dict(self.dropped)
    d["dropped_tokens"] = dict(self.dropped_tokens)
    return d

  @classmethod
  def from_json(cls, d: dict) -> Ledger:
    d = {k: v for k, v in d.items() if k not in ("kept_stale", "kept_stale_tokens")}  # rl.on_stale="keep" is gone
    dropped = collections.defaultdict(int, d.pop("dropped", {}))
    dropped_tokens = collections.defaultdict(int, d.pop("dropped_tokens", {}))
    return cls(dropped=dropped, dropped_tokens=dropped_tokens, **d)
