"""Decode engine over a fixed pool of slots (JetStream Engine API shape): prefill, insert, generate.

The decode state holds a preallocated KV cache for `max_slots` sequences of up to `max_len` tokens, sharded on
the sampler mesh (slots over "data", kv heads over "tensor"). Each slot keeps its whole sequence in `tokens_SxT`
and `pos_S`, the position of its last token, whose logits the next step computes. `generate` runs
`steps_per_call` decode steps in one jitted loop; a slot that finishes goes inactive inside the loop and is
refilled by `insert` between calls. Shapes never depend on the requests, so each function compiles once (prefill,
insert and rebuild once per prompt-length bucket).

With kv="paged" the cache is a pool of pages with a page table per slot (models.PagedKVCache): the host's
sampler/pages.py allocates them and hands the tables over (`set_tables`, `insert(table_row=)`); a group's prompt
pages are written once (`store_prefix`) and shared; `rebuild_spans` recomputes only the live tokens; and a
generate call runs only its live slots, gathered into a batch of the smallest row bucket that holds them (the pool
is shared, so only page tables and per-slot state move): a step costs what its live rows do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxrl.kernels.paged_attention import IMPLS as PAGED_ATTENTION
from jaxrl.models import KVCache, ModelConfig, PagedKVCache, forward_cached, init_cache, init_paged_cache
from jaxrl.models.config import DTYPES
from jaxrl.models.hf import abstract_params
from jaxrl.sampler import continuation, paged
from jaxrl.sampler.sampling import sample
from jaxrl.settings import KV_LAYOUTS  # declared once, with the run config
from jaxrl.sharding import SAMPLER_RULES, Versioned, logical_to_spec, param_shardings, transfer


@flax.struct.dataclass
class SlotSettings:
  """Per-request decoding settings; in the decode state every field has a leading slot axis."""

  key: jax.Array  # uint32 raw key data of the request's rng; token t is drawn with fold_in(key, t)
  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  greedy: jax.Array  # bool
  max_new: jax.Array  # int32, completion tokens allowed
  stop_ids: jax.Array  # int32 [..., max_stop_ids], -1 padded; generating one of them ends the sample


@flax.struct.dataclass
class DecodeState:
  cache: KVCache | PagedKVCache  # [N, S, T, K, D] | a pool of pages ([N, P, Z, K, D] or [K, N, P, Z, D]) + tables
  tokens_SxT: jax.Array  # int32, prompt then completion
  pos_S: jax.Array  # int32, position of the last token (its logits are computed next)
  active_S: jax.Array  # bool
  num_generated_S: jax.Array  # int32
  settings: SlotSettings


@flax.struct.dataclass
class Prefix:
  """A prefilled prompt: its keys/values over a length bucket, ready to be inserted into any number of slots."""

  cache: KVCache  # [L, 1, bucket, K, D]
  tokens_P: jax.Array  # int32 [bucket], the prompt right-padded with 0
  length: jax.Array  # int32 scalar, the true prompt length
  version: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class ResultTokens:
  """What one generate call produced: entry [s, i] is slot s's token from decode step i (if valid)."""

  tokens_SxK: jax.Array
  logprobs_SxK: jax.Array
  valid_SxK: jax.Array  # the slot was active at that step
  done_S: jax.Array  # the slot finished within this call (stop id or max tokens or full cache)
  version: jax.Array  # int32 scalar: the policy version of the params of this call


def _prefill(graphdef, cfg, params, tokens_P, length):
  bucket = tokens_P.shape[0]
  cache = init_cache(cfg, 1, bucket)
  _, cache = forward_cached(graphdef, params, tokens_P[None], jnp.arange(bucket)[None], cache)
  return Prefix(cache, tokens_P, length)


def _insert(prefix: Prefix, state: DecodeState, slot, settings: SlotSettings, num_generated, table_row_M,
            first_private) -> DecodeState:
  """Puts a prefix into a slot; num_generated > 0 resumes a preempted sample (its prefix holds the completion)."""
  if isinstance(state.cache, PagedKVCache):
    cache = paged.write_prefix_pages(state.cache, prefix.cache, table_row_M, first_private, prefix.length)
    cache = cache.replace(table_SxM=cache.table_SxM.at[slot].set(table_row_M))
  else:
    at = (0, slot, 0, 0, 0)
    cache = KVCache(jax.lax.dynamic_update_slice(state.cache.k_NxSxTxKxD, prefix.cache.k_NxSxTxKxD, at),
                    jax.lax.dynamic_update_slice(state.cache.v_NxSxTxKxD, prefix.cache.v_NxSxTxKxD, at))
  tokens = jax.lax.dynamic_update_slice(state.tokens_SxT, prefix.tokens_P[None], (slot, 0))
  put = lambda rows, value: rows.at[slot].set(value)
  return DecodeState(
      cache=cache,
      tokens_SxT=tokens,
      pos_S=put(state.pos_S, prefix.length - 1),
      active_S=put(state.active_S, True),
      num_generated_S=put(state.num_generated_S, num_generated),
      settings=jax.tree.map(put, state.settings, settings),
  )


def _insert_dense(prefix: Prefix, state: DecodeState, slots_W, settings_W: SlotSettings, count) -> DecodeState:
  """A dense cache: the same prefix into slots_W[:count] (a group's samples), one program for the whole group."""
  unused_row = jnp.zeros((1,), jnp.int32)

  def one(i, state):
    settings = jax.tree.map(lambda x: x[i], settings_W)
    return _insert(prefix, state, slots_W[i], settings, 0, unused_row, 0)

  return jax.lax.fori_loop(0, count, one, state)


def _generate(graphdef, steps, params, version, state: DecodeState, forward=forward_cached, draw=sample):
  """`steps` decode steps; `forward` and `draw` are swappable only for bench/decode_baseline.py."""
  num_slots, max_len = state.tokens_SxT.shape
  rows = jnp.arange(num_slots)
  s = state.settings
  request_keys = jax.random.wrap_key_data(s.key)

  def step(i, carry):
    state, out = carry
    token_S = state.tokens_SxT[rows, state.pos_S]
    cache = state.cache
    if isinstance(cache, PagedKVCache):  # an idle slot's pages may belong to another slot by now: no writes
      cache = cache.replace(write_end_S=jnp.where(state.active_S, state.pos_S + 1, 0))
    # An idle row runs at position 0 (its output is dropped): attention reads stop at the live rows' positions.
    pos_S = jnp.where(state.active_S, state.pos_S, 0)
    logits, cache = forward(graphdef, params, token_S[:, None], pos_S[:, None], cache)
    keys = jax.vmap(jax.random.fold_in)(request_keys, state.num_generated_S)
    new_S, logprob_S = draw(keys, logits[:, 0], s.temperature, s.top_k, s.top_p, s.greedy)
    active = state.active_S
    next_pos = jnp.where(active, state.pos_S + 1, state.pos_S)
    tokens = state.tokens_SxT.at[rows, next_pos].set(jnp.where(active, new_S, state.tokens_SxT[rows, next_pos]))
    num_generated = state.num_generated_S + active
    stop = jnp.any(new_S[:, None] == s.stop_ids, axis=-1)
    done = active & (stop | (num_generated >= s.max_new) | (next_pos >= max_len - 1))
    state = state.replace(cache=cache, tokens_SxT=tokens, pos_S=next_pos, active_S=active & ~done,
                          num_generated_S=num_generated)
    out = (out[0].at[:, i].set(new_S), out[1].at[:, i].set(logprob_S), out[2].at[:, i].set(active))
    return state, out

  out = (jnp.zeros((num_slots, steps), jnp.int32), jnp.zeros((num_slots, steps), jnp.float32),
         jnp.zeros((num_slots, steps), bool))
  new_state, (tokens, logprobs, valid) = jax.lax.fori_loop(0, steps, step, (state, out))
  done = state.active_S & ~new_state.active_S
  return new_state, ResultTokens(tokens, logprobs, valid, done, version)


def _generate_live(graphdef, steps, shardings, num_rows, params, version, state: DecodeState):
  """Paged: `_generate` over a compacted batch of num_rows rows holding the active slots (paged.take_live_rows),
  so a step costs what its live rows do. The batch is laid out as the decode state is (shardings[num_rows]): XLA
  then splits each step's sums over the mesh as for the full batch, which keeps every row's numbers the same."""
  sub, rows_R = paged.take_live_rows(state, num_rows)
  sub = jax.lax.with_sharding_constraint(sub, shardings[num_rows])
  sub, result = _generate(graphdef, steps, params, version, sub)
  return paged.put_rows(state, sub, result, rows_R)


def _rebuild(graphdef, chunk, length, params, state: DecodeState) -> DecodeState:
  """Recomputes keys/values of positions [0, length) of every slot with `params` (after a weight update)."""
  num_slots, max_len = state.tokens_SxT.shape

  def body(c, cache):
    pos_SxC = jnp.broadcast_to(c * chunk + jnp.arange(chunk), (num_slots, chunk))
    # Positions past the cache read a clamped token and their writes are dropped.
    tokens_SxC = jnp.take_along_axis(state.tokens_SxT, jnp.minimum(pos_SxC, max_len - 1), axis=1)
    _, cache = forward_cached(graphdef, params, tokens_SxC, pos_SxC, cache)
    return cache

  return state.replace(cache=jax.lax.fori_loop(0, math.ceil(length / chunk), body, state.cache))


def _release(state: DecodeState, slot) -> DecodeState:
  return state.replace(active_S=state.active_S.at[slot].set(False))


def _decode_attention(attention: str, kv: str, mesh) -> str:
  """The paged decode attention an Engine runs (see Engine's attention)."""
  if attention not in ("auto", *PAGED_ATTENTION):
    raise ValueError(f"Engine: attention must be 'auto' or one of {PAGED_ATTENTION} (got {attention!r})")
  platform, devices = mesh.devices.flat[0].platform, mesh.devices.size
  if attention == "auto":
    kernel = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
    return kernel if kernel is not None and kv == "paged" and devices == 1 else "xla"
  if attention != "xla" and kv != "paged":
    raise ValueError(f"Engine: attention={attention!r} is a paged-cache kernel (kv='paged'; got kv={kv!r})")
  if attention != "xla" and devices != 1:
    raise ValueError(f"Engine: attention={attention!r} runs on a sampler mesh of one device (got {devices}): its "
                     "custom call cannot be partitioned; use attention='xla' or one device per sampler replica")
  return attention


class Engine:
  """Prefill / insert / generate over `max_slots` decode slots of `max_len` tokens on the sampler mesh."""

  def __init__(self, cfg: ModelConfig, mesh, *, max_slots: int, max_len: int, steps_per_call: int = 8,
               min_bucket: int = 16, max_stop_ids: int = 8, rebuild_chunk: int = 128, dtype: str | None = None,
               kv: str = "dense", page_size: int = 16, num_pages: int | None = None, rebuild_rows: int = 8,
               row_buckets=None, attention: str = "auto", interpret: bool = False, rules=SAMPLER_RULES):
    """dtype: of the sampler's weights, activations and KV cache: "float32" | "bfloat16" | "auto" (bfloat16 on
    TPU/GPU, float32 on CPU, where XLA's float32 matmuls are exact and bfloat16 ones are not faster everywhere);
    None: cfg.dtype. kv: "dense" (max_len positions per slot) or "paged" (a pool of num_pages pages of page_size
    positions; None: as many as the dense cache holds, max_slots * max_len / page_size). A paged rebuild runs
    calls of rebuild_rows chunks of rebuild_chunk positions (a call's cost is fixed: small calls waste less).
    row_buckets (paged): the batch sizes a generate call may run at, over its live slots only (None: 8, 16, 32,
    ... below max_slots; max_slots is always one); each is compiled once, all at the first generate call.
    attention (paged): the decode attention, "xla" | "pallas_gpu" | "pallas_tpu" (kernels.paged_attention) or
    "auto": the backend's Pallas kernel on a GPU or TPU sampler of one device, "xla" otherwise (on CPU, and on a
    sampler mesh of several devices, which a kernel's custom call cannot be partitioned over); a kernel keeps the
    pool in its [K, N, P, Z, D] layout. interpret: run the kernel in Pallas interpret mode (tests on CPU)."""
    num_pages = max_slots * max_len // page_size if num_pages is None and page_size else num_pages
    for name, value in (("max_slots", max_slots), ("max_len", max_len), ("steps_per_call", steps_per_call),
                        ("min_bucket", min_bucket), ("max_stop_ids", max_stop_ids), ("rebuild_chunk", rebuild_chunk),
                        ("page_size", page_size), ("num_pages", num_pages), ("rebuild_rows", rebuild_rows)):
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"Engine: {name} must be a positive int (got {value!r})")
    if max_len < 2:
      raise ValueError(f"Engine: max_len must be >= 2 to hold a prompt token and a generated one (got {max_len})")
    if kv not in KV_LAYOUTS:
      raise ValueError(f"Engine: kv must be one of {KV_LAYOUTS} (got {kv!r})")
    if kv == "paged" and max_len % page_size:
      raise ValueError(f"Engine: max_len={max_len} must be a multiple of page_size={page_size} (whole pages)")
    if kv == "paged" and num_pages < max_len // page_size:
      raise ValueError(f"Engine: num_pages={num_pages} cannot hold one sample of max_len={max_len} "
                       f"({max_len // page_size} pages of {page_size})")
    self.attention = _decode_attention(attention, kv, mesh)
    self.interpret = bool(interpret)
    self.row_buckets = paged.row_buckets(row_buckets, max_slots, kv)
    self.kv, self.page_size, self.num_pages = kv, page_size, num_pages
    self.pages_per_slot = max_len // page_size
    dtype = cfg.dtype if dtype is None else dtype
    if dtype == "auto":
      dtype = "float32" if mesh.devices.flat[0].platform == "cpu" else "bfloat16"
    if dtype not in DTYPES:
      raise ValueError(f"Engine: dtype must be one of {DTYPES} or 'auto' (got {dtype!r})")
    # Params are cast once when placed (not per step inside the decode program).
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.dtype = cfg.compute_dtype
    self.cfg, self.mesh, self.rules = cfg, mesh, rules
    self.max_slots, self.max_len, self.steps_per_call = max_slots, max_len, steps_per_call
    self.max_stop_ids = max_stop_ids
    buckets, b = [], min_bucket
    while b < max_len:
      buckets.append(b)
      b *= 2
    self.buckets = (*buckets, max_len)
    self.graphdef, abstract = abstract_params(cfg)
    self.param_shardings = param_shardings(abstract, mesh, rules)
    self._state_shardings = self._decode_state_shardings()
    prefix_shardings = Prefix(self._kv_sharding(batch_axis=None), self._named(None), self._named())
    result_shardings = ResultTokens(self._named("batch", None), self._named("batch", None),
                                    self._named("batch", None), self._named("batch"), self._named())
    g = self.graphdef
    self._prefill = jax.jit(functools.partial(_prefill, g, cfg), out_shardings=prefix_shardings)
    # Each engine jits its own function objects: jit keeps one cache per function, so compile_count() counts this
    # engine's programs only (not those of other engines over the same module-level function).
    own = functools.partial
    self._insert = jax.jit(own(_insert), donate_argnums=1, out_shardings=self._state_shardings)
    self._insert_dense = jax.jit(own(_insert_dense), donate_argnums=1, out_shardings=self._state_shardings)
    self._generate = jax.jit(functools.partial(_generate, g, steps_per_call), donate_argnums=2,
                             out_shardings=(self._state_shardings, result_shardings))
    # One program per row bucket, compiled ahead of time (all at the first call, so none compiles mid-run).
    rows = {b: self._decode_state_shardings(b) for b in self.row_buckets}
    self._generate_live = jax.jit(functools.partial(_generate_live, g, steps_per_call, rows), static_argnums=0,
                                  donate_argnums=3, out_shardings=(self._state_shardings, result_shardings))
    self._live_programs = {}
    self._rebuild = jax.jit(functools.partial(_rebuild, g, rebuild_chunk), static_argnums=0, donate_argnums=2,
                            out_shardings=self._state_shardings)
    self._release = jax.jit(own(_release), donate_argnums=0, out_shardings=self._state_shardings)
    self._store_prefix = jax.jit(own(paged.store_prefix), donate_argnums=1, out_shardings=self._state_shardings)
    self._set_tables = jax.jit(own(paged.set_table), donate_argnums=0, out_shardings=self._state_shardings)
    self._rebuild_rows = jax.jit(functools.partial(paged.rebuild_rows, g, rebuild_chunk), donate_argnums=1,
                                 out_shardings=self._state_shardings)
    self.rebuild_chunk, self.rebuild_rows = rebuild_chunk, rebuild_rows
    self._zeros = None

  def _named(self, *axes, rows=None) -> NamedSharding:
    """Sharding of an array whose dimensions carry these logical axes (sizes are only checked for divisibility)."""
    return NamedSharding(self.mesh, logical_to_spec(axes, self._dims(axes, rows), self.mesh, self.rules))

  def _dims(self, axes, rows=None):
    sizes = {"batch": rows or self.max_slots, "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim,
             "layers": self.cfg.num_layers}
    return [sizes.get(a, 1) for a in axes]

  def _kv_sharding(self, batch_axis="batch") -> KVCache:
    sh = self._named("layers", batch_axis, None, "kv_heads", "head_dim")
    return KVCache(sh, sh)

  def _decode_state_shardings(self, rows=None) -> DecodeState:
    """Shardings of the decode state; rows: of a compacted batch of that many rows (default max_slots)."""
    vec = self._named("batch", rows=rows)
    mat = self._named("batch", None, rows=rows)
    cache = self._kv_sharding()
    if self.kv == "paged":  # the pool is not split by slot (any slot may own any page); heads still are
      if self.layout == "NPZKD":
        pages = self._named("layers", None, None, "kv_heads", "head_dim")
      else:
        pages = self._named("kv_heads", "layers", None, None, "head_dim")
      cache = PagedKVCache(pages, pages, mat, vec, **self._paging)
    return DecodeState(cache, mat, vec, vec, vec, SlotSettings(mat, vec, vec, vec, vec, vec, mat))

  @property
  def layout(self) -> str:
    """Of the paged pool: the Pallas kernels' [K, N, P, Z, D] when one runs, [N, P, Z, K, D] for XLA."""
    return "NPZKD" if self.attention == "xla" else "KNPZD"

  @property
  def _paging(self) -> dict:
    return dict(layout=self.layout, attention=self.attention, interpret=self.interpret)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.max_slots

  def bucket(self, length: int) -> int:
    """The smallest prompt-length bucket that holds `length` tokens."""
    for b in self.buckets:
      if b >= length:
        return b
    raise ValueError(f"a prompt of {length} tokens does not fit the cache (max_len={self.max_len})")

  def place(self, params, version: int) -> Versioned:
    """Puts params onto the sampler shardings in the engine's dtype (a no-op for arrays already there)."""
    return transfer(params, version, self.param_shardings, self.dtype)

  def init_decode_state(self) -> DecodeState:
    s, t = self.max_slots, self.max_len
    key_shape = jax.random.key_data(jax.random.key(0)).shape

    def zeros():
      if self.kv == "paged":
        cache = init_paged_cache(self.cfg, s, self.num_pages, self.page_size, self.pages_per_slot, **self._paging)
      else:
        cache = init_cache(self.cfg, s, t)
      settings = SlotSettings(jnp.zeros((s, *key_shape), jnp.uint32), jnp.ones((s,), jnp.float32),
                              jnp.zeros((s,), jnp.int32), jnp.ones((s,), jnp.float32), jnp.zeros((s,), bool),
                              jnp.zeros((s,), jnp.int32), jnp.full((s, self.max_stop_ids), -1, jnp.int32))
      return DecodeState(cache, jnp.zeros((s, t), jnp.int32), jnp.zeros((s,), jnp.int32), jnp.zeros((s,), bool),
                         jnp.zeros((s,), jnp.int32), settings)

    if self._zeros is None:  # one compile per engine, however many Samplers it serves
      self._zeros = jax.jit(zeros, out_shardings=self._state_shardings)
    return self._zeros()

  def prefill(self, params: Versioned, tokens, true_length: int | None = None) -> Prefix:
    """Keys/values of the prompt tokens[:true_length], padded to its length bucket."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    true_length = len(tokens) if true_length is None else int(true_length)
    if not 0 < true_length <= len(tokens):
      raise ValueError(f"true_length must be in [1, {len(tokens)}] (got {true_length}); prompts cannot be empty")
    if true_length > self.max_len - 1:
      raise ValueError(f"a prompt of {true_length} tokens does not fit the cache: max_len={self.max_len} leaves "
                       f"room for prompts of at most {self.max_len - 1} tokens")
    padded = np.zeros(self.bucket(true_length), np.int32)
    padded[:true_length] = tokens[:true_length]
    prefix = self._prefill(params.params, padded, np.int32(true_length))
    return prefix.replace(version=params.version)

  def slot_settings(self, key, sampling, max_new: int, stop_ids=()) -> SlotSettings:
    """One request's settings as host scalars; stop_ids must already be checked against the vocabulary. key: a
    typed jax key or its raw uint32 data (jax.random.key_data; a host array costs no device round trip)."""
    if len(stop_ids) > self.max_stop_ids:
      raise ValueError(f"{len(stop_ids)} stop token ids given, the engine holds at most {self.max_stop_ids}")
    stops = np.full((self.max_stop_ids,), -1, np.int32)
    stops[: len(stop_ids)] = stop_ids
    temperature = 1.0 if sampling.greedy else sampling.temperature
    data = key if isinstance(key, np.ndarray) else jax.random.key_data(key)
    return SlotSettings(np.asarray(data, np.uint32), np.float32(temperature),
                        np.int32(sampling.top_k), np.float32(sampling.top_p), np.bool_(sampling.greedy),
                        np.int32(max_new), stops)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, settings: SlotSettings, *,
             num_generated: int = 0, table_row=None, first_private: int = 0) -> DecodeState:
    """Puts a prefix into a slot. Paged: table_row is the slot's page table (from PageAllocator.table_row);
    pages below first_private are the group's shared ones (already stored), the others get the prefix's pages.
    num_generated > 0 resumes a sample whose prefix holds its first num_generated completion tokens."""
    if not 0 <= slot < self.max_slots:
      raise ValueError(f"slot {slot} is outside [0, {self.max_slots})")
    if (self.kv == "paged") != (table_row is not None):
      raise ValueError(f"Engine(kv={self.kv!r}).insert: table_row is required for a paged cache and only there")
    row = np.zeros(self.pages_per_slot, np.int32) if table_row is None else np.asarray(table_row, np.int32)
    # The version is static metadata of Prefix: drop it so that a new policy version does not recompile insert.
    return self._insert(prefix.replace(version=0), decode_state, np.int32(slot), settings, np.int32(num_generated),
                        row, np.int32(first_private))

  def insert_group(self, prefix: Prefix, decode_state: DecodeState, slots, settings: Sequence[SlotSettings]
                   ) -> DecodeState:
    """Dense: puts one prefix into several slots (a group's new samples), each with its settings, in one program
    (per sample, insert's dispatch, an eager fold_in and a key read cost ~0.35 ms of a one-core sampler's time: a
    group of 4 went in 1.56 ms that way, 0.22 ms grouped; bench/results/headline_parts.json)."""
    if self.kv == "paged":
      raise ValueError("Engine(kv='paged').insert_group: a paged slot needs its page table (use insert)")
    if not 1 <= len(slots) <= self.max_slots or len(slots) != len(settings):
      raise ValueError(f"insert_group: {len(slots)} slots with {len(settings)} settings (1 to {self.max_slots})")
    if len(set(slots)) != len(slots) or not all(0 <= s < self.max_slots for s in slots):
      raise ValueError(f"insert_group: slots {list(slots)} must be distinct and in [0, {self.max_slots})")
    width = self.max_slots  # one shape: no compilation for a new group size or a partial placement mid-run
    slots_W = np.zeros(width, np.int32)
    slots_W[: len(slots)] = slots
    stacked = jax.tree.map(lambda *xs: np.resize(np.stack(xs), (width, *np.shape(xs[0]))), *settings)  # rows cycled
    return self._insert_dense(prefix.replace(version=0), decode_state, slots_W, stacked, np.int32(len(slots)))

  def store_prefix(self, prefix: Prefix, decode_state: DecodeState, pages) -> DecodeState:
    """Paged: writes a group's shared prompt pages (ids in position order) once, before its samples' inserts."""
    row = np.full(self.pages_per_slot, self.num_pages, np.int32)
    row[: len(pages)] = pages
    return self._store_prefix(prefix.replace(version=0), decode_state, row)

  def set_tables(self, decode_state: DecodeState, table_SxM) -> DecodeState:
    """Paged: the slots' page tables after the host reserved or freed pages."""
    return self._set_tables(decode_state, np.asarray(table_SxM, np.int32))

  def rebuild_spans(self, params: Versioned, decode_state: DecodeState, spans) -> DecodeState:
    """Paged: recomputes (slot, start, end) spans in order with new params, in calls of rebuild_rows chunks."""
    for slot_R, start_R, end_R in paged.spans_to_rows(spans, self.rebuild_chunk, self.rebuild_rows):
      decode_state = self._rebuild_rows(params.params, decode_state, slot_R, start_R, end_R)
    return decode_state

  def row_bucket(self, live: int | None) -> int:
    """Rows a generate call runs for `live` active slots (None: all): paged, the smallest row bucket that holds
    them; dense, always max_slots."""
    live = self.max_slots if live is None else live
    if not 0 <= live <= self.max_slots:
      raise ValueError(f"live={live} active slots is outside [0, {self.max_slots}]")
    return min(b for b in self.row_buckets if b >= live)

  def generate(self, params: Versioned, decode_state: DecodeState, live: int | None = None
               ) -> tuple[DecodeState, ResultTokens]:
    """`steps_per_call` decode steps. live: at least the number of active slots (the host's occupied slots);
    paged, the call then runs only that many rows (in row_bucket(live)); a smaller count would skip slots."""
    version = np.int32(params.version)
    if self.kv == "dense":
      return self._generate(params.params, version, decode_state)
    if not self._live_programs:
      for b in self.row_buckets:
        self._live_programs[b] = self._generate_live.lower(b, params.params, version, decode_state).compile()
    return self._live_programs[self.row_bucket(live)](params.params, version, decode_state)

  def rebuild(self, params: Versioned, decode_state: DecodeState, length: int) -> DecodeState:
    """Recomputes the cache of positions [0, length) of all slots with new params (exact in-flight update)."""
    if self.kv == "paged":
      raise ValueError("Engine(kv='paged').rebuild: use rebuild_spans (it recomputes only the live tokens)")
    return self._rebuild(self.bucket(min(length, self.max_len)), params.params, decode_state)

  def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Stops a slot (the host ended its sample, e.g. on a stop string)."""
    return self._release(decode_state, np.int32(slot))

  def append(self, params: Versioned, decode_state: DecodeState, slot: int, tokens, start: int,
             max_new: int) -> DecodeState:
    """Continues a slot whose model turn ended at position `start` with an environment's observation tokens
    (jaxrl.sampler.continuation): they go at start+1.., their keys/values are computed with `params` in chunks of
    rebuild_chunk, and the slot decodes again with a budget of max_new generated tokens (the whole episode's).
    Paged: the slot's table must already hold pages for the new positions (the host reserves them)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if not 0 <= slot < self.max_slots:
      raise ValueError(f"slot {slot} is outside [0, {self.max_slots})")
    if tokens.size == 0:
      raise ValueError("append: no observation tokens (a turn continues with at least one)")
    end = int(start) + len(tokens)
    if not 0 <= start or end > self.max_len - 2:
      raise ValueError(f"append: {len(tokens)} tokens after position {start} leave no room to generate in "
                       f"max_len={self.max_len}")
    if not hasattr(self, "_append_fns"):  # compiled on first use: engines that never continue a slot skip them
      g, chunk, out = self.graphdef, self.rebuild_chunk, self._state_shardings
      self._append_fns = (jax.jit(continuation.write_observation, donate_argnums=0, out_shardings=out),
                          jax.jit(functools.partial(continuation.fill_dense, g, chunk), donate_argnums=1,
                                  out_shardings=out))
    write, fill = self._append_fns
    padded = np.zeros(self.bucket(len(tokens)), np.int32)
    padded[: len(tokens)] = tokens
    decode_state = write(decode_state, np.int32(slot), np.int32(start), padded, np.int32(len(tokens)),
                         np.int32(max_new))
    if self.kv == "paged":
      return self.rebuild_spans(params, decode_state, [(slot, int(start), end)])
    # While the slot was parked, generate ran it as an idle row, which writes garbage at position 0 of a dense cache
    # (a finished slot's next insert overwrites it; a parked slot keeps its cache): recompute it first (exact, as
    # position 0 attends to itself only; the rest of that chunk is rewritten with the values it already holds).
    for a in (0, *range(int(start), end, self.rebuild_chunk)):
      decode_state = fill(params.params, decode_state, np.int32(slot), np.int32(a))
    return decode_state

  def compile_count(self) -> int:
    """Compiled executables across the engine's jitted functions (each shape compiles once)."""
    return len(self._live_programs) + sum(
        f._cache_size() for f in (self._prefill, self._insert, self._insert_dense, self._generate, self._rebuild,
                                  self._release, self._store_prefix, self._set_tables, self._rebuild_rows))
