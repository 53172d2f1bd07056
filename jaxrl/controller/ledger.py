"""The sample ledger: every generated sample trained on or accounted for with a counted reason."""

from __future__ import annotations

import collections
import dataclasses

from jaxrl.rollout import Rollout


def _completion_tokens(samples: list[Rollout]) -> int:
  return sum(r.num_model_tokens for r in samples)  # the model's: an environment's observations are not generated


@dataclasses.dataclass
class Ledger:
  """Counts every sample: generated = trained + dropped (by reason) + discarded at resume + refused + in flight.
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
  prompts_set_aside: int = 0  # of the skipped prompts, those the pass-rate filter set aside (task.pass_rate_filter)
  skipped_updates: int = 0  # non-finite updates the learner skipped; their samples are dropped as "update_skipped"
  # applied steps of which a non-finite update was skipped alone (rl.atomic_step=False): their samples are trained
  partial_steps: int = 0
  zero_advantage_groups: int = 0  # trained or skipped groups whose rewards were all equal (no learning signal)
  filtered_groups: int = 0  # groups rl.filter_groups kept out of training (their samples: dropped["filtered"])
  tokens_trained: int = 0  # completion tokens of the trained samples
  dropped_tokens: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  # Independent samplers (jaxrl.distributed.hub): samples of a group delivered by a sampler that no longer held it
  # ("fenced": its lease had expired and the group went to another; "forged": a sampler id the hub never gave), past
  # the group's deadline ("late"), or that its assignment could not have produced ("sampling_mismatch",
  # "wrong_prompt", "bad_values": hub.refusal), refused and never trained; and the groups generated again for it, by
  # why ("sampler_lost", "sampler_left", "late", and the refusals' reasons).
  samples_refused: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
  groups_generated_again: dict[str, int] = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

  def drop(self, group: list[Rollout], reason: str) -> None:
    self.dropped[reason] += len(group)
    self.dropped_tokens[reason] += _completion_tokens(group)
    self.dropped_groups += 1

  def generated(self, samples: list[Rollout]) -> None:
    self.samples_generated += len(samples)
    self.tokens_generated += _completion_tokens(samples)

  def trained(self, samples: list[Rollout]) -> None:
    self.samples_trained += len(samples)
    self.tokens_trained += _completion_tokens(samples)

  @property
  def samples_dropped(self) -> int:
    return sum(self.dropped.values())

  def held_at_checkpoint(self) -> int:
    """Finished samples neither trained, dropped nor already discarded: in flight when this ledger was saved."""
    return (self.samples_generated - self.samples_trained - self.samples_dropped - self.samples_discarded_at_resume
            - sum(self.samples_refused.values()))

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
    d["samples_refused"] = dict(self.samples_refused)
    d["groups_generated_again"] = dict(self.groups_generated_again)
    return d

  @classmethod
  def from_json(cls, d: dict) -> Ledger:
    d = {k: v for k, v in d.items() if k not in ("kept_stale", "kept_stale_tokens")}  # rl.on_stale="keep" is gone
    counts = {k: collections.defaultdict(int, d.pop(k, {}))
              for k in ("dropped", "dropped_tokens", "samples_refused", "groups_generated_again")}
    return cls(**counts, **d)
