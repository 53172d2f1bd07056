"""The learner's optimizer: AdamW on a warmup + cosine (or constant) schedule, after global-norm clipping, and the
one way the train step applies an update (`apply_update`).

`make_optimizer` returns an `AdamW`, an optax GradientTransformation with the values and the state layout (which
checkpoints hold) of optax's chain(clip_by_global_norm, adamw), plus `update_if`, the same update with the skip
inside, which `apply_update` uses so that XLA updates params and both moments in place: through optax's chain XLA:CPU
recomputes each new moment inside the parameter update from the old one, so it copies both moments first, and it
materialises the clipped gradients (bench/memory.py; docs/BENCHMARKS_HISTORY.md, "Under 4 GB (2026-12-05)").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax


def _decayed(params):
  """Which leaves weight decay applies to: matrices, not vectors (norm scales, biases)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def apply_update(optimizer: optax.GradientTransformation, grads, opt_state, params, ok: jax.Array):
  """(params, opt_state) after one update of any optax transformation where `ok`, else both as they were (NaN
  gradients are harmless). An optimizer with its own `update_if` (AdamW) skips inside each moment's update, in
  place; any other is run and then selected against the old state, which keeps both alive (a copy of its state).
  Not a lax.cond: with one around the update, a full test run aborted once on a deadlock of the learner mesh's
  collectives on XLA:CPU (tests/test_e2e.py, sampler beside it); this is the program shape that never did."""
  update_if = getattr(optimizer, "update_if", None)
  if update_if is not None:
    return update_if(grads, opt_state, params, ok)
  updates, new_state = optimizer.update(grads, opt_state, params)
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
  return keep(optax.apply_updates(params, updates), params), keep(new_state, opt_state)


@dataclasses.dataclass(frozen=True)
class AdamW:
  """An optax GradientTransformation (init, update): chain(clip_by_global_norm, adamw)'s maths and state layout,
  written in place-friendly form. The values of the chain: the same operations in the same order, except that a
  clipped gradient is multiplied by max_norm / norm (optax: divided by norm, then multiplied by max_norm; a
  rounding apart) so that the clip fuses into each moment's update instead of being a gradient-sized temporary
  (tests/test_learner_optim.py)."""

  chain: optax.GradientTransformation
  schedule: optax.Schedule
  b1: float
  b2: float
  eps: float
  weight_decay: float
  max_grad_norm: float | None

  def init(self, params):
    return self.chain.init(params)

  def update(self, grads, state, params) -> tuple[Any, Any]:
    count, mu, nu = self._moments(grads, state)
    _, (adam, masked, sched) = self._parts(state)
    updates = self._updates(params, mu, nu, count, sched.count)
    return updates, self._state(state, optax.ScaleByAdamState(count=count, mu=mu, nu=nu), masked,
                                optax.safe_increment(sched.count))

  def _parts(self, state):
    """(clip state or None, (adam, masked, schedule)) of an optimizer state."""
    return state if self.max_grad_norm is not None else (None, state)

  def _state(self, old, adam, masked, sched_count):
    clip_state, _ = self._parts(old)
    new = (adam, masked, optax.ScaleByScheduleState(count=sched_count))
    return new if self.max_grad_norm is None else (clip_state, new)

  def _moments(self, grads, state):
    """(count, mu, nu) after this update: the gradients clipped (multiplied by max_norm / norm), then Adam's."""
    _, (adam, _, _) = self._parts(state)
    if self.max_grad_norm is not None:
      g_norm = optax.tree.norm(grads)
      trigger = jnp.squeeze(g_norm < self.max_grad_norm)
      scale = jnp.where(trigger, 1.0, self.max_grad_norm / g_norm)
      grads = jax.tree.map(lambda t: t * scale.astype(t.dtype), grads)
    mu = jax.tree.map(lambda g, t: (1 - self.b1) * (g**1) + self.b1 * t, grads, adam.mu)
    nu = jax.tree.map(lambda g, t: (1 - self.b2) * (g**2) + self.b2 * t, grads, adam.nu)
    return optax.safe_increment(adam.count), mu, nu

  def _updates(self, params, mu, nu, count, sched_count):
    """AdamW's parameter updates from the new moments (count: the updates so far, this one included)."""
    bc1, bc2 = 1 - self.b1**count, 1 - self.b2**count
    step_size = -self.schedule(sched_count)

    def update(p, m, v, decay):
      u = (m / bc1.astype(m.dtype)) / (jnp.sqrt(v / bc2.astype(v.dtype) + 0.0) + self.eps)
      if decay and self.weight_decay != 0.0:
        u = u + self.weight_decay * p
      return jnp.array(step_size, u.dtype) * u

    return jax.tree.map(update, params, mu, nu, _decayed(params))

  def update_if(self, grads, state, params, ok: jax.Array) -> tuple[Any, Any]:
    """(params, state) after `update` and optax.apply_updates where `ok`, else both as they were: the skip inside
    each moment's and each parameter's update, so that XLA writes them over the donated old ones."""
    count, mu, nu = self._moments(grads, state)
    _, (adam, masked, sched) = self._parts(state)
    keep = lambda new, old: jnp.where(ok, new, old)
    mu = jax.tree.map(keep, mu, adam.mu)
    nu = jax.tree.map(keep, nu, adam.nu)
    # The parameter update reads the moments written above, not their inputs: without the barrier XLA recomputes
    # them inside it from the old moments, which then have to be copied before they are overwritten.
    mu, nu = jax.lax.optimization_barrier((mu, nu))
    updates = self._updates(params, mu, nu, count, sched.count)
    params = jax.tree.map(lambda p, u: keep(jnp.asarray(p + u).astype(p.dtype), p), params, updates)
    adam = optax.ScaleByAdamState(count=keep(count, adam.count), mu=mu, nu=nu)
    return params, self._state(state, adam, masked, keep(optax.safe_increment(sched.count), sched.count))

def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0, end_lr_ratio: float = 0.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   max_grad_norm: float | None = 1.0) -> AdamW:
  """AdamW; linear warmup over warmup_steps, then cosine decay to end_lr_ratio * lr over decay_steps (0: flat).

  Weight decay skips vectors (norm scales, biases). Steps count applied updates: a skipped update is never
  passed to the optimizer, so it does not advance the schedule.
  """
  if learning_rate <= 0:
    raise ValueError(f"learning_rate must be > 0 (got {learning_rate})")
  if warmup_steps < 0 or decay_steps < 0:
    raise ValueError(f"warmup_steps and decay_steps must be >= 0 (got {warmup_steps}, {decay_steps})")
  if max_grad_norm is not None and not max_grad_norm > 0:
    raise ValueError(f"max_grad_norm must be > 0 or None (got {max_grad_norm})")
  after = (optax.cosine_decay_schedule(learning_rate, decay_steps, end_lr_ratio) if decay_steps
           else optax.constant_schedule(learning_rate))
  schedule = (optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps), after], [warmup_steps])
              if warmup_steps else after)
  adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                      mask=_decayed)
  chain = adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
  return AdamW(chain, schedule, b1, b2, eps, weight_decay, max_grad_norm)
