"""make_optimizer's AdamW through apply_update (the one update path of the train step): optax's chain's values, a
not-ok update skipped without touching anything (any optax transformation), params and moments updated in place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.learner import make_optimizer
from jaxrl.learner.optim import apply_update


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
def test_adamw_gives_the_optax_chains_values(grad_scale, exact):
  opt = make_optimizer(1e-2, warmup_steps=2, decay_steps=6, weight_decay=0.1, max_grad_norm=1.0)
  params_a = params_b = params0()
  state_a = state_b = opt.init(params_a)
  apply = jax.jit(apply_update, static_argnums=0)
  for step in range(4):
    grads = grads_at(step, grad_scale)
    params_a, state_a = apply(opt, grads, state_a, params_a, jnp.bool_(True))
    params_b, state_b = jax.jit(optax_step, static_argnums=0)(opt.chain, params_b, state_b, grads)
  assert jax.tree.structure(state_a) == jax.tree.structure(state_b)
  for a, b in zip(jax.tree.leaves((params_a, state_a)), jax.tree.leaves((params_b, state_b)), strict=True):
    if exact:
      np.testing.assert_array_equal(a, b)
    else:  # the clip multiplies by max_norm / norm where optax divides by the norm: float rounding
      np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7)
  assert not np.allclose(params_a["w"], params0()["w"])
  np.testing.assert_array_equal(state_a[1][0].count, 4)


def test_adamw_without_clip_or_decay_gives_the_optax_chains_values():
  opt = make_optimizer(1e-2, max_grad_norm=None)
  params, state = params0(), opt.init(params0())
  a = jax.jit(apply_update, static_argnums=0)(opt, grads_at(0, 1.0), state, params, jnp.bool_(True))
  b = jax.jit(optax_step, static_argnums=0)(opt.chain, params, state, grads_at(0, 1.0))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kind", ["adamw", "optax_sgd_momentum"])
def test_a_not_ok_update_changes_nothing_even_with_nan_gradients(kind):
  opt = make_optimizer(1e-2, weight_decay=0.1) if kind == "adamw" else optax.sgd(1e-2, momentum=0.9)
  apply = jax.jit(apply_update, static_argnums=0)
  params, state = params0(), opt.init(params0())
  params, state = apply(opt, grads_at(0, 1.0), state, params, jnp.bool_(True))
  nan = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads_at(1, 1.0))
  after = apply(opt, nan, state, params, jnp.bool_(False))
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves((params, state)), strict=True):
    np.testing.assert_array_equal(x, y)
  moved = apply(opt, grads_at(1, 1.0), state, params, jnp.bool_(True))[0]
  assert not np.allclose(moved["w"], params["w"])


def test_adamw_updates_params_and_moments_in_place():
  """Donated params and state (the train step donates them): no temporary the size of a moment (optax's chain
  copies both moments here)."""
  opt = make_optimizer(1e-2, weight_decay=0.1)
  params = {"w": jnp.zeros((1024, 256)), "v": jnp.zeros((1024, 256)), "b": jnp.zeros((256,))}
  state = opt.init(params)
  leaf = 1024 * 256 * 4

  def temporaries(fn):
    return jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, params, jnp.bool_(True)).compile() \
        .memory_analysis().temp_size_in_bytes

  fused = temporaries(lambda p, s, g, ok: apply_update(opt, g, s, p, ok))
  chain = temporaries(lambda p, s, g, ok: optax_step(opt.chain, p, s, g))
  assert fused < 0.05 * leaf, fused
  assert chain >= leaf  # what AdamW avoids (if optax's chain ever updates in place too, this says so)

  def select(p, s, g, ok):  # a skip as a select of old and new, not a conditional: both kept alive
    new_p, new_s = optax_step(opt, p, s, g)
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), (new_p, new_s), (p, s))

  assert temporaries(select) >= leaf
