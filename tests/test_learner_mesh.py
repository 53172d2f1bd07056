"""The train step on an 8-device CPU mesh (FSDP, FSDP x TP) gives the one-device result, and compiles once."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl import sharding
from jaxrl.learner import (
  LossConfig,
  StepConfig,
  init_train_state,
  jit_train_step,
  make_optimizer,
  train_state_shardings,
)
from jaxrl.models import Decoder, ModelConfig
from jaxrl.rollout import Rollout, make_batch

B, L, K = 16, 12, 2
CFG = LossConfig(proximal="recompute", is_level="token", is_cap=2.0)


def _model():
  graphdef, params = nnx.split(Decoder(ModelConfig.tiny(), nnx.Rngs(0)))
  return graphdef, params


def _batch(seed, version):
  rng = np.random.default_rng(seed)
  rs = []
  for i in range(B - 1):  # one padding row
    p, c = rng.integers(1, 4), rng.integers(1, L - 4)
    rs.append(Rollout(rng.integers(0, 64, p).astype(np.int32), rng.integers(0, 64, c).astype(np.int32),
                      rng.normal(-4.0, 0.3, c).astype(np.float32), np.full(c, version, np.int32), "eos",
                      group_id=i // 4, reward=float(rng.uniform())))
  return make_batch(rs, B, L)


def _train(mesh_axes, steps=2):
  graphdef, params = _model()
  opt = make_optimizer(1e-2, warmup_steps=1, decay_steps=10, weight_decay=0.1)
  if mesh_axes is None:
    step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=CFG, batch_size=B, seq_len=L,
                                     num_microbatches=K))
    state = init_train_state(params, opt)
  else:
    mesh = sharding.make_mesh(mesh_axes)
    shardings = train_state_shardings(params, opt, sharding.param_shardings(params, mesh, sharding.LEARNER_RULES),
                                      mesh)
    state = init_train_state(params, opt, shardings=shardings)
    step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=CFG, batch_size=B, seq_len=L,
                                     num_microbatches=K,
                                     batch_sharding=sharding.batch_sharding(mesh, sharding.LEARNER_RULES)), shardings)
  for i in range(steps):
    state, metrics = step(state, _batch(i, version=i), jax.random.key(i))
    assert metrics["updates_applied"] == 1
  assert step._cache_size() == 1
  return state


@pytest.fixture(scope="module")
def one_device():
  return jax.tree.map(np.asarray, _train(None).params)


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"fsdp": 8}, {"fsdp": 4, "tensor": 2}])
def test_mesh_step_matches_one_device(one_device, axes):
  state = _train(axes)
  leaves = jax.tree.leaves(state.params)
  assert len(leaves[0].sharding.device_set) == 8
  specs = {str(x.sharding.spec) for x in leaves}
  assert any("fsdp" in s for s in specs) and (("tensor" in axes) == any("tensor" in s for s in specs))
  # Two AdamW steps of lr 1e-2: sharded reductions reorder float32 sums, nothing more.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6), jax.tree.map(np.asarray,
                                                                                                  state.params),
               one_device)
  assert int(state.version) == 2


def test_shardings_reject_indivisible_microbatches():
  graphdef, params = _model()
  mesh = sharding.make_mesh({"fsdp": 8})
  shardings = train_state_shardings(params, optax.sgd(1.0), sharding.param_shardings(params, mesh,
                                                                                     sharding.LEARNER_RULES), mesh)
  with pytest.raises(ValueError, match="not divisible by the 8 devices"):
    jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(1.0), loss=CFG, batch_size=B, seq_len=L,
                              num_microbatches=4,
                              batch_sharding=sharding.batch_sharding(mesh, sharding.LEARNER_RULES)), shardings)
