"""LoRA (jaxrl/models/lora.py): adapters train alone on a frozen base, equal a dense update of the same low rank,
reach the sampler alone with exact behaviour log-probs, checkpoint and export."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sampling_util import random_params, run_groups

from jaxrl.checkpoint import Checkpointer
from jaxrl.config import ConfigError, override, validate
from jaxrl.controller.weights import WeightPublisher
from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, make_optimizer, token_logprobs
from jaxrl.models import ModelConfig, hf, init_params, lora
from jaxrl.models import forward as eager_forward
from jaxrl.rollout import SamplingParams, make_batch
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402

LORA = lora.LoRAConfig(rank=2, alpha=4.0, targets=r"attn\.(q|o)_proj|mlp\.down_proj")
CFG = ModelConfig.tiny(eos_token_ids=(1,), lora=LORA)
B, L = 8, 24


def _small(tree, seed, std):
  """Every leaf of a params tree drawn anew (norm scales near 1): small logits, nonzero B factors."""
  return random_params(tree, seed, std)


PLAIN = hf.abstract_params(CFG.replace(lora=None))[0]  # the graphdef of the same model without adapters
# The full forward as one program per model and shape (run op by op, each op compiles on its own)
forward = jax.jit(eager_forward, static_argnums=0)


@pytest.fixture(scope="module")
def fresh():
  return init_params(CFG)


@pytest.fixture(scope="module")
def model(fresh):
  """(graphdef, adapters with nonzero A and B, base) of the LoRA tiny model."""
  graphdef, params = fresh
  adapters, base = lora.split(params)
  return graphdef, _small(adapters, 1, 0.3), _small(base, 0, 0.08)


def _tokens(n=2, t=6, vocab=CFG.vocab_size):
  tokens = ((np.arange(n * t).reshape(n, t) * 7 + 3) % vocab).astype(np.int32)
  return tokens, np.broadcast_to(np.arange(t, dtype=np.int32), (n, t)), np.ones((n, t), np.int32)


def test_fresh_adapters_leave_the_base_model_unchanged(fresh):
  graphdef, params = fresh
  adapters, base = lora.split(params)
  assert {k[-1] for k, _ in nnx.to_flat_state(adapters)} == {
      f"{p}_lora_{f}" for p in ("q_proj", "o_proj", "down_proj") for f in "ab"}
  assert all(not np.any(v.get_value()) for k, v in nnx.to_flat_state(adapters) if k[-1].endswith("_b"))
  np.testing.assert_array_equal(forward(graphdef, params, *_tokens()), forward(PLAIN, base, *_tokens()))


def test_merged_weights_give_the_lora_models_logits(model):
  graphdef, adapters, base = model
  merged = lora.merged(lora.merge(base, adapters), LORA)
  assert not any(isinstance(v, lora.LoRAParam) for _, v in nnx.to_flat_state(merged))
  lora_logits = np.asarray(forward(graphdef, lora.merge(base, adapters), *_tokens()))
  assert float(np.abs(lora_logits - np.asarray(forward(PLAIN, base, *_tokens()))).max()) > 1e-3  # adapters matter
  np.testing.assert_allclose(forward(PLAIN, merged, *_tokens()), lora_logits, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def sampler(model):
  """A sampler holding the base once; its params are the adapters, placed alone."""
  graphdef, adapters, base = model
  engine = make_engine(CFG, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), max_slots=4, max_len=L,
                       steps_per_call=4, min_bucket=8)
  engine.hold_base(base)
  return Sampler(engine, adapters, seed=3)


def _rollouts(sampler, sp, seed=0):
  return run_groups(sampler, sp, groups=B // 2, vocab_size=CFG.vocab_size, seed=seed, max_prompt=6, max_tokens=12)


def test_a_publish_moves_the_adapters_alone_and_the_sampler_merges_them(model, sampler):
  graphdef, adapters, base = model
  engine = sampler.engine
  publisher = WeightPublisher(engine.publish_shardings, engine.dtype)
  moved = publisher.publish(jax.tree.map(lambda x: 2 * x, adapters), 1)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert nbytes(moved.params) == nbytes(adapters) < nbytes(base) / 4
  placed = engine.place(moved.params, moved.version)
  assert placed.version == 1 and nbytes(placed.params) == nbytes(base) + nbytes(adapters)
  for (_, held), (_, used) in zip(nnx.to_flat_state(engine.base), nnx.to_flat_state(lora.split(placed.params)[1]),
                                  strict=True):
    assert held.get_value() is used.get_value()  # the base is held once, not copied per publish


def test_on_policy_ratio_is_one_with_top_p_on_published_adapters(model, sampler):
  """The learner's log-prob of each token the sampler drew (top-k and top-p, adapters published onto the held
  base) equals the sampler's within float error, through the train step too (ratio metrics 1)."""
  graphdef, adapters, base = model
  sp = SamplingParams(temperature=0.9, top_k=8, top_p=0.6)
  batch = make_batch(_rollouts(sampler, sp, seed=5), B, L)
  tokens = batch.loss_mask_BxL > 0
  assert tokens.sum() > 30
  logp = np.asarray(jax.jit(lambda params, tokens, positions, segments: token_logprobs(
      eager_forward(graphdef, params, tokens, positions, segments), tokens, sp)[0])(
      lora.merge(base, adapters), batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL))  # one program
  np.testing.assert_allclose(np.exp(logp[tokens] - batch.behavior_logprobs_BxL[tokens]), 1.0, rtol=0, atol=2e-6)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(0.1), loss=LossConfig(sampling=sp), batch_size=B,
                                   seq_len=L))
  _, m = step(init_train_state(adapters, optax.sgd(0.1), frozen=base), batch, jax.random.key(0))
  np.testing.assert_allclose([m["ratio_min"], m["ratio_max"]], 1.0, atol=2e-6)
  assert m["clip_frac_low"] == m["clip_frac_high"] == 0


def test_a_lora_step_trains_the_adapters_alone_as_a_dense_step_of_the_same_low_rank(model, sampler):
  """With SGD a step moves each factor by -lr times its gradient. The LoRA step's gradients are the dense model's
  (W' = W + s A @ B, computed by hand) through the chain rule: dA = s dW' B^T, dB = s A^T dW'; the losses agree;
  the base is returned untouched and AdamW's state holds the adapters only."""
  graphdef, adapters, base = model
  sp = SamplingParams(temperature=1.0)
  batch = make_batch(_rollouts(sampler, sp, seed=9), B, L)
  lr, s = 0.5, LORA.scale
  dense = lora.merged(lora.merge(base, adapters), LORA)
  loss_cfg = LossConfig(sampling=sp)
  lora_step = jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(lr), loss=loss_cfg, batch_size=B,
                                        seq_len=L))
  dense_step = jit_train_step(StepConfig(model=PLAIN, optimizer=optax.sgd(lr), loss=loss_cfg, batch_size=B, seq_len=L))
  after, m = lora_step(init_train_state(adapters, optax.sgd(lr), frozen=base), batch, jax.random.key(0))
  dense_after, dm = dense_step(init_train_state(dense, optax.sgd(lr)), batch, jax.random.key(0))
  assert m["updates_applied"] == 1
  np.testing.assert_allclose(m["loss"], dm["loss"], rtol=1e-5)
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), after.frozen, base))

  # On the host, in numpy: eager jnp ops here would compile one program per op and shape
  flat = lambda tree: jax.device_get({k: v.get_value() for k, v in nnx.to_flat_state(tree)})
  factors, moved, dense0, dense1 = flat(adapters), flat(after.params), flat(dense), flat(dense_after.params)
  for path in [p for p in factors if p[-1].endswith("_lora_a")]:
    w = (*path[:-1], path[-1][: -len("_lora_a")])
    b_path = (*path[:-1], w[-1] + "_lora_b")
    a, b = factors[path], factors[b_path]
    dw = (dense0[w] - dense1[w]) / lr  # the dense gradient, per layer [N, in..., out...]
    n_out = b.ndim - 2
    out_axes = tuple(range(dw.ndim - n_out, dw.ndim))
    want_da = s * np.einsum(dw, list(range(dw.ndim)), b, [0, dw.ndim, *out_axes], [*range(dw.ndim - n_out),
                                                                                     dw.ndim])
    in_axes = tuple(range(1, a.ndim - 1))
    want_db = s * np.einsum(a, [0, *in_axes, dw.ndim], dw, list(range(dw.ndim)), [0, dw.ndim, *out_axes])
    np.testing.assert_allclose((a - moved[path]) / lr, want_da, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose((b - moved[b_path]) / lr, want_db, rtol=1e-4, atol=1e-6)
    assert float(np.abs(want_da).max()) > 1e-4 and float(np.abs(want_db).max()) > 1e-4

  adamw = make_optimizer(1e-3)
  state = init_train_state(adapters, adamw, frozen=base)
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert len(moments) == 2 * len(factors)
  assert sum(x.nbytes for x in moments) == 2 * sum(x.nbytes for x in factors.values())


def test_the_kl_reference_is_the_initial_adapters_on_the_shared_base(model, fresh, sampler):
  """kl_coef > 0: the reference is fresh adapters (B = 0) on the base the policy trains on, an adapter-sized copy;
  the first step's KL to it is 0 (the policy starts there), the second's is not, and the reference stays put."""
  graphdef, _, base = model
  start = lora.split(fresh[1])[0]
  sp = SamplingParams(temperature=1.0)
  batch = make_batch(_rollouts(sampler, sp, seed=13), B, L)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(1.0), loss=LossConfig(sampling=sp, kl_coef=0.5),
                                   batch_size=B, seq_len=L))
  state = init_train_state(start, optax.sgd(1.0), frozen=base, ref_params=jax.tree.map(jnp.copy, start))
  assert sum(x.nbytes for x in jax.tree.leaves(state.ref_params)) < sum(x.nbytes for x in jax.tree.leaves(base)) / 4
  state, first = step(state, batch, jax.random.key(0))
  state, second = step(state, batch, jax.random.key(1))
  assert abs(float(first["kl_ref"])) < 1e-7 < float(second["kl_ref"])
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), state.ref_params, start))


def test_checkpoint_holds_the_adapters_and_restores_them_onto_the_base(model, tmp_path):
  graphdef, adapters, base = model
  adamw = make_optimizer(1e-3)
  state = init_train_state(adapters, adamw, frozen=base, version=3)
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(3, state, {"note": "lora"}, force=True)
  ckpt.wait()
  saved = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
  assert saved < sum(x.nbytes for x in jax.tree.leaves(base))  # the base is not in it
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored, record = ckpt.restore(abstract)
  ckpt.close()
  assert restored.frozen is None and record == {"note": "lora"} and int(restored.version) == 3
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), restored.params, adapters))
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), restored.opt_state, state.opt_state))


def test_merged_export_reloads_in_the_hf_loader_with_equal_logits_and_adapters_alone(model, fresh, tmp_path):
  from jaxrl.policy import Policy, export

  graphdef, adapters, base = model
  params = lora.merge(base, adapters)
  path = export(Policy(CFG, graphdef, params, 1, None, None, None), tmp_path / "hf")
  cfg, plain_graphdef, loaded = hf.load_params(path, CFG.replace(lora=None))
  assert cfg.lora is None
  np.testing.assert_allclose(forward(plain_graphdef, loaded, *_tokens()), forward(graphdef, params, *_tokens()),
                             rtol=0, atol=1e-6)
  again = lora.load_adapters(path / lora.ADAPTERS_FILE, lora.split(fresh[1])[0])
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), again, adapters))


@pytest.mark.parametrize("fields, match", [
    ({"model.lora.rank": 0}, "model.lora.rank must be an int >= 1"),
    ({"model.lora.alpha": -1.0}, "model.lora.alpha must be a number > 0"),
    ({"model.lora.targets": "attn.x_proj"}, "model.lora.targets: LoRA targets 'attn.x_proj' match no projection"),
    ({"model.lora.targets": "attn.(q"}, "model.lora.targets: .* is not a regular expression"),
])
def test_a_bad_lora_setting_is_a_config_error_naming_it(fields, match):
  c = override(tiny.get_config(), **{"model.lora.enabled": True, **fields})
  with pytest.raises(ConfigError, match=match):
    validate(c)


def test_a_tiny_lora_run_learns_and_its_checkpoint_exports_merged(tmp_path):
  """jaxrl-train with model.lora learns; load_policy puts the checkpoint's adapters on the config's base, and the
  merged export reloads with that policy's logits."""
  from jaxrl.metrics import read_jsonl
  from jaxrl.policy import export, load_policy
  from jaxrl.train import train

  c = override(tiny.get_config("sync"), **{"model.lora.enabled": True, "model.lora.rank": 4, "model.lora.alpha": 16.0,
                                          "optimizer.learning_rate": 0.1, "num_steps": 8, "log.tensorboard": False,
                                          "log.progress": False})
  summary = train(c, tmp_path / "run")
  rewards = [r["reward_mean"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
  assert summary["steps"] == 8 and len(rewards) == 8
  assert np.mean(rewards[-2:]) > np.mean(rewards[:2]) + 0.4, rewards  # 0.02 -> 0.77 when written

  policy = load_policy(validate(c), tmp_path / "run", jax.devices()[:1])
  assert policy.version == 8 and policy.model_cfg.lora is not None
  adapters, base = lora.split(policy.params)
  assert any(np.any(v.get_value()) for k, v in nnx.to_flat_state(adapters) if k[-1].endswith("_b"))  # trained
  path = export(policy, tmp_path / "hf")
  _, plain_graphdef, loaded = hf.load_params(path, policy.model_cfg.replace(lora=None))
  tokens = _tokens(vocab=policy.model_cfg.vocab_size)
  np.testing.assert_allclose(forward(plain_graphdef, loaded, *tokens), forward(policy.graphdef, policy.params, *tokens),
                             rtol=0, atol=1e-5)
