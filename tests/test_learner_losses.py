"""Advantages, logprobs, surrogates, corrections and the combined objective against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.learner import LossConfig, token_logprobs
from jaxrl.learner.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from jaxrl.learner.logprobs import support_mask
from jaxrl.learner.losses import (
    aggregation_weights,
    behavior_weights,
    gspo_surrogate,
    kl_k2,
    kl_k3,
    pg_surrogate,
    policy_objective,
    ppo_surrogate,
)
from jaxrl.rollout import SamplingParams

# Group 7 = rewards [1, 0, .5, 1], group 3 = [2, 2], group 9 = [3] alone, rows interleaved; last row is padding.
REWARDS = np.array([1.0, 2.0, 0.0, 3.0, 0.5, 2.0, 1.0, np.nan], np.float32)
GROUPS = np.array([7, 3, 7, 9, 7, 3, 7, -1], np.int32)
MASK = np.array([1, 1, 1, 1, 1, 1, 1, 0], np.float32)


def test_dr_grpo_and_grpo_advantages():
  dr, g = jax.jit(lambda *a: (dr_grpo_advantages(*a), grpo_advantages(*a, eps=1e-6)))(REWARDS, GROUPS, MASK)
  np.testing.assert_allclose(dr, [0.375, 0.0, -0.625, 0.0, -0.125, 0.0, 0.375, 0.0], atol=1e-6)
  std7 = np.sqrt((0.375**2 * 2 + 0.625**2 + 0.125**2) / 4)  # ddof=0
  np.testing.assert_allclose(g, np.array([0.375, 0, -0.625, 0, -0.125, 0, 0.375, 0]) / (std7 + 1e-6), rtol=1e-5)


def test_rloo_advantages_leave_one_out():
  a = jax.jit(rloo_advantages)(REWARDS, GROUPS, MASK)
  # r_i - mean of the others in group 7; group 3 ties give 0; a group of one has no baseline and gets 0.
  np.testing.assert_allclose(a, [1 - 1.5 / 3, 0.0, 0 - 2.5 / 3, 0.0, 0.5 - 2 / 3, 0.0, 1 - 1.5 / 3, 0.0], atol=1e-6)


def test_reinforce_advantages_batch_baseline():
  a = np.asarray(jax.jit(reinforce_advantages)(REWARDS, MASK))
  np.testing.assert_allclose(a[:7], REWARDS[:7] - 9.5 / 7, rtol=1e-6)
  assert a[7] == 0.0


def test_advantages_ignore_padding_nan_and_dispatch():
  kinds, epsilons = ("grpo", "dr_grpo", "rloo", "reinforce"), (1e-6, 1.0)
  pair = np.array([0.0, 1.0], np.float32)
  bad = REWARDS.copy()
  bad[1] = np.nan

  @jax.jit
  def advantages(rewards, groups, mask, pair, bad):  # one program for every call below
    return ([compute_advantages(rewards, groups, mask, LossConfig(advantage=kind)) for kind in kinds],
            [compute_advantages(pair, jnp.zeros(2, jnp.int32), jnp.ones(2), LossConfig(adv_eps=eps))
             for eps in epsilons],
            dr_grpo_advantages(bad, groups, mask))

  by_kind, by_eps, poisoned = jax.device_get(advantages(REWARDS, GROUPS, MASK, pair, bad))
  for kind, adv in zip(kinds, by_kind, strict=True):
    assert np.isfinite(adv).all(), kind
  # GRPO's adv_eps reaches the std division: rewards 0, 1 have std 0.5, so +-0.5 / (0.5 + eps).
  for eps, adv in zip(epsilons, by_eps, strict=True):
    np.testing.assert_allclose(adv, [-0.5 / (0.5 + eps), 0.5 / (0.5 + eps)], rtol=1e-6)
  # A NaN reward of a valid sample poisons only its own group (the step then skips the update).
  assert np.isnan(poisoned[[1, 5]]).all() and np.isfinite(np.delete(poisoned, [1, 5])).all()


def test_aggregation_weights():
  loss_mask = np.array([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]], np.float32)
  sample_mask = np.array([1, 1, 0], np.float32)  # row 2 is padding despite its loss mask
  tok, seq, norm, norm10 = jax.jit(lambda *a: [aggregation_weights(*a, *kind) for kind in (
      ("token_mean",), ("seq_mean",), ("seq_sum_norm",), ("seq_sum_norm", 10))])(loss_mask, sample_mask)
  np.testing.assert_allclose(tok, [[0, 1 / 3, 1 / 3, 0], [0, 1 / 3, 0, 0], [0, 0, 0, 0]], rtol=1e-6)
  np.testing.assert_allclose(seq, [[0, 0.25, 0.25, 0], [0, 0.5, 0, 0], [0, 0, 0, 0]], rtol=1e-6)
  # seq_sum_norm: norm_length 0 -> L = 4
  np.testing.assert_allclose(norm, loss_mask * sample_mask[:, None] / 8, rtol=1e-6)
  np.testing.assert_allclose(norm10, loss_mask * sample_mask[:, None] / 20, rtol=1e-6)


def _value_and_grad(f, x, *args):
  return jax.jit(jax.value_and_grad(lambda x: f(x, *args).sum()))(jnp.asarray(x, jnp.float32))


def test_ppo_surrogate_values_gradients_and_clip_flags():
  u = np.array([1.5, 0.5, 0.5, 1.5, 1.1], np.float32)
  adv = np.array([1.0, 1.0, -1.0, -1.0, 2.0], np.float32)
  surrogate = lambda lr: ppo_surrogate(lr, adv, 0.2, 0.28)
  # One program: the values at numpy's log u, the gradient at jnp.log(u)
  values_and_grad = jax.jit(lambda lr, u: (surrogate(lr), jax.grad(lambda x: surrogate(x)[0].sum())(jnp.log(u))))
  (loss, low, high), grad = jax.device_get(values_and_grad(np.log(u), u))
  np.testing.assert_allclose(loss, [-1.28, -0.5, 0.8, 1.5, -2.2], rtol=1e-6)
  assert low.tolist() == [False, False, True, False, False]
  assert high.tolist() == [True, False, False, False, False]
  # d loss / d log u = -u A where the unclipped branch is the minimum, else 0.
  np.testing.assert_allclose(grad, [0.0, -0.5, 0.0, 1.5, -2.2], rtol=1e-6)


def test_pg_surrogate_value_and_gradient():
  value, grad = _value_and_grad(pg_surrogate, np.log([2.0, 0.5]), np.array([1.0, -3.0], np.float32))
  np.testing.assert_allclose(value, -2.0 + 1.5, rtol=1e-6)
  np.testing.assert_allclose(grad, [-2.0, 1.5], rtol=1e-6)


def test_gspo_sequence_ratio():
  log_ratio = np.array([[0.1, 0.3], [0.5, 9.0]], np.float32)
  mask = np.array([[1, 1], [1, 0]], bool)  # row 1's second entry is not a token
  adv = np.ones((2, 2), np.float32)
  surrogate = lambda lr: gspo_surrogate(lr, adv, mask, 0.2, 0.28)
  (loss, _, high), grad = jax.jit(lambda lr: (surrogate(lr), jax.grad(lambda x: surrogate(x)[0][:, 0].sum())(lr)))(
      log_ratio)
  np.testing.assert_allclose(loss, [[-np.exp(0.2)] * 2, [-1.28] * 2], rtol=1e-6)
  assert high.tolist() == [[False, False], [True, True]]
  np.testing.assert_allclose(grad, [[-np.exp(0.2) / 2] * 2, [0.0, 0.0]], rtol=1e-6)


def test_behavior_weights_token_and_sequence():
  prox = np.log(np.array([[3.0, 0.5, 1.5]], np.float32))
  behavior = np.zeros((1, 3), np.float32)
  mask = np.array([[True, True, True]])
  cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0, is_mask_low=0.6)
  seq = cfg.replace(is_level="sequence", is_cap=None, is_mask_low=None, is_mask_high=2.0)
  short = np.array([[True, True, False]])
  by_token, by_short_seq, by_seq = jax.jit(lambda *a: (behavior_weights(*a, mask, cfg), behavior_weights(
      *a, short, seq), behavior_weights(*a, mask, seq)))(prox, behavior)  # one program for the three
  w, keep, trunc, cap = by_token
  assert cap == 2.0
  np.testing.assert_allclose(w, [[2.0, 0.5, 1.5]], rtol=1e-6)
  assert keep.tolist() == [[True, False, True]] and trunc.tolist() == [[True, False, False]]
  w, keep, _, _ = by_short_seq
  np.testing.assert_allclose(w, [[1.5, 1.5, 1.5]], rtol=1e-6)  # 3 * 0.5; the third entry is not a token
  assert keep.all()
  w, keep, _, _ = by_seq  # 3 * .5 * 1.5 = 2.25 > 2: the sample is dropped
  np.testing.assert_allclose(w, [[2.25] * 3], rtol=1e-6)
  assert not keep.any()


def test_kl_estimators():
  logp = np.array([-1.0, -0.5], np.float32)
  ref = np.array([-2.0, -0.5], np.float32)
  k2, k3, grad = jax.jit(lambda x: (kl_k2(x, ref), kl_k3(x, ref), jax.grad(lambda y: kl_k2(y, ref).sum())(x)))(logp)
  np.testing.assert_allclose(k2, [0.5, 0.0])
  np.testing.assert_allclose(k3, [np.exp(-1.0), 0.0], rtol=1e-6)
  # k2 gradient wrt logp: log pi - log ref.
  np.testing.assert_allclose(grad, [1.0, 0.0], rtol=1e-6)


def _np_support(x, top_k, top_p):
  """Reference support rule, one distribution at a time, with an explicit loop over the sorted tokens."""
  order = np.argsort(-x, kind="stable")
  kept = order[:top_k] if top_k else order
  p = np.exp(x[kept] - x[kept].max())
  p /= p.sum()
  keep, before = [], 0.0
  for tok, prob in zip(kept, p, strict=True):
    if before >= top_p:
      break
    keep.append(tok)
    before += prob
  return np.isin(np.arange(len(x)), keep)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.6)])
def test_token_logprobs_under_sampling_support(top_k, top_p):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 5, 9)).astype(np.float32) * 2
  tokens = rng.integers(0, 9, size=(2, 5)).astype(np.int32)
  sampling = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)

  @jax.jit
  def scored(logits, scaled):  # one program: the scores, the support, and the two gradients checked below
    score = lambda z: token_logprobs(z, tokens, sampling)
    return (*score(logits), support_mask(scaled, top_k, top_p), jax.grad(lambda z: score(z)[0][0, 1])(logits),
            jax.grad(lambda z: score(z)[2].sum())(logits))

  logp, in_support, entropy, masks, grad, entropy_grad = jax.device_get(scored(logits, logits / 0.7))
  assert logp[:, 0].tolist() == [0, 0] and in_support[:, 0].all()
  for b in range(2):
    for t in range(1, 5):
      x = logits[b, t - 1] / 0.7
      s = _np_support(x, top_k, top_p)
      np.testing.assert_array_equal(masks[b, t - 1], s)
      p = np.where(s, np.exp(x - x.max()), 0.0)
      p /= p.sum()
      assert bool(in_support[b, t]) == s[tokens[b, t]]
      if s[tokens[b, t]]:
        np.testing.assert_allclose(logp[b, t], np.log(p[tokens[b, t]]), rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(entropy[b, t], -np.sum(p[s] * np.log(p[s])), rtol=1e-5, atol=1e-6)
  # Gradient of a renormalised logprob: (onehot(y) - p * support) / T, zero off the support.
  x = logits[0, 0] / 0.7
  s = _np_support(x, top_k, top_p)
  p = np.where(s, np.exp(x - x.max()), 0.0)
  p /= p.sum()
  np.testing.assert_allclose(grad[0, 0], (np.eye(9)[tokens[0, 1]] - p) / 0.7, atol=1e-6)
  assert np.isfinite(entropy_grad).all()


def test_policy_objective_decoupled_ppo_with_tis_kl_entropy():
  """The full objective against a term-by-term reference, values and gradient wrt the current logprobs."""
  cfg = LossConfig(policy_loss="ppo", proximal="recompute", is_level="token", is_cap=1.5, clip_low=0.2,
                   clip_high=0.3, kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01)
  logp = np.array([[0.0, -1.0, -0.5, -2.0]], np.float32)
  prox = np.array([[0.0, -1.5, -0.5, -1.0]], np.float32)
  behavior = np.array([[0.0, -2.0, -0.4, np.nan]], np.float32)  # the NaN entry is not a token
  ref = np.array([[0.0, -1.2, -0.3, -3.0]], np.float32)
  entropy = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
  weights = np.array([[0.0, 0.5, 0.5, 0.0]], np.float32)
  adv = np.array([2.0], np.float32)

  def objective(lp):
    return policy_objective(lp, behavior, adv, weights, cfg, prox_logp_BxL=prox, ref_logp_BxL=ref,
                            entropy_BxL=jnp.asarray(entropy))

  (loss, stats), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(jnp.asarray(logp))
  # Token 1: u = e^0.5 = 1.6487 > 1.3 (clipped, A > 0): surrogate -1.3 * 2, no gradient; w = min(e^0.5, 1.5).
  # Token 2: u = 1, surrogate -2 (gradient -2); w = e^-0.1.
  w1, w2 = 1.5, np.exp(-0.1)
  policy = 0.5 * (w1 * -2.6) + 0.5 * (w2 * -2.0)
  # KL: k2 = 0.5 (logp - ref)^2 weighted by pi / mu, not truncated (the IS cap is the policy term's): e^1 on
  # token 1, e^-0.1 on token 2.
  kw1, kw2 = np.exp(1.0), np.exp(-0.1)
  kl = 0.1 * 0.5 * (kw1 * 0.5 * 0.2**2 + kw2 * 0.5 * 0.2**2)
  ent = -0.01 * 0.5 * (1.0 + 2.0)
  np.testing.assert_allclose(loss, policy + kl + ent, rtol=1e-6)
  np.testing.assert_allclose(stats["loss/policy"], policy, rtol=1e-6)
  # d k2 / d logp = logp - ref: 0.2 on token 1, -0.2 on token 2.
  np.testing.assert_allclose(grad, [[0.0, 0.1 * 0.5 * kw1 * 0.2, 0.5 * w2 * -2.0 + 0.1 * 0.5 * kw2 * -0.2, 0.0]],
                             rtol=1e-5)
  assert stats["tokens"] == 2 and stats["clip_high"] == 1 and stats["is_truncated"] == 1
  np.testing.assert_allclose(stats["ratio_sum"], np.exp(1.0) + np.exp(-0.1), rtol=1e-6)  # pi / mu
  np.testing.assert_allclose(stats["ratio_max"], np.exp(1.0), rtol=1e-6)


def test_policy_objective_uncorrected_and_masked_is():
  logp = np.array([[0.0, -1.0, -1.0]], np.float32)
  behavior = np.array([[0.0, -3.0, -1.0]], np.float32)  # token 1: w = e^2 = 7.4
  weights = np.array([[0.0, 0.5, 0.5]], np.float32)
  adv = np.array([1.0], np.float32)
  base = LossConfig(policy_loss="pg", proximal="recompute", is_level="none", is_cap=None)
  masked = base.replace(is_level="token", is_mask_high=5.0)
  grad = lambda c: jax.grad(lambda lp: policy_objective(lp, behavior, adv, weights, c, prox_logp_BxL=lp)[0])
  plain, dropped = jax.jit(lambda lp: (grad(base)(lp), grad(masked)(lp)))(jnp.asarray(logp))  # one program
  np.testing.assert_allclose(plain, [[0.0, -0.5, -0.5]])  # behavior ignored: plain on-policy REINFORCE
  np.testing.assert_allclose(dropped, [[0.0, 0.0, -0.5]])  # token 1 dropped, its weight still in the denominator


@pytest.mark.parametrize("bad", [
    dict(advantage="ppo"), dict(proximal="behavior"), dict(is_level="none"), dict(proximal="recompute", is_level="x"),
    dict(clip_low=1.0), dict(sampling=SamplingParams(greedy=True)), dict(kl_coef=-1.0),
    dict(proximal="recompute", is_level="token", is_mask_low=2.0, is_mask_high=1.0),
])
def test_loss_config_rejects_bad_combinations(bad):
  with pytest.raises(ValueError):
    LossConfig(**bad)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (5, 1.0), (6, 0.5), (1, 0.9)])
def test_renormalised_logprobs_match_the_sampler(top_k, top_p):
  """The learner scores tokens under exactly the support and distribution the sampler draws from (ties too)."""
  from jaxrl.sampler import sampling_logprobs

  rng = np.random.default_rng(2)
  logits = np.round(rng.normal(size=(3, 7, 12)) * 2).astype(np.float32)  # integer logits: many ties
  tokens = rng.integers(0, 12, size=(3, 7)).astype(np.int32)
  params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
  # One program for both sides
  ours, in_support, theirs = jax.jit(lambda x, y: (*token_logprobs(x, y, params)[:2],
                                                   sampling_logprobs(x[:, :-1], y[:, 1:], params)))(logits, tokens)
  theirs = np.asarray(theirs)
  np.testing.assert_array_equal(in_support[:, 1:], np.isfinite(theirs))
  np.testing.assert_allclose(np.where(in_support[:, 1:], ours[:, 1:], 0.0), np.where(np.isfinite(theirs), theirs, 0.0),
                             rtol=1e-5, atol=1e-6)


def test_log_ratio_clamp_bounds_the_ratio():
  """A log-ratio of 100 would overflow exp: it is clamped to +-log_ratio_clamp first (loss -e^c A, finite)."""
  logp = np.array([[0.0, 100.0]], np.float32)
  prox = np.zeros((1, 2), np.float32)
  weights = np.array([[0.0, 1.0]], np.float32)
  clamps = (20.0, 5.0)
  cfgs = [LossConfig(policy_loss="pg", proximal="recompute", log_ratio_clamp=clamp) for clamp in clamps]
  losses = jax.jit(lambda lp: [policy_objective(lp, prox, np.ones(1, np.float32), weights, cfg, prox_logp_BxL=prox)[0]
                               for cfg in cfgs])(logp)  # one program for both
  for clamp, loss in zip(clamps, losses, strict=True):
    np.testing.assert_allclose(loss, -np.exp(clamp), rtol=1e-6)
