"""Mixture-of-experts policies in the learner: routing replay (the learner routes each sampled token as the sampler
did), the recorded routing through the sampler, batches and packing, and the load-balance terms of the objective."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sampling_util import random_params, run_groups

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step
from jaxrl.learner.packing import pack_batch
from jaxrl.learner.step import batch_arrays, check_batch, token_logprobs_of
from jaxrl.models import ModelConfig
from jaxrl.models import init_params as fresh_params
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import Rollout, SamplingParams, make_batch
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

# The aux coefficient of the load-balance test's "aux on" model (tiny_moe's is 0.001): its train step is then the
# routing-replay step of the other tests, one program compiled for the file, not two.
CFG = ModelConfig.tiny_moe(router_aux_loss_coef=0.5)
B, L = 4, 16


@functools.cache
def init_params(cfg):
  """(graphdef, params) of a fresh model, built once per config for the file (_train copies the params it donates)."""
  return fresh_params(cfg)


def _rollouts(seed=0, forced=True):
  """Random prompts and completions; each completion token's routing forced to random experts (as if the sampler's
  kernels had routed otherwise than the learner's would), behaviour logprobs still to be filled in."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(B):
    p, c = int(rng.integers(2, 6)), int(rng.integers(3, 9))
    experts = np.stack([[rng.permutation(CFG.num_experts)[:CFG.num_experts_per_tok] for _ in range(CFG.num_layers)]
                        for _ in range(c)]).astype(np.int16)
    out.append(Rollout(rng.integers(2, 64, p).astype(np.int32), rng.integers(2, 64, c).astype(np.int32),
                       np.zeros(c, np.float32), np.zeros(c, np.int32), "length", group_id=i // 2, sample_index=i % 2,
                       reward=float(i % 3), experts=experts if forced else None))
  return out


def _step_config(cfg=CFG, routing="replay", graphdef=None, **kw):
  graphdef = graphdef if graphdef is not None else init_params(cfg)[0]
  return StepConfig(model=graphdef, optimizer=optax.sgd(0.1), loss=LossConfig(routing=routing), batch_size=B,
                    seq_len=L, **kw)


@functools.cache
def _scorer():
  config = _step_config()
  return jax.jit(lambda p, x: token_logprobs_of(config, p, x)[0])


def _on_policy(rollouts, params, batch):
  """The rollouts with their behaviour logprobs scored by the learner's own forward under their recorded routing."""
  logp = np.asarray(_scorer()(params, batch_arrays(batch)))
  for row, r in enumerate(rollouts):
    start = len(r.prompt_tokens)
    r.logprobs = logp[row, start : start + len(r.completion_tokens)].copy()
  return rollouts


def _train(config, params, batch):
  state = init_train_state(jax.tree.map(jnp.copy, params), config.optimizer)
  return jit_train_step(config)(state, batch, jax.random.key(0))


def test_replay_makes_on_policy_ratios_one_and_recompute_does_not():
  """Behaviour logprobs drawn under a routing the learner would not choose: replaying it, every ratio is exactly 1;
  routing afresh, the ratios measure the routing difference."""
  graphdef, params = init_params(CFG)
  rollouts = _on_policy(_rollouts(), params, make_batch(_rollouts(), B, L))
  batch = make_batch(rollouts, B, L)
  _, m = _train(_step_config(routing="replay", graphdef=graphdef), params, batch)
  assert float(m["ratio_max"]) == float(m["ratio_min"]) == 1.0
  _, m = _train(_step_config(routing="recompute", graphdef=graphdef), params, batch)
  assert float(m["ratio_max"]) - float(m["ratio_min"]) > 0.05


def _placements(batch, rollouts):
  """(row, start column) of each rollout in a packed batch, found by its tokens."""
  seg, tokens = np.asarray(batch.segment_ids_BxL), np.asarray(batch.tokens_BxL)
  found = []
  for r in rollouts:
    seq = np.concatenate([r.prompt_tokens, r.completion_tokens])
    found.append(next((row, int(np.argmax(seg[row] == s))) for row in range(seg.shape[0]) for s in range(1, 5)
                      if np.array_equal(tokens[row][seg[row] == s], seq)))
  return found


def test_batches_and_packing_carry_the_routing():
  """Column t of a row holds the routing recorded for the completion token at t + 1, -1 elsewhere (prompts,
  padding, other segments' edges); a packed batch trains on it as the unpacked one does (ratios exactly 1)."""
  graphdef, params = init_params(CFG)
  rollouts = _rollouts(1)
  for batch, starts in ((make_batch(rollouts, B, L), [(b, 0) for b in range(B)]),
                        (pack_batch(rollouts, 2 * L, (1, 2), max_segments=4), None)):
    experts = np.asarray(batch.experts_BxLxNxK)
    assert experts.dtype == np.int16
    starts = starts or _placements(batch, rollouts)
    for r, (row, start) in zip(rollouts, starts, strict=True):
      p = start + len(r.prompt_tokens)
      np.testing.assert_array_equal(experts[row, p - 1 : p - 1 + len(r.completion_tokens)], r.experts)
    assert (experts[..., 0, 0] >= 0).sum() == sum(len(r.completion_tokens) for r in rollouts)
  packed_rollouts = _on_policy(rollouts, params, make_batch(rollouts, B, L))
  packed = pack_batch(packed_rollouts, 2 * L, (1, 2), max_segments=4)
  config = StepConfig(model=graphdef, optimizer=optax.sgd(0.1), loss=LossConfig(), batch_size=2, seq_len=2 * L,
                      row_buckets=(1, 2))
  _, m = _train(config, params, packed)
  assert int(m["num_tokens"]) == sum(len(r.completion_tokens) for r in rollouts)
  np.testing.assert_allclose([m["ratio_max"], m["ratio_min"]], 1.0, rtol=0, atol=1e-6)


def test_rollout_routing_must_match_the_completion():
  r = _rollouts()[0]
  with pytest.raises(ValueError, match="routing of shape"):
    Rollout(r.prompt_tokens, r.completion_tokens, r.logprobs, r.versions, "length", 0, experts=r.experts[1:])


@pytest.mark.parametrize("kv", ["dense", "paged"])
def test_sampler_records_the_routing_and_replay_scores_it(kv):
  """Every completion token's rollout carries the experts the sampler's decode step routed its input through, and
  every prompt input the experts its prefill routed it through: the learner's own routing of the same tokens (same
  params), and with replay the train step's ratios are 1 (to the float32 rounding between the decode path and the
  full forward, as for a dense model)."""
  cfg = CFG.replace(eos_token_ids=(1,))
  graphdef, abstract = abstract_params(cfg)
  params = random_params(abstract, 0, 0.08)
  engine = make_engine(cfg, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), kv=kv, max_slots=4, max_len=L,
                       steps_per_call=4, min_bucket=8)
  rollouts = run_groups(Sampler(engine, params, seed=3), SamplingParams(), groups=B // 2, vocab_size=cfg.vocab_size,
                        seed=1, max_prompt=6, max_tokens=8)
  assert all(r.experts.shape == (len(r.completion_tokens), cfg.num_layers, cfg.num_experts_per_tok)
             and r.prompt_experts.shape == (len(r.prompt_tokens) - 1, cfg.num_layers, cfg.num_experts_per_tok)
             for r in rollouts)
  batch = make_batch(rollouts, B, L)
  _, routing = jax.jit(lambda p: nnx.merge(graphdef, p)(batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL,
                                                        routing=True))(params)  # one program, not one per op
  recorded = np.asarray(batch.experts_BxLxNxK)
  at = recorded[..., 0, 0] >= 0
  assert at.sum() == sum(len(r.completion_tokens) + len(r.prompt_tokens) - 1 for r in rollouts)  # all but padding
  np.testing.assert_array_equal(recorded[at], np.asarray(routing.experts_BxTxNxK)[at])
  _, m = _train(_step_config(cfg, graphdef=graphdef), params, batch)
  np.testing.assert_allclose([m["ratio_max"], m["ratio_min"]], 1.0, rtol=0, atol=2e-6)


def test_load_balance_terms_are_in_the_loss_with_the_model_config_coefficients():
  """loss = the policy loss + coefficient * each term (moe.Routing's aux loss, the router z-loss), each moving the
  router's weights."""
  rollouts = _on_policy(_rollouts(2), init_params(CFG)[1], make_batch(_rollouts(2), B, L))
  batch = make_batch(rollouts, B, L)
  off = CFG.replace(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
  graphdef, params = init_params(off)
  routing = jax.jit(lambda p: nnx.merge(graphdef, p)(batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL,
                                                      experts_BxTxNxK=batch.experts_BxLxNxK, routing=True)[1])(params)
  state_off, m_off = _train(_step_config(off), params, batch)
  router = lambda s: np.asarray(s.params["blocks"]["moe"]["router"][...])
  for term, value in (("aux", routing.aux_loss()), ("z", routing.z_loss())):
    assert value > 0.1
    on = off.replace(**{f"router_{term}_loss_coef": 0.5})
    assert term == "z" or on == CFG
    state_on, m_on = _train(_step_config(on), params, batch)
    np.testing.assert_allclose(m_on[f"loss/router_{term}"], value, rtol=1e-5)
    np.testing.assert_allclose(m_on["loss"] - m_off["loss"], 0.5 * value, rtol=1e-4, err_msg=term)
    assert np.abs(router(state_on) - router(state_off)).max() > 1e-4, term


def test_a_batch_with_routing_of_another_shape_is_refused():
  batch = make_batch(_rollouts(), B, L)
  with pytest.raises(ValueError, match=r"Batch.experts_BxLxNxK has shape \(4, 15, 2, 2\)"):
    check_batch(batch.replace(experts_BxLxNxK=batch.experts_BxLxNxK[:, 1:]), B, L)
