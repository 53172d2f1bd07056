"""Host-side sampler loop: prompt groups in, finished Rollouts out, over an Engine's decode slots.

`step()` admits waiting samples into free slots (one prefill per group, inserted into n slots), dispatches one
generate call (`steps_per_call` decode steps) and returns the samples that finished. With `overlap` (the default)
it reads the results of the previous call after dispatching the next one, so the host's work (collecting tokens,
stop checks, admissions) runs while the device decodes; a slot that finishes then idles one call before it is
refilled. Between steps the caller may submit more prompts or swap the params (`update_params`). Not thread-safe:
call it from one thread.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import numpy as np

from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.sampler.engine import Engine, Prefix, ResultTokens
from jaxrl.sharding import Versioned

ON_UPDATE = ("recompute", "finish")
ADMISSION = ("continuous", "static")
# Tokens of text re-decoded per new token for stop strings, past the longest stop string's length in characters
# (a token decodes to at least one character except for a few partial UTF-8 bytes).
_STOP_WINDOW = 8


@dataclasses.dataclass(frozen=True)
class Request:
  """n samples of one prompt (a GRPO group)."""

  prompt_tokens: Sequence[int]
  group_id: int
  n: int = 1
  sampling: SamplingParams = SamplingParams()
  max_tokens: int | None = None  # None: until the cache is full
  stop_token_ids: tuple[int, ...] = ()  # end the sample (finish_reason "stop"), kept in the completion
  stop_strings: tuple[str, ...] = ()  # needs the Sampler's `detokenize`
  ignore_eos: bool = False
  meta: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Group:
  request: Request
  prompt: np.ndarray
  key: jax.Array
  max_new: int
  stop_ids: tuple[int, ...]
  placed: int = 0
  prefix: Prefix | None = None


@dataclasses.dataclass
class _Sample:
  group: _Group
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)

  @property
  def pos(self) -> int:
    return len(self.group.prompt) + len(self.tokens) - 1


@dataclasses.dataclass
class _InFlight:
  """A dispatched generate call: its results (not yet read) and the sample each slot held when it was dispatched."""

  result: ResultTokens
  occupants: list[_Sample | None]


@dataclasses.dataclass
class SamplerStats:
  generated_tokens: int = 0  # includes tokens cut after a stop string
  slot_steps: int = 0  # slots x decode steps run
  decode_calls: int = 0
  prefills: int = 0
  rebuilds: int = 0
  finished: int = 0
  seconds: float = 0.0  # wall time inside step()

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
  lets in-flight samples finish on the old params, then swaps.
  admission: "continuous" refills a slot as soon as it frees; "static" waits until every slot is free (a
  static batch padded to its longest sample; the baseline of bench/sampler.py).
  overlap: dispatch call k+1 before reading call k (see the module docstring); False reads each call at once.
  """

  def __init__(self, engine: Engine, params, version: int = 0, *, seed: int = 0, on_update: str = "recompute",
               admission: str = "continuous", eos_token_ids: Sequence[int] | None = None,
               detokenize: Callable[[Sequence[int]], str] | None = None, overlap: bool = True):
    if on_update not in ON_UPDATE:
      raise ValueError(f"on_update must be one of {ON_UPDATE} (got {on_update!r})")
    if admission not in ADMISSION:
      raise ValueError(f"admission must be one of {ADMISSION} (got {admission!r})")
    self.engine, self.on_update, self.admission, self.detokenize = engine, on_update, admission, detokenize
    self.overlap = overlap
    self._in_flight: _InFlight | None = None
    self.eos_token_ids = tuple(engine.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    self._check_ids(self.eos_token_ids, "eos token")
    self._params = engine.place(params, version)
    self._pending: Versioned | None = None
    self._state = engine.init_decode_state()
    self._slots: list[_Sample | None] = [None] * engine.max_slots
    self._waiting: collections.deque[_Group] = collections.deque()
    self._key = jax.random.key(seed)
    self.stats = SamplerStats()

  @property
  def version(self) -> int:
    """Policy version of the params the next decode step uses."""
    return self._params.version

  @property
  def num_active(self) -> int:
    return sum(s is not None for s in self._slots)

  @property
  def num_waiting(self) -> int:
    """Samples submitted but not yet in a slot."""
    return sum(g.request.n - g.placed for g in self._waiting)

  def _check_ids(self, ids, what):
    v = self.engine.cfg.vocab_size
    bad = [int(i) for i in ids if not 0 <= int(i) < v]
    if bad:
      raise ValueError(f"{what} ids {bad} are outside the vocabulary [0, {v})")

  def submit(self, prompt_tokens, group_id: int, n: int = 1, meta: dict | None = None, **kw) -> None:
    """Queues n samples of a prompt; kw are the other Request fields. Bad input raises ValueError here."""
    self.submit_request(Request(prompt_tokens, group_id, n, meta=dict(meta or {}), **kw))

  def submit_request(self, r: Request) -> None:
    prompt = np.asarray(r.prompt_tokens).reshape(-1)
    if prompt.size == 0:
      raise ValueError(f"group {r.group_id}: empty prompt (a sample needs at least one prompt token)")
    if not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(f"group {r.group_id}: prompt tokens must be integers (got dtype {prompt.dtype})")
    room = self.engine.max_len - len(prompt)
    if room < 1:
      raise ValueError(f"group {r.group_id}: prompt of {len(prompt)} tokens does not fit the KV cache "
                       f"(max_len={self.engine.max_len} allows prompts of at most {self.engine.max_len - 1})")
    self._check_ids(prompt, f"group {r.group_id}: prompt token")
    self._check_ids(r.stop_token_ids, f"group {r.group_id}: stop token")
    if not isinstance(r.group_id, (int, np.integer)) or not 0 <= r.group_id < 2**31:
      raise ValueError(f"group_id must be an int in [0, 2**31) (got {r.group_id!r})")
    if not isinstance(r.n, (int, np.integer)) or r.n < 1:
      raise ValueError(f"group {r.group_id}: n must be a positive int (got {r.n!r})")
    if r.max_tokens is not None and r.max_tokens < 1:
      raise ValueError(f"group {r.group_id}: max_tokens must be >= 1 (got {r.max_tokens})")
    if not isinstance(r.sampling, SamplingParams):
      raise ValueError(f"group {r.group_id}: sampling must be a SamplingParams (got {type(r.sampling).__name__})")
    if r.stop_strings and self.detokenize is None:
      raise ValueError(f"group {r.group_id}: stop_strings need a Sampler built with detokenize=")
    stop_ids = tuple(dict.fromkeys(int(i) for i in (*(() if r.ignore_eos else self.eos_token_ids),
                                                      *r.stop_token_ids)))
    if len(stop_ids) > self.engine.max_stop_ids:
      raise ValueError(f"group {r.group_id}: {len(stop_ids)} stop ids (eos included) exceed the engine's "
                       f"max_stop_ids={self.engine.max_stop_ids}")
    max_new = room if r.max_tokens is None else min(r.max_tokens, room)
    key = jax.random.fold_in(self._key, int(r.group_id))
    self._waiting.append(_Group(r, prompt.astype(np.int32), key, max_new, stop_ids))

  def update_params(self, params, version: int) -> None:
    """New params for the next step; in-flight samples continue on them ("recompute") or finish first."""
    if version < self.version:
      raise ValueError(f"policy version went backwards: {version} after {self.version}")
    new = self.engine.place(params, version)
    if self.on_update == "finish" and self.num_active:
      self._pending = new
    else:
      self._swap(new)

  def _swap(self, new: Versioned) -> None:
    self._params, self._pending = new, None
    active = [s for s in self._slots if s is not None]
    if active:
      # A call in flight may have advanced every slot by up to steps_per_call tokens the host has not read yet.
      ahead = self.engine.steps_per_call if self._in_flight is not None else 0
      self._state = self.engine.rebuild(new, self._state, max(s.pos for s in active) + ahead)
      self.stats.rebuilds += 1

  def step(self) -> list[Rollout]:
    """Admits waiting samples, dispatches one generate call, returns the samples that finished."""
    start = time.perf_counter()
    if self._pending is not None and not self.num_active:
      self._swap(self._pending)
    self._admit()
    dispatched = None
    if self.num_active and not self._all_end_in_flight():
      self._state, result = self.engine.generate(self._params, self._state)
      dispatched = _InFlight(result, list(self._slots))
      self.stats.decode_calls += 1
      self.stats.slot_steps += self.engine.max_slots * self.engine.steps_per_call
    previous, self._in_flight = (self._in_flight, dispatched) if self.overlap else (dispatched, None)
    finished = self._collect(previous) if previous is not None else []
    self.stats.finished += len(finished)
    self.stats.seconds += time.perf_counter() - start
    return finished

  def _all_end_in_flight(self) -> bool:
    """Every active sample reaches its token budget within the call in flight (no call after it is needed)."""
    call = self._in_flight
    if call is None:
      return False
    steps = self.engine.steps_per_call
    return all(s is None or (call.occupants[i] is s and len(s.tokens) + steps >= s.group.max_new)
               for i, s in enumerate(self._slots))

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

  def _admit(self) -> None:
    if self._pending is not None or (self.admission == "static" and self.num_active):
      return
    for slot, occupant in enumerate(self._slots):
      if not self._waiting:
        break
      if occupant is not None:
        continue
      g = self._waiting[0]
      if g.prefix is None or g.prefix.version != self.version:  # the prefill is shared by the group's samples
        g.prefix = self.engine.prefill(self._params, g.prompt)
        self.stats.prefills += 1
      r = g.request
      settings = self.engine.slot_settings(jax.random.fold_in(g.key, g.placed), r.sampling, g.max_new, g.stop_ids)
      self._state = self.engine.insert(g.prefix, self._state, slot, settings)
      self._slots[slot] = _Sample(g, g.placed)
      g.placed += 1
      if g.placed == r.n:
        self._waiting.popleft()

  def _collect(self, call: _InFlight) -> list[Rollout]:
    finished = []
    result = jax.device_get(call.result)
    version = int(result.version)
    for slot, sample in enumerate(call.occupants):
      if sample is None or self._slots[slot] is not sample:  # empty, or ended by the host after this dispatch
        continue
      valid = result.valid_SxK[slot]
      before = len(sample.tokens)
      sample.tokens += result.tokens_SxK[slot][valid].tolist()
      sample.logprobs += result.logprobs_SxK[slot][valid].tolist()
      sample.versions += [version] * int(valid.sum())
      self.stats.generated_tokens += int(valid.sum())
      reason = self._finish_reason(sample) if result.done_S[slot] else None
      cut = self._stop_string_end(sample, before)
      if cut is not None:
        del sample.tokens[cut:], sample.logprobs[cut:], sample.versions[cut:]
        if reason is None:
          self._state = self.engine.release(self._state, slot)
        reason = "stop"
      if reason is not None:
        finished.append(self._rollout(sample, reason))
        self._slots[slot] = None
    return finished

  def _finish_reason(self, sample: _Sample) -> str:
    last = sample.tokens[-1]
    if last in sample.group.stop_ids:
      return "eos" if last in self.eos_token_ids and not sample.group.request.ignore_eos else "stop"
    return "length"

  def _stop_string_end(self, sample: _Sample, before: int) -> int | None:
    """Number of tokens up to the one that completes a stop string, if a new token completed one.

    Each new token re-decodes only a window of the last tokens long enough to hold any stop string, so the cost
    is proportional to the new tokens (re-decoding the whole completion per token was quadratic)."""
    stops = sample.group.request.stop_strings
    if not stops:
      return None
    window = max(len(s) for s in stops) + _STOP_WINDOW
    for end in range(before + 1, len(sample.tokens) + 1):
      text = self.detokenize(sample.tokens[max(0, end - window) : end])
      if any(s in text for s in stops):
        return end
    return None

  def _rollout(self, sample: _Sample, reason: str) -> Rollout:
    r = sample.group.request
    return Rollout(
        prompt_tokens=sample.group.prompt,
        completion_tokens=np.asarray(sample.tokens, np.int32),
        logprobs=np.asarray(sample.logprobs, np.float32),
        versions=np.asarray(sample.versions, np.int32),
        finish_reason=reason,
        group_id=int(r.group_id),
        sample_index=sample.index,
        sampling=r.sampling,
        meta=dict(r.meta),
    )
