"""What both role loops share: a run's sections and what the build derives from them (RunSpec), and its host-side
position (RunRecord), saved with every checkpoint."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from jaxrl import settings
from jaxrl.controller.adaptive import AutoStaleness
from jaxrl.controller.ledger import Ledger
from jaxrl.learner.packing import pack_batch
from jaxrl.rollout import Rollout, make_batch, with_routing


class SkipPrompt(Exception):
  """A prompt that cannot be used (too long, malformed): skipped and counted, the run goes on."""


@dataclasses.dataclass
class RunRecord:
  """Host-side run position, saved with every checkpoint and restored on resume."""

  next_group_id: int = 0  # data position: the next prompt index to admit
  pending_group_ids: list[int] = dataclasses.field(default_factory=list)  # admitted, not yet trained or dropped
  ledger: Ledger = dataclasses.field(default_factory=Ledger)
  # Data positions below next_group_id that no sampler had admitted yet (the sampler processes of a job admit
  # interleaved positions at their own pace): a resume admits them first, as new groups.
  unadmitted_group_ids: list[int] = dataclasses.field(default_factory=list)
  # The pass-rate filter's table as the learner side saw every settled group (controller.pass_rate; {}: off or empty)
  pass_rate: dict = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict:
    return {"next_group_id": self.next_group_id, "pending_group_ids": sorted(self.pending_group_ids),
            "unadmitted_group_ids": sorted(self.unadmitted_group_ids), "ledger": self.ledger.to_json(),
            "pass_rate": copy.deepcopy(self.pass_rate)}

  @classmethod
  def from_json(cls, d: dict) -> RunRecord:
    # unadmitted_group_ids and pass_rate are absent from checkpoints written before they existed
    return cls(d["next_group_id"], list(d["pending_group_ids"]), Ledger.from_json(d["ledger"]),
               list(d.get("unadmitted_group_ids", [])), copy.deepcopy(d.get("pass_rate", {})))


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """What both loops read: the run's sections and the few values the build derives from them (none copied)."""

  rl: settings.RL
  sampler: settings.Sampler
  task: settings.Task  # its pass-rate filter
  num_steps: int
  seed: int = 0
  max_staleness: int = 1  # k, the hard bound: every trained token has staleness <= k (0: sync)
  auto_staleness: AutoStaleness | None = None  # k adapts below max_staleness; None: fixed
  row_buckets: tuple[int, ...] = ()  # row counts of packed batches (the train step compiles once per bucket)
  # A mixture-of-experts model's (layers, experts per token): every batch carries Batch.experts_BxLxNxK
  routing: tuple[int, int] | None = None

  @property
  def pass_rate_aside_positions(self) -> int:
    return self.task.pass_rate_aside_steps * self.rl.groups_per_step

  def make_batch(self, samples: list[Rollout], step: int = 0):
    """The learner's batch of these samples for train step `step`: packed into the smallest row bucket, or one
    sample per row. With several mini-batches the samples are first shuffled, by (seed, step): sample i of the
    shuffled order is in mini-batch i % num_minibatches, packed or not (jaxrl.learner.step)."""
    rl = self.rl
    if rl.num_minibatches > 1:
      order = np.random.default_rng([self.seed, step]).permutation(len(samples))
      samples = [samples[i] for i in order]
    if rl.pack:
      batch = pack_batch(samples, rl.seq_len, self.row_buckets or (rl.batch_size,), rl.max_segments,
                         num_minibatches=rl.num_minibatches)
    else:
      batch = make_batch(samples, rl.batch_size, rl.seq_len)
    return with_routing(batch, self.routing)
