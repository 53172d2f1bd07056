"""Meshes, the sampler/learner split, logical-axis rules, and versioned transfer between submeshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl import sharding
from jaxrl.models import Decoder, ModelConfig, forward


def _params(**kw):
  cfg = ModelConfig.tiny(num_heads=4, num_kv_heads=2, **kw)
  return cfg, *nnx.split(Decoder(cfg, nnx.Rngs(0)))


def test_resolve_axis_sizes():
  assert sharding.resolve_axis_sizes({"fsdp": -1, "tensor": 2}, 8) == {"fsdp": 4, "tensor": 2}
  assert sharding.resolve_axis_sizes([("data", 4)], 4) == {"data": 4}
  with pytest.raises(ValueError, match="at most one"):
    sharding.resolve_axis_sizes({"a": -1, "b": -1}, 8)
  with pytest.raises(ValueError, match="need 6 devices, 8 given"):
    sharding.resolve_axis_sizes({"a": 3, "b": 2}, 8)
  with pytest.raises(ValueError, match="not divisible"):
    sharding.resolve_axis_sizes({"a": 3, "b": -1}, 8)
  with pytest.raises(ValueError, match="positive"):
    sharding.resolve_axis_sizes({"a": 0}, 8)


def test_split_is_disjoint_and_ordered():
  learner, sampler = sharding.split_devices(4)
  assert [d.id for d in learner] == [0, 1, 2, 3] and [d.id for d in sampler] == [4, 5, 6, 7]
  learner, sampler = sharding.split_devices(0.25)
  assert len(learner) == 6 and len(sampler) == 2
  for bad in (0, 8, 9, -1, 1.0, 0.0):
    with pytest.raises(ValueError, match="sampler"):
      sharding.split_devices(bad)


def test_rules_shard_fsdp_and_tensor_and_replicate_what_does_not_divide():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  rules = sharding.LEARNER_RULES
  assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh, rules) == P("fsdp", "tensor")
  # 2 kv heads cannot split over tensor=4: replicated rather than failing.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh, rules) == P("fsdp", None, None)
  assert sharding.logical_to_spec(("layers", "embed"), (2, 32), mesh, rules) == P(None, "fsdp")
  cfg, graphdef, params = _params()
  specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(params, mesh, rules))
  assert specs["blocks"]["attn"]["q_proj"] == P(None, "fsdp", "tensor", None)
  assert specs["blocks"]["mlp"]["down_proj"] == P(None, "tensor", "fsdp")
  assert specs["embed"] == P("tensor", "fsdp")


@pytest.mark.parametrize("axes", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"fsdp": 2, "tensor": 4}])
def test_sharded_forward_equals_single_device(axes):
  cfg, graphdef, params = _params()
  tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(12), (8, 12))
  seg = jnp.ones((8, 12), jnp.int32)
  ref = jax.jit(forward, static_argnums=0)(graphdef, params, tokens, pos, seg)
  mesh = sharding.make_mesh(axes)
  psh = sharding.param_shardings(params, mesh, sharding.LEARNER_RULES)
  bsh = sharding.batch_sharding(mesh, sharding.LEARNER_RULES)
  step = jax.jit(forward, static_argnums=0, in_shardings=(psh, bsh, bsh, bsh))
  out = step(graphdef, jax.device_put(params, psh), *(jax.device_put(x, bsh) for x in (tokens, pos, seg)))
  assert len(out.sharding.device_set) == 8
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=1e-5)


def test_transfer_learner_to_sampler_is_bitwise_and_versioned():
  cfg, graphdef, params = _params()
  learner, sampler = sharding.split_devices(4)
  learner_mesh = sharding.make_mesh({"fsdp": -1, "tensor": 2}, learner)
  sampler_mesh = sharding.make_mesh({"data": -1, "tensor": 2}, sampler)
  assert {d.id for d in learner_mesh.devices.flat} == {0, 1, 2, 3}
  assert {d.id for d in sampler_mesh.devices.flat} == {4, 5, 6, 7}
  learner_params = jax.device_put(params, sharding.param_shardings(params, learner_mesh, sharding.LEARNER_RULES))
  dst = sharding.param_shardings(params, sampler_mesh, sharding.SAMPLER_RULES)
  moved = sharding.transfer(learner_params, 7, dst)
  assert moved.version == 7
  for src, out, want in zip(jax.tree.leaves(learner_params), jax.tree.leaves(moved.params),
                            jax.tree.leaves(dst, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)), strict=True):
    assert out.sharding == want
    assert {d.id for d in out.sharding.device_set} == {4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(src))
  cast = sharding.transfer(learner_params, 8, dst, dtype=jnp.bfloat16)
  leaf = jax.tree.leaves(cast.params)[0]
  assert leaf.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax.tree.leaves(params)[0]).astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="version"):
    sharding.transfer(learner_params, -1, dst)
