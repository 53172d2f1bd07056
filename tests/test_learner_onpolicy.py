"""On-policy data through the real Sampler: the learner's importance ratios are exactly 1 for every sampling
setting (temperature, top-k, top-p, greedy), and a rollout drawn under other settings is refused."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sampling_util import random_params, run_groups

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, token_logprobs
from jaxrl.models import ModelConfig, forward
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams, check_sampling, make_batch
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

CFG = ModelConfig.tiny(eos_token_ids=(1,))
B, L = 8, 32
SETTINGS = [SamplingParams(temperature=t, top_k=k, top_p=p)
            for t, k, p in itertools.product((0.7, 1.3), (0, 5), (1.0, 0.6))] + [SamplingParams(greedy=True)]


@pytest.fixture(scope="module")
def model():
  graphdef, abstract = abstract_params(CFG)
  # Small weights keep the logits small: the sampler's decode path (KV cache, sharded heads) and the learner's
  # full forward then agree to float32 rounding well below 1e-6 in logprob (with weights of std 0.5 the two
  # forward passes alone differ by ~1e-5, whatever the sampling settings). Top-k / top-p still cut real mass.
  return graphdef, random_params(abstract, 0, 0.08)


@pytest.fixture(scope="module")
def sampler(model):
  engine = make_engine(CFG, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), max_slots=4, max_len=L,
                       steps_per_call=4, min_bucket=8)
  return Sampler(engine, model[1], seed=3)


def _rollouts(sampler, sp, seed):
  return run_groups(sampler, sp, groups=B // 2, vocab_size=CFG.vocab_size, seed=seed, max_prompt=8, max_tokens=14)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _learner_logprobs(graphdef, params, sampling, batch):
  logits = forward(graphdef, params, batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL)
  return token_logprobs(logits, batch.tokens_BxL, sampling)


@pytest.mark.parametrize("sp", SETTINGS, ids=str)
def test_on_policy_ratio_is_one(model, sampler, sp):
  """The learner's logprob of every sampled token equals the sampler's: ratio pi / mu = 1 within 2e-6 (the decode
  path and the full forward sum in different orders: 1.3e-6 is the largest seen over random prompts)."""
  graphdef, params = model
  rollouts = _rollouts(sampler, sp, seed=zlib.crc32(str(sp).encode()) % 1000)  # str hashes vary per process
  assert all(r.sampling == sp for r in rollouts)
  batch = make_batch(rollouts, B, L)
  logp, in_support, _ = _learner_logprobs(graphdef, params, sp, batch)
  tokens = batch.loss_mask_BxL > 0
  assert tokens.sum() > 40
  assert np.asarray(in_support)[tokens].all()
  ratio = np.exp(np.asarray(logp)[tokens] - batch.behavior_logprobs_BxL[tokens])
  np.testing.assert_allclose(ratio, 1.0, rtol=0, atol=2e-6)
  if sp.top_k or sp.top_p < 1:  # the support matters: the full softmax would give ratios well below 1
    full = _learner_logprobs(graphdef, params, SamplingParams(temperature=sp.temperature), batch)[0]
    assert np.exp(np.asarray(full)[tokens] - batch.behavior_logprobs_BxL[tokens]).mean() < 0.95


def test_train_step_on_policy_top_p_ratios_one_and_no_clip(model, sampler):
  """Through the train step (PPO anchored at mu): ratio metrics are 1, nothing is clipped or truncated."""
  graphdef, params = model
  sp = SamplingParams(temperature=0.9, top_k=8, top_p=0.6)
  batch = make_batch(_rollouts(sampler, sp, seed=11), B, L)
  cfg = LossConfig(sampling=sp, proximal="behavior", is_level="none", is_cap=None)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(0.1), loss=cfg, batch_size=B, seq_len=L))
  _, m = step(init_train_state(jax.tree.map(jnp.copy, params), optax.sgd(0.1)), batch, jax.random.key(0))
  for name in ("ratio_max", "ratio_min", "ratio_mean", "ess_frac", "ess_applied_frac"):
    np.testing.assert_allclose(m[name], 1.0, atol=2e-6, err_msg=name)
  assert m["clip_frac_low"] == m["clip_frac_high"] == m["clip_frac_dual"] == 0
  assert m["out_of_support_frac"] == 0 and m["updates_applied"] == 1


def test_greedy_cannot_be_trained_on_and_mismatched_rollouts_are_refused(model, sampler):
  with pytest.raises(ValueError, match="point mass"):
    LossConfig(sampling=SamplingParams(greedy=True))
  rollouts = _rollouts(sampler, SamplingParams(top_p=0.8), seed=5)
  check_sampling(rollouts, SamplingParams(top_p=0.8))
  with pytest.raises(ValueError, match=r"group 0, sample 0\) was drawn with .*top_p=0.8.*the learner scores"):
    check_sampling(rollouts, SamplingParams())
