"""What both role loops share: a run's sizes (RunSpec) and its host-side position (RunRecord), saved with every
checkpoint."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

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


@dataclasses.dataclass
class RunSpec:
  """Sizes of one run, shared by both loops."""

  num_steps: int
  group_size: int
  groups_per_step: int
  seq_len: int
  max_staleness: int = 1  # k: every trained token has staleness <= k (0: sync)
  queue_groups: int = 8
  max_new_tokens: int | None = None
  sampling: Any = None  # jaxrl.rollout.SamplingParams
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0
  max_failures_in_a_row: int = 100  # skipped prompts + dropped groups + skipped updates with no applied update
  auto_staleness: Any = None  # jaxrl.controller.adaptive.AutoStaleness: k adapts below max_staleness; None: fixed
  pack: bool = False  # several samples per row of seq_len tokens (jaxrl.learner.packing)
  max_segments: int = 16  # samples per packed row at most
  row_buckets: tuple[int, ...] = ()  # row counts of packed batches (the train step compiles once per bucket)
  num_minibatches: int = 1  # optimizer updates per epoch of a learner step (rl.num_minibatches)
  filter_groups: str = "none"  # rl.filter_groups: "zero_variance" drops groups whose rewards are all equal
  # A mixture-of-experts model's (layers, experts per token): every batch carries Batch.experts_BxLxNxK
  routing: tuple[int, int] | None = None
  max_filtered_in_a_row: int = 1000  # filtered groups with no applied update before the run stops
  pass_rate_window: int = 0  # task.pass_rate_filter (0: off)
  pass_rate_aside_positions: int = 0  # task.pass_rate_aside_steps x groups_per_step

  @property
  def batch_size(self) -> int:
    return self.group_size * self.groups_per_step

  def make_batch(self, samples: list[Rollout], step: int = 0):
    """The learner's batch of these samples for train step `step`: packed into the smallest row bucket, or one
    sample per row. With several mini-batches the samples are first shuffled, by (seed, step): sample i of the
    shuffled order is in mini-batch i % num_minibatches, packed or not (jaxrl.learner.step)."""
    if self.num_minibatches > 1:
      order = np.random.default_rng([self.seed, step]).permutation(len(samples))
      samples = [samples[i] for i in order]
    if self.pack:
      batch = pack_batch(samples, self.seq_len, self.row_buckets or (self.batch_size,), self.max_segments,
                         num_minibatches=self.num_minibatches)
    else:
      batch = make_batch(samples, self.batch_size, self.seq_len)
    return with_routing(batch, self.routing)
