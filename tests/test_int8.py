"""Int8 weight-only sampler (sampler.weight_dtype="int8", jaxrl/models/quant.py): per-channel quantization, the
sampler's behaviour log-probs are the quantized model's, a publish hands the sampler int8 leaves while the learner
keeps float ones, and a tiny job trains through it with its importance weights measuring the gap."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sampling_util import random_params, run_groups

from jaxrl import config as config_lib
from jaxrl.controller.weights import WeightPublisher
from jaxrl.learner import token_logprobs
from jaxrl.metrics import read_jsonl
from jaxrl.models import ModelConfig, forward, quant
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams, make_batch
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import LEARNER_RULES, make_mesh, param_shardings
from jaxrl.train import train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402

CFG = ModelConfig.tiny(eos_token_ids=(1,))
B, L = 8, 32


def _values(params):
  """{name path: value} of every Variable (a QuantizedWeight where quantized)."""
  flat = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return {jax.tree_util.keystr(p): v.get_value() for p, v in flat}


def test_quantize_is_within_half_a_step_and_exact_on_representable_values():
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((2, 16, 4, 8)) * rng.uniform(0.01, 3, (2, 1, 4, 8)), jnp.float32)
  q = quant.quantize(w, quant.CONTRACTED["q_proj"])
  assert q.values.dtype == jnp.int8 and q.values.shape == w.shape and q.scale.shape == (2, 4, 8)
  np.testing.assert_allclose(q.scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)
  err = np.abs(np.asarray(quant.dequantize(q, quant.CONTRACTED["q_proj"])) - np.asarray(w))
  assert (err <= np.asarray(q.scale)[:, None] / 2 * (1 + 1e-5)).all()
  assert err.max() > 0  # random weights are not on the grid

  # Integers times a power-of-two step, each output channel reaching +-127 steps, come back bit for bit.
  k = rng.integers(-127, 128, (64, 24))
  k[0], k[1] = 127, -127  # o_proj-like [in, in, out]: contracted (-3, -2) -> one scale per last-axis entry
  step = 2.0 ** rng.integers(-8, 2, 24)
  w = jnp.asarray((k * step).reshape(8, 8, 24), jnp.float32)
  q = quant.quantize(w, quant.CONTRACTED["o_proj"])
  np.testing.assert_array_equal(q.values, k.reshape(8, 8, 24))
  np.testing.assert_array_equal(q.scale, step)
  np.testing.assert_array_equal(quant.dequantize(q, quant.CONTRACTED["o_proj"]), w)
  zero = quant.quantize(jnp.zeros((4, 3)), quant.CONTRACTED["gate_proj"])
  np.testing.assert_array_equal(zero.scale, 1.0)
  np.testing.assert_array_equal(zero.values, 0)


@pytest.fixture(scope="module")
def model():
  graphdef, abstract = abstract_params(CFG)
  # Weights of std 0.3: the quantization moves the logits by ~1e-3, far above the float32 rounding that separates
  # the decode path from the full forward (~1e-6 in log-prob).
  return graphdef, random_params(abstract, 0, 0.3)


@functools.cache
def _engine(kv):
  return make_engine(CFG, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), kv=kv, max_slots=4, max_len=L,
                     steps_per_call=4, min_bucket=8, weight_dtype="int8", **({"page_size": 8} if kv == "paged" else {}))


@pytest.fixture(scope="module")
def engine():
  return _engine("dense")


@functools.partial(jax.jit, static_argnums=(0, 2))
def _learner_logprobs(graphdef, params, sampling, batch):
  logits = forward(graphdef, params, batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL)
  return token_logprobs(logits, batch.tokens_BxL, sampling)[0]


@pytest.mark.parametrize("kv, sp", [("dense", SamplingParams(temperature=1.0)),
                                    ("dense", SamplingParams(temperature=0.7, top_p=0.6)),
                                    ("paged", SamplingParams(temperature=0.7, top_p=0.6))], ids=str)
def test_int8_sampler_logprobs_are_the_quantized_models(model, kv, sp):
  """The recorded behaviour log-prob of every sampled token equals a float recomputation over the dequantized
  weights (same temperature / top-p support), and differs from the float model's: mu is the model that sampled."""
  graphdef, params = model
  engine = _engine(kv)
  sampler = Sampler(engine, params, seed=5)
  rollouts = run_groups(sampler, sp, groups=B // 2, vocab_size=CFG.vocab_size, seed=1, max_prompt=8, max_tokens=14,
                        rewards=False)
  batch = make_batch(rollouts, B, L)
  tokens = batch.loss_mask_BxL > 0
  assert tokens.sum() > 40
  mu = batch.behavior_logprobs_BxL[tokens]
  dequantized = quant.dequantize_params(jax.device_get(engine.place(params, 0).params))
  recomputed = np.asarray(_learner_logprobs(graphdef, dequantized, sp, batch))[tokens]
  np.testing.assert_allclose(recomputed, mu, rtol=0, atol=1e-5)
  float_model = np.asarray(_learner_logprobs(graphdef, params, sp, batch))[tokens]
  assert np.abs(float_model - mu).max() > 1e-3


def test_int8_publish_gives_the_sampler_int8_leaves_and_leaves_the_learner_float(model, engine):
  _, params = model
  learner_mesh = make_mesh({"fsdp": 4}, jax.devices()[:4])
  learner_params = jax.device_put(params, param_shardings(params, learner_mesh, LEARNER_RULES))
  before = jax.tree.map(np.asarray, learner_params)
  publisher = WeightPublisher(engine.param_shardings, engine.dtype, weight_dtype=engine.weight_dtype)
  moved = _values(publisher.publish(learner_params, 1).params)
  learner = _values(learner_params)
  quantized = {k for k in moved if k.split("'")[-2] in quant.CONTRACTED}
  assert len(quantized) == 9  # q, k, v, o, gate, up, down, embed, lm_head
  for k, v in moved.items():
    if k in quantized:
      assert v.values.dtype == jnp.int8 and v.values.nbytes == learner[k].size
      assert v.scale.dtype == jnp.float32 and v.scale.size * v.values.shape[-1] <= v.values.size * 4
      np.testing.assert_array_equal(v.values, quant.quantize(learner[k], quant.CONTRACTED[k.split("'")[-2]]).values)
    else:
      assert v.dtype == jnp.float32
    for leaf in jax.tree.leaves(v):
      assert leaf.sharding.device_set == set(engine.mesh.devices.flat)
  sampler_bytes = sum(x.nbytes for x in jax.tree.leaves(moved))
  float_bytes = sum(x.nbytes for x in jax.tree.leaves(learner))
  assert sampler_bytes < 0.4 * float_bytes
  assert all(v.dtype == jnp.float32 for v in learner.values())  # the learner's own params: untouched float32
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, learner_params), before)
  # The sampler's placement of what it took is a no-op (already quantized, already there): the same buffers.
  placed = engine.place(publisher.take_newer(0).params, 1).params
  pointer = lambda x: x.addressable_data(0).unsafe_buffer_pointer()
  assert jax.tree.map(pointer, _values(placed)) == jax.tree.map(pointer, moved)


def test_bad_weight_dtype_is_a_one_line_error_naming_the_key(tmp_path):
  c = config_lib.override(tiny.get_config(), **{"sampler.weight_dtype": "int4"})
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, tmp_path, num_devices=8)
  assert "sampler.weight_dtype" in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ValueError, match="weight_dtype"):
    make_engine(CFG, make_mesh({"data": 1}, jax.devices()[:1]), max_slots=2, max_len=8, weight_dtype="int4")


def test_tiny_job_trains_on_an_int8_sampler_with_its_ess_reported(tmp_path):
  """Sync mode (no staleness): the IS weights prox / mu the loss applies move off 1 only by the quantization gap
  (a float sampler's are 1 within 2e-6, its ess_applied_frac 1.0), and the run reports their ESS."""
  # The learning rate decays over tiny's 12 steps, as in its full runs: the schedule is part of the train step's
  # program, so this one is theirs (tests/test_e2e.py's, in the compilation cache), not one of its own.
  c = config_lib.override(tiny.get_config("sync"), num_steps=2, **{
      "sampler.weight_dtype": "int8", "log.tensorboard": False, "log.progress": False,
      "optimizer.decay_steps": tiny.get_config().num_steps})
  summary = train(c, tmp_path)
  assert summary["steps"] == 2
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert len(records) == 2
  for r in records:
    assert 0.99 < r["ess_applied_frac"] < 1 - 1e-5  # the gap is real, small, and corrected
    assert 0 < r["ess_frac"] <= 1  # pi / mu: the quantization gap and the step's own updates
    assert r["staleness_max"] == 0
