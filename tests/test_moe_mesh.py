"""Expert parallelism on an 8-device CPU mesh: the experts split over an "expert" mesh axis (jaxrl/axes.py), the
tokens dispatched by moe.experts_mlp's shard_map (no all-to-all); the learner's train step and the sampler's decode
equal their unsharded runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sampling_util import random_params, run_groups
from test_learner_moe import _rollouts

from jaxrl import sharding
from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, train_state_shardings
from jaxrl.models import ModelConfig, init_params
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams, make_batch
from jaxrl.sampler import Sampler, make_engine

CFG = ModelConfig.tiny_moe()
B, L = 8, 16


def _train(axes):
  graphdef, params = init_params(CFG)
  rollouts = _rollouts(0) + _rollouts(1)
  for i, r in enumerate(rollouts):
    r.group_id = i // 2
  batch = make_batch(rollouts, B, L)
  opt = optax.adam(1e-2)
  config = dict(model=graphdef, optimizer=opt, loss=LossConfig(), batch_size=B, seq_len=L)
  if axes is None:
    step, state = jit_train_step(StepConfig(**config)), init_train_state(params, opt)
  else:
    mesh = sharding.make_mesh(axes)
    shardings = train_state_shardings(params, opt, sharding.param_shardings(params, mesh, sharding.LEARNER_RULES),
                                      mesh)
    state = init_train_state(params, opt, shardings=shardings)
    step = jit_train_step(StepConfig(**config, batch_sharding=sharding.batch_sharding(mesh, sharding.LEARNER_RULES)),
                          shardings)
  hlo = step.lower(state, batch, jax.random.key(0)).compile().as_text()
  for i in range(2):
    state, metrics = step(state, batch, jax.random.key(i))
    assert metrics["updates_applied"] == 1
  return state, hlo


@pytest.mark.slow
def test_expert_parallel_train_step_equals_one_device():
  one, _ = _train(None)
  state, hlo = _train({"fsdp": 2, "expert": 4})
  gate = state.params["blocks"]["moe"]["expert_gate"][...]
  assert gate.sharding.spec[1] == "expert"  # [N, X, E, F]: 2 of the 8 experts per device of the expert axis
  assert {s.data.shape[1] for s in gate.addressable_shards} == {CFG.num_experts // 4}
  assert not re.search(r"= \S+ all-to-all\(", hlo)  # tokens are not moved: each expert-axis device sees its rows
  # Two Adam steps of lr 1e-2: the sharded run sums in another order, nothing more.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
               jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, one.params))


@pytest.mark.slow
def test_expert_parallel_decode_equals_one_device():
  cfg = CFG.replace(eos_token_ids=(1,))
  _, abstract = abstract_params(cfg)
  params = random_params(abstract, 0, 0.08)
  runs = []
  for axes, devices in (({"data": 1}, jax.devices()[:1]), ({"data": 2, "expert": 2}, jax.devices()[4:])):
    engine = make_engine(cfg, sharding.make_mesh(axes, devices), max_slots=4, max_len=L, steps_per_call=4,
                         min_bucket=8)
    runs.append(run_groups(Sampler(engine, params, seed=3), SamplingParams(), groups=2, vocab_size=cfg.vocab_size,
                           seed=1, max_prompt=6, max_tokens=8))
  placed = engine.place(params, 0).params["blocks"]["moe"]["expert_up"]
  assert {s.data.shape[1] for s in jax.tree.leaves(placed)[0].addressable_shards} == {cfg.num_experts // 2}
  for one, sharded in zip(*runs, strict=True):
    np.testing.assert_array_equal(sharded.completion_tokens, one.completion_tokens)
    np.testing.assert_array_equal(sharded.experts, one.experts)
    np.testing.assert_allclose(sharded.logprobs, one.logprobs, atol=1e-5)
  assert jnp.all(jnp.asarray([len(r.completion_tokens) for r in runs[0]]) > 0)
