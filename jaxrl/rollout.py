"""Rollout (one finished sample, host side) and Batch (fixed-shape arrays for the learner).

Per-token arrays of a Batch are aligned with `tokens_BxL`: entry i describes token i (its behavior logprob,
the policy version that sampled it, whether it is trained on). Token 0 of a row is never a target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """The distribution a token was drawn from: logits / temperature, then top-k, then top-p (nucleus)."""

  temperature: float = 1.0
  top_k: int = 0  # 0: no top-k filter
  top_p: float = 1.0  # 1.0: no nucleus filter
  greedy: bool = False

  def __post_init__(self):
    if not self.greedy and not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 (got {self.temperature}); use greedy=True for argmax")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")


@dataclasses.dataclass
class Rollout:
  """One finished sample: prompt, completion, and for every completion token its behavior logprob and version."""

  prompt_tokens: np.ndarray  # int32 [P]
  completion_tokens: np.ndarray  # int32 [C]
  logprobs: np.ndarray  # float32 [C], log p_behavior(token) under the distribution actually sampled from
  versions: np.ndarray  # int32 [C], policy version of the params that computed the token's logits
  finish_reason: str  # "eos" | "stop" | "length" | "cancelled" (Sampler.cancel: a surplus group ended early)
  group_id: int  # samples of one prompt (a GRPO group) share it
  sample_index: int = 0  # index within the group
  sampling: SamplingParams = SamplingParams()
  reward: float = float("nan")
  meta: dict = dataclasses.field(default_factory=dict)
  # float32 [C]: 1 on the model's tokens, 0 on an environment's observation tokens (multi-turn episodes), which
  # are in the learner's input but never trained on (their logprob 0, version -1); None: every token is the model's.
  loss_mask: np.ndarray | None = None
  # Why the sampler side left this sample's group out of every share although it could be trained ("surplus": over-
  # asked by dynamic sampling beyond its step's places, past its deadline); the learner drops it, counted. None: not.
  left_out: str | None = None
  # int16 [C, N, k] (mixture of experts): entry i holds, for each of the N layers, the k experts that routed the
  # input token whose logits drew completion token i (the token before it), as the sampler chose them; -1 where
  # nothing was recorded (a dense layer, an environment's observation token). None: a dense model.
  experts: np.ndarray | None = None
  # int16 [P - 1, N, k] (mixture of experts): the routing of the prompt's inputs before its last token (whose routing
  # is experts[0]), as the prefill that wrote the keys/values the sample read chose it. None: not recorded (the
  # learner routes the prompt afresh).
  prompt_experts: np.ndarray | None = None

  def __post_init__(self):
    c = len(self.completion_tokens)
    if len(self.logprobs) != c or len(self.versions) != c:
      raise ValueError(
          f"rollout arrays disagree: {c} completion tokens, {len(self.logprobs)} logprobs, "
          f"{len(self.versions)} versions"
      )
    if self.loss_mask is not None and len(self.loss_mask) != c:
      raise ValueError(f"rollout arrays disagree: {c} completion tokens, {len(self.loss_mask)} loss mask entries")
    if self.experts is not None and (np.ndim(self.experts) != 3 or len(self.experts) != c):
      raise ValueError(f"rollout arrays disagree: {c} completion tokens, routing of shape "
                       f"{np.shape(self.experts)} (want [{c}, layers, experts per token])")
    p = len(self.prompt_tokens)
    if self.prompt_experts is not None and (np.ndim(self.prompt_experts) != 3 or len(self.prompt_experts) != p - 1):
      raise ValueError(f"rollout arrays disagree: {p} prompt tokens, prompt routing of shape "
                       f"{np.shape(self.prompt_experts)} (want [{p - 1}, layers, experts per token])")
    if (self.experts is not None and self.prompt_experts is not None
        and np.shape(self.experts)[1:] != np.shape(self.prompt_experts)[1:]):
      raise ValueError(f"rollout routing disagrees: completion {np.shape(self.experts)[1:]}, prompt "
                       f"{np.shape(self.prompt_experts)[1:]} (layers, experts per token)")

  @property
  def model_mask(self) -> np.ndarray:
    """bool [C]: the completion tokens the model generated (the ones trained on)."""
    if self.loss_mask is None:
      return np.ones(len(self.completion_tokens), bool)
    return np.asarray(self.loss_mask) > 0

  @property
  def min_version(self) -> int:
    """Oldest policy version of the model's tokens; staleness at learner step s is s - min_version."""
    versions = np.asarray(self.versions)[self.model_mask]
    return int(versions.min()) if len(versions) else -1

  @property
  def num_model_tokens(self) -> int:
    """Completion tokens the model generated: the completion less an environment's observation tokens."""
    return int(self.model_mask.sum())

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_tokens) + len(self.completion_tokens)


def check_sampling(rollouts: Sequence[Rollout], sampling: SamplingParams) -> None:
  """Raises ValueError naming the first rollout drawn with other sampling settings than the learner scores.

  The learner scores every token under one SamplingParams (LossConfig.sampling); a rollout drawn under another
  would get importance ratios that are not 1 on-policy, silently.
  """
  for r in rollouts:
    if r.sampling != sampling:
      raise ValueError(f"rollout (group {r.group_id}, sample {r.sample_index}) was drawn with {r.sampling}; the "
                       f"learner scores tokens under {sampling}")


@flax.struct.dataclass
class Batch:
  """Fixed-shape learner input: one right-padded sample per row (make_batch), or several per row (packed,
  jaxrl.learner.packing), each a segment with positions from 0; segment id 0 marks padding.

  The per-sample fields (`_B`) are [B] with one sample per row, [B, G] packed: entry [b, g] is the sample with
  segment id g + 1 in row b.
  """

  tokens_BxL: jax.Array  # int32
  positions_BxL: jax.Array  # int32
  segment_ids_BxL: jax.Array  # int32, 1.. per sample of the row (1 unpacked), 0 for padding
  loss_mask_BxL: jax.Array  # float32, 1 on completion tokens (the ones trained on)
  behavior_logprobs_BxL: jax.Array  # float32, 0 off the completion
  versions_BxL: jax.Array  # int32, -1 off the completion
  rewards_B: jax.Array  # float32
  group_ids_B: jax.Array  # int32, -1 for padding rows
  sample_mask_B: jax.Array  # float32, 0 for padding rows
  # int16 [B, L, N, k] (mixture of experts, routing replay): the experts the sampler routed the token at each
  # column through, per layer (k: experts per token); -1 where none was recorded (padding, observations, a prompt
  # without Rollout.prompt_experts: routed afresh). Column t holds what Rollout.experts records for completion token
  # t + 1, and a prompt's earlier columns Rollout.prompt_experts. None: a dense model.
  experts_BxLxNxK: jax.Array | None = None

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.tokens_BxL.shape)


def make_batch(rollouts: Sequence[Rollout], batch_size: int, seq_len: int, pad_id: int = 0) -> Batch:
  """Packs rollouts into a right-padded numpy Batch of exactly [batch_size, seq_len]."""
  if len(rollouts) > batch_size:
    raise ValueError(f"{len(rollouts)} rollouts do not fit a batch of {batch_size}")
  check_fits(rollouts, seq_len)
  return fill_batch([(r, b, 0, 1, b) for b, r in enumerate(rollouts)], batch_size, seq_len, (batch_size,), pad_id)


def check_fits(rollouts: Sequence[Rollout], seq_len: int) -> None:
  """Raises ValueError naming the first rollout with an empty prompt or more than seq_len tokens."""
  for i, r in enumerate(rollouts):
    if len(r.prompt_tokens) == 0:
      raise ValueError(f"rollout {i} (group {r.group_id}) has an empty prompt")
    if r.num_tokens > seq_len:
      raise ValueError(f"rollout {i} (group {r.group_id}) has {r.num_tokens} tokens, more than seq_len={seq_len}")


def with_routing(batch: Batch, routing: tuple[int, int] | None) -> Batch:
  """The batch with routing entries (-1: none recorded) of (layers, experts per token) if it has none: a MoE run's
  batches all carry them, so its train step sees one structure (an empty batch compiled ahead, a batch of rollouts
  that recorded none)."""
  if routing is None or batch.experts_BxLxNxK is not None:
    return batch
  return batch.replace(experts_BxLxNxK=np.full((*np.shape(batch.tokens_BxL), *routing), -1, np.int16))


def fill_batch(placements, rows: int, seq_len: int, samples_shape: tuple[int, ...], pad_id: int = 0) -> Batch:
  """A numpy Batch of [rows, seq_len] with per-sample arrays of samples_shape, from (rollout, row, start column,
  segment id, per-sample index) placements; everything else is padding."""
  tokens = np.full((rows, seq_len), pad_id, np.int32)
  positions = np.zeros((rows, seq_len), np.int32)
  segments = np.zeros((rows, seq_len), np.int32)
  loss_mask = np.zeros((rows, seq_len), np.float32)
  logprobs = np.zeros((rows, seq_len), np.float32)
  versions = np.full((rows, seq_len), -1, np.int32)
  rewards = np.zeros(samples_shape, np.float32)
  group_ids = np.full(samples_shape, -1, np.int32)
  sample_mask = np.zeros(samples_shape, np.float32)
  routed = [e for r, *_ in placements for e in (r.experts, r.prompt_experts) if e is not None]
  experts = np.full((rows, seq_len, *routed[0].shape[1:]), -1, np.int16) if routed else None
  for r, row, start, segment, index in placements:
    p, end = start + len(r.prompt_tokens), start + r.num_tokens
    tokens[row, start:p] = r.prompt_tokens
    tokens[row, p:end] = r.completion_tokens
    positions[row, start:end] = np.arange(r.num_tokens)
    segments[row, start:end] = segment
    loss_mask[row, p:end] = 1.0 if r.loss_mask is None else r.loss_mask
    logprobs[row, p:end] = r.logprobs
    versions[row, p:end] = r.versions
    if r.experts is not None:
      experts[row, p - 1 : end - 1] = r.experts
    if r.prompt_experts is not None:
      experts[row, start : p - 1] = r.prompt_experts
    rewards[index] = r.reward
    group_ids[index] = r.group_id
    sample_mask[index] = 1.0
  return Batch(tokens, positions, segments, loss_mask, logprobs, versions, rewards, group_ids, sample_mask, experts)
