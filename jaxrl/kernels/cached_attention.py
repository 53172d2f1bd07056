"""Attention of new queries over one layer of a KV cache, reading only the cache's live blocks.

Shapes: S rows (decode slots), C new tokens per row, K kv heads, G query heads per kv head, D head dim, N layers,
T cache length, B keys per block. A query at position p sees cache entries 0..p of its row (cache index =
position), so the keys past the largest query position of the call are never read: the loop over key blocks
stops at the live length (a dynamic trip count), with an online softmax across blocks. The cache stays one
[N, S, T, K, D] buffer and the layer is an index, so no per-layer copy of the cache is made. The paged cache
(kernels/paged_attention.py) runs the same loop over blocks gathered through a page table.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def _block(cache_NxSxTxKxD, layer, start, size):
  n, s, t, k, d = cache_NxSxTxKxD.shape
  return jax.lax.dynamic_slice(cache_NxSxTxKxD, (layer, 0, start, 0, 0), (1, s, size, k, d))[0]


def online_softmax(q_SxCxKxGxD, positions_SxC, num_blocks, fetch):
  """softmax(q k^T / sqrt(D)) v over key blocks 0..num_blocks-1; `fetch(i)` gives block i's
  (keys_SxBxKxD, values_SxBxKxD, positions_B of its keys, fresh_B: not seen in an earlier block)."""
  s, c, kh, g, d = q_SxCxKxGxD.shape
  scale = 1.0 / math.sqrt(d)

  def body(i, carry):
    m_SxKxGxC, l_SxKxGxC, acc_SxKxGxCxD = carry
    keys_SxBxKxD, values_SxBxKxD, idx_B, fresh_B = fetch(i)
    q = q_SxCxKxGxD.astype(keys_SxBxKxD.dtype)
    scores = jnp.einsum("sckgd,sbkd->skgcb", q, keys_SxBxKxD, preferred_element_type=jnp.float32) * scale
    visible_SxCxB = (idx_B[None, None, :] <= positions_SxC[:, :, None]) & fresh_B[None, None, :]
    visible = visible_SxCxB[:, None, None]
    scores = jnp.where(visible, scores, _NEG_INF)
    m_new = jnp.maximum(m_SxKxGxC, jnp.max(scores, axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(m_SxKxGxC - m_new)
    l_new = l_SxKxGxC * correction + jnp.sum(p, axis=-1)
    pv = jnp.einsum("skgcb,sbkd->skgcd", p.astype(values_SxBxKxD.dtype), values_SxBxKxD,
                    preferred_element_type=jnp.float32)
    return m_new, l_new, acc_SxKxGxCxD * correction[..., None] + pv

  init = (jnp.full((s, kh, g, c), _NEG_INF, jnp.float32), jnp.zeros((s, kh, g, c), jnp.float32),
          jnp.zeros((s, kh, g, c, d), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
  out_SxKxGxCxD = acc / jnp.maximum(l, 1e-30)[..., None]  # a row with no visible key (never used) gives 0
  return jnp.transpose(out_SxKxGxCxD, (0, 3, 1, 2, 4)).astype(q_SxCxKxGxD.dtype)


def _reference(q_SxCxKxGxD, k_NxSxTxKxD, v_NxSxTxKxD, layer, positions_SxC, block):
  t = k_NxSxTxKxD.shape[2]
  size = min(block, t)
  live = jnp.max(positions_SxC) + 1

  def fetch(i):
    # The last block may start before i * size (dynamic_slice clamps it into the cache): mask what was seen.
    start = jnp.minimum(i * size, t - size)
    idx_B = start + jnp.arange(size)
    return (_block(k_NxSxTxKxD, layer, start, size), _block(v_NxSxTxKxD, layer, start, size), idx_B,
            idx_B >= i * size)

  return online_softmax(q_SxCxKxGxD, positions_SxC, (live + size - 1) // size, fetch)


def cached_attention(q_SxCxKxGxD, k_NxSxTxKxD, v_NxSxTxKxD, layer, positions_SxC, *, block: int = 128):
  """softmax(q k^T / sqrt(D)) v over cache entries 0..position of each query's row, in layer `layer`."""
  # XLA reference on every backend for now; a Pallas kernel slots in here per jax.default_backend().
  return _reference(q_SxCxKxGxD, k_NxSxTxKxD, v_NxSxTxKxD, layer, positions_SxC, block)
