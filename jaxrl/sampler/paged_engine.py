"""The engine over a paged KV cache: a pool of pages with a page table per slot (models.PagedKVCache).

The host's page allocator (sampler/page_allocator.py) decides which page holds what and hands the tables over
(`set_tables`, `insert(table_row=)`); a group's prompt pages are written once (`store_prefix`) and shared;
`rebuild_spans` recomputes only the live tokens; and a generate call runs only its live slots, gathered into a
batch of the smallest row bucket that holds them (the pool is shared, so only page tables and per-slot state
move): a step costs what its live rows do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.kernels.mosaic import LANES
from jaxrl.kernels.paged_attention import IMPLS as PAGED_ATTENTION
from jaxrl.models import ModelConfig, PagedKVCache, init_paged_cache
from jaxrl.sampler import decode, paged_kv
from jaxrl.sampler.decode_state import DecodeState, Prefix, ResultTokens, SlotSettings
from jaxrl.sampler.slot_engine import SlotEngine, check_positive_ints
from jaxrl.sharding import Versioned, under_mesh


def insert(prefix: Prefix, state: DecodeState, slot, settings: SlotSettings, num_generated, table_row_M,
           first_private) -> DecodeState:
  """Writes a prefix's private pages (from first_private on) to the pages table_row_M lists and fills the slot."""
  cache = paged_kv.write_prefix_pages(state.cache, prefix.cache, table_row_M, first_private, prefix.length)
  cache = cache.replace(table_SxM=cache.table_SxM.at[slot].set(table_row_M))
  return decode.fill_slot(state, cache, prefix, slot, settings, num_generated)


def only_live_writes(cache: PagedKVCache, state: DecodeState) -> PagedKVCache:
  """An idle slot's pages may belong to another slot by now: only active rows write (up to their position)."""
  return cache.replace(write_end_S=jnp.where(state.active_S, state.pos_S + 1, 0))


def generate_live(graphdef, steps, shardings, num_rows, params, version, state: DecodeState):
  """The decode loop over a compacted batch of num_rows rows holding the active slots (paged_kv.take_live_rows),
  so a step costs what its live rows do. The batch is laid out as the decode state is (shardings[num_rows]): XLA
  then splits each step's sums over the mesh as for the full batch, which keeps every row's numbers the same."""
  sub, rows_R = paged_kv.take_live_rows(state, num_rows)
  sub = jax.lax.with_sharding_constraint(sub, shardings[num_rows])
  sub, result = decode.generate(graphdef, steps, params, version, sub, before_step=only_live_writes)
  return paged_kv.put_rows(state, sub, result, rows_R)


def decode_attention(attention: str, mesh, head_dim: int) -> str:
  """The decode attention a paged engine runs ("auto": the Pallas kernel of the mesh's platform, where it applies;
  the kernel runs in shard_map over the sampler mesh: slots over "data", kv heads over "tensor")."""
  if attention not in ("auto", *PAGED_ATTENTION):
    raise ValueError(f"Engine: attention must be 'auto' or one of {PAGED_ATTENTION} (got {attention!r})")
  platform = mesh.devices.flat[0].platform
  if attention == "auto":
    kernel = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform)
    return "xla" if kernel is None or (kernel == "pallas_tpu" and head_dim % LANES) else kernel
  if attention == "pallas_tpu" and head_dim % LANES:
    raise ValueError(f"Engine: attention='pallas_tpu' needs head_dim a multiple of {LANES} (Mosaic tiles the "
                     f"kernel's head blocks by {LANES} lanes; got {head_dim}); use attention='xla'")
  return attention


def live_row_buckets(buckets, max_slots: int) -> tuple[int, ...]:
  """The batch sizes a generate call may run at (default 8, 16, 32, ... below max_slots), max_slots included."""
  if buckets is None:
    buckets = [2**i for i in range(3, max_slots.bit_length()) if 2**i < max_slots]
  bad = [b for b in buckets if not isinstance(b, (int, np.integer)) or not 0 < b <= max_slots]
  if bad:
    raise ValueError(f"Engine: row_buckets must be ints in [1, max_slots={max_slots}] (got {bad})")
  return tuple(sorted({*(int(b) for b in buckets), max_slots}))


def check_pages(max_len: int, page_size: int, num_pages: int) -> None:
  check_positive_ints(page_size=page_size, num_pages=num_pages)
  if max_len % page_size:
    raise ValueError(f"Engine: max_len={max_len} must be a multiple of page_size={page_size} (whole pages)")
  if num_pages < max_len // page_size:
    raise ValueError(f"Engine: num_pages={num_pages} cannot hold one sample of max_len={max_len} "
                     f"({max_len // page_size} pages of {page_size})")


class PagedEngine(SlotEngine):
  """Prefill / insert / generate over `max_slots` slots whose keys/values live in a shared pool of pages."""

  kv = "paged"

  def __init__(self, cfg: ModelConfig, mesh, *, max_slots: int, max_len: int, page_size: int = 16,
               num_pages: int | None = None, rebuild_rows: int = 8, row_buckets=None, attention: str = "auto",
               interpret: bool = False, **common):
    """common: SlotEngine's. num_pages of page_size positions (None: as many as the dense cache holds,
    max_slots * max_len / page_size). A rebuild runs calls of rebuild_rows chunks of rebuild_chunk positions (a
    call's cost is fixed: small calls waste less). row_buckets: the batch sizes a generate call may run at, over
    its live slots only (None: 8, 16, 32, ... below max_slots; max_slots is always one); each is compiled once,
    all at the first generate call. attention: "xla" | "pallas_gpu" | "pallas_tpu" (kernels.paged_attention) or
    "auto": the Pallas kernel of a GPU or TPU sampler mesh (TPU: head_dim a multiple of 128), "xla" otherwise (on
    CPU); a kernel runs in shard_map over the mesh and keeps the pool in its [K, N, P, Z, D] layout. interpret: run
    the kernel in Pallas interpret mode (tests on CPU)."""
    num_pages = max_slots * max_len // page_size if num_pages is None and page_size else num_pages
    check_positive_ints(max_len=max_len, rebuild_rows=rebuild_rows)
    check_pages(max_len, page_size, num_pages)
    self.attention = decode_attention(attention, mesh, cfg.head_dim)
    self.interpret = bool(interpret)
    self.row_buckets = live_row_buckets(row_buckets, max_slots)
    self.page_size, self.num_pages, self.pages_per_slot = page_size, num_pages, max_len // page_size
    self.rebuild_rows = rebuild_rows
    super().__init__(cfg, mesh, max_slots=max_slots, max_len=max_len, **common)
    g, out, steps, chunk = self.graphdef, self._state_shardings, self.steps_per_call, self.rebuild_chunk
    self._insert = jax.jit(functools.partial(insert), donate_argnums=1, out_shardings=out)
    # One program per row bucket, compiled ahead of time (all at the first call, so none compiles mid-run).
    rows = {b: self.decode_state_shardings(b) for b in self.row_buckets}
    # The programs that attend over the pool trace under the mesh: a kernel there runs in shard_map over it.
    self._generate_live = jax.jit(under_mesh(functools.partial(generate_live, g, steps, rows), mesh),
                                  static_argnums=0, donate_argnums=3, out_shardings=(out, self._result_shardings))
    self._live_programs = {}
    self._store_prefix = jax.jit(functools.partial(paged_kv.store_prefix), donate_argnums=1, out_shardings=out)
    self._set_tables = jax.jit(functools.partial(paged_kv.set_table), donate_argnums=0, out_shardings=out)
    self._rebuild_rows = jax.jit(under_mesh(functools.partial(paged_kv.rebuild_rows, g, chunk), mesh),
                                 donate_argnums=1, out_shardings=out)

  @property
  def layout(self) -> str:
    """Of the pool: [K, N, P, Z, D] for a Pallas kernel and on TPU (XLA:TPU reads and writes its pages as [Z, D]
    tiles in place; in [N, P, Z, K, D] it copied the pool every layer of every decode step: docs/TPU.md), [N, P, Z,
    K, D] for XLA on CPU and GPU."""
    return "NPZKD" if self.attention == "xla" and self.mesh.devices.flat[0].platform != "tpu" else "KNPZD"

  @property
  def _paging(self) -> dict:
    return dict(layout=self.layout, attention=self.attention, interpret=self.interpret)

  def empty_cache(self) -> PagedKVCache:
    return init_paged_cache(self.cfg, self.max_slots, self.num_pages, self.page_size, self.pages_per_slot,
                            **self._paging)

  def cache_shardings(self, rows=None) -> PagedKVCache:
    """The pool is not split by slot (any slot may own any page); heads still are."""
    if self.layout == "NPZKD":
      pages = self._named("layers", None, None, "kv_heads", "head_dim")
    else:
      pages = self._named("kv_heads", "layers", None, None, "head_dim")
    return PagedKVCache(pages, pages, self._named("batch", None, rows=rows), self._named("batch", rows=rows),
                        **self._paging)

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, settings: SlotSettings, *,
             num_generated: int = 0, table_row=None, first_private: int = 0) -> DecodeState:
    """Puts a prefix into a slot: table_row is the slot's page table (from PageAllocator.table_row); pages below
    first_private are the group's shared ones (already stored), the others get the prefix's pages.
    num_generated > 0 resumes a sample whose prefix holds its first num_generated completion tokens."""
    self.check_slot(slot)
    if table_row is None:
      raise ValueError("Engine(kv='paged').insert: table_row is required for a paged cache and only there")
    # The version is static metadata of Prefix: drop it so that a new policy version does not recompile insert.
    return self._insert(prefix.replace(version=0), decode_state, np.int32(slot), settings, np.int32(num_generated),
                        np.asarray(table_row, np.int32), np.int32(first_private))

  def store_prefix(self, prefix: Prefix, decode_state: DecodeState, pages) -> DecodeState:
    """Writes a group's shared prompt pages (ids in position order) once, before its samples' inserts."""
    row = np.full(self.pages_per_slot, self.num_pages, np.int32)
    row[: len(pages)] = pages
    return self._store_prefix(prefix.replace(version=0), decode_state, row)

  def set_tables(self, decode_state: DecodeState, table_SxM) -> DecodeState:
    """The slots' page tables after the host reserved or freed pages."""
    return self._set_tables(decode_state, np.asarray(table_SxM, np.int32))

  def rebuild_spans(self, params: Versioned, decode_state: DecodeState, spans) -> DecodeState:
    """Recomputes (slot, start, end) spans in order with new params, in calls of rebuild_rows chunks."""
    for slot_R, start_R, end_R in paged_kv.spans_to_rows(spans, self.rebuild_chunk, self.rebuild_rows):
      decode_state = self._rebuild_rows(params.params, decode_state, slot_R, start_R, end_R)
    return decode_state

  def row_bucket(self, live: int | None) -> int:
    """Rows a generate call runs for `live` active slots (None: all): the smallest row bucket that holds them."""
    live = self.max_slots if live is None else live
    if not 0 <= live <= self.max_slots:
      raise ValueError(f"live={live} active slots is outside [0, {self.max_slots}]")
    return min(b for b in self.row_buckets if b >= live)

  def generate(self, params: Versioned, decode_state: DecodeState, live: int | None = None
               ) -> tuple[DecodeState, ResultTokens]:
    """`steps_per_call` decode steps over row_bucket(live) rows. live: at least the number of active slots (the
    host's occupied slots); a smaller count would skip slots."""
    version = np.int32(params.version)
    if not self._live_programs:
      for b in self.row_buckets:
        self._live_programs[b] = self._generate_live.lower(b, params.params, version, decode_state).compile()
    return self._live_programs[self.row_bucket(live)](params.params, version, decode_state)

  def append(self, params: Versioned, decode_state: DecodeState, slot: int, tokens, start: int,
             max_new: int) -> DecodeState:
    """Continues a slot whose model turn ended at position `start` with an environment's observation tokens
    (jaxrl.sampler.continuation), recomputed as a span; the slot's table must already hold pages for the new
    positions (the host reserves them)."""
    decode_state, end = self.write_observation(decode_state, slot, tokens, start, max_new)
    return self.rebuild_spans(params, decode_state, [(slot, int(start), end)])

  def compile_count(self) -> int:
    """Compiled executables across the engine's jitted functions (each shape compiles once)."""
    programs = (*self.own_programs(), self._insert, self._store_prefix, self._set_tables, self._rebuild_rows)
    return len(self._live_programs) + sum(f._cache_size() for f in programs)
