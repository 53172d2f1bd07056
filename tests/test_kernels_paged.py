"""Paged decode attention: XLA reference vs the dense cache and a masked softmax, in both pool layouts; the Pallas
GPU and TPU kernels in interpret mode vs the reference (bf16 tolerance), reading one layer of the stacked pool in
place; the TPU kernel lowers for a TPU target from the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice

from jaxrl.kernels import cached_attention, paged_attention
from jaxrl.models import PagedKVCache
from jaxrl.sharding import make_mesh

N, P, Z, K, G, D = 2, 24, 4, 2, 3, 8


def _case(seed, num_rows=3, pages_per_row=5, num_queries=1, head_dim=D, dtype=np.float32):
  rng = np.random.default_rng(seed)
  k, v = (rng.standard_normal((N, P, Z, K, head_dim)).astype(dtype) for _ in range(2))
  table = rng.permutation(P)[: num_rows * pages_per_row].reshape(num_rows, pages_per_row).astype(np.int32)
  q = rng.standard_normal((num_rows, num_queries, K, G, head_dim)).astype(dtype)
  last = rng.integers(num_queries - 1, pages_per_row * Z, num_rows)
  positions = (last[:, None] - np.arange(num_queries)[::-1][None]).astype(np.int32)
  return q, k, v, table, positions


@pytest.mark.parametrize("num_queries, block", [(1, 128), (1, 8), (3, 8), (3, 12)])
def test_reference_equals_the_dense_cache_bit_for_bit(num_queries, block):
  q, k, v, table, positions = _case(num_queries * 10 + block, num_queries=num_queries)
  # The same keys laid out densely: row s's position t at [s, t].
  dense_k, dense_v = (x[:, table].reshape(N, table.shape[0], -1, K, D) for x in (k, v))
  paged = jax.jit(lambda *a: paged_attention(*a, block=block))(q, k, v, 1, table, positions)
  dense = jax.jit(lambda *a: cached_attention(*a, block=block))(q, dense_k, dense_v, 1, positions)
  np.testing.assert_array_equal(np.asarray(paged), np.asarray(dense))


def test_reference_reads_only_the_live_blocks_of_pages():
  q, k, v, table, positions = _case(7)
  positions[:] = np.minimum(positions, 2 * Z - 1)  # live part: the first block of two pages of each row
  free = np.setdiff1d(np.arange(P), table[:, :2])
  k[:, free], v[:, free] = np.nan, np.nan
  table[:, 2:] = P  # unused entries: the pool size
  out = np.asarray(paged_attention(q, k, v, 0, table, positions, block=2 * Z))
  assert np.isfinite(out).all()
  scores = np.einsum("sckgd,stkd->skgct", q, k[0, table[:, :2]].reshape(3, -1, K, D)) / np.sqrt(D)
  visible = np.arange(2 * Z)[None, None, :] <= positions[:, :, None]
  p = np.exp(np.where(visible[:, None, None], scores, -np.inf))
  expected = np.einsum("skgct,stkd->sckgd", p / p.sum(-1, keepdims=True), v[0, table[:, :2]].reshape(3, -1, K, D))
  np.testing.assert_allclose(out, expected, atol=2e-6)


def _kernel_layout(x_NxPxZxKxD):
  return np.ascontiguousarray(np.moveaxis(np.asarray(x_NxPxZxKxD), 3, 0))  # [K, N, P, Z, D]


@pytest.mark.parametrize("num_queries", [1, 3])
def test_pool_writes_are_the_same_in_both_layouts(num_queries):
  """A decode step's writes (one position per row: whole [Z, D] page blocks in the kernels' layout) and a chunk's,
  rows whose page is past the pool dropped, land where the XLA layout's writes do, bit for bit."""
  rng = np.random.default_rng(num_queries)
  k, v = (rng.standard_normal((N, P, Z, K, D)).astype(np.float32) for _ in range(2))
  page_SxC = np.array([[3] * num_queries, [P] * num_queries, [17] * num_queries], np.int32)  # row 1: dropped
  offset_SxC = np.array([np.arange(num_queries) + o for o in (0, 1, 4 - num_queries)], np.int32)
  new_k, new_v = (rng.standard_normal((3, num_queries, K, D)).astype(np.float32) for _ in range(2))
  table, ends = np.zeros((3, 1), np.int32), np.zeros(3, np.int32)

  def write(layout, pool_k, pool_v):
    cache = PagedKVCache(jnp.asarray(pool_k), jnp.asarray(pool_v), table, ends, layout=layout)
    return jax.jit(lambda c, n: c.write(n, page_SxC, offset_SxC, new_k, new_v))(cache, 1)

  xla = write("NPZKD", k, v)
  kernels = write("KNPZD", _kernel_layout(k), _kernel_layout(v))
  np.testing.assert_array_equal(np.asarray(kernels.k_pages), _kernel_layout(xla.k_pages))
  np.testing.assert_array_equal(np.asarray(kernels.v_pages), _kernel_layout(xla.v_pages))
  assert not np.array_equal(np.asarray(xla.k_pages), k)  # rows 0 and 2 wrote


@pytest.mark.parametrize("num_queries, rows", [(1, 3), (2, 6), (3, 16)])
def test_kernel_layout_reference_equals_the_xla_layout_bit_for_bit(num_queries, rows):
  q, k, v, table, positions = _case(num_queries + rows, num_rows=rows, pages_per_row=min(5, P // rows),
                                    num_queries=num_queries)
  xla = jax.jit(lambda *a: paged_attention(*a, block=8))(q, k, v, 1, table, positions)
  kernels = jax.jit(lambda *a: paged_attention(*a, block=8, layout="KNPZD"))(q, _kernel_layout(k),
                                                                               _kernel_layout(v), 1, table, positions)
  np.testing.assert_array_equal(np.asarray(kernels), np.asarray(xla))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_pallas_kernel_in_interpret_mode_equals_the_reference(impl):
  """Every layer's pool side by side ([K, N * P, Z, D]); layer 1 is read through page ids offset by P."""
  q, k, v, table, positions = _case(3, num_rows=2, pages_per_row=4, head_dim=128 if impl == "pallas_tpu" else D)
  q = q * q.shape[-1] ** -0.5  # attention logits of the scale a model's have (bf16 products stay accurate)
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  table[1, 3] = P  # an unused entry
  ref = paged_attention(q, k, v, 1, table, positions)
  out = paged_attention(q, jnp.asarray(_kernel_layout(k)), jnp.asarray(_kernel_layout(v)), 1, table, positions,
                        impl=impl, interpret=True, layout="KNPZD")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=3e-2, rtol=3e-2)
  other = paged_attention(q, k, v, 0, table, positions)  # layer 0's keys give other numbers: the offset matters
  assert not np.allclose(np.asarray(out, np.float32), np.asarray(other, np.float32), atol=3e-2, rtol=3e-2)


def test_kernels_need_the_kernel_layout():
  q, k, v, table, positions = _case(0)
  with pytest.raises(ValueError, match="kernels' layout 'KNPZD'"):
    paged_attention(q, k, v, 0, table, positions, impl="pallas_gpu")


def test_pallas_tpu_kernel_lowers_for_a_tpu_target():
  sd = jax.ShapeDtypeStruct
  f = jax.jit(lambda q, k, v, t, p: paged_attention(q, k, v, 1, t, p, impl="pallas_tpu", layout="KNPZD"))
  device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)):
    lowered = f.trace(sd((4, 1, 2, 4, 128), jnp.bfloat16), sd((2, 3, 32, 16, 128), jnp.bfloat16),
                      sd((2, 3, 32, 16, 128), jnp.bfloat16), sd((4, 8), jnp.int32),
                      sd((4, 1), jnp.int32)).lower(lowering_platforms=("tpu",))
  assert "tpu_custom_call" in lowered.as_text()


def test_unknown_impl_is_named():
  q, k, v, table, positions = _case(0)
  with pytest.raises(ValueError, match="impl must be one of"):
    paged_attention(q, k, v, 0, table, positions, impl="cuda")


def test_ragged_row_groups_equal_the_reference():
  q, k, v, table, positions = _case(11, num_rows=6, pages_per_row=4, num_queries=2)
  ragged = jax.jit(lambda *a: paged_attention(*a, block=8, rows_per_group=2))(q, k, v, 1, table, positions)
  plain = jax.jit(lambda *a: paged_attention(*a, block=8, rows_per_group=6))(q, k, v, 1, table, positions)
  np.testing.assert_allclose(np.asarray(ragged), np.asarray(plain), atol=1e-6)


def test_decode_step_with_the_tpu_kernel_lowers_for_a_tpu_target():
  """The decoder's cached step over a pool in the kernels' layout: every layer of the scan calls the kernel on the
  whole stacked pool (a reshape, its layer a page offset)."""
  import dataclasses

  from jaxrl.models import ModelConfig, PagedKVCache, forward_cached
  from jaxrl.models.hf import abstract_params

  cfg = dataclasses.replace(ModelConfig.tiny(), head_dim=128, dtype="bfloat16", param_dtype="bfloat16")
  graphdef, abstract = abstract_params(cfg)
  sd = jax.ShapeDtypeStruct
  rows, pages, per_row = 8, 64, 8
  pool = sd((cfg.num_kv_heads, cfg.num_layers, pages, 16, cfg.head_dim), jnp.bfloat16)
  cache = PagedKVCache(pool, pool, sd((rows, per_row), jnp.int32), sd((rows,), jnp.int32), layout="KNPZD",
                       attention="pallas_tpu")
  device = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)):
    lowered = jax.jit(forward_cached, static_argnums=0).trace(
        graphdef, abstract, sd((rows, 1), jnp.int32), sd((rows, 1), jnp.int32), cache).lower(
        lowering_platforms=("tpu",))
  text = lowered.as_text()
  assert text.count("tpu_custom_call") == 1 and "stablehlo.while" in text  # one kernel, inside the layer loop


def test_kernel_under_a_mesh_runs_per_device_and_equals_the_reference():
  """Under a mesh (the engine traces its programs under its own) the kernel runs in shard_map: each device its
  slots (data) and kv heads (tensor) against its heads' pages of the shared pool; the same numbers as one call."""
  q, k, v, table, positions = _case(5, num_rows=4, pages_per_row=4)
  pools = jnp.asarray(_kernel_layout(k)), jnp.asarray(_kernel_layout(v))
  attend = lambda q, k, v: paged_attention(q, k, v, 1, table, positions, impl="pallas_gpu", interpret=True,
                                           layout="KNPZD")
  whole = attend(q, *pools)
  with jax.set_mesh(make_mesh({"data": 2, "tensor": 2}, jax.devices()[:4])):
    assert "shard_map" in str(jax.make_jaxpr(attend)(q, *pools))
    per_device = jax.jit(attend)(q, *pools)
  np.testing.assert_allclose(np.asarray(per_device), np.asarray(whole), atol=1e-6)
