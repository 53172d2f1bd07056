"""Meshes, the sampler/learner split, shardings from the logical-axis rules (jaxrl.axes), and versioned parameter
transfer between submeshes.

Meshes use Auto axes (GSPMD: shardings given at jit boundaries and by constraints), so one train step or decode
step serves FSDP, tensor parallel or both, chosen by the rules alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# The logical-axis rules live in jaxrl.axes (no model imports: the kernels read them too); imported from here as before.
from jaxrl.axes import LEARNER_RULES as LEARNER_RULES
from jaxrl.axes import SAMPLER_RULES as SAMPLER_RULES
from jaxrl.axes import constrain_rows as constrain_rows
from jaxrl.axes import logical_to_spec
from jaxrl.models import quant


def _ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """Devices grouped by process, each process's devices in its local order (ids are not contiguous per host)."""
  devices = list(jax.devices() if devices is None else devices)
  local_rank = {}
  for d in devices:
    local_rank[d] = sum(1 for e in local_rank if e.process_index == d.process_index)
  return sorted(devices, key=lambda d: (d.process_index, local_rank[d]))


def resolve_axis_sizes(axes: Mapping[str, int] | Sequence[tuple[str, int]], num_devices: int) -> dict[str, int]:
  """Fills the one -1 ("the rest") and checks that the sizes multiply to num_devices."""
  axes = dict(axes)
  if not axes:
    raise ValueError("a mesh needs at least one axis")
  bad = {k: v for k, v in axes.items() if not isinstance(v, int) or (v < 1 and v != -1)}
  if bad:
    raise ValueError(f"mesh axis sizes must be positive ints or -1 (the rest), got {bad}")
  rest = [k for k, v in axes.items() if v == -1]
  if len(rest) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {rest}")
  known = math.prod(v for v in axes.values() if v != -1)
  if rest:
    if num_devices % known:
      raise ValueError(f"mesh axes {axes}: {num_devices} devices are not divisible by {known}")
    axes[rest[0]] = num_devices // known
  if math.prod(axes.values()) != num_devices:
    raise ValueError(f"mesh axes {axes} need {math.prod(axes.values())} devices, {num_devices} given")
  return axes


def under_mesh(fn, mesh: Mesh):
  """fn traced with `mesh` in scope (jax.sharding.get_abstract_mesh() inside it; a jit of it needs no jax.set_mesh
  around its calls): the kernels a program calls run in shard_map over it (XLA cannot partition a Mosaic call),
  and "auto" kernels pick by its devices' platform, which is the target's also in a deviceless TPU compile."""

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)

  return traced


def make_mesh(axes: Mapping[str, int] | Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh with Auto axes over `devices` (default: all), e.g. make_mesh({"fsdp": -1, "tensor": 2})."""
  devices = _ordered_devices(devices)
  sizes = resolve_axis_sizes(axes, len(devices))
  grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
  return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def sampler_count(num_sampler: int | float, pool: int) -> int:
  """The sampler's devices in a pool of `pool`: mesh.sampler_devices as a count, or a fraction of the pool (at
  least one device)."""
  return max(1, round(num_sampler * pool)) if isinstance(num_sampler, float) else num_sampler


def split_devices(num_sampler: int | float, devices: Sequence[jax.Device] | None = None,
                  whole_processes: bool = False) -> tuple[list[jax.Device], list[jax.Device]]:
  """Disjoint (learner, sampler) device lists: the learner takes the first devices, the sampler the last.

  num_sampler is a count (int) or a fraction of the pool (float in (0, 1)). With whole_processes, the split
  falls on a process boundary so that each process serves one role (multi-host pipelines).
  """
  devices = _ordered_devices(devices)
  n = len(devices)
  if isinstance(num_sampler, float):
    if not 0 < num_sampler < 1:
      raise ValueError(f"sampler fraction must be in (0, 1), got {num_sampler}")
  num_sampler = sampler_count(num_sampler, n)
  if not isinstance(num_sampler, (int, np.integer)) or not 0 < num_sampler < n:
    raise ValueError(f"sampler devices must be in [1, {n - 1}] for a pool of {n} devices, got {num_sampler}")
  learner, sampler = devices[: n - num_sampler], devices[n - num_sampler :]
  if whole_processes and {d.process_index for d in learner} & {d.process_index for d in sampler}:
    raise ValueError(f"a split of {len(learner)} learner / {num_sampler} sampler devices cuts through a process")
  return learner, sampler


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes(params: nnx.State) -> nnx.State:
  """Logical axis names of every parameter (stacked blocks gain a leading "layers" axis)."""

  def axes_of(path, v):
    axes = tuple(v.get_metadata().get("axes", (None,) * v.get_value().ndim))
    under_blocks = any(getattr(k, "key", None) == "blocks" for k in path)
    if under_blocks and len(axes) == v.get_value().ndim - 1:
      axes = ("layers", *axes)
    if len(axes) != v.get_value().ndim:
      raise ValueError(f"parameter {jax.tree_util.keystr(path)} has shape {v.get_value().shape} but axes {axes}")
    return axes

  return jax.tree_util.tree_map_with_path(axes_of, params, is_leaf=_is_variable)


def param_shardings(params: nnx.State, mesh: Mesh, rules: Sequence[tuple[str, Any]]) -> nnx.State:
  """NamedSharding for every parameter, following the logical-axis rules."""
  axes = logical_axes(params)
  return jax.tree.map(
      lambda v, a: NamedSharding(mesh, logical_to_spec(a, v.get_value().shape, mesh, rules)),
      params, axes, is_leaf=lambda x: _is_variable(x) or isinstance(x, tuple),
  )


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]], ndim: int = 2) -> NamedSharding:
  """Shards the leading (batch) dimension over the mesh axes the "batch" rule names."""
  targets = dict(rules).get("batch")
  targets = (targets,) if isinstance(targets, str) else tuple(targets or ())
  chosen = tuple(t for t in targets if t in mesh.shape)
  lead = None if not chosen else chosen[0] if len(chosen) == 1 else chosen
  return NamedSharding(mesh, P(lead, *([None] * (ndim - 1))))


@dataclasses.dataclass(frozen=True)
class Versioned:
  """A parameter pytree and the policy version (number of learner updates) it holds."""

  params: Any
  version: int


def transfer(params: Any, version: int, dst_shardings: Any, dtype=None, weight_dtype: str = "float") -> Versioned:
  """Moves params to another submesh's shardings (asynchronous dispatch), optionally casting the dtype first;
  weight_dtype "int8": its large matmul weights quantized (jaxrl.models.quant; dst_shardings then of that layout).

  The cast happens on the source side, so that exactly the bytes the sampler will use are sent.
  """
  if version < 0:
    raise ValueError(f"policy version must be >= 0, got {version}")
  if weight_dtype == "int8":
    params = params if quant.is_quantized(params) else quant.quantize_params(params, dtype)
  elif weight_dtype != "float":
    raise ValueError(f"weight_dtype must be one of {quant.WEIGHT_DTYPES} (got {weight_dtype!r})")
  elif dtype is not None:
    params = jax.tree.map(lambda x: x.astype(dtype), params)
  return Versioned(jax.device_put(params, dst_shardings), int(version))
