"""TrainState (everything a train step reads and writes) and its construction on a mesh."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@flax.struct.dataclass
class TrainState:
  """Learner state. `version` is the policy version: the number of applied learner steps."""

  params: Any
  opt_state: Any
  step: jax.Array  # int32: train_step calls so far
  version: jax.Array  # int32: applied learner steps, one per step whatever its mini-batches (a skipped one: none)
  skipped: jax.Array  # int32: learner steps skipped (non-finite loss or gradient, non-finite reward, no tokens)
  rng: jax.Array  # the run's learner key, checkpointed with the state; derive step keys from (rng, step)
  ref_params: Any = None  # frozen reference policy of the KL term; None without one
  # The params the step reads and never trains (a LoRA run's base model; None: every param trains). `params` and
  # `ref_params` then hold what trains on top of it (the adapters); checkpoints leave it out (the loaded model).
  frozen: Any = None


def init_train_state(params, optimizer: optax.GradientTransformation, *, rng: jax.Array | int = 0,
                     version: int = 0, ref_params=None, frozen=None,
                     shardings: TrainState | None = None) -> TrainState:
  """A fresh state at `version`; with `shardings` (see train_state_shardings) it is built in place on the mesh."""
  if version < 0:
    raise ValueError(f"version must be >= 0 (got {version})")
  key = jax.random.key(rng) if isinstance(rng, int) else rng

  def init(params, ref_params, frozen, key):
    zero = jnp.zeros((), jnp.int32)
    return TrainState(params=params, opt_state=optimizer.init(params), step=zero,
                      version=zero + version, skipped=zero, rng=key, ref_params=ref_params, frozen=frozen)

  return jax.jit(init, out_shardings=shardings)(params, ref_params, frozen, key)


def _expand(prefix_tree, full_tree):
  """Broadcasts a prefix tree (e.g. one NamedSharding per nnx.Param) to the full structure of full_tree."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), prefix_tree, full_tree)


def train_state_shardings(params, optimizer: optax.GradientTransformation, param_shardings, mesh: Mesh,
                          with_ref: bool = False, frozen=None, frozen_shardings=None) -> TrainState:
  """Shardings of every TrainState leaf: optimizer moments follow their parameter, scalars are replicated.

  param_shardings may be a prefix of params (as jaxrl.sharding.param_shardings returns for nnx.State);
  frozen, frozen_shardings: TrainState.frozen (a LoRA run's base; None without one) and its shardings (a prefix).
  """
  replicated = NamedSharding(mesh, P())
  param_shardings = _expand(param_shardings, params)
  abstract_opt = jax.eval_shape(optimizer.init, params)
  opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_shardings,
                                        transform_non_params=lambda _: replicated)
  return TrainState(params=param_shardings, opt_state=opt_shardings, step=replicated, version=replicated,
                    skipped=replicated, rng=replicated, ref_params=param_shardings if with_ref else None,
                     frozen=None if frozen is None else _expand(frozen_shardings, frozen))
