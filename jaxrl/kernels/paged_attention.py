"""Decode attention over a paged KV cache: queries of each row attend to the pages its page table lists.

Shapes as in cached_attention.py, plus P pages in the pool, Z positions per page, M pages per row's table.
Position t of row s lives at entry t % Z of page table_SxM[s, t // Z]; entries of a table past the row's pages
hold any id (the pool size marks them unused): they are clamped into the pool and masked by position.

Implementations behind `paged_attention(..., impl=)`:
- "xla" (the reference, every backend): the online softmax of cached_attention over blocks of pages gathered
  through the table, up to the call's largest live position. With blocks of the dense path's size it gives the
  dense cache's numbers bit for bit, which is what lets the paged engine reproduce the dense one exactly. Over
  many rows it sorts them by live length and attends in groups of rows, each up to its own longest: ragged work.
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.paged_attention` (one query per row, lengths per row: ragged).
- "pallas_tpu": `jax.experimental.pallas.ops.tpu.ragged_paged_attention` (ragged queries and lengths).
The shipped kernels take one layer of the pool in their own layout ([K, P, Z, D]; [P, Z, 2K, D] with k and v
interleaved), so their wrappers copy that layer per call: they are correct (the GPU kernel equals the reference
in interpret mode; the TPU kernel lowers for a TPU target from the CPU) but the engine stays on "xla" until the
pool is stored per layer in their layout (the copy would cost what paging saves).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.kernels.cached_attention import online_softmax

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")


def _reference(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, block):
  _, num_pages, z, _, _ = k_NxPxZxKxD.shape
  m = table_SxM.shape[1]
  per_block = max(1, min(block, m * z) // z)  # pages per key block
  num_table_blocks = -(-m // per_block)
  table = jnp.pad(jnp.minimum(table_SxM, num_pages - 1), ((0, 0), (0, num_table_blocks * per_block - m)))
  size = per_block * z

  def fetch(i):
    pages_SxW = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
    keys, values = (jnp.asarray(c)[layer, pages_SxW] for c in (k_NxPxZxKxD, v_NxPxZxKxD))  # [S, W, Z, K, D]
    s, _, _, k, d = keys.shape
    idx_B = i * size + jnp.arange(size)
    return keys.reshape(s, size, k, d), values.reshape(s, size, k, d), idx_B, jnp.ones((size,), bool)

  live = jnp.max(positions_SxC) + 1
  return online_softmax(q_SxCxKxGxD, positions_SxC, (live + size - 1) // size, fetch)


def _ragged(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, block, rows_per_group):
  """The reference over groups of rows sorted by live length, each group reading only up to its own longest row:
  attention work ~ the sum of the rows' live lengths instead of rows x the longest (what XLA can do raggedly)."""
  s = q_SxCxKxGxD.shape[0]
  order_S = jnp.argsort(-jnp.max(positions_SxC, axis=1))
  groups = s // rows_per_group

  def group(g):
    rows_R = jax.lax.dynamic_slice_in_dim(order_S, g * rows_per_group, rows_per_group)
    return _reference(q_SxCxKxGxD[rows_R], k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM[rows_R],
                      positions_SxC[rows_R], block)

  per_group = jax.lax.map(group, jnp.arange(groups))  # [S / R, R, C, K, G, D], rows in sorted order
  out_SxCxKxGxD = per_group.reshape(q_SxCxKxGxD.shape)
  return jnp.zeros_like(out_SxCxKxGxD).at[order_S].set(out_SxCxKxGxD)


def _pallas_gpu(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, interpret):
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu

  s, c, kh, g, d = q_SxCxKxGxD.shape
  if c != 1:
    raise ValueError(f"paged_attention(impl='pallas_gpu') takes one query per row (got {c})")
  k_KxPxZxD, v_KxPxZxD = (jnp.transpose(x[layer], (2, 0, 1, 3)) for x in (k_NxPxZxKxD, v_NxPxZxKxD))
  m = table_SxM.shape[1]
  table = jnp.minimum(table_SxM, k_NxPxZxKxD.shape[1] - 1)
  per_block = min(8, m)
  splits = max(1, m // per_block) if m % per_block == 0 else 1
  # The kernel applies no softmax scale: fold 1/sqrt(D) into q.
  q = (q_SxCxKxGxD[:, 0].reshape(s, kh * g, d) / jnp.sqrt(jnp.float32(d)).astype(q_SxCxKxGxD.dtype))
  out = gpu.paged_attention(q.astype(k_KxPxZxD.dtype), k_KxPxZxD, v_KxPxZxD, table, positions_SxC[:, 0] + 1,
                            block_h=16, pages_per_compute_block=per_block if splits > 1 else m,
                            k_splits=splits, interpret=interpret)
  return out.reshape(s, 1, kh, g, d).astype(q_SxCxKxGxD.dtype)


def _pallas_tpu(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, interpret):
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu

  s, c, kh, g, d = q_SxCxKxGxD.shape
  # Rows' queries are consecutive positions ending at positions_SxC[:, -1] (decode: c == 1; a prefill chunk).
  kv = jnp.stack([k_NxPxZxKxD[layer], v_NxPxZxKxD[layer]], axis=3)  # [P, Z, K, 2, D]: k, v interleaved
  p, z = kv.shape[:2]
  kv_pages = kv.reshape(p, z, 2 * kh, d)
  q = q_SxCxKxGxD.reshape(s * c, kh * g, d)
  lengths = positions_SxC[:, -1] + 1
  cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(jnp.full((s,), c, jnp.int32))])
  table = jnp.minimum(table_SxM, p - 1)
  if interpret:
    # jax 0.12's TPU interpreter (pltpu.force_tpu_interpret_mode) fails inside this kernel on a reshaped ref
    # ("'ReshapeTransform' object has no attribute 'indices'"); the kernel is checked by lowering it instead.
    raise ValueError("paged_attention(impl='pallas_tpu') has no interpret mode in jax 0.12 (see the comment)")
  out = tpu.ragged_paged_attention(q, kv_pages, lengths, table, cu, jnp.array([s], jnp.int32), sm_scale=d ** -0.5,
                                   num_kv_pages_per_block=1, num_queries_per_block=c)
  return out.reshape(s, c, kh, g, d).astype(q_SxCxKxGxD.dtype)


def paged_attention(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, *, block: int = 128,
                    impl: str = "xla", interpret: bool = False, rows_per_group: int = 8):
  """softmax(q k^T / sqrt(D)) v over positions 0..position of each query's row, through the row's page table.

  xla: with more than `rows_per_group` rows (a multiple of it), rows are sorted by live length and attended in
  groups that each stop at their own longest row; otherwise all rows stop at the longest (the plain reference)."""
  if impl == "xla":
    s = q_SxCxKxGxD.shape[0]
    if s > rows_per_group and s % rows_per_group == 0:
      return _ragged(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, block, rows_per_group)
    return _reference(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, block)
  if impl == "pallas_gpu":
    return _pallas_gpu(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, interpret)
  if impl == "pallas_tpu":
    return _pallas_tpu(q_SxCxKxGxD, k_NxPxZxKxD, v_NxPxZxKxD, layer, table_SxM, positions_SxC, interpret)
  raise ValueError(f"paged_attention: impl must be one of {IMPLS} (got {impl!r})")
