"""make_optimizer's AdamW: `apply` (the fused in-place update the train step runs) gives optax's chain's values,
skips a not-ok update without touching anything, and updates params and moments in place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.learner import make_optimizer


def params0():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,)), "e": jnp.ones((4, 8))}


def grads_at(step, scale):
  keys = jax.random.split(jax.random.key(step + 1), 3)
  return {name: scale * jax.random.normal(k, x.shape) for (name, x), k in zip(params0().items(), keys, strict=True)}


def optax_step(opt, params, state, grads):
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("grad_scale,exact", [(1e-3, True), (10.0, False)])  # under the clip norm / clipped
def test_apply_gives_the_optax_chains_values(grad_scale, exact):
  opt = make_optimizer(1e-2, warmup_steps=2, decay_steps=6, weight_decay=0.1, max_grad_norm=1.0)
  params_a = params_b = params0()
  state_a = state_b = opt.init(params_a)
  apply = jax.jit(opt.apply)
  for step in range(4):
    grads = grads_at(step, grad_scale)
    params_a, state_a = apply(grads, state_a, params_a, jnp.bool_(True))
    params_b, state_b = jax.jit(optax_step, static_argnums=0)(opt, params_b, state_b, grads)
  assert jax.tree.structure(state_a) == jax.tree.structure(state_b)
  for a, b in zip(jax.tree.leaves((params_a, state_a)), jax.tree.leaves((params_b, state_b)), strict=True):
    if exact:
      np.testing.assert_array_equal(a, b)
    else:  # the clip multiplies by max_norm / norm where optax divides by the norm: float rounding
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert not np.allclose(params_a["w"], params0()["w"])
  np.testing.assert_array_equal(state_a[1][0].count, 4)


def test_apply_without_clip_or_decay_gives_the_optax_chains_values():
  opt = make_optimizer(1e-2, max_grad_norm=None)
  params, state = params0(), opt.init(params0())
  a = jax.jit(opt.apply)(grads_at(0, 1.0), state, params, jnp.bool_(True))
  b = jax.jit(optax_step, static_argnums=0)(opt, params, state, grads_at(0, 1.0))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_a_not_ok_update_changes_nothing_even_with_nan_gradients():
  opt = make_optimizer(1e-2, weight_decay=0.1)
  params, state = params0(), opt.init(params0())
  params, state = jax.jit(opt.apply)(grads_at(0, 1.0), state, params, jnp.bool_(True))
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads_at(1, 1.0))
  after = jax.jit(opt.apply)(nan, state, params, jnp.bool_(False))
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves((params, state)), strict=True):
    np.testing.assert_array_equal(x, y)


def test_apply_updates_params_and_moments_in_place():
  """Donated params and state (the train step donates them): no temporary the size of a moment (optax's chain
  copies both moments here)."""
  opt = make_optimizer(1e-2, weight_decay=0.1)
  params = {"w": jnp.zeros((1024, 256)), "v": jnp.zeros((1024, 256)), "b": jnp.zeros((256,))}
  state = opt.init(params)
  leaf = 1024 * 256 * 4

  def temporaries(fn):
    return jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, params, jnp.bool_(True)).compile() \
        .memory_analysis().temp_size_in_bytes

  fused = temporaries(lambda p, s, g, ok: opt.apply(g, s, p, ok))
  chain = temporaries(lambda p, s, g, ok: optax_step(opt, p, s, g))
  assert fused < 0.05 * leaf, fused
  assert chain >= leaf  # what apply avoids (if optax's chain ever updates in place too, this says so)
