"""Off-policy corrections against hand-computed values: the KL term's gradient, dual clip, GSPO per-sequence
averaging, length-normalised sequence IS, the ESS-driven cap, KL in the reward, and decoupled PPO's exact update
over two mini-batches on stale bandit data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.learner import (
    LossConfig,
    aggregation_weights,
    behavior_weights,
    ess_cap,
    ess_fraction,
    init_train_state,
    make_train_step,
    policy_objective,
    ppo_surrogate,
    token_logprobs,
)
from jaxrl.rollout import Rollout, make_batch

V = 6


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def test_k2_gradient_is_the_reverse_kl_gradient_under_stale_samples():
  """Exact expectation over every token y ~ mu: the k2 term weighted by pi/mu has the gradient of KL(pi || ref)."""
  rng = np.random.default_rng(0)
  theta, theta_ref, theta_mu = (rng.normal(size=V).astype(np.float32) for _ in range(3))
  log_mu = np.log(_softmax(theta_mu)).astype(np.float32)
  log_ref = np.log(_softmax(theta_ref)).astype(np.float32)
  # Row y scores token y (entry 1; entry 0 is never a target); its weight is mu(y): the expectation under mu.
  weights = np.stack([np.zeros(V), np.exp(log_mu)], 1).astype(np.float32)
  col = lambda x: jnp.stack([jnp.zeros(V), jnp.asarray(x, jnp.float32)], 1)
  cfg = LossConfig(policy_loss="pg", kl_coef=1.0, kl_estimator="k2")

  def loss(t):
    logp = col(jax.nn.log_softmax(t))
    return policy_objective(logp, col(log_mu), jnp.zeros(V), weights, cfg, ref_logp_BxL=col(log_ref))[0]

  def reverse_kl(t):
    logp = jax.nn.log_softmax(t)
    return jnp.sum(jnp.exp(logp) * (logp - log_ref))

  got, want = jax.grad(loss)(jnp.asarray(theta)), jax.grad(reverse_kl)(jnp.asarray(theta))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Without the pi/mu weight the same samples follow another gradient: the weight is what makes it right.
  unweighted = jax.grad(lambda t: jnp.sum(weights[:, 1] * 0.5 * (jax.nn.log_softmax(t) - log_ref) ** 2))(theta)
  assert np.abs(np.asarray(unweighted) - np.asarray(want)).max() > 1e-2


def test_dual_clip_values_gradients_and_flags():
  u = np.array([4.0, 2.0, 4.0, 0.5], np.float32)
  adv = np.array([-1.0, -1.0, 1.0, -2.0], np.float32)
  loss, low, high, dual = ppo_surrogate(np.log(u), adv, 0.2, 0.28, dual_clip=3.0)
  # u=4, A=-1: PPO gives 4, the dual clip holds it at 3; u=2: 2 (under 3); A>0 above the band: -1.28;
  # u=0.5, A=-2: below the band, clipped to 0.8 * 2 = 1.6.
  np.testing.assert_allclose(loss, [3.0, 2.0, -1.28, 1.6], rtol=1e-6)
  assert dual.tolist() == [True, False, False, False]
  assert high.tolist() == [False, False, True, False] and low.tolist() == [False, False, False, True]
  grad = jax.grad(lambda lr: ppo_surrogate(lr, adv, 0.2, 0.28, 3.0)[0].sum())(jnp.log(u))
  np.testing.assert_allclose(grad, [0.0, 2.0, 0.0, 0.0], rtol=1e-6)  # -u A where unclipped
  with pytest.raises(ValueError, match="dual_clip"):
    LossConfig(dual_clip=1.1)


def test_gspo_averages_over_sequences_not_tokens():
  """Two samples of 3 and 1 tokens: the loss is the plain mean of the two sequence losses."""
  logp = np.array([[0.0, 0.1, 0.3, -0.1], [0.0, 0.5, 0.0, 0.0]], np.float32)
  prox = np.zeros((2, 4), np.float32)
  mask = np.array([[0, 1, 1, 1], [0, 1, 0, 0]], np.float32)
  adv = np.array([1.0, -1.0], np.float32)
  cfg = LossConfig(policy_loss="gspo", aggregation="seq_mean", proximal="recompute", clip_low=0.2, clip_high=0.28)
  weights = aggregation_weights(mask, np.ones(2), "seq_mean")
  loss, stats = policy_objective(logp, prox, adv, weights, cfg, prox_logp_BxL=prox)
  s0, s1 = np.exp(0.3 / 3), np.exp(0.5)  # sequence ratios: geometric means of the token ratios
  want = 0.5 * (-s0 * 1.0) + 0.5 * (-min(-s1, -1.28))  # sample 1: A < 0, u above the band: unclipped branch
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  grad = jax.grad(lambda lp: policy_objective(lp, prox, adv, weights, cfg, prox_logp_BxL=prox)[0])(logp)
  # d/d logp_t of 0.5 * -s0 = 0.5 * -s0 / 3 on each of sample 0's tokens; sample 1: 0.5 * s1 on its token.
  np.testing.assert_allclose(grad, [[0, -s0 / 6, -s0 / 6, -s0 / 6], [0, 0.5 * s1, 0, 0]], rtol=1e-5)
  with pytest.raises(ValueError, match="seq_mean"):
    LossConfig(policy_loss="gspo")


def test_length_normalised_sequence_weights():
  prox = np.log(np.array([[3.0, 0.5, 1.5, 9.0]], np.float32))
  mask = np.array([[True, True, True, False]])
  cfg = LossConfig(proximal="recompute", is_level="sequence_mean")
  w, keep, trunc, cap = behavior_weights(prox, np.zeros((1, 4), np.float32), mask, cfg)
  np.testing.assert_allclose(w, [[2.25 ** (1 / 3)] * 4], rtol=1e-6)  # (3 * 0.5 * 1.5)^(1/3); entry 3 ignored
  assert keep.all() and not trunc.any() and cap == np.inf


def test_ess_cap_reaches_the_target_and_is_applied():
  w = np.array([[1.0, 1.0, 1.0, 10.0]], np.float32)
  valid = np.ones((1, 4), bool)
  # ESS(c) = (3 + c)^2 / (4 (3 + c^2)) = 0.8  <=>  2.2 c^2 - 6 c + 0.6 = 0: c = (6 + sqrt(36 - 5.28)) / 4.4.
  c = (6 + np.sqrt(36 - 5.28)) / 4.4
  np.testing.assert_allclose(ess_cap(w, valid, 0.8, 20.0), c, rtol=1e-5)
  np.testing.assert_allclose(ess_fraction(np.minimum(w, c), valid), 0.8, rtol=1e-5)
  np.testing.assert_allclose(ess_cap(w, valid, 0.2, 20.0), np.exp(20.0), rtol=1e-5)  # already above: no cap
  np.testing.assert_allclose(ess_cap(np.array([[0.1, 1.0]]), np.ones((1, 2), bool), 0.99, 20.0), 1.0)  # floor 1
  # Through the objective: the cap is the smaller of is_cap and the ESS cap, and the applied ESS is logged.
  logp = np.zeros((1, 5), np.float32)
  behavior = np.concatenate([[[0.0]], -np.log(w)], 1).astype(np.float32)
  weights = np.array([[0, 0.25, 0.25, 0.25, 0.25]], np.float32)
  cfg = LossConfig(policy_loss="pg", proximal="recompute", is_level="token", is_ess_min=0.8, is_cap=5.0)
  _, stats = policy_objective(logp, behavior, np.ones(1), weights, cfg, prox_logp_BxL=logp)
  np.testing.assert_allclose(stats["is_cap_min"], c, rtol=1e-5)
  np.testing.assert_allclose(stats["w_sum"] ** 2 / (4 * stats["w_sq_sum"]), 0.8, rtol=1e-5)
  assert stats["is_truncated"] == 1


def _bandit_batch(tokens, log_mu, rewards, version):
  rs = [Rollout(np.array([0], np.int32), np.array([y], np.int32), np.array([lp], np.float32),
                np.array([version], np.int32), "length", group_id=0, sample_index=i, reward=float(r))
        for i, (y, lp, r) in enumerate(zip(tokens, log_mu, rewards, strict=True))]
  return make_batch(rs, len(rs), 2)


def _bigram(params, tokens, positions, segments):
  return params["w"][tokens]


def test_decoupled_ppo_two_minibatches_on_stale_data_is_the_exact_update():
  """A one-token bandit, stale mu, two SGD mini-batch updates: the update equals a numpy reference of decoupled
  PPO (ratio against the pre-step policy, clip, dual clip, weights min(prox / mu, 2)); anchoring at mu, or
  swapping prox and mu, gives another update."""
  rng = np.random.default_rng(3)
  w0 = rng.normal(size=(V, V)).astype(np.float32)
  mu = _softmax(w0[0] + rng.normal(size=V) * 1.5)  # a stale behaviour policy
  tokens = np.array([0, 1, 2, 0, 3, 1, 4, 0])
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
  batch = _bandit_batch(tokens, np.log(mu[tokens]), rewards, version=3)
  lr, b, m = 4.0, len(tokens), 2
  cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0, dual_clip=3.0)
  step = make_train_step(_bigram, optax.sgd(lr), cfg, batch_size=b, seq_len=2, num_minibatches=m)
  key = jax.random.key(5)
  state, metrics = step(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr), version=5), batch, key)

  # Reference. Mini-batch j holds the permuted rows r*M + j (make_train_step's split with one micro-batch).
  order = np.asarray(jax.random.permutation(key, b))
  adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
  prox = np.log(_softmax(w0[0].astype(np.float64)))
  theta = w0[0].astype(np.float64)
  clipped = 0
  for j in range(m):
    pi = _softmax(theta)
    grad = np.zeros(V)
    for i in order[j::m]:
      y, a = tokens[i], adv[i]
      u = pi[y] / np.exp(prox[y])
      w = min(np.exp(prox[y]) / mu[y], 2.0)
      live = not ((a > 0 and u > 1.28) or (a < 0 and u < 0.8) or (a < 0 and u > 3.0))
      clipped += not live
      # d(-u A)/d theta = -u A (onehot(y) - pi); token-mean weight 1 / (rows of the mini-batch)
      grad += live * w * (-u * a) * (np.eye(V)[y] - pi) / (b // m)
    theta = theta - lr * grad
  want = w0.astype(np.float64)
  want[0] = theta
  np.testing.assert_allclose(state.params["w"], want, rtol=1e-5, atol=1e-5)
  assert clipped > 0 and metrics["clip_frac_low"] + metrics["clip_frac_high"] == clipped / b  # the clip acts
  assert int(state.version) == 6 and metrics["updates_applied"] == 2

  # The same data anchored at mu (plain PPO on the behaviour policy) moves elsewhere.
  for other in (LossConfig(dual_clip=3.0), None):
    if other is None:  # prox and mu swapped: the batch carries prox as its behaviour logprobs
      swapped = batch.replace(behavior_logprobs_BxL=np.where(batch.loss_mask_BxL > 0, prox[batch.tokens_BxL], 0.0)
                              .astype(np.float32))
      run = make_train_step(_bigram, optax.sgd(lr), cfg, batch_size=b, seq_len=2, num_minibatches=m)
      out, _ = run(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr), version=5), swapped, key)
    else:
      run = make_train_step(_bigram, optax.sgd(lr), other, batch_size=b, seq_len=2, num_minibatches=m)
      out, _ = run(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr), version=5), batch, key)
    assert np.abs(np.asarray(out.params["w"]) - want).max() > 1e-2


def test_k1_in_the_reward_equals_training_on_shaped_rewards():
  """kl_estimator="k1_reward": the step equals a step without KL on rewards r_i - beta sum_t (log mu - log ref)."""
  rng = np.random.default_rng(4)
  w0, w_ref = (rng.normal(size=(V, V)).astype(np.float32) for _ in range(2))
  tokens = np.array([0, 1, 2, 3, 4, 5])
  log_mu = np.log(_softmax(w0[0])[tokens])
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
  batch = _bandit_batch(tokens, log_mu, rewards, version=0)
  beta, b = 0.3, len(tokens)
  cfg = LossConfig(proximal="recompute", is_level="token", kl_coef=beta, kl_estimator="k1_reward")
  step = make_train_step(_bigram, optax.sgd(1.0), cfg, batch_size=b, seq_len=2)
  state = init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0), ref_params={"w": jnp.asarray(w_ref)})
  out, metrics = step(state, batch, jax.random.key(0))
  log_ref = np.asarray(token_logprobs(w_ref[batch.tokens_BxL], batch.tokens_BxL)[0])[:, 1]
  kl = log_mu - log_ref
  np.testing.assert_allclose(metrics["kl_reward_mean"], kl.mean(), rtol=1e-5)
  assert metrics["loss/kl"] == 0  # no KL loss term: it is in the reward
  shaped = _bandit_batch(tokens, log_mu, rewards - beta * kl, version=0)
  plain = make_train_step(_bigram, optax.sgd(1.0), cfg.replace(kl_coef=0.0), batch_size=b, seq_len=2)
  want, _ = plain(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0)), shaped, jax.random.key(0))
  np.testing.assert_allclose(out.params["w"], want.params["w"], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(want.params["w"]) - np.asarray(
      plain(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0)), batch, jax.random.key(0))[0].params["w"])
  ).max() > 1e-3  # the shaping changed the update
