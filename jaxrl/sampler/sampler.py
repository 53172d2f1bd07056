"""The sampler's host loop: prompt groups in, finished Rollouts out, over an Engine's decode slots.

`step()` admits waiting samples into free slots (sampler/admission.py: one prefill per group, inserted into n
slots), dispatches one generate call (`steps_per_call` decode steps) and returns the samples that finished. With
`overlap` (the default) it reads the results of the previous call after dispatching the next one, so the host's
work (collecting tokens, stop checks, admissions) runs while the device decodes; a slot that finishes then idles
one call before it is refilled. Between steps the caller may submit more prompts or swap the params
(`update_params`). Not thread-safe: call it from one thread.

The parts it composes, each in its module: the page policy over the engine's KV memory (page_policy.py; paged:
shared prompt pages, pages reserved ahead of each call, preemption), admission, stop handling (stops.py) and the
episode driver of multi-turn samples (multi_turn.py). Each generate call is told how many slots are occupied, and
a paged engine runs only that many rows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from jaxrl.rollout import Rollout
from jaxrl.sampler.admission import Admission
from jaxrl.sampler.engine import Engine
from jaxrl.sampler.multi_turn import MultiTurn
from jaxrl.sampler.page_policy import page_policy_for
from jaxrl.sampler.requests import Request, check_ids, check_request
from jaxrl.sampler.samples import Group, InFlight, Sample, sample_key_data, to_rollout
from jaxrl.sampler.stops import Stops
from jaxrl.sharding import Versioned

ON_UPDATE = ("recompute", "finish", "keep_kv")  # what the sampler does with samples in flight at a params update


@dataclasses.dataclass
class SamplerStats:
  generated_tokens: int = 0  # includes tokens cut after a stop string
  slot_steps: int = 0  # rows x decode steps run (paged: the rows of each call's live-row bucket)
  decode_calls: int = 0
  prefills: int = 0
  rebuilds: int = 0
  rebuilt_tokens: int = 0  # positions an in-flight update recomputed (slots x length dense; live tokens paged)
  preemptions: int = 0  # paged: samples whose pages were taken back (and recomputed later)
  observed_tokens: int = 0  # multi-turn: observation tokens appended to slots
  finished: int = 0
  cancelled: int = 0  # samples ended by cancel() (counted in finished too): their slots and pages freed early
  seconds: float = 0.0  # wall time inside step()
  live_rows: int = 0  # live slots summed over decode calls (rows / calls: a call's mean live batch)
  context_tokens: int = 0  # positions of the live slots at dispatch, summed over decode calls
  # Keys the decode steps of the generated tokens attended: sum over those tokens of their step's position + 1
  attended_keys: int = 0
  prefill_tokens: int = 0  # prompt (and resumed completion) tokens prefilled, unpadded
  prefill_keys: int = 0  # keys the prefills attended (causal): n (n + 1) / 2 per prefill of n tokens
  update_seconds: float = 0.0  # wall time inside update_params() (placement and KV recompute)

  @property
  def useful_fraction(self) -> float:
    """Fraction of slot-steps that produced a token."""
    return self.generated_tokens / self.slot_steps if self.slot_steps else 0.0

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.seconds if self.seconds else 0.0


class Sampler:
  """Continuous batching over an Engine, with per-token behavior logprobs and policy versions.

  on_update: "recompute" swaps params at the next step and recomputes the KV cache of in-flight samples with
  them, so every token's logprob is exactly that of the version it is tagged with; "finish" stops admitting,
  lets in-flight samples finish on the old params, then swaps; "keep_kv" swaps at once and continues in-flight
  samples over the keys/values the old params computed (no recompute: an update costs nothing). Each token is
  still tagged with the version that computed its logits and its logprob is that of the distribution it was drawn
  from, but that distribution is conditioned on stale keys/values (a policy no learner version is): the learner's
  importance ratio then corrects for that mismatch too, not only for the version lag.
  admission: "continuous" or "static" (sampler/admission.py; static is the baseline of bench/sampler.py).
  overlap: dispatch call k+1 before reading call k (see the module docstring); False reads each call at once.
  """

  def __init__(self, engine: Engine, params, version: int = 0, *, seed: int = 0, on_update: str = "recompute",
               admission: str = "continuous", eos_token_ids: Sequence[int] | None = None,
               detokenize: Callable[[Sequence[int]], str] | None = None, overlap: bool = True):
    if on_update not in ON_UPDATE:
      raise ValueError(f"on_update must be one of {ON_UPDATE} (got {on_update!r})")
    self.engine, self.on_update, self.detokenize, self.overlap = engine, on_update, detokenize, overlap
    self.eos_token_ids = tuple(engine.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    check_ids(self.eos_token_ids, engine.cfg.vocab_size, "eos token")
    self.stats = SamplerStats()
    self.cache = page_policy_for(engine)
    self.admission = Admission(admission, engine, self.cache, self.stats)
    self.turns = MultiTurn(engine, self.cache, self.admission, self.stats)
    self.stops = Stops(self.eos_token_ids, detokenize)
    self._params = engine.place(params, version)
    self._pending: Versioned | None = None
    self._in_flight: InFlight | None = None
    self._slots: list[Sample | None] = [None] * engine.max_slots
    self._key = jax.random.key(seed)

  @property
  def version(self) -> int:
    """Policy version of the params the next decode step uses."""
    return self._params.version

  @property
  def num_active(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def num_waiting(self) -> int:
    """Samples submitted but not yet in a slot (preempted ones included)."""
    return self.admission.num_waiting

  def submit(self, prompt_tokens, group_id: int, n: int = 1, meta: dict | None = None, **kw) -> None:
    """Queues n samples of a prompt; kw are the other Request fields. Bad input raises ValueError here."""
    self.submit_request(Request(prompt_tokens, group_id, n, meta=dict(meta or {}), **kw))

  def submit_request(self, r: Request) -> None:
    r, prompt, max_new, stop_ids = check_request(r, self.engine, self.eos_token_ids, self.detokenize)
    keys = np.asarray(sample_key_data(self._key, np.uint32(r.group_id), r.n))
    self.admission.waiting.append(Group(r, prompt, keys, max_new, stop_ids))

  def run(self, requests: Iterable[Request]) -> Iterator[Rollout]:
    """Generates every request (read lazily, about one pool of slots ahead) and yields rollouts as they finish."""
    requests = iter(requests)
    more = True
    while True:
      while more and self.num_waiting < self.engine.max_slots:
        r = next(requests, None)
        if r is None:
          more = False
        else:
          self.submit_request(r)
      if not (more or self.num_active or self.num_waiting):
        return
      yield from self.step()

  def update_params(self, params, version: int) -> None:
    """New params for the next step; in-flight samples continue on them ("recompute") or finish first."""
    if version < self.version:
      raise ValueError(f"policy version went backwards: {version} after {self.version}")
    start = time.perf_counter()
    new = self.engine.place(params, version)
    if self.on_update == "finish" and self.num_active:
      self._pending = new
    else:
      self._swap(new)
    self.stats.update_seconds += time.perf_counter() - start

  def _swap(self, new: Versioned) -> None:
    self._params, self._pending = new, None
    live = [(slot, s) for slot, s in enumerate(self._slots) if s is not None]
    if not live or self.on_update == "keep_kv":
      return
    # A call in flight may have advanced every slot by up to steps_per_call tokens the host has not read yet.
    ahead = self.engine.steps_per_call if self._in_flight is not None else 0
    self.stats.rebuilt_tokens += self.cache.rebuild(new, live, ahead)
    self.stats.rebuilds += 1

  def step(self) -> list[Rollout]:
    """Admits waiting samples, dispatches one generate call, returns the samples that finished."""
    start = time.perf_counter()
    ended = self._continue_episodes()
    if self._pending is not None and not self.num_active:
      self._swap(self._pending)
    self.admission.admit(self._slots, self._params, blocked=self._pending is not None)
    for victim in self.cache.grow(self._slots):
      self.admission.preempted.append(self._slots[victim])
      self._slots[victim] = None
      self.stats.preemptions += 1
    dispatched = self._dispatch()
    previous, self._in_flight = (self._in_flight, dispatched) if self.overlap else (dispatched, None)
    finished = ended + (self._collect(previous) if previous is not None else [])
    if previous is None and dispatched is None and not finished:  # every live slot waits for its env
      self.turns.wait_for_envs(self._slots)
    self.stats.finished += len(finished)
    self.stats.seconds += time.perf_counter() - start
    return finished

  def _dispatch(self) -> InFlight | None:
    """One generate call over the decoding slots, unless none decodes or the call in flight ends them all."""
    live = sum(s is not None and not s.parked for s in self._slots)  # a slot active on the device decodes here
    if not live or self._all_end_in_flight():
      return None
    self.cache.state, result = self.engine.generate(self._params, self.cache.state, live)
    self.stats.decode_calls += 1
    self.stats.slot_steps += self.engine.row_bucket(live) * self.engine.steps_per_call
    self.stats.live_rows += live
    self.stats.context_tokens += sum(s.pos for s in self._slots if s is not None)
    return InFlight(result, list(self._slots), [s.turn if s else 0 for s in self._slots])

  def _all_end_in_flight(self) -> bool:
    """Every active sample reaches its token budget within the call in flight (no call after it is needed)."""
    call = self._in_flight
    if call is None:
      return False
    steps = self.engine.steps_per_call
    return all(s is None or s.parked
               or (s.episode is None and call.occupants[i] is s and len(s.tokens) + steps >= s.group.max_new[s.index])
               for i, s in enumerate(self._slots))

  def _free(self, slot: int) -> None:
    self._slots[slot] = None
    self.cache.free(slot)

  def _collect(self, call: InFlight) -> list[Rollout]:
    """Reads a call's tokens into its samples; ends those the device or a stop string stopped."""
    finished = []
    result = jax.device_get(call.result)
    version = int(result.version)
    # A slot's valid steps are a prefix of the call (it is active from the call's start, or from none of it, until
    # it ends): its new tokens are the first `count` of its row. Whole arrays to lists once, not per slot.
    counts = result.valid_SxK.sum(axis=1).tolist()
    tokens, logprobs, done = result.tokens_SxK.tolist(), result.logprobs_SxK.tolist(), result.done_S.tolist()
    for slot, sample in enumerate(call.occupants):
      if sample is None or self._slots[slot] is not sample or call.turns[slot] != sample.turn:
        continue  # empty, ended by the host after this dispatch, or a turn that ended then (its env is working)
      n = counts[slot]
      before = len(sample.tokens)
      # The step that drew a sample's next token ran at its last position and attended every key up to it.
      self.stats.attended_keys += n * (sample.pos + 1) + n * (n - 1) // 2
      sample.tokens += tokens[slot][:n]
      sample.logprobs += logprobs[slot][:n]
      sample.versions += [version] * n
      if result.experts_SxCxNxK is not None:
        sample.experts += list(result.experts_SxCxNxK[slot, :n])
      self.stats.generated_tokens += n
      reason = self.stops.finish_reason(sample) if done[slot] else None
      cut = self.stops.stop_string_end(sample, before)
      if cut is not None:
        del sample.tokens[cut:], sample.logprobs[cut:], sample.versions[cut:], sample.experts[cut:]
        if reason is None:
          self.cache.state = self.engine.release(self.cache.state, slot)
        reason = "stop"
      if reason is not None and sample.episode is not None:
        self.turns.end_turn(sample, reason)
      elif reason is not None:
        finished.append(self._rollout(sample, reason))
        self._free(slot)
    return finished

  def cancel(self, group_id: int) -> list[Rollout]:
    """Ends group `group_id` now, freeing its slots, pages and waiting places (a group no learner step can train
    any more: dynamic sampling's surplus); returns its samples that had not finished, as they are (finish_reason
    "cancelled", none scored; never placed: no tokens). A multi-turn group is left to finish: its environments hold
    state. [] when the sampler holds nothing of it."""
    mine = lambda s: s is not None and s.group.request.group_id == group_id
    waiting = [g for g in self.admission.waiting if g.request.group_id == group_id]
    held = [s.group for s in (*self.admission.preempted, *self._slots) if mine(s)]
    if any(g.request.meta.get("episode") is not None for g in waiting + held):
      return []
    ended: list[Sample] = []
    for g in waiting:
      self.admission.waiting.remove(g)
      self.cache.release_group(g)
      g.prefix = g.shared = None
      ended += [Sample(g, i) for i in range(g.placed, g.request.n)]
    for s in [s for s in self.admission.preempted if mine(s)]:
      self.admission.preempted.remove(s)
      ended.append(s)
    for slot, s in enumerate(self._slots):
      if mine(s):
        self.cache.state = self.engine.release(self.cache.state, slot)  # results in flight for it are dropped
        self._free(slot)
        ended.append(s)
    self.stats.cancelled += len(ended)
    self.stats.finished += len(ended)
    return [self._rollout(s, "cancelled") for s in ended]

  def _continue_episodes(self) -> list[Rollout]:
    """Continues every parked sample whose env answered (multi_turn.py); rollouts of the episodes that ended."""
    ended = self.turns.continue_parked(self._slots, self._params, self._free)
    return [self._rollout(s, s.reason) for s in ended]

  def _rollout(self, sample: Sample, reason: str) -> Rollout:
    return to_rollout(sample, reason)
