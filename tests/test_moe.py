"""Mixture of experts (jaxrl/models/moe.py and the decoder's MoE layers): dropless expert compute, routing, replay."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import ModelConfig, init_params, moe


def _dense_reference(x_MxE, experts_MxK, gates_MxK, gate, up, down):
  """Every expert on every token, then the chosen ones combined: what dropless routing must equal."""
  h = jax.nn.silu(jnp.einsum("me,xef->mxf", x_MxE, gate)) * jnp.einsum("me,xef->mxf", x_MxE, up)
  y_MxXxE = jnp.einsum("mxf,xfe->mxe", h, down)
  return jnp.einsum("mk,mke->me", gates_MxK, jnp.take_along_axis(y_MxXxE, experts_MxK[..., None], axis=1))


@pytest.mark.parametrize("skewed", [False, True])
def test_experts_mlp_is_dropless(skewed):
  """Equal to running every expert densely, also when every token picks the same two experts (a capacity factor
  would drop most of them)."""
  keys = jax.random.split(jax.random.key(0), 5)
  m, e, f, x, k = 24, 8, 6, 4, 2
  tokens = jax.random.normal(keys[0], (m, e))
  gate, up = jax.random.normal(keys[1], (x, e, f)), jax.random.normal(keys[2], (x, e, f))
  down = jax.random.normal(keys[3], (x, f, e))
  logits = jax.random.normal(keys[4], (m, x)) + (jnp.array([0.0, 9.0, 0.0, 8.0]) if skewed else 0.0)
  experts, gates, _ = moe.route(logits, k, True)
  if skewed:
    assert np.all(np.sort(np.asarray(experts), axis=1) == [1, 3])
  np.testing.assert_allclose(moe.experts_mlp(tokens, experts, gates, gate, up, down),
                             _dense_reference(tokens, experts, gates, gate, up, down), rtol=1e-5, atol=1e-5)


def test_route_renormalises_and_replays_with_the_current_router():
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]))
  experts, gates, _ = moe.route(logits, 2, True)
  assert experts.tolist() == [[3, 2], [0, 1]]
  np.testing.assert_allclose(gates, [[4 / 7, 3 / 7], [4 / 7, 3 / 7]], rtol=1e-6)
  np.testing.assert_allclose(moe.route(logits, 2, False)[1], [[0.4, 0.3], [0.4, 0.3]], rtol=1e-6)
  # Replay: row 0 held to experts (0, 1), gated by the current probabilities of those; row 1 (-1) routed afresh.
  experts, gates, _ = moe.route(logits, 2, True, jnp.array([[0, 1], [-1, -1]]))
  assert experts.tolist() == [[0, 1], [0, 1]]
  np.testing.assert_allclose(gates[0], [1 / 3, 2 / 3], rtol=1e-6)


def _batch():
  tokens = (jnp.arange(16).reshape(2, 8) * 7) % 64
  return tokens, jnp.tile(jnp.arange(8), (2, 1)), jnp.ones((2, 8), jnp.int32).at[1, 6:].set(0)


def test_replaying_its_own_routing_changes_nothing_and_other_routing_does():
  cfg = ModelConfig.tiny_moe()
  graphdef, params = init_params(cfg)
  model = nnx.merge(graphdef, params)
  tokens, positions, segments = _batch()
  logits, routing = model(tokens, positions, segments, routing=True)
  assert routing.experts_BxTxNxK.shape == (2, 8, cfg.num_layers, cfg.num_experts_per_tok)
  assert float(routing.tokens_N.sum()) == cfg.num_layers * 14  # padding is not counted
  np.testing.assert_array_equal(model(tokens, positions, segments, experts_BxTxNxK=routing.experts_BxTxNxK), logits)
  other = (routing.experts_BxTxNxK + 1) % cfg.num_experts
  assert not np.allclose(model(tokens, positions, segments, experts_BxTxNxK=other), logits)

  def replayed_loss(p):  # the router still learns under replay: the gates are its probabilities
    return jnp.sum(nnx.merge(graphdef, p)(tokens, positions, segments, experts_BxTxNxK=other) ** 2)

  assert float(jnp.abs(jax.grad(replayed_loss)(params)["blocks"]["moe"]["router"][...]).sum()) > 0


def test_moe_config_errors_name_the_field():
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    ModelConfig.tiny_moe(num_experts_per_tok=9)
  with pytest.raises(ValueError, match="mlp_only_layers"):
    ModelConfig.tiny_moe(mlp_only_layers=(5,))
  with pytest.raises(ValueError, match="router_z_loss_coef"):
    ModelConfig.tiny_moe(router_z_loss_coef=-1.0)
  tokens, positions, segments = _batch()
  graphdef, params = init_params(ModelConfig.tiny())
  with pytest.raises(ValueError, match="mixture-of-experts"):
    nnx.merge(graphdef, params)(tokens, positions, segments, routing=True)
