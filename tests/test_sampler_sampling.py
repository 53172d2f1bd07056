"""Sampling filters: the support and the log-probabilities of the distribution tokens are drawn from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.learner.logprobs import token_logprobs
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import filtered_logprobs, sample, sampling_logprobs

filtered_logprobs = jax.jit(filtered_logprobs)
sample = jax.jit(sample)


def _rows(n, v, seed=0):
  return jax.random.normal(jax.random.key(seed), (n, v)) * 3.0


def _lp(logits, sp: SamplingParams):
  n = logits.shape[0]
  return np.asarray(filtered_logprobs(logits, jnp.full((n,), sp.temperature), jnp.full((n,), sp.top_k, jnp.int32),
                                      jnp.full((n,), sp.top_p), jnp.full((n,), sp.greedy)))


def _reference(logits_v, sp: SamplingParams):
  """numpy: scale, keep the k largest, then the smallest most-likely set with mass >= top_p."""
  x = np.asarray(logits_v, np.float64) / sp.temperature
  order = np.argsort(-x)
  k = sp.top_k if 0 < sp.top_k < len(x) else len(x)
  kept = order[:k]
  p = np.exp(x[kept] - x[kept].max())
  p /= p.sum()
  if sp.top_p < 1:
    kept = kept[: int(np.searchsorted(np.cumsum(p), sp.top_p) + 1)]
  out = np.full(len(x), -np.inf)
  out[kept] = x[kept] - np.log(np.exp(x[kept] - x[kept].max()).sum()) - x[kept].max()
  return out


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_k=5),
                                SamplingParams(top_p=0.6), SamplingParams(temperature=1.3, top_k=7, top_p=0.8),
                                SamplingParams(top_k=1)])
def test_filtered_logprobs_match_numpy_reference(sp):
  logits = _rows(6, 40)
  got = _lp(logits, sp)
  for row, ref in zip(got, (_reference(l, sp) for l in logits), strict=True):
    np.testing.assert_array_equal(np.isfinite(row), np.isfinite(ref))
    np.testing.assert_allclose(row[np.isfinite(row)], ref[np.isfinite(ref)], atol=1e-5)
    np.testing.assert_allclose(np.exp(row).sum(), 1.0, atol=1e-5)


def test_top_k_support_size_and_no_filter_is_log_softmax():
  logits = _rows(4, 50)
  assert (np.isfinite(_lp(logits, SamplingParams(top_k=9))).sum(-1) == 9).all()
  np.testing.assert_allclose(_lp(logits, SamplingParams(temperature=0.5)), jax.nn.log_softmax(logits / 0.5), atol=1e-6)


def test_top_p_one_keeps_the_far_tail():
  logits = jnp.array([[60.0, 0.0, -30.0, -60.0]])  # cumulative mass reaches 1.0 in float32 after the first token
  assert np.isfinite(_lp(logits, SamplingParams(top_p=1.0))).all()
  assert np.isfinite(_lp(logits, SamplingParams(top_p=0.999))).sum() == 1


def test_greedy_is_a_point_mass_on_the_argmax():
  logits = _rows(3, 20)
  lp = _lp(logits, SamplingParams(greedy=True, temperature=0.0))
  np.testing.assert_array_equal(np.argmax(lp, -1), np.argmax(logits, -1))
  assert (lp.max(-1) == 0).all() and (np.isfinite(lp).sum(-1) == 1).all()


def test_rows_keep_their_own_settings():
  logits = _rows(3, 30)
  mixed = np.asarray(filtered_logprobs(logits, jnp.array([1.0, 0.5, 1.0]), jnp.array([0, 4, 0]),
                                       jnp.array([1.0, 1.0, 0.5]), jnp.array([True, False, False])))
  for i, sp in enumerate([SamplingParams(greedy=True), SamplingParams(temperature=0.5, top_k=4),
                          SamplingParams(top_p=0.5)]):
    np.testing.assert_allclose(mixed[i], _lp(logits[i : i + 1], sp)[0], atol=1e-6)


def test_samples_follow_the_filtered_distribution():
  logits = jnp.broadcast_to(jnp.array([2.0, 1.5, 1.0, 0.0, -1.0, -2.0]), (20000, 6))
  n = logits.shape[0]
  sp = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
  keys = jax.random.split(jax.random.key(3), n)
  tokens, logprobs = sample(keys, logits, jnp.full((n,), 0.8), jnp.full((n,), 4, jnp.int32), jnp.full((n,), 0.9),
                            jnp.zeros((n,), bool))
  expected = np.exp(_reference(logits[0], sp))
  freq = np.bincount(np.asarray(tokens), minlength=6) / n
  np.testing.assert_allclose(freq, expected, atol=0.015)  # ~4 standard errors
  assert freq[expected == 0].sum() == 0  # never outside the support
  np.testing.assert_allclose(logprobs, np.log(expected[np.asarray(tokens)]), atol=1e-5)


def test_draws_across_vocabulary_blocks_follow_the_distribution():
  # 300 tokens = 3 blocks of the two-level draw (the last one padded); the support spans every block, including
  # its first and last token; token 1 (probability ~4e-31) is in practice never drawn.
  support = np.array([0, 127, 128, 200, 255, 256, 299])
  weights = np.array([1.0, 2.0, 0.5, 3.0, 1.5, 1.0, 2.0])
  lp_v = np.full(300, -np.inf, np.float32)
  lp_v[support] = np.log(weights / weights.sum())
  lp_v[1] = -70.0
  n = 30000
  keys = jax.random.split(jax.random.key(5), n)
  tokens, logprobs = sample(keys, jnp.broadcast_to(jnp.asarray(lp_v), (n, 300)), jnp.ones((n,)),
                            jnp.zeros((n,), jnp.int32), jnp.ones((n,)), jnp.zeros((n,), bool))
  freq = np.bincount(np.asarray(tokens), minlength=300) / n
  np.testing.assert_allclose(freq[support], weights / weights.sum(), atol=0.012)  # ~4 standard errors
  assert freq.sum() == pytest.approx(freq[support].sum())  # nothing outside the support
  np.testing.assert_allclose(logprobs, lp_v[np.asarray(tokens)], atol=1e-6)


def test_sampling_logprobs_any_leading_shape():
  logits = _rows(6, 16).reshape(2, 3, 16)
  tokens = jnp.array([[0, 5, 9], [3, 3, 15]])
  sp = SamplingParams(temperature=0.9, top_p=0.95)
  got = jax.jit(sampling_logprobs, static_argnums=2)(logits, tokens, sp)
  assert got.shape == (2, 3)
  flat = _lp(logits.reshape(6, 16), sp)
  np.testing.assert_allclose(got.reshape(-1), flat[np.arange(6), tokens.reshape(-1)], atol=1e-6)
  with pytest.raises(ValueError, match="do not match"):
    sampling_logprobs(logits, tokens[:, :2], sp)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.7), SamplingParams(top_k=6),
                                SamplingParams(temperature=1.3, top_k=9, top_p=0.75), SamplingParams(top_p=0.5)])
def test_learner_recomputes_the_same_logprobs(sp):
  """The learner's renormalised token logprobs use the support the sampler drew from."""
  logits = _rows(2 * 7, 30, seed=5).reshape(2, 7, 30)
  tokens = jax.random.randint(jax.random.key(6), (2, 7), 0, 30)
  ours = jax.jit(sampling_logprobs, static_argnums=2)(logits[:, :-1], tokens[:, 1:], sp)
  learner, in_support, _ = jax.jit(token_logprobs, static_argnums=2)(logits, tokens, sp)
  inside = np.asarray(in_support[:, 1:])
  np.testing.assert_array_equal(inside, np.isfinite(ours))
  np.testing.assert_allclose(np.asarray(learner[:, 1:])[inside], np.asarray(ours)[inside], atol=1e-5)
