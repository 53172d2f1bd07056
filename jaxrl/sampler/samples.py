"""The host's records of what the sampler is generating: a submitted group, one sample of it, a dispatched call.

A sample's completion holds every token it has so far (an episode's observations included); `budget` says what
its slot may still draw. The sampling keys of a group's samples are made here, once per group.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout import Rollout
from jaxrl.sampler.decode_state import Prefix, ResultTokens
from jaxrl.sampler.page_allocator import SharedPrompt
from jaxrl.sampler.requests import Request


@functools.partial(jax.jit, static_argnums=2)
def sample_key_data(key, group_id, n: int):
  """The raw key data of a group's n samples, in one program (not 2n eager dispatches and n device reads)."""
  group_key = jax.random.fold_in(key, group_id)
  return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(group_key, i)))(jnp.arange(n, dtype=jnp.uint32))


@dataclasses.dataclass
class Group:
  """A request waiting for (some of) its samples to be placed in slots."""

  request: Request
  prompt: np.ndarray
  keys: np.ndarray  # [n, 2] uint32: sample i's key data, fold_in(fold_in(sampler key, group id), i)
  max_new: tuple[int, ...]  # per sample
  stop_ids: tuple[int, ...]
  placed: int = 0
  prefix: Prefix | None = None
  shared: SharedPrompt | None = None  # paged: the prompt pages of `prefix` its samples share


@dataclasses.dataclass
class Sample:
  group: Group
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  # A mixture-of-experts model's routing per completion token ([N, k] int16, Rollout.experts), None where none was
  # recorded (an environment's observation)
  experts: list = dataclasses.field(default_factory=list)
  # ... and of its prompt: the prefill's int16 [bucket, N, k] (Prefix.experts_PxNxK) that wrote the keys/values the
  # sample read (a preempted sample's: the prefill that resumed it), read back when the sample ends
  prompt_experts: Any = None
  admitted: int = 0  # admission order (paged: the most recent live sample is preempted first)
  episode: Any = None  # jaxrl.envs.episodes.Episode of a multi-turn sample
  turn: int = 0  # model turns started: results of a call dispatched in an earlier turn are stale
  reason: str = ""  # how the last model turn ended

  @property
  def pos(self) -> int:
    return len(self.group.prompt) + len(self.tokens) - 1

  @property
  def parked(self) -> bool:
    """A multi-turn sample whose env is working on its last turn (inactive on the device)."""
    return self.episode is not None and self.episode.future is not None

  def budget(self) -> tuple[int, int]:
    """(model tokens drawn so far, the slot's max_new): sampling keys and budgets count model tokens only (an
    episode's observations are not drawn); a model turn may draw the sample's max_new tokens, within the env's
    budget for the whole episode."""
    g, ep = self.group, self.episode
    if ep is None:
      return len(self.tokens), g.max_new[self.index]
    drawn_before_turn = ep.turn_start - ep.observed_tokens
    turn = min(g.max_new[self.index], g.request.meta["episode"].driver.max_tokens - ep.turn_start)
    return len(self.tokens) - ep.observed_tokens, drawn_before_turn + turn


@dataclasses.dataclass
class InFlight:
  """A dispatched generate call: its results (not yet read) and the sample each slot held when it was dispatched."""

  result: ResultTokens
  occupants: list[Sample | None]
  turns: list[int]  # each occupant's turn when the call was dispatched


def to_rollout(sample: Sample, reason: str) -> Rollout:
  r = sample.group.request
  meta, loss_mask = dict(r.meta), None
  if sample.episode is not None:
    meta["episode"], loss_mask = sample.episode.outcome, sample.episode.loss_mask(len(sample.tokens))
  routed = [e for e in sample.experts if e is not None]
  experts = prompt_experts = None
  if routed:  # -1: no record, routed afresh by the learner
    experts = np.stack([np.full_like(routed[0], -1) if e is None else e for e in sample.experts])
  if sample.prompt_experts is not None:  # the inputs before the last prompt token (its routing is experts[0])
    prompt_experts = np.asarray(sample.prompt_experts)[: len(sample.group.prompt) - 1]
  return Rollout(
      prompt_tokens=sample.group.prompt,
      completion_tokens=np.asarray(sample.tokens, np.int32),
      logprobs=np.asarray(sample.logprobs, np.float32),
      versions=np.asarray(sample.versions, np.int32),
      finish_reason=reason,
      group_id=int(r.group_id),
      sample_index=sample.index,
      sampling=r.sampling,
      meta=meta,
      loss_mask=loss_mask,
      experts=experts,
      prompt_experts=prompt_experts,
  )
