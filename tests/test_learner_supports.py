"""Top-k / top-p supports through the train step: a token outside the pre-step policy's support has no ratio and
importance weight 0; one outside the reference's support has no KL term; both are counted. And a multi-turn batch:
observation tokens get exactly zero gradient and do not count as generated length."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.controller.ledger import Ledger
from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step
from jaxrl.learner.step import minibatch_order
from jaxrl.rollout import Rollout, SamplingParams, make_batch

V = 4
A, C, B, D = 0, 1, 2, 3  # tokens, by their initial logit rank: a > c > b > d
TOP2 = SamplingParams(top_k=2)


def bandit(params, tokens, positions, segments):
  return params["w"][tokens]


def _rollout(token, log_mu, reward, group=0, index=0):
  return Rollout(np.array([0], np.int32), np.array([token], np.int32), np.array([log_mu], np.float32),
                 np.array([0], np.int32), "length", group_id=group, sample_index=index, sampling=TOP2,
                 reward=float(reward))


def test_a_token_that_left_the_pre_step_support_gets_no_weight_and_is_counted():
  """Two mini-batches, top-2 sampling. The first update pushes a (A < 0) below b, so at the second update b is in
  pi's top 2 but was not in prox's ({a, c}): prox(b) = 0, no ratio, weight 0. The second update therefore moves
  nothing (SGD): the step equals a's update alone; a made-up prox log-prob for b would have trained it."""
  w0 = np.zeros((V, V), np.float32)
  w0[0] = [2.0, 1.9, 1.8, -5.0]
  cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0, sampling=TOP2)
  lr, key = 8.0, jax.random.key(0)
  pair = [_rollout(A, np.log(0.5), 0.0, index=0), _rollout(B, np.log(0.5), 1.0, index=1)]  # GRPO: A -1, B +1
  rows = pair if int(minibatch_order(key, 2, 1)[0]) == 0 else pair[::-1]  # row r: mini-batch r % 2; a's first
  batch = make_batch(rows, 2, 2)
  step = jit_train_step(StepConfig(model=bandit, optimizer=optax.sgd(lr), loss=cfg, batch_size=2, seq_len=2,
                                   num_minibatches=2))
  state, metrics = step(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr)), batch, key)
  np.testing.assert_allclose(metrics["prox_out_of_support_frac"], 0.5)  # b: 1 of the step's 2 tokens
  assert metrics["updates_applied"] == 2 and metrics["num_tokens"] == 2
  # a's update alone: one update over the batch with b's token masked out (advantages still from both samples).
  a_only = batch.replace(loss_mask_BxL=np.where(batch.tokens_BxL == A, batch.loss_mask_BxL, 0.0))
  one = jit_train_step(StepConfig(model=bandit, optimizer=optax.sgd(lr), loss=cfg, batch_size=2, seq_len=2))
  want, _ = one(init_train_state({"w": jnp.asarray(w0)}, optax.sgd(lr)), a_only, key)
  w_a = np.asarray(want.params["w"])[0]
  assert np.argsort(-w_a)[:2].tolist() == [C, B]  # after a's update the support is {c, b}
  np.testing.assert_allclose(np.asarray(state.params["w"]), np.asarray(want.params["w"]), rtol=1e-6, atol=1e-6)


def test_a_token_outside_the_reference_support_has_no_kl_term_and_is_counted():
  """One sample of a group of one (advantage 0): the loss is the KL term alone. Its token is in pi's top 2 but not
  in ref's: KL(pi || ref) is infinite there and the term is dropped, so nothing moves; a token inside ref's support
  moves the params."""
  w0 = np.zeros((V, V), np.float32)
  w0[0] = [2.0, 1.9, 1.8, -5.0]
  ref = w0.copy()
  ref[0] = [2.0, -3.0, 1.0, 0.5]  # ref's top 2: {a, b}
  cfg = LossConfig(proximal="recompute", is_level="token", kl_coef=1.0, sampling=TOP2)
  step = jit_train_step(StepConfig(model=bandit, optimizer=optax.sgd(1.0), loss=cfg, batch_size=1, seq_len=2))
  out = {}
  for token in (C, A):
    state = init_train_state({"w": jnp.asarray(w0)}, optax.sgd(1.0), ref_params={"w": jnp.asarray(ref)})
    new, metrics = step(state, make_batch([_rollout(token, np.log(0.5), 1.0)], 1, 2), jax.random.key(0))
    out[token] = (np.abs(np.asarray(new.params["w"]) - w0).max(), metrics)
  moved, metrics = out[C]
  assert moved == 0.0 and metrics["ref_out_of_support_frac"] == 1.0 and metrics["kl_ref"] == 0.0
  moved, metrics = out[A]
  assert moved > 1e-3 and metrics["ref_out_of_support_frac"] == 0.0 and metrics["kl_ref"] > 0.0


def test_observation_tokens_get_exactly_zero_gradient_and_no_length():
  """A multi-turn sample: model turn, observation (loss mask 0), model turn. A per-position logit offset shows each
  position's gradient: exactly 0 at the positions predicting observation tokens (entropy bonus and KL on), non-zero
  at the model's. Lengths count the model's tokens only."""
  L = 10
  prompt = np.array([1, 2], np.int32)
  completion = np.array([3, 1, 0, 2, 2, 1, 3], np.int32)  # model 3 tokens, observation 2, model 2
  mask = np.array([1, 1, 1, 0, 0, 1, 1], np.float32)
  rs = [Rollout(prompt, completion, np.full(7, -1.2, np.float32) * mask, np.where(mask > 0, 0, -1).astype(np.int32),
                "eos", group_id=0, sample_index=i, reward=float(i), loss_mask=mask) for i in range(2)]
  batch = make_batch(rs, 2, L)

  def model(params, tokens, positions, segments):
    return params["w"][tokens] + params["offset"][positions]  # both rows have the same layout

  params = {"w": jax.random.normal(jax.random.key(1), (V, V)), "offset": jnp.zeros((L, V))}
  cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0, dual_clip=3.0, entropy_coef=0.1,
                   kl_coef=0.1)
  step = jit_train_step(StepConfig(model=model, optimizer=optax.sgd(1.0), loss=cfg, batch_size=2, seq_len=L,
                                   num_minibatches=2))
  state = init_train_state(params, optax.sgd(1.0), ref_params=jax.tree.map(lambda x: x + 0.05, params))
  new, metrics = step(state, batch, jax.random.key(0))
  moved = np.abs(np.asarray(new.params["offset"])).max(-1)  # [L]: position t - 1 predicts token t
  observation_at = 2 + np.flatnonzero(mask == 0) - 1
  model_at = 2 + np.flatnonzero(mask > 0) - 1
  assert np.all(moved[observation_at] == 0.0)
  assert np.all(moved[model_at] > 0.0)
  assert metrics["num_tokens"] == 2 * 5 and metrics["updates_applied"] == 2
  assert rs[0].num_model_tokens == 5
  ledger = Ledger()
  ledger.trained(rs)
  assert ledger.tokens_trained == 10 and ledger.length_bias()["trained_mean_len"] == 5.0
