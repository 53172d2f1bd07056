"""Decode attention over a paged KV cache: queries of each row attend to the pages its page table lists.

Shapes as in cached_attention.py, plus P pages in the pool, Z positions per page, M pages per row's table.
Position t of row s lives at entry t % Z of page table_SxM[s, t // Z]; entries of a table past the row's pages
hold any id (the pool size marks them unused): they are clamped into the pool and masked by position. The pool's
layout (models.PagedKVCache): "NPZKD" = [N, P, Z, K, D], or "KNPZD" = [K, N, P, Z, D], the kernels'.

Implementations behind `paged_attention(..., impl=)`:
- "xla" (the reference, every backend, either layout): the online softmax of cached_attention over blocks of pages
  gathered through the table, up to the call's largest live position. With blocks of the dense path's size it
  gives the dense cache's numbers bit for bit, which is what lets the paged engine reproduce the dense one exactly.
  Over many rows it sorts them by live length and attends in groups of rows, each up to its own longest: ragged
  work.
- "pallas_gpu": `jax.experimental.pallas.ops.gpu.paged_attention`; "pallas_tpu":
  `jax.experimental.pallas.ops.tpu.paged_attention`. Both take one query per row, a length per row (ragged: a row
  reads only its own pages) and a [K, pages, Z, D] pool. In the "KNPZD" layout the stacked pool is that array for
  all layers at once ([K, N * P, Z, D], a free reshape) and layer n's page p is page n * P + p: the kernel reads
  the pages of one layer in place, with no per-layer copy of the pool. Rows of several queries (a prefill chunk:
  rebuild, an observation's append) take the XLA path over the same layout. Under a mesh a kernel runs in
  shard_map (slots over "data", kv heads over "tensor"; docs/KERNELS.md); the TPU kernel needs head_dim % 128 == 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.axes import SAMPLER_RULES, logical_to_spec
from jaxrl.kernels.cached_attention import online_softmax
from jaxrl.kernels.mosaic import LANES, mosaic_precision, per_device

IMPLS = ("xla", "pallas_gpu", "pallas_tpu")
LAYOUTS = ("NPZKD", "KNPZD")  # of the pool: [N, P, Z, K, D] (XLA's), [K, N, P, Z, D] (the kernels')


def _pages(x, layer, pages_SxW, layout):
  """Keys (or values) of these pages of one layer: [S, W, Z, K, D]. KNPZD: gathered as [Z, D] blocks of each head
  (as a decode step writes them, models.PagedKVCache): [K, Z, D] blocks made XLA:TPU copy the pool to K, Z, D
  innermost for the read, after every layer of every decode step."""
  x = jnp.asarray(x)
  if layout == "NPZKD":
    return x[layer, pages_SxW]
  return jnp.moveaxis(x[jnp.arange(x.shape[0])[:, None, None], layer, pages_SxW[None]], 0, 3)


def _reference(q_SxCxKxGxD, k_pages, v_pages, layer, table_SxM, positions_SxC, block, layout="NPZKD"):
  num_pages, z = k_pages.shape[1:3] if layout == "NPZKD" else k_pages.shape[2:4]
  m = table_SxM.shape[1]
  per_block = max(1, min(block, m * z) // z)  # pages per key block
  num_table_blocks = -(-m // per_block)
  table = jnp.pad(jnp.minimum(table_SxM, num_pages - 1), ((0, 0), (0, num_table_blocks * per_block - m)))
  size = per_block * z

  def fetch(i):
    pages_SxW = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
    keys, values = (_pages(c, layer, pages_SxW, layout) for c in (k_pages, v_pages))  # [S, W, Z, K, D]
    s, _, _, k, d = keys.shape
    idx_B = i * size + jnp.arange(size)
    return keys.reshape(s, size, k, d), values.reshape(s, size, k, d), idx_B, jnp.ones((size,), bool)

  live = jnp.max(positions_SxC) + 1
  return online_softmax(q_SxCxKxGxD, positions_SxC, (live + size - 1) // size, fetch)


def _ragged(q_SxCxKxGxD, k_pages, v_pages, layer, table_SxM, positions_SxC, block, rows_per_group, layout):
  """The reference over groups of rows sorted by live length, each group reading only up to its own longest row:
  attention work ~ the sum of the rows' live lengths instead of rows x the longest (what XLA can do raggedly)."""
  s = q_SxCxKxGxD.shape[0]
  order_S = jnp.argsort(-jnp.max(positions_SxC, axis=1))
  groups = s // rows_per_group

  def group(g):
    rows_R = jax.lax.dynamic_slice_in_dim(order_S, g * rows_per_group, rows_per_group)
    return _reference(q_SxCxKxGxD[rows_R], k_pages, v_pages, layer, table_SxM[rows_R], positions_SxC[rows_R],
                      block, layout)

  per_group = jax.lax.map(group, jnp.arange(groups))  # [S / R, R, C, K, G, D], rows in sorted order
  out_SxCxKxGxD = per_group.reshape(q_SxCxKxGxD.shape)
  return jnp.zeros_like(out_SxCxKxGxD).at[order_S].set(out_SxCxKxGxD)


def _kernel_operands(q_SxCxKxGxD, k_KxNxPxZxD, v_KxNxPxZxD, layer, table_SxM):
  """The kernels' operands: q [S, K * G, D] scaled by 1/sqrt(D) (they apply no scale), the pool of every layer
  as [K, N * P, Z, D] (a reshape, no copy) and the table of this layer's pages in it."""
  s, _, kh, g, d = q_SxCxKxGxD.shape
  _, n, p, z, _ = k_KxNxPxZxD.shape
  k_pool, v_pool = (x.reshape(kh, n * p, z, d) for x in (k_KxNxPxZxD, v_KxNxPxZxD))
  table = jnp.minimum(table_SxM, p - 1) + layer * p
  q = q_SxCxKxGxD[:, 0].reshape(s, kh * g, d) / jnp.sqrt(jnp.float32(d)).astype(q_SxCxKxGxD.dtype)
  return q.astype(k_pool.dtype), k_pool, v_pool, table.astype(jnp.int32)


def _compute_block(m: int, most: int = 8) -> int:
  """Pages per compute block: the largest divisor of the table's width M up to `most`."""
  return max(b for b in range(1, min(m, most) + 1) if m % b == 0)


def _pallas_gpu(q_SxCxKxGxD, k_KxNxPxZxD, v_KxNxPxZxD, layer, table_SxM, positions_SxC, interpret):
  from jax.experimental.pallas.ops.gpu import paged_attention as gpu

  s, _, kh, g, d = q_SxCxKxGxD.shape
  q, k_pool, v_pool, table = _kernel_operands(q_SxCxKxGxD, k_KxNxPxZxD, v_KxNxPxZxD, layer, table_SxM)
  m = table_SxM.shape[1]
  per_block = _compute_block(m)
  out = gpu.paged_attention(q, k_pool, v_pool, table, positions_SxC[:, 0] + 1, block_h=16,
                            pages_per_compute_block=per_block, k_splits=m // per_block, interpret=interpret)
  return out.reshape(s, 1, kh, g, d).astype(q_SxCxKxGxD.dtype)


def _pallas_tpu(q_SxCxKxGxD, k_KxNxPxZxD, v_KxNxPxZxD, layer, table_SxM, positions_SxC, interpret):
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu

  s, _, kh, g, d = q_SxCxKxGxD.shape
  q, k_pool, v_pool, table = _kernel_operands(q_SxCxKxGxD, k_KxNxPxZxD, v_KxNxPxZxD, layer, table_SxM)
  call = lambda: tpu(q, k_pool, v_pool, (positions_SxC[:, 0] + 1).astype(jnp.int32), table,
                     pages_per_compute_block=_compute_block(table_SxM.shape[1]))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out = call()
  else:
    out = call()
  return out.reshape(s, 1, kh, g, d).astype(q_SxCxKxGxD.dtype)


def _kernel_specs(mesh, s: int, kh: int):
  """shard_map specs of (q, k pool, v pool, layer, table, positions) and of the output: slots over the sampler's
  "batch" axis, kv heads over its "kv_heads" axis where that divides them; the pool is not split by slot (any slot
  may own any page), as the engine lays it out, so each device reads its heads' pages in place."""
  rows, heads = logical_to_spec(("batch", "kv_heads"), (s, kh), mesh, SAMPLER_RULES)
  q, pool = P(rows, None, heads, None, None), P(heads, None, None, None, None)
  return (q, pool, pool, P(), P(rows, None), P(rows, None)), q


def paged_attention(q_SxCxKxGxD, k_pages, v_pages, layer, table_SxM, positions_SxC, *, block: int = 128,
                    impl: str = "xla", interpret: bool = False, rows_per_group: int = 8, layout: str = "NPZKD"):
  """softmax(q k^T / sqrt(D)) v over positions 0..position of each query's row, through the row's page table.

  xla: with more than `rows_per_group` rows (a multiple of it), rows are sorted by live length and attended in
  groups that each stop at their own longest row; otherwise all rows stop at the longest (the plain reference).
  pallas_gpu / pallas_tpu: need layout "KNPZD"; rows of one query run the kernel, longer rows the XLA path."""
  if impl not in IMPLS:
    raise ValueError(f"paged_attention: impl must be one of {IMPLS} (got {impl!r})")
  if layout not in LAYOUTS:
    raise ValueError(f"paged_attention: layout must be one of {LAYOUTS} (got {layout!r})")
  if impl != "xla" and layout != "KNPZD":
    raise ValueError(f"paged_attention(impl={impl!r}) reads the pool in the kernels' layout 'KNPZD' "
                     f"([K, N, P, Z, D]; got {layout!r})")
  if impl == "pallas_tpu" and q_SxCxKxGxD.shape[-1] % LANES:
    raise ValueError(f"paged_attention(impl='pallas_tpu') needs head_dim a multiple of {LANES} (got "
                     f"{q_SxCxKxGxD.shape[-1]}): Mosaic tiles the kernel's per-head blocks by {LANES} lanes")
  if impl != "xla" and q_SxCxKxGxD.shape[1] == 1:
    kernel = functools.partial(_pallas_gpu if impl == "pallas_gpu" else _pallas_tpu, interpret=interpret)
    s, _, kh = q_SxCxKxGxD.shape[:3]
    specs = lambda mesh: _kernel_specs(mesh, s, kh)
    with mosaic_precision():
      return per_device(kernel, specs, q_SxCxKxGxD, k_pages, v_pages, jnp.asarray(layer, jnp.int32), table_SxM,
                        positions_SxC)
  s = q_SxCxKxGxD.shape[0]
  if s > rows_per_group and s % rows_per_group == 0:
    return _ragged(q_SxCxKxGxD, k_pages, v_pages, layer, table_SxM, positions_SxC, block, rows_per_group, layout)
  return _reference(q_SxCxKxGxD, k_pages, v_pages, layer, table_SxM, positions_SxC, block, layout)
