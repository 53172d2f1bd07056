"""A tiny decoder trained by the learner alone, on a synthetic stream of rollouts sampled two versions stale,
raises its expected reward, computed exactly from the model's probabilities (no sampling noise)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, make_optimizer
from jaxrl.models import Decoder, ModelConfig, forward
from jaxrl.rollout import Rollout, make_batch

V, PROMPTS, GROUP, LAG = 32, 4, 8, 2
PROMPT_TOKENS = np.array([[5, 9, 17], [30, 2, 11], [7, 7, 20], [14, 25, 3]], np.int32)
TARGET = 4  # reward = fraction of the two completion tokens below TARGET (0.125 under a uniform policy)


@functools.partial(jax.jit, static_argnums=0)
def _tables(graphdef, params):
  """For every prompt p and first token a: pi(a | p) [P, V] and pi(b | p, a) [P, V, V]."""
  rows = np.concatenate([np.repeat(PROMPT_TOKENS, V, 0), np.tile(np.arange(V), PROMPTS)[:, None]], 1)
  n, l = rows.shape
  logits = forward(graphdef, params, jnp.asarray(rows), jnp.broadcast_to(jnp.arange(l), (n, l)),
                   jnp.ones((n, l), jnp.int32))
  probs = jax.nn.softmax(logits, -1).reshape(PROMPTS, V, l, V)
  return probs[:, 0, l - 2], probs[:, :, l - 1]


def _expected_reward(first_PxV, second_PxVxV):
  hit = (np.arange(V) < TARGET).astype(np.float64)
  return float(np.mean(first_PxV @ hit + np.einsum("pa,pab,b->p", first_PxV, second_PxVxV, hit)) / 2)


def _rollouts(first, second, version, rng):
  out = []
  for p in range(PROMPTS):
    for i in range(GROUP):
      a = rng.choice(V, p=first[p] / first[p].sum())
      b = rng.choice(V, p=second[p, a] / second[p, a].sum())
      lp = np.log([first[p, a], second[p, a, b]]).astype(np.float32)
      out.append(Rollout(PROMPT_TOKENS[p], np.array([a, b], np.int32), lp, np.full(2, version, np.int32), "length",
                         group_id=p, sample_index=i, reward=float(np.mean(np.array([a, b]) < TARGET))))
  return out


@pytest.mark.slow
def test_learner_raises_exact_expected_reward_from_stale_stream():
  graphdef, params = nnx.split(Decoder(ModelConfig.tiny(vocab_size=V), nnx.Rngs(0)))
  opt = make_optimizer(3e-3, warmup_steps=2)
  cfg = LossConfig(policy_loss="ppo", proximal="recompute", is_level="token", is_cap=2.0)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=cfg, batch_size=PROMPTS * GROUP, seq_len=5))
  state = init_train_state(params, opt)
  rng = np.random.default_rng(0)
  tables = lambda p: jax.tree.map(lambda x: np.asarray(x, np.float64), _tables(graphdef, p))
  history = [tables(state.params)]  # history[v] = exact tables of policy version v
  start = _expected_reward(*history[0])
  for i in range(30):
    behavior_version = max(0, int(state.version) - LAG)
    batch = make_batch(_rollouts(*history[behavior_version], behavior_version, rng), PROMPTS * GROUP, 5)
    state, metrics = step(state, batch, jax.random.key(i))
    assert metrics["updates_applied"] == 1
    assert metrics["staleness_max"] == min(i, LAG)
    history.append(tables(state.params))
  end = _expected_reward(*history[-1])
  print(f"exact expected reward {start:.3f} -> {end:.3f}")
  assert start < 0.2 and end > start + 0.4, (start, end)
