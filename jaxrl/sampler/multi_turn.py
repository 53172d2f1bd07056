"""The episode driver: multi-turn samples (a request whose meta holds "episode", a jaxrl.envs.episodes.EpisodeStart).

When a model turn ends (eos, a stop id or string of the env's, the turn's token budget) the slot is parked and its
env steps on a thread pool while the other slots decode and free slots refill; then the observation's tokens are
appended to the same slot (Engine.append, a chunked prefill at the slot's offset) and the model's next turn decodes
from there. The rollout's completion holds every turn and observation; observation tokens have loss mask 0,
logprob 0 and version -1. Paged, a parked slot keeps its pages and reserves none (it writes nothing until it
continues, and is never preempted while its env works); the observation's pages are reserved before the append,
and when the pool cannot hold them the episode itself is preempted with its observation: it is prefilled again
(prompt, turns and observations so far) when pages free, and continues with the same sampling keys and budget.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from jaxrl.sampler.page_allocator import OutOfPages
from jaxrl.sampler.samples import Sample


class MultiTurn:
  """Parks samples whose model turn ended and continues them with their env's observation."""

  def __init__(self, engine, policy, admission, stats):
    self.engine, self.policy, self.admission, self.stats = engine, policy, admission, stats

  @staticmethod
  def end_turn(sample: Sample, reason: str) -> None:
    """Parks a multi-turn sample whose model turn ended: its env steps on the turn meanwhile."""
    ep = sample.episode
    sample.reason = reason
    sample.group.request.meta["episode"].driver.step(ep, sample.tokens[ep.turn_start :])

  def continue_parked(self, slots: list[Sample | None], params, free: Callable[[int], None]) -> list[Sample]:
    """Appends the observation of every parked sample whose env answered; returns those whose episode ended
    (their slots freed)."""
    ended = []
    for slot, s in enumerate(slots):
      ep = s.episode if s is not None else None
      if ep is None or ep.future is None or not ep.future.done():
        continue
      driver = s.group.request.meta["episode"].driver
      pos = s.pos
      # Room for the observation: one generated token must still fit the cache and the env's budget after it.
      room = min(self.engine.max_len - 2 - pos, driver.max_tokens - 1 - len(s.tokens))
      tokens = driver.observation(ep, s.reason == "eos", room)
      if tokens is None:
        ended.append(s)
        free(slot)
        continue
      self._observe(s, tokens)
      try:  # the observation's positions and what the next calls may write
        self.policy.reserve(slot, pos + len(tokens))
      except OutOfPages:  # continued later by a prefill of the whole episode so far (Admission._resume)
        free(slot)
        self.admission.preempted.appendleft(s)
        self.stats.preemptions += 1
        continue
      self.policy.state = self.engine.append(params, self.policy.state, slot, tokens, pos, s.budget()[1])
    return ended

  def _observe(self, s: Sample, tokens: list[int]) -> None:
    """The observation joins the completion (no logprob, no version) and a new model turn starts after it."""
    ep = s.episode
    ep.observed.append((len(s.tokens), len(s.tokens) + len(tokens)))
    s.tokens += tokens
    s.logprobs += [0.0] * len(tokens)
    s.versions += [-1] * len(tokens)
    s.experts += [None] * len(tokens)
    ep.turn_start, s.turn = len(s.tokens), s.turn + 1
    self.stats.observed_tokens += len(tokens)

  @staticmethod
  def wait_for_envs(slots: list[Sample | None]) -> None:
    """Blocks until some env step is done (briefly), instead of spinning while nothing decodes."""
    futures = [s.episode.future for s in slots if s is not None and s.parked]
    if futures:
      concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
