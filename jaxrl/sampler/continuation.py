"""Device side of a multi-turn episode: an environment's observation tokens appended to a live slot.

A slot whose model turn ended holds its last model token at `pos` (its keys/values not computed yet: the next
decode step would). Continuing it writes the observation's tokens at positions pos+1 .. pos+m, computes the
keys/values of positions [pos, pos+m) in chunks (a prefill at the slot's offset, over the cache the earlier turns
left), and leaves the slot at pos+m, whose logits the next generate call computes: the model's next turn then
attends to its earlier turns and to the observation exactly as a full forward over the whole episode would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import KVCache, forward_cached


def write_observation(state, slot, start, tokens_A, count, max_new):
  """Writes tokens_A[:count] after position `start` of the slot and reactivates it at start + count with a
  budget of max_new generated tokens (counted over the whole episode); the padding of tokens_A is dropped."""
  max_len = state.tokens_SxT.shape[1]
  index_A = jnp.arange(tokens_A.shape[0])
  at_A = jnp.where(index_A < count, start + 1 + index_A, max_len)
  put = lambda rows, value: rows.at[slot].set(value)
  return state.replace(
      tokens_SxT=state.tokens_SxT.at[slot, at_A].set(tokens_A, mode="drop"),
      pos_S=put(state.pos_S, start + count),
      active_S=put(state.active_S, True),
      settings=state.settings.replace(max_new=put(state.settings.max_new, max_new)))


def fill_dense(graphdef, chunk, params, state, slot, start):
  """Keys/values of positions [start, start + chunk) of one slot of a dense cache (positions past the cache are
  dropped; those past the slot's new position are rewritten by the decode step that reaches them before any query
  reads them)."""
  max_len = state.tokens_SxT.shape[1]
  row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=1), state.cache)
  pos_1xC = (start + jnp.arange(chunk))[None]
  tokens_1xC = state.tokens_SxT[slot][jnp.minimum(pos_1xC, max_len - 1)]
  _, row = forward_cached(graphdef, params, tokens_1xC, pos_1xC, row)
  put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, slot, axis=1)
  return state.replace(cache=KVCache(put(state.cache.k_NxSxTxKxD, row.k_NxSxTxKxD),
                                     put(state.cache.v_NxSxTxKxD, row.v_NxSxTxKxD)))
