"""The engine over a dense KV cache: every slot owns max_len positions ([N, S, T, K, D]) and a generate call runs
every slot, live or not. Inserting copies a prefix into the slot's rows; a weight update recomputes positions
[0, length) of every slot (`rebuild`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.paged_attention import IMPLS as PAGED_ATTENTION
from jaxrl.models import KVCache, ModelConfig, forward_cached, init_cache
from jaxrl.sampler import continuation, decode
from jaxrl.sampler.decode_state import DecodeState, Prefix, ResultTokens, SlotSettings
from jaxrl.sampler.slot_engine import SlotEngine
from jaxrl.sharding import Versioned, under_mesh


def insert(prefix: Prefix, state: DecodeState, slot, settings: SlotSettings, num_generated) -> DecodeState:
  """Copies a prefix's keys/values into the slot's rows of the cache and fills the slot."""
  at = (0, slot, 0, 0, 0)
  cache = KVCache(jax.lax.dynamic_update_slice(state.cache.k_NxSxTxKxD, prefix.cache.k_NxSxTxKxD, at),
                  jax.lax.dynamic_update_slice(state.cache.v_NxSxTxKxD, prefix.cache.v_NxSxTxKxD, at))
  return decode.fill_slot(state, cache, prefix, slot, settings, num_generated)


def insert_group(prefix: Prefix, state: DecodeState, slots_W, settings_W: SlotSettings, count) -> DecodeState:
  """The same prefix into slots_W[:count] (a group's samples), one program for the whole group."""

  def one(i, state):
    settings = jax.tree.map(lambda x: x[i], settings_W)
    return insert(prefix, state, slots_W[i], settings, 0)

  return jax.lax.fori_loop(0, count, one, state)


def rebuild(graphdef, chunk, length, params, state: DecodeState) -> DecodeState:
  """Recomputes keys/values of positions [0, length) of every slot with `params` (after a weight update)."""
  num_slots, max_len = state.tokens_SxT.shape

  def body(c, cache):
    pos_SxC = jnp.broadcast_to(c * chunk + jnp.arange(chunk), (num_slots, chunk))
    # Positions past the cache read a clamped token and their writes are dropped.
    tokens_SxC = jnp.take_along_axis(state.tokens_SxT, jnp.minimum(pos_SxC, max_len - 1), axis=1)
    _, cache = forward_cached(graphdef, params, tokens_SxC, pos_SxC, cache)
    return cache

  return state.replace(cache=jax.lax.fori_loop(0, math.ceil(length / chunk), body, state.cache))


def check_dense_options(attention: str, row_buckets, max_slots: int) -> None:
  """The paged engine's options, refused on a dense one with the reason."""
  if attention not in ("auto", *PAGED_ATTENTION):
    raise ValueError(f"Engine: attention must be 'auto' or one of {PAGED_ATTENTION} (got {attention!r})")
  if attention not in ("auto", "xla"):
    raise ValueError(f"Engine: attention={attention!r} is a paged-cache kernel (kv='paged'; got kv='dense')")
  bad = [b for b in row_buckets or () if not isinstance(b, (int, np.integer)) or not 0 < b <= max_slots]
  if bad:
    raise ValueError(f"Engine: row_buckets must be ints in [1, max_slots={max_slots}] (got {bad})")
  if any(b != max_slots for b in row_buckets or ()):
    raise ValueError("Engine: row_buckets are for kv='paged' (a dense call runs every slot)")


class DenseEngine(SlotEngine):
  """Prefill / insert / generate over `max_slots` dense slots of `max_len` tokens (see SlotEngine)."""

  kv = "dense"
  attention = "xla"

  def __init__(self, cfg: ModelConfig, mesh, *, max_slots: int, row_buckets=None, attention: str = "auto",
               **common):
    """common: SlotEngine's. row_buckets and attention are the paged engine's: here only max_slots rows and
    "auto" / "xla"."""
    check_dense_options(attention, row_buckets, max_slots)
    super().__init__(cfg, mesh, max_slots=max_slots, **common)
    self.row_buckets = (max_slots,)
    out = self._state_shardings
    self._insert = jax.jit(functools.partial(insert), donate_argnums=1, out_shardings=out)
    self._insert_dense = jax.jit(functools.partial(insert_group), donate_argnums=1, out_shardings=out)
    self._generate = jax.jit(under_mesh(functools.partial(decode.generate, self.graphdef, self.steps_per_call), mesh),
                             donate_argnums=2, out_shardings=(out, self._result_shardings))
    self._rebuild = jax.jit(functools.partial(rebuild, self.graphdef, self.rebuild_chunk), static_argnums=0,
                            donate_argnums=2, out_shardings=out)
    self._fill_observation = None

  def empty_cache(self) -> KVCache:
    return init_cache(self.cfg, self.max_slots, self.max_len)

  def cache_shardings(self, rows=None) -> KVCache:
    return self.kv_shardings()

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, settings: SlotSettings, *,
             num_generated: int = 0, table_row=None, first_private: int = 0) -> DecodeState:
    """Puts a prefix into a slot; num_generated > 0 resumes a sample whose prefix holds its first num_generated
    completion tokens. table_row and first_private are the paged engine's (a dense slot has no page table)."""
    self.check_slot(slot)
    if table_row is not None:
      raise ValueError("Engine(kv='dense').insert: table_row is required for a paged cache and only there")
    # The version is static metadata of Prefix: drop it so that a new policy version does not recompile insert.
    return self._insert(prefix.replace(version=0), decode_state, np.int32(slot), settings, np.int32(num_generated))

  def insert_group(self, prefix: Prefix, decode_state: DecodeState, slots, settings: Sequence[SlotSettings]
                   ) -> DecodeState:
    """Puts one prefix into several slots (a group's new samples), each with its settings, in one program: one
    dispatch and one transfer of settings per group instead of one per sample (bench/headline_parts.py)."""
    if not 1 <= len(slots) <= self.max_slots or len(slots) != len(settings):
      raise ValueError(f"insert_group: {len(slots)} slots with {len(settings)} settings (1 to {self.max_slots})")
    if len(set(slots)) != len(slots) or not all(0 <= s < self.max_slots for s in slots):
      raise ValueError(f"insert_group: slots {list(slots)} must be distinct and in [0, {self.max_slots})")
    width = self.max_slots  # one shape: no compilation for a new group size or a partial placement mid-run
    slots_W = np.zeros(width, np.int32)
    slots_W[: len(slots)] = slots
    stacked = jax.tree.map(lambda *xs: np.resize(np.stack(xs), (width, *np.shape(xs[0]))), *settings)  # rows cycled
    return self._insert_dense(prefix.replace(version=0), decode_state, slots_W, stacked, np.int32(len(slots)))

  def row_bucket(self, live: int | None) -> int:
    """Rows a generate call runs for `live` active slots: always max_slots."""
    live = self.max_slots if live is None else live
    if not 0 <= live <= self.max_slots:
      raise ValueError(f"live={live} active slots is outside [0, {self.max_slots}]")
    return self.max_slots

  def generate(self, params: Versioned, decode_state: DecodeState, live: int | None = None
               ) -> tuple[DecodeState, ResultTokens]:
    """`steps_per_call` decode steps over every slot (live: unused, every slot runs)."""
    return self._generate(params.params, np.int32(params.version), decode_state)

  def rebuild(self, params: Versioned, decode_state: DecodeState, length: int) -> DecodeState:
    """Recomputes the cache of positions [0, length) of all slots with new params (exact in-flight update)."""
    return self._rebuild(self.bucket(min(length, self.max_len)), params.params, decode_state)

  def append(self, params: Versioned, decode_state: DecodeState, slot: int, tokens, start: int,
             max_new: int) -> DecodeState:
    """Continues a slot whose model turn ended at position `start` with an environment's observation tokens
    (jaxrl.sampler.continuation): they go at start+1.., their keys/values are computed with `params` in chunks of
    rebuild_chunk, and the slot decodes again with a budget of max_new generated tokens (the whole episode's)."""
    decode_state, end = self.write_observation(decode_state, slot, tokens, start, max_new)
    if self._fill_observation is None:
      self._fill_observation = jax.jit(functools.partial(continuation.fill_dense, self.graphdef, self.rebuild_chunk),
                                       donate_argnums=1, out_shardings=self._state_shardings)
    # While the slot was parked, generate ran it as an idle row, which writes garbage at position 0 of a dense cache
    # (a finished slot's next insert overwrites it; a parked slot keeps its cache): recompute it first (exact, as
    # position 0 attends to itself only; the rest of that chunk is rewritten with the values it already holds).
    for a in (0, *range(int(start), end, self.rebuild_chunk)):
      decode_state = self._fill_observation(params.params, decode_state, np.int32(slot), np.int32(a))
    return decode_state

  def compile_count(self) -> int:
    """Compiled executables across the engine's jitted functions (each shape compiles once)."""
    programs = (*self.own_programs(), self._insert, self._insert_dense, self._generate, self._rebuild)
    return sum(f._cache_size() for f in programs)
