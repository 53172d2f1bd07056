"""Device side of the paged KV cache: prefix pages into a slot's table, the live-token rebuild, spans to rows, and
the compacted batch of live slots a generate call runs.

The host (sampler/page_allocator.py) owns which page holds what; these pure functions only move keys/values between a
prefilled prompt, the page pool and the model. Letters as in models/decoder.py (P pages, Z positions per page,
M pages per slot's table), R rows of one rebuild or generate call, W pages of a prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import PagedKVCache, forward_cached


def write_prefix_pages(cache: PagedKVCache, prefix_cache, row_M, first, length) -> PagedKVCache:
  """Copies a prefilled prompt's pages [first, pages holding `length` positions) to the pages row_M lists."""
  n, _, bucket, k, d = prefix_cache.k_NxSxTxKxD.shape
  num_pages, z = cache.num_pages, cache.page_size
  w = -(-bucket // z)
  index_W = jnp.arange(w)
  dest_W = jnp.where((index_W >= first) & (index_W * z < length), row_M[:w], num_pages)

  def pages(x_Nx1xTxKxD):
    return jnp.pad(x_Nx1xTxKxD[:, 0], ((0, 0), (0, w * z - bucket), (0, 0), (0, 0))).reshape(n, w, z, k, d)

  return cache.write_pages(dest_W, pages(prefix_cache.k_NxSxTxKxD), pages(prefix_cache.v_NxSxTxKxD))


def store_prefix(prefix, state, pages_M):
  """Writes a group's shared prompt pages once (pages_M: their ids, then the pool size)."""
  shared = jnp.sum(pages_M < state.cache.num_pages)
  z = state.cache.page_size
  return state.replace(cache=write_prefix_pages(state.cache, prefix.cache, pages_M, 0, shared * z))


def set_table(state, table_SxM):
  return state.replace(cache=state.cache.replace(table_SxM=table_SxM))


def rebuild_rows(graphdef, chunk, params, state, slot_R, start_R, end_R):
  """Recomputes positions [start, end) of each row's slot (at most `chunk` each) with `params`.

  Rows of one call may continue one another (a slot's span cut in chunks, a group's shared prompt then its
  samples): each layer writes every row's keys/values before any row attends, so a row sees what the rows before
  it in the same call wrote, layer by layer, exactly as one longer prefill would."""
  max_len = state.tokens_SxT.shape[1]
  pos_RxC = start_R[:, None] + jnp.arange(chunk)[None]
  tokens_RxC = state.tokens_SxT[slot_R[:, None], jnp.minimum(pos_RxC, max_len - 1)]
  view = state.cache.replace(table_SxM=state.cache.table_SxM[slot_R], write_end_S=end_R)
  _, view = forward_cached(graphdef, params, tokens_RxC, pos_RxC, view)
  return state.replace(cache=state.cache.replace(k_pages=view.k_pages, v_pages=view.v_pages))


def spans_to_rows(spans, chunk: int, rows: int):
  """(slot, start, end) spans, in the order they must be computed, cut into calls of `rows` chunks each.

  Returns a list of (slot_R, start_R, end_R) int32 arrays; padding rows have end 0 (they write nothing)."""
  pieces = [(slot, a, end) for slot, start, end in spans for a in range(start, end, chunk)]
  calls = []
  for i in range(0, len(pieces), rows):
    block = pieces[i : i + rows]
    block += [(0, 0, 0)] * (rows - len(block))
    slot_R, start_R, end_R = (np.asarray(col, np.int32) for col in zip(*block, strict=True))
    calls.append((slot_R, start_R, end_R))
  return calls


def take_live_rows(state, num_rows: int):
  """The decode state of the active slots (in slot order) as a batch of num_rows rows, and their slots rows_R.

  Padding rows (fewer active slots than rows) are inactive, so they write nothing; slots left out must be
  inactive. The pool is shared, not gathered: only page tables and per-slot state move."""
  num_slots = state.pos_S.shape[0]
  rows_R = jnp.nonzero(state.active_S, size=num_rows, fill_value=num_slots)[0]
  take = lambda x: x.at[rows_R].get(mode="fill", fill_value=0)
  cache = state.cache
  sub = jax.tree.map(take, state.replace(cache=None))
  return sub.replace(cache=cache.replace(table_SxM=take(cache.table_SxM), write_end_S=take(cache.write_end_S))), rows_R


def put_rows(state, sub, result, rows_R):
  """Scatters a compacted batch's decode state and results (rows_R as from take_live_rows) back to its slots."""
  num_slots = state.pos_S.shape[0]
  put = lambda full, part: full.at[rows_R].set(part, mode="drop")
  state = state.replace(
      cache=state.cache.replace(k_pages=sub.cache.k_pages, v_pages=sub.cache.v_pages),
      tokens_SxT=put(state.tokens_SxT, sub.tokens_SxT), pos_S=put(state.pos_S, sub.pos_S),
      active_S=put(state.active_S, sub.active_S), num_generated_S=put(state.num_generated_S, sub.num_generated_S))
  full = lambda part: put(jnp.zeros((num_slots, *part.shape[1:]), part.dtype), part)
  experts = result.experts_SxCxNxK
  return state, result.replace(tokens_SxK=full(result.tokens_SxK), logprobs_SxK=full(result.logprobs_SxK),
                               valid_SxK=full(result.valid_SxK), done_S=full(result.done_S),
                               experts_SxCxNxK=None if experts is None else full(experts))
