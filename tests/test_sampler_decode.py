"""The decode program: in-place KV cache (no second cache-sized buffer), live-length attention, sampler dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels import cached_attention
from jaxrl.models import ModelConfig
from jaxrl.models.hf import abstract_params
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=16, eos_token_ids=(1,))


def _mesh():
  return make_mesh({"data": 1}, jax.devices()[:1])


def _params(seed=0):
  graphdef, abstract = abstract_params(CFG)
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray((1.0 if "scale" in jax.tree_util.keystr(path) else 0.0)
                                  + 0.25 * rng.standard_normal(x.shape), x.dtype), abstract)


def test_decode_program_updates_the_cache_in_place():
  # Before: the cache went through the layer scan as xs -> ys, a second cache-sized temporary (1.1x the cache).
  engine = make_engine(CFG, _mesh(), max_slots=8, max_len=1024, steps_per_call=4)
  state = engine.init_decode_state()
  params = engine.place(_params(), 0)
  compiled = engine._generate.lower(params.params, np.int32(0), state).compile()
  memory = compiled.memory_analysis()
  cache_bytes = state.cache.k_NxSxTxKxD.nbytes + state.cache.v_NxSxTxKxD.nbytes
  assert memory.temp_size_in_bytes < 0.1 * cache_bytes, (memory.temp_size_in_bytes, cache_bytes)
  assert memory.alias_size_in_bytes >= cache_bytes  # the donated cache is the output cache


def _masked_softmax_attention(q_SxCxKxGxD, k_SxTxKxD, v_SxTxKxD, positions_SxC):
  d = q_SxCxKxGxD.shape[-1]
  scores = np.einsum("sckgd,stkd->skgct", q_SxCxKxGxD, k_SxTxKxD) / np.sqrt(d)
  visible = np.arange(k_SxTxKxD.shape[1])[None, None, :] <= positions_SxC[:, :, None]
  scores = np.where(visible[:, None, None], scores, -np.inf)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("skgct,stkd->sckgd", p / p.sum(-1, keepdims=True), v_SxTxKxD)


@pytest.mark.parametrize("num_queries, block", [(1, 128), (1, 16), (1, 7), (5, 16), (5, 7)])
def test_cached_attention_equals_masked_softmax(num_queries, block):
  rng = np.random.default_rng(num_queries * 100 + block)
  n, s, t, k, g, d = 3, 4, 40, 2, 3, 8
  k_cache, v_cache = (rng.standard_normal((n, s, t, k, d)).astype(np.float32) for _ in range(2))
  q = rng.standard_normal((s, num_queries, k, g, d)).astype(np.float32)
  positions = rng.integers(0, 20, (s, num_queries)).astype(np.int32)  # live part: entries past 20 never matter
  # Past the live length: stale values inside the last live block (masked), NaN in the blocks never read.
  read_end = -(-(positions.max() + 1) // min(block, t)) * min(block, t)
  for cache in (k_cache, v_cache):
    cache[:, :, 20:] = 1e4
    cache[:, :, read_end:] = np.nan
  out = jax.jit(lambda *a: cached_attention(*a, block=block))(q, k_cache, v_cache, 1, positions)
  expected = _masked_softmax_attention(q, k_cache[1, :, :read_end], v_cache[1, :, :read_end], positions)
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6)


def test_bfloat16_engine_casts_weights_and_cache_once():
  engine = make_engine(CFG, _mesh(), max_slots=2, max_len=32, steps_per_call=4, dtype="bfloat16")
  params = _params()
  sampler = Sampler(engine, params, seed=0)
  assert {x.dtype for x in jax.tree.leaves(sampler._params.params)} == {jnp.dtype(jnp.bfloat16)}
  assert sampler.cache.state.cache.k_NxSxTxKxD.dtype == jnp.bfloat16
  f32 = Sampler(make_engine(CFG, _mesh(), max_slots=2, max_len=32, steps_per_call=4), params, seed=0)
  for s in (sampler, f32):
    s.submit([3, 4, 5], group_id=0, max_tokens=8, ignore_eos=True)
  out = {}
  for name, s in (("bf16", sampler), ("f32", f32)):
    while s.num_active or s.num_waiting:
      out.setdefault(name, []).extend(s.step())
  lp16, lp32 = out["bf16"][0].logprobs, out["f32"][0].logprobs
  assert len(lp16) == len(lp32) == 8 and np.all(np.isfinite(lp16))
  np.testing.assert_allclose(lp16[0], lp32[0], atol=0.1)  # same prompt, same first distribution, bf16 rounding


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_dispatches_no_call_past_the_token_budgets(overlap):
  engine = make_engine(CFG, _mesh(), max_slots=2, max_len=32, steps_per_call=4)
  sampler = Sampler(engine, _params(), seed=0, overlap=overlap)
  sampler.submit([3, 4, 5], group_id=0, n=2, max_tokens=8, ignore_eos=True)
  rollouts = []
  while sampler.num_active or sampler.num_waiting:
    rollouts += sampler.step()
  assert [len(r.completion_tokens) for r in rollouts] == [8, 8]
  assert sampler.stats.decode_calls == 2  # 8 tokens = 2 calls of 4, with or without overlap
