"""Off-policy corrections against hand-computed values: the KL term's gradient, dual clip, GSPO per-sequence
averaging, length-normalised sequence IS, the ESS-driven cap, KL in the reward, and decoupled PPO's exact update
over two mini-batches on stale bandit data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl import config as config_lib
from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, token_logprobs
from jaxrl.learner.losses import (
  aggregation_weights,
  behavior_weights,
  dual_clip,
  ess_cap,
  ess_fraction,
  policy_objective,
  ppo_surrogate,
)
from jaxrl.learner.step import minibatch_order
from jaxrl.rollout import Rollout, make_batch

V = 6


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _stale_kl_case():
  """pi, ref and a stale mu over V tokens, with pi / mu above the default IS cap (2) on some token."""
  rng = np.random.default_rng(0)
  theta, theta_ref = (rng.normal(size=V).astype(np.float32) for _ in range(2))
  theta_mu = (theta + 1.5 * rng.normal(size=V)).astype(np.float32)
  log_mu = np.log(_softmax(theta_mu)).astype(np.float32)
  log_ref = np.log(_softmax(theta_ref)).astype(np.float32)
  assert (_softmax(theta) / np.exp(log_mu)).max() > 2.0
  return theta, log_mu, log_ref


def _kl_gradient(theta, tokens, weights, log_mu, log_ref, cfg):
  """Gradient in theta of policy_objective over rows [unused, y] (y = tokens), advantage 0: the KL term alone."""
  col = lambda x: jnp.stack([jnp.zeros(len(tokens)), jnp.asarray(x, jnp.float32)], 1)
  w = np.stack([np.zeros(len(tokens)), weights], 1).astype(np.float32)

  def loss(t):
    logp = col(jax.nn.log_softmax(t)[tokens])
    return policy_objective(logp, col(log_mu[tokens]), jnp.zeros(len(tokens)), w, cfg,
                            prox_logp_BxL=jax.lax.stop_gradient(logp), ref_logp_BxL=col(log_ref[tokens]))[0]

  return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(theta)))


def _reverse_kl_gradient(theta, log_ref):
  def reverse_kl(t):
    logp = jax.nn.log_softmax(t)
    return jnp.sum(jnp.exp(logp) * (logp - log_ref))

  return np.asarray(jax.jit(jax.grad(reverse_kl))(jnp.asarray(theta)))


# The run config's objective (decoupled PPO, token IS weights truncated at 2) with a k2 KL term.
KL_CFG = LossConfig(policy_loss="pg", proximal="recompute", is_level="token", is_cap=2.0, kl_coef=1.0,
                    kl_estimator="k2")


def test_k2_gradient_is_the_reverse_kl_gradient_under_stale_samples():
  """Exact expectation over every token y ~ mu (row y weighted mu(y)): the k2 term weighted by pi/mu has the
  gradient of KL(pi || ref), with the IS cap set and pi/mu above it on some token (the cap must not touch it)."""
  theta, log_mu, log_ref = _stale_kl_case()
  want = _reverse_kl_gradient(theta, log_ref)
  got = _kl_gradient(theta, np.arange(V), np.exp(log_mu), log_mu, log_ref, KL_CFG)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Truncating the weight at the cap, or dropping it, follows another gradient on the same samples.
  pi = _softmax(theta)
  k2 = lambda t, w: jnp.sum(np.exp(log_mu) * w * 0.5 * (jax.nn.log_softmax(t) - log_ref) ** 2)
  weights = np.stack([np.minimum(pi / np.exp(log_mu), 2.0), np.ones(V)])
  for other in np.asarray(jax.jit(jax.vmap(jax.grad(k2), (None, 0)))(jnp.asarray(theta), weights)):  # one program
    assert np.abs(other - want).max() > 1e-2


def test_k2_sampled_estimate_converges_to_the_reverse_kl_gradient():
  """The estimator as the learner runs it: tokens drawn from the stale mu, token-mean over them. Its mean over
  20000 draws is within 4 standard errors of the exact gradient in every coordinate."""
  theta, log_mu, log_ref = _stale_kl_case()
  n = 20000
  tokens = np.random.default_rng(1).choice(V, size=n, p=np.exp(log_mu) / np.exp(log_mu).sum())
  one = jax.jit(jax.vmap(lambda y: jnp.asarray(_kl_gradient_one(theta, y, log_mu, log_ref))))(jnp.asarray(tokens))
  per_draw = np.asarray(one)
  mean, se = per_draw.mean(0), per_draw.std(0) / np.sqrt(n)
  np.testing.assert_allclose(_kl_gradient(theta, tokens, np.full(n, 1.0 / n), log_mu, log_ref, KL_CFG), mean,
                             rtol=1e-3, atol=1e-5)
  want = _reverse_kl_gradient(theta, log_ref)
  assert np.all(np.abs(mean - want) < 4 * se + 1e-6), (mean, want, se)


def _kl_gradient_one(theta, y, log_mu, log_ref):
  """The k2 term's gradient on one drawn token (traceable in y)."""
  def loss(t):
    logp = jax.nn.log_softmax(t)[y]
    row = lambda x: jnp.stack([jnp.float32(0.0), x])[None]
    return policy_objective(row(logp), row(jnp.asarray(log_mu)[y]), jnp.zeros(1), jnp.array([[0.0, 1.0]]), KL_CFG,
                            prox_logp_BxL=jax.lax.stop_gradient(row(logp)),
                            ref_logp_BxL=row(jnp.asarray(log_ref)[y]))[0]

  return jax.grad(loss)(jnp.asarray(theta))


def test_dual_clip_values_gradients_and_flags():
  """The dual clip bounds a token's whole loss w * surrogate for A < 0 (w u = pi / mu untruncated)."""
  u = np.array([1.6, 2.0, 4.0, 0.5], np.float32)
  w = np.array([2.0, 1.0, 2.0, 2.0], np.float32)
  adv = np.array([-1.0, -1.0, 1.0, -2.0], np.float32)

  def held(log_u):
    return dual_clip(w * ppo_surrogate(log_u, adv, 0.2, 0.28)[0], adv, 3.0)

  # One program: the values at numpy's log u, the gradient at jnp.log(u)
  (loss, dual), grad = jax.jit(lambda lu, u: (held(lu), jax.grad(lambda x: held(x)[0].sum())(jnp.log(u))))(
      np.log(u), u)
  # u=1.6, w=2, A=-1: PPO gives 1.6, weighted 3.2, held at 3; u=2, w=1: 2 (under 3); A>0 above the band:
  # -1.28 * 2; u=0.5, A=-2: below the band, 0.8 * 2 * w = 3.2, under 3 * 2.
  np.testing.assert_allclose(loss, [3.0, 2.0, -2.56, 3.2], rtol=1e-6)
  assert dual.tolist() == [True, False, False, False]
  np.testing.assert_allclose(grad, [0.0, 2.0, 0.0, 0.0], rtol=1e-6)  # -w u A where unclipped
  with pytest.raises(ValueError, match="dual_clip"):
    LossConfig(dual_clip=1.1)


def test_dual_clip_acts_on_a_stale_token_at_the_default_settings():
  """The run config's objective: a token with A < 0 whose pi / prox = 1.6 (inside any PPO bound for A < 0) and
  prox / mu = 2.5 (weight truncated to 2): w u = 3.2 passes the dual clip (3), so its gradient is 0; without the
  dual clip it is -w u A = 3.2 per unit of weight."""
  cfg = config_lib.validate(config_lib.base()).loss
  assert cfg == LossConfig() and cfg.dual_clip == 3.0 and cfg.is_cap == 2.0 and cfg.proximal == "recompute"
  prox = np.log(np.array([[1.0, 0.2, 0.2]], np.float32))
  behavior = prox - np.log(np.array([[1.0, 2.5, 1.0]], np.float32))
  logp = prox + np.log(np.array([[1.0, 1.6, 1.0]], np.float32))
  weights = np.array([[0.0, 0.5, 0.5]], np.float32)
  adv = np.array([-1.0], np.float32)

  objective = lambda lp, c: policy_objective(lp, behavior, adv, weights, c, prox_logp_BxL=prox)
  grad = lambda c: jax.grad(lambda lp: objective(lp, c)[0])
  held, free, (_, stats) = jax.jit(lambda lp: (grad(cfg)(lp), grad(cfg.replace(dual_clip=None))(lp), objective(
      lp, cfg)))(logp)  # one program for the three

  np.testing.assert_allclose(held, [[0.0, 0.0, 0.5 * 1.0]], rtol=1e-6)
  np.testing.assert_allclose(free, [[0.0, 0.5 * 3.2, 0.5 * 1.0]], rtol=1e-5)
  assert stats["clip_dual"] == 1 and stats["is_truncated"] == 1


def test_gspo_averages_over_sequences_not_tokens():
  """Two samples of 3 and 1 tokens: the loss is the plain mean of the two sequence losses."""
  logp = np.array([[0.0, 0.1, 0.3, -0.1], [0.0, 0.5, 0.0, 0.0]], np.float32)
  prox = np.zeros((2, 4), np.float32)
  mask = np.array([[0, 1, 1, 1], [0, 1, 0, 0]], np.float32)
  adv = np.array([1.0, -1.0], np.float32)
  cfg = LossConfig(policy_loss="gspo", aggregation="seq_mean", proximal="recompute", clip_low=0.2, clip_high=0.28)

  @jax.jit
  def loss_and_grad(logp):  # one program: the weights, the objective and its gradient
    weights = aggregation_weights(mask, np.ones(2), "seq_mean")
    objective = lambda lp: policy_objective(lp, prox, adv, weights, cfg, prox_logp_BxL=prox)
    return objective(logp), jax.grad(lambda lp: objective(lp)[0])(logp)

  (loss, stats), grad = loss_and_grad(logp)
  s0, s1 = np.exp(0.3 / 3), np.exp(0.5)  # sequence ratios: geometric means of the token ratios
  want = 0.5 * (-s0 * 1.0) + 0.5 * (-min(-s1, -1.28))  # sample 1: A < 0, u above the band: unclipped branch
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  # d/d logp_t of 0.5 * -s0 = 0.5 * -s0 / 3 on each of sample 0's tokens; sample 1: 0.5 * s1 on its token.
  np.testing.assert_allclose(grad, [[0, -s0 / 6, -s0 / 6, -s0 / 6], [0, 0.5 * s1, 0, 0]], rtol=1e-5)
  with pytest.raises(ValueError, match="seq_mean"):
    LossConfig(policy_loss="gspo")


def test_length_normalised_sequence_weights():
  prox = np.log(np.array([[3.0, 0.5, 1.5, 9.0]], np.float32))
  mask = np.array([[True, True, True, False]])
  cfg = LossConfig(proximal="recompute", is_level="sequence_mean", is_cap=None)
  w, keep, trunc, cap = jax.jit(lambda p: behavior_weights(p, np.zeros((1, 4), np.float32), mask, cfg))(prox)
  np.testing.assert_allclose(w, [[2.25 ** (1 / 3)] * 4], rtol=1e-6)  # (3 * 0.5 * 1.5)^(1/3); entry 3 ignored
  assert keep.all() and not trunc.any() and cap == np.inf


def test_ess_cap_reaches_the_target_and_is_applied():
  w = np.array([[1.0, 1.0, 1.0, 10.0]], np.float32)
  valid = np.ones((1, 4), bool)
  # ESS(c) = (3 + c)^2 / (4 (3 + c^2)) = 0.8  <=>  2.2 c^2 - 6 c + 0.6 = 0: c = (6 + sqrt(36 - 5.28)) / 4.4.
  c = (6 + np.sqrt(36 - 5.28)) / 4.4
  logp = np.zeros((1, 5), np.float32)
  behavior = np.concatenate([[[0.0]], -np.log(w)], 1).astype(np.float32)
  weights = np.array([[0, 0.25, 0.25, 0.25, 0.25]], np.float32)
  cfg = LossConfig(policy_loss="pg", proximal="recompute", is_level="token", is_ess_min=0.8, is_cap=5.0)

  @jax.jit
  def caps(w, capped, low, logp):  # one program for every call below
    return (ess_cap(w, valid, 0.8, 20.0), ess_fraction(capped, valid), ess_cap(w, valid, 0.2, 20.0),
            ess_cap(low, np.ones((1, 2), bool), 0.99, 20.0),
            policy_objective(logp, behavior, np.ones(1), weights, cfg, prox_logp_BxL=logp)[1])

  at_08, ess, at_02, floor, stats = caps(w, np.minimum(w, c), np.array([[0.1, 1.0]]), logp)
  np.testing.assert_allclose(at_08, c, rtol=1e-5)
  np.testing.assert_allclose(ess, 0.8, rtol=1e-5)
  np.testing.assert_allclose(at_02, np.exp(20.0), rtol=1e-5)  # already above: no cap
  np.testing.assert_allclose(floor, 1.0)  # floor 1
  # Through the objective: the cap is the smaller of is_cap and the ESS cap, and the applied ESS is logged.
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
  PPO (ratio against the pre-step policy, clip, dual clip on w u, weights w = min(prox / mu, 2)); anchoring at mu, or
  swapping prox and mu, gives another update."""
  rng = np.random.default_rng(3)
  w0 = rng.normal(size=(V, V)).astype(np.float32)
  mu = _softmax(w0[0] + rng.normal(size=V) * 1.5)  # a stale behaviour policy
  tokens = np.array([0, 1, 2, 0, 3, 1, 4, 0])
  rewards = np.array([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
  batch = _bandit_batch(tokens, np.log(mu[tokens]), rewards, version=3)
  lr, b, m = 4.0, len(tokens), 2
  cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0, dual_clip=3.0)
  step = jit_train_step(StepConfig(model=_bigram, optimizer=optax.sgd(lr), loss=cfg, batch_size=b, seq_len=2,
                                   num_minibatches=m))
  key = jax.random.key(5)
  state, metrics = step(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr), version=5), batch, key)

  # Reference. Row r is in mini-batch r % M; the step visits the mini-batches in the order its key draws.
  visits = np.asarray(minibatch_order(key, m, 1))
  assert sorted(visits.tolist()) == [0, 1]
  adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
  prox = np.log(_softmax(w0[0].astype(np.float64)))
  theta = w0[0].astype(np.float64)
  clipped = 0
  for j in visits:
    pi = _softmax(theta)
    grad = np.zeros(V)
    for i in range(j, b, m):
      y, a = tokens[i], adv[i]
      u = pi[y] / np.exp(prox[y])
      w = min(np.exp(prox[y]) / mu[y], 2.0)
      live = not ((a > 0 and u > 1.28) or (a < 0 and u < 0.8) or (a < 0 and w * u > 3.0))
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
  for other in (LossConfig(proximal="behavior", is_level="none", is_cap=None), None):
    if other is None:  # prox and mu swapped: the batch carries prox as its behaviour logprobs
      swapped = batch.replace(behavior_logprobs_BxL=np.where(batch.loss_mask_BxL > 0, prox[batch.tokens_BxL], 0.0)
                              .astype(np.float32))
      out, _ = step(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr), version=5), swapped, key)
    else:
      run = jit_train_step(StepConfig(model=_bigram, optimizer=optax.sgd(lr), loss=other, batch_size=b, seq_len=2,
                                      num_minibatches=m))
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
  step = jit_train_step(StepConfig(model=_bigram, optimizer=optax.sgd(1.0), loss=cfg, batch_size=b, seq_len=2))
  state = init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0), ref_params={"w": jnp.asarray(w_ref)})
  out, metrics = step(state, batch, jax.random.key(0))
  log_ref = np.asarray(jax.jit(lambda w, t: token_logprobs(w[t], t)[0])(w_ref, batch.tokens_BxL))[:, 1]
  kl = log_mu - log_ref
  np.testing.assert_allclose(metrics["kl_reward_mean"], kl.mean(), rtol=1e-5)
  assert metrics["loss/kl"] == 0  # no KL loss term: it is in the reward
  shaped = _bandit_batch(tokens, log_mu, rewards - beta * kl, version=0)
  plain = jit_train_step(StepConfig(model=_bigram, optimizer=optax.sgd(1.0), loss=cfg.replace(kl_coef=0.0),
                                    batch_size=b, seq_len=2))
  want, _ = plain(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0)), shaped, jax.random.key(0))
  np.testing.assert_allclose(out.params["w"], want.params["w"], rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(want.params["w"]) - np.asarray(
      plain(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0)), batch, jax.random.key(0))[0].params["w"])
  ).max() > 1e-3  # the shaping changed the update
