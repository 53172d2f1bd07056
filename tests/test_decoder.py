"""Decoder: cached decoding equals the full forward; packing; dtypes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Decoder, ModelConfig, forward, forward_cached, init_cache

VARIANTS = {
    "llama": dict(),
    "qwen2": dict(attention_bias=True, tie_embeddings=True, architecture="qwen2"),
    "qwen3": dict(qk_norm=True, head_dim=16, architecture="qwen3"),
    "llama3_rope": dict(rope_type="llama3", rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                          ("low_freq_factor", 1.0),
                                                          ("original_max_position_embeddings", 16.0))),
}
T = 7  # sequence length of the default model's _full batches: one compiled forward (and gradient) for its tests


@jax.jit  # one program per params tree, not a few eager ops per leaf shape
def _perturb(params):
  return jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), params)


@functools.cache  # one build per config: the tests only read the params
def _model(**kw):
  cfg = ModelConfig.tiny(**kw)
  graphdef, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  # Perturb norms and biases away from their init so that every parameter matters.
  return cfg, graphdef, _perturb(params)


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, params, tokens):
  b, l = tokens.shape
  return forward(graphdef, params, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)), jnp.ones((b, l), jnp.int32))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decode_equals_full_forward(variant):
  cfg, graphdef, params = _model(**VARIANTS[variant])
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, cfg.vocab_size)
  full = _full(graphdef, params, tokens)
  cache = init_cache(cfg, 2, 16)
  step = jax.jit(forward_cached, static_argnums=0)
  pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
  logits, cache = step(graphdef, params, tokens[:, :5], pos[:, :5], cache)  # prefill 5, then one at a time
  outs = [logits]
  for t in range(5, 11):
    logits, cache = step(graphdef, params, tokens[:, t : t + 1], pos[:, t : t + 1], cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)


def _rows(*rows):
  """Sequences as one [2, T] batch, padded with token 0 after their ends: the causal forward of a row at position t
  reads its positions <= t alone, so every test of the default model runs the one _full program of that shape."""
  return jnp.stack([jnp.pad(r[0], (0, T - r.shape[1])) for r in rows])


def test_cached_rows_at_different_positions():
  """Continuous batching: each row of the cache decodes at its own position."""
  cfg, graphdef, params = _model()
  a = jax.random.randint(jax.random.key(2), (1, 7), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(3), (1, 4), 0, cfg.vocab_size)
  full = _full(graphdef, params, _rows(a, b))
  cache = init_cache(cfg, 2, 8)
  # Row 0 holds a[:6], row 1 holds b[:3]; then decode one token each at positions 6 and 3.
  tok = jnp.zeros((2, 6), jnp.int32).at[0].set(a[0, :6]).at[1, :3].set(b[0, :3])
  pos = jnp.stack([jnp.arange(6), jnp.arange(6)])
  step = jax.jit(forward_cached, static_argnums=0)  # two programs, not one per eager op
  _, cache = step(graphdef, params, tok, pos, cache)
  logits, _ = step(graphdef, params, jnp.array([[a[0, 6]], [b[0, 3]]]), jnp.array([[6], [3]]), cache)
  np.testing.assert_allclose(logits[0, 0], full[0, 6], atol=1e-5)
  np.testing.assert_allclose(logits[1, 0], full[1, 3], atol=1e-5)


def test_packed_segments_equal_separate_sequences():
  cfg, graphdef, params = _model()
  a = jax.random.randint(jax.random.key(4), (1, 5), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(5), (1, 4), 0, cfg.vocab_size)
  tokens = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], 1)
  positions = jnp.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]])
  segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0]])
  packed = forward(graphdef, params, tokens, positions, segments)
  full = _full(graphdef, params, _rows(a, b))
  np.testing.assert_allclose(packed[0, :5], full[0, :5], atol=1e-5)
  np.testing.assert_allclose(packed[0, 5:9], full[1, :4], atol=1e-5)
  assert np.isfinite(np.asarray(packed)).all()  # fully masked padding rows stay finite


def test_bfloat16_compute_is_close_to_float32():
  cfg, graphdef, params = _model()
  tokens = jax.random.randint(jax.random.key(6), (2, T), 0, cfg.vocab_size)
  ref = _full(graphdef, params, tokens)
  graphdef_bf16, _ = nnx.split(Decoder(cfg.replace(dtype="bfloat16"), nnx.Rngs(0)))
  out = _full(graphdef_bf16, params, tokens)
  assert out.dtype == jnp.float32
  err = float(jnp.max(jnp.abs(out - ref)))
  assert 0 < err < 0.1 * float(jnp.max(jnp.abs(ref)))  # it ran in bfloat16, and stayed close


def test_remat_gives_same_gradients():
  cfg, graphdef, params = _model()
  _, graphdef_r, _ = _model(remat=True)
  tokens = jax.random.randint(jax.random.key(7), (2, T), 0, cfg.vocab_size)
  loss = lambda g, p: jnp.sum(_full(g, p, tokens) ** 2)
  g1 = jax.grad(loss, argnums=1)(graphdef, params)
  g2 = jax.grad(loss, argnums=1)(graphdef_r, params)
  for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(x))))


@pytest.mark.parametrize("unroll", [2, 8])
def test_unrolled_layer_scan_computes_the_same_logits_gradients_and_cache(unroll):
  """model.scan_unroll (2 of tiny's 2 layers, or more than it has: fully unrolled) is the same computation."""
  cfg, graphdef, params = _model()
  _, graphdef_u, _ = _model(scan_unroll=unroll)
  tokens = jax.random.randint(jax.random.key(3), (2, T), 0, cfg.vocab_size)
  loss = lambda g, p: jnp.sum(_full(g, p, tokens) ** 2)
  np.testing.assert_allclose(_full(graphdef_u, params, tokens), _full(graphdef, params, tokens), rtol=1e-5,
                             atol=1e-5)
  for x, y in zip(jax.tree.leaves(jax.grad(loss, argnums=1)(graphdef, params)),
                  jax.tree.leaves(jax.grad(loss, argnums=1)(graphdef_u, params)), strict=True):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(x))))
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  step = jax.jit(forward_cached, static_argnums=0)
  (a, ca), (b, cb) = (step(g, params, tokens, pos, init_cache(cfg, 2, 8)) for g in (graphdef, graphdef_u))
  np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(cb.k_NxSxTxKxD, ca.k_NxSxTxKxD, rtol=1e-5, atol=1e-5)


def test_full_path_requires_segment_ids():
  cfg, graphdef, params = _model()
  with pytest.raises(ValueError, match="segment_ids"):
    nnx.merge(graphdef, params)(jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32))


@pytest.mark.parametrize("bad, match", [
    (dict(num_heads=3, num_kv_heads=2), "multiple"),
    (dict(head_dim=7), "even"),
    (dict(num_layers=0), "num_layers"),
    (dict(rope_type="yarn"), "rope_type"),
    (dict(dtype="float16"), "dtype"),
    (dict(scan_unroll=0), "scan_unroll"),
])
def test_bad_config_is_rejected(bad, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig.tiny(**bad)
