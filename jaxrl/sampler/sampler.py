"""Host-side sampler loop: prompt groups in, finished Rollouts out, over an Engine's decode slots.

`step()` admits waiting samples into free slots (one prefill per group, inserted into n slots), dispatches one
generate call (`steps_per_call` decode steps) and returns the samples that finished. With `overlap` (the default)
it reads the results of the previous call after dispatching the next one, so the host's work (collecting tokens,
stop checks, admissions) runs while the device decodes; a slot that finishes then idles one call before it is
refilled. Between steps the caller may submit more prompts or swap the params (`update_params`). Not thread-safe:
call it from one thread.

Over a paged engine (Engine(kv="paged")) the sampler also owns the page allocator: a group's prompt pages are
shared by its samples, each live slot gets pages for the positions the next call may write before it is
dispatched, and pages return to the pool when a sample ends. When the pool runs short, admission stops; when a
live sample cannot grow, the most recently admitted live sample is preempted: its pages are freed and it waits,
with its tokens so far, to be prefilled again (prompt + completion) and continued with the same sampling keys.
Each generate call is told how many slots are occupied, and a paged engine runs only that many rows.

A request whose meta holds "episode" (a jaxrl.envs.episodes.EpisodeStart) is a multi-turn episode: when a model
turn ends (eos, a stop id or string of the env's, the turn's token budget), the slot is parked and its env steps on
a thread pool while the other slots decode and free slots refill; then the observation's tokens are appended to
the same slot (Engine.append, a chunked prefill at the slot's offset) and the model's next turn decodes from there.
The rollout's completion holds every turn and observation; observation tokens have loss mask 0, logprob 0 and
version -1. Paged, a parked slot keeps its pages and reserves none (it writes nothing until it continues, and is
never preempted while its env works); the observation's pages are reserved before the append, and when the pool
cannot hold them the episode itself is preempted with its observation: it is prefilled again (prompt, turns and
observations so far) when pages free, and continues with the same sampling keys and budget.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rollout import Rollout
from jaxrl.sampler.engine import Engine, Prefix, ResultTokens
from jaxrl.sampler.pages import OutOfPages, PageAllocator, SharedPrompt, pages_for
from jaxrl.sampler.requests import Request, check_ids, check_request
from jaxrl.settings import ON_UPDATE  # declared once, with the run config
from jaxrl.sharding import Versioned

ADMISSION = ("continuous", "static")
# Tokens of text re-decoded per new token for stop strings, past the longest stop string's length in characters
# (a token decodes to at least one character except for a few partial UTF-8 bytes).
_STOP_WINDOW = 8


@dataclasses.dataclass
class _Group:
  request: Request
  prompt: np.ndarray
  keys: np.ndarray  # [n, 2] uint32: sample i's key data, fold_in(fold_in(sampler key, group id), i)
  max_new: tuple[int, ...]  # per sample
  stop_ids: tuple[int, ...]
  placed: int = 0
  prefix: Prefix | None = None
  shared: SharedPrompt | None = None  # paged: the prompt pages of `prefix` its samples share


@functools.partial(jax.jit, static_argnums=2)
def _sample_key_data(key, group_id, n: int):
  """The raw key data of a group's n samples, in one program (not 2n eager dispatches and n device reads)."""
  group_key = jax.random.fold_in(key, group_id)
  return jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(group_key, i)))(jnp.arange(n, dtype=jnp.uint32))


@dataclasses.dataclass
class _Sample:
  group: _Group
  index: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  admitted: int = 0  # admission order (paged: the most recent live sample is preempted first)
  episode: Any = None  # jaxrl.envs.episodes.Episode of a multi-turn sample
  turn: int = 0  # model turns started: results of a call dispatched in an earlier turn are stale
  reason: str = ""  # how the last model turn ended

  @property
  def pos(self) -> int:
    return len(self.group.prompt) + len(self.tokens) - 1


@dataclasses.dataclass
class _InFlight:
  """A dispatched generate call: its results (not yet read) and the sample each slot held when it was dispatched."""

  result: ResultTokens
  occupants: list[_Sample | None]
  turns: list[int]  # each occupant's turn when the call was dispatched


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
  seconds: float = 0.0  # wall time inside step()
  live_rows: int = 0  # live slots summed over decode calls (rows / calls: a call's mean live batch)
  context_tokens: int = 0  # positions of the live slots at dispatch, summed over decode calls
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
    check_ids(self.eos_token_ids, engine.cfg.vocab_size, "eos token")
    self._params = engine.place(params, version)
    self._pending: Versioned | None = None
    self._state = engine.init_decode_state()
    self._slots: list[_Sample | None] = [None] * engine.max_slots
    self._waiting: collections.deque[_Group] = collections.deque()
    self._preempted: collections.deque[_Sample] = collections.deque()
    self._admissions = 0
    self._placed: list[tuple[Prefix, int, Any]] = []  # dense: (prefix, slot, settings) placed, not yet inserted
    self._pages = (PageAllocator(engine.num_pages, engine.page_size, engine.max_slots, engine.pages_per_slot)
                   if engine.kv == "paged" else None)
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
    """Samples submitted but not yet in a slot (preempted ones included)."""
    return sum(g.request.n - g.placed for g in self._waiting) + len(self._preempted)

  def submit(self, prompt_tokens, group_id: int, n: int = 1, meta: dict | None = None, **kw) -> None:
    """Queues n samples of a prompt; kw are the other Request fields. Bad input raises ValueError here."""
    self.submit_request(Request(prompt_tokens, group_id, n, meta=dict(meta or {}), **kw))

  def submit_request(self, r: Request) -> None:
    r, prompt, max_new, stop_ids = check_request(r, self.engine, self.eos_token_ids, self.detokenize)
    keys = np.asarray(_sample_key_data(self._key, np.uint32(r.group_id), r.n))
    self._waiting.append(_Group(r, prompt, keys, max_new, stop_ids))

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
    active = [(slot, s) for slot, s in enumerate(self._slots) if s is not None]
    if not active or self.on_update == "keep_kv":
      return
    # A call in flight may have advanced every slot by up to steps_per_call tokens the host has not read yet.
    ahead = self.engine.steps_per_call if self._in_flight is not None else 0
    max_len = self.engine.max_len
    if self._pages is None:
      length = self.engine.bucket(min(max(s.pos for _, s in active) + ahead, max_len))
      self._state = self.engine.rebuild(new, self._state, length)
      self.stats.rebuilt_tokens += self.engine.max_slots * length
    else:
      spans = self._pages.live_spans([(slot, min(s.pos + 1 + ahead, max_len)) for slot, s in active])
      self._state = self.engine.rebuild_spans(new, self._state, spans)
      self.stats.rebuilt_tokens += sum(end - start for _, start, end in spans)
    self.stats.rebuilds += 1

  def step(self) -> list[Rollout]:
    """Admits waiting samples, dispatches one generate call, returns the samples that finished."""
    start = time.perf_counter()
    ended = self._continue_episodes()
    if self._pending is not None and not self.num_active:
      self._swap(self._pending)
    self._admit()
    if self._pages is not None:
      self._grow()
    dispatched = None
    live = self._num_decoding()  # every slot active on the device is decoding here (the host frees after it)
    if live and not self._all_end_in_flight():
      self._state, result = self.engine.generate(self._params, self._state, live)
      dispatched = _InFlight(result, list(self._slots), [s.turn if s else 0 for s in self._slots])
      self.stats.decode_calls += 1
      self.stats.slot_steps += self.engine.row_bucket(live) * self.engine.steps_per_call
      self.stats.live_rows += live
      self.stats.context_tokens += sum(s.pos for s in self._slots if s is not None)
    previous, self._in_flight = (self._in_flight, dispatched) if self.overlap else (dispatched, None)
    finished = ended + (self._collect(previous) if previous is not None else [])
    if previous is None and dispatched is None and not finished:  # every live slot waits for its env
      self._wait_for_envs()
    self.stats.finished += len(finished)
    self.stats.seconds += time.perf_counter() - start
    return finished

  def _all_end_in_flight(self) -> bool:
    """Every active sample reaches its token budget within the call in flight (no call after it is needed)."""
    call = self._in_flight
    if call is None:
      return False
    steps = self.engine.steps_per_call
    return all(s is None or s.episode is not None and s.episode.future is not None
               or (s.episode is None and call.occupants[i] is s and len(s.tokens) + steps >= s.group.max_new[s.index])
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

  def _horizon(self, pos: int) -> int:
    """Positions a slot at host position `pos` needs pages for before the next call: the call in flight and the
    next one may each write steps_per_call positions."""
    return min(pos + 2 * self.engine.steps_per_call, self.engine.max_len)

  def _admit(self) -> None:
    if self._pending is not None or (self.admission == "static" and self.num_active):
      return
    for slot, occupant in enumerate(self._slots):
      if occupant is not None:
        continue
      try:
        if self._preempted:
          self._resume(slot, self._preempted[0])
          self._preempted.popleft()
        elif self._waiting:
          self._place(slot, self._waiting[0])
        else:
          break
      except OutOfPages:  # stop admitting until samples end and free pages
        break
    self._insert_placed()

  def _insert_placed(self) -> None:
    """Dense: inserts the samples _place placed, one program per group (per sample, an insert's dispatch and its
    settings' transfer took ~0.35 ms of a one-core sampler's time: ~11 ms of a 60 ms headline step)."""
    placed, self._placed = self._placed, []
    while placed:
      prefix = placed[0][0]
      group = [p for p in placed if p[0] is prefix]
      placed = [p for p in placed if p[0] is not prefix]
      self._state = self.engine.insert_group(prefix, self._state, [slot for _, slot, _ in group],
                                             [settings for _, _, settings in group])

  def _place(self, slot: int, g: _Group) -> None:
    if g.prefix is None or g.prefix.version != self.version:  # the prefill is shared by the group's samples
      if g.shared is not None:  # samples placed before keep their references to the old pages
        self._pages.release_prompt(g.shared)
        g.shared = None
      if self._pages is not None:
        g.shared = self._pages.share_prompt(len(g.prompt))
      g.prefix = self.engine.prefill(self._params, g.prompt)
      self.stats.prefills += 1
      if g.shared is not None:
        self._state = self.engine.store_prefix(g.prefix, self._state, g.shared.pages)
    r = g.request
    settings = self.engine.slot_settings(g.keys[g.placed], r.sampling, g.max_new[g.placed], g.stop_ids)
    if self._pages is None:  # dense: a group's samples placed now go in with one program (_insert_placed)
      self._placed.append((g.prefix, slot, settings))
      self._admissions += 1
    else:
      self._insert(slot, g.prefix, settings, g.shared, 0)
    start = r.meta.get("episode")
    self._slots[slot] = _Sample(g, g.placed, admitted=self._admissions,
                                episode=start.driver.open(start) if start is not None else None)
    g.placed += 1
    if g.placed == r.n:
      self._waiting.popleft()
      if g.shared is not None:
        self._pages.release_prompt(g.shared)
      g.prefix = g.shared = None

  def _insert(self, slot, prefix, settings, shared: SharedPrompt | None, num_generated: int) -> None:
    row, first_private = None, 0
    if self._pages is not None:
      self._pages.attach(slot, shared, self._horizon(int(prefix.length) - 1))
      row, first_private = self._pages.table_row(slot), int(self._pages.num_shared_S[slot])
    self._state = self.engine.insert(prefix, self._state, slot, settings, num_generated=num_generated,
                                     table_row=row, first_private=first_private)
    self._admissions += 1

  def _resume(self, slot: int, sample: _Sample) -> None:
    """Continues a preempted sample: prefills its prompt and completion so far (with the current params)."""
    g, r = sample.group, sample.group.request
    tokens = np.concatenate([g.prompt, np.asarray(sample.tokens, np.int32)])
    need = pages_for(self._horizon(len(tokens) - 1), self.engine.page_size)
    if need > self._pages.num_free:  # before the prefill, which would be wasted
      raise OutOfPages(f"{need} pages needed, {self._pages.num_free} free")
    prefix = self.engine.prefill(self._params, tokens)
    self.stats.prefills += 1
    drawn, limit = self._budget(sample)
    settings = self.engine.slot_settings(g.keys[sample.index], r.sampling, limit, g.stop_ids)
    self._insert(slot, prefix, settings, None, drawn)
    sample.admitted = self._admissions
    self._slots[slot] = sample

  def _grow(self) -> None:
    """Reserves pages for what the next call may write; preempts the latest admitted samples when they run out.
    Slots parked for their env write nothing meanwhile: they reserve nothing here and are never preempted."""
    live = sorted((i for i, s in enumerate(self._slots) if s is not None and not self._parked(s)),
                  key=lambda i: self._slots[i].admitted)
    victims, grown = self._pages.reserve_or_preempt([(i, self._horizon(self._slots[i].pos)) for i in live])
    for victim in victims:
      self._preempted.append(self._slots[victim])
      self._slots[victim] = None
      self._state = self.engine.release(self._state, victim)
      self.stats.preemptions += 1
    if grown:
      self._state = self.engine.set_tables(self._state, self._pages.table_SxM())

  def _free(self, slot: int) -> None:
    self._slots[slot] = None
    if self._pages is not None:
      self._pages.release(slot)

  def _collect(self, call: _InFlight) -> list[Rollout]:
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
      sample.tokens += tokens[slot][:n]
      sample.logprobs += logprobs[slot][:n]
      sample.versions += [version] * n
      self.stats.generated_tokens += n
      reason = self._finish_reason(sample) if done[slot] else None
      cut = self._stop_string_end(sample, before)
      if cut is not None:
        del sample.tokens[cut:], sample.logprobs[cut:], sample.versions[cut:]
        if reason is None:
          self._state = self.engine.release(self._state, slot)
        reason = "stop"
      if reason is not None and sample.episode is not None:
        self._end_turn(sample, reason)
      elif reason is not None:
        finished.append(self._rollout(sample, reason))
        self._free(slot)
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
    first = sample.episode.turn_start if sample.episode is not None else 0  # never match in an earlier turn
    for end in range(before + 1, len(sample.tokens) + 1):
      text = self.detokenize(sample.tokens[max(first, end - window) : end])
      if any(s in text for s in stops):
        return end
    return None

  @staticmethod
  def _budget(s: _Sample) -> tuple[int, int]:
    """(model tokens drawn so far, the slot's max_new): sampling keys and budgets count model tokens only (an
    episode's observations are not drawn); a model turn may draw the sample's max_new tokens, within the env's
    budget for the whole episode."""
    g, ep = s.group, s.episode
    if ep is None:
      return len(s.tokens), g.max_new[s.index]
    drawn_before_turn = ep.turn_start - ep.observed_tokens
    turn = min(g.max_new[s.index], g.request.meta["episode"].driver.max_tokens - ep.turn_start)
    return len(s.tokens) - ep.observed_tokens, drawn_before_turn + turn

  @staticmethod
  def _parked(s: _Sample) -> bool:
    """A multi-turn sample whose env is working on its last turn (inactive on the device)."""
    return s.episode is not None and s.episode.future is not None

  def _num_decoding(self) -> int:
    """Live slots not waiting for their env."""
    return sum(s is not None and not self._parked(s) for s in self._slots)

  def _end_turn(self, sample: _Sample, reason: str) -> None:
    """Parks a multi-turn sample whose model turn ended: its env steps on the turn meanwhile."""
    ep = sample.episode
    sample.reason = reason
    sample.group.request.meta["episode"].driver.step(ep, sample.tokens[ep.turn_start :])

  def _continue_episodes(self) -> list[Rollout]:
    """Appends the observation of every parked sample whose env answered, or ends its episode."""
    finished = []
    for slot, s in enumerate(self._slots):
      ep = s.episode if s is not None else None
      if ep is None or ep.future is None or not ep.future.done():
        continue
      driver = s.group.request.meta["episode"].driver
      pos = s.pos
      # Room for the observation: one generated token must still fit the cache and the env's budget after it.
      room = min(self.engine.max_len - 2 - pos, driver.max_tokens - 1 - len(s.tokens))
      tokens = driver.observation(ep, s.reason == "eos", room)
      if tokens is None:
        finished.append(self._rollout(s, s.reason))
        self._free(slot)
        continue
      ep.observed.append((len(s.tokens), len(s.tokens) + len(tokens)))
      s.tokens += tokens
      s.logprobs += [0.0] * len(tokens)
      s.versions += [-1] * len(tokens)
      ep.turn_start, s.turn = len(s.tokens), s.turn + 1
      self.stats.observed_tokens += len(tokens)
      if self._pages is not None:
        try:  # the observation's positions and what the next calls may write
          if self._pages.reserve(slot, self._horizon(pos + len(tokens))):
            self._state = self.engine.set_tables(self._state, self._pages.table_SxM())
        except OutOfPages:  # continued later by a prefill of the whole episode so far (see _resume)
          self._free(slot)
          self._preempted.appendleft(s)
          self.stats.preemptions += 1
          continue
      self._state = self.engine.append(self._params, self._state, slot, tokens, pos, self._budget(s)[1])
    return finished

  def _wait_for_envs(self) -> None:
    """Blocks until some env step is done (briefly), instead of spinning while nothing decodes."""
    futures = [s.episode.future for s in self._slots if s is not None and s.episode is not None
               and s.episode.future is not None]
    if futures:
      concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)

  def _rollout(self, sample: _Sample, reason: str) -> Rollout:
    r = sample.group.request
    meta, loss_mask = dict(r.meta), None
    if sample.episode is not None:
      meta["episode"], loss_mask = sample.episode.outcome, sample.episode.loss_mask(len(sample.tokens))
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
    )
