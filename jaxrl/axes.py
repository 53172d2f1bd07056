"""Logical axis names and the rules that map them to mesh axes, for the learner's and the sampler's meshes.

Apart from jaxrl.sharding (which re-exports them) because it imports the models: the kernels, which the models
import, read the rules too, to run per device on the shards the rules give (jaxrl.kernels.mosaic).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

# Logical axis -> mesh axis (or tuple of mesh axes, or None). An axis missing from the mesh is replicated.
LEARNER_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # rows over the expert axis too: only the experts' matmuls gather them
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),  # a MoE layer's experts (jaxrl/models/moe.py): expert parallelism over an "expert" mesh axis
)
SAMPLER_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("layers", None),
    ("vocab", "tensor"),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh,
                    rules: Sequence[tuple[str, Any]]) -> P:
  """Maps logical axes to a PartitionSpec; a mesh axis is used once, and only where it divides the dimension."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape, strict=True):
    targets = table.get(name) if name is not None else None
    targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
    chosen = tuple(t for t in targets if t in mesh.shape and t not in used and mesh.shape[t] > 1)
    while chosen and dim % math.prod(mesh.shape[t] for t in chosen):
      chosen = chosen[:-1]  # replicate what does not divide evenly (e.g. 2 kv heads on a tensor axis of 4)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return P(*spec)


def constrain_rows(x: jax.Array) -> jax.Array:
  """x with its leading (row) axis split over the learner's batch axes (LEARNER_RULES) of the mesh in context, the
  rest whole; unchanged without one. The learner's train step traces under its mesh (under_mesh), so a model's
  activations stay row-sharded through the layer scan and FSDP gathers each layer's weights: left to itself,
  XLA:TPU kept the weights sharded and all-reduced the whole batch's activations on every chip instead (several
  times FSDP's collective bytes: jaxrl-compile; docs/TPU.md, "What the compiled programs show")."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else tuple(a for a in dict(LEARNER_RULES)["batch"] if a in mesh.axis_names)
  if not axes:
    return x
  return jax.lax.with_sharding_constraint(x, P(axes, *([None] * (x.ndim - 1))))
