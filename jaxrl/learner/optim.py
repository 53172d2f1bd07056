"""The learner's optimizer: AdamW on a warmup + cosine (or constant) schedule, after global-norm clipping."""

from __future__ import annotations

import jax
import optax


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0, end_lr_ratio: float = 0.0,
                   weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   max_grad_norm: float | None = 1.0) -> optax.GradientTransformation:
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
                      mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))
  return adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
