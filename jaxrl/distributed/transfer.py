"""Cross-host copies between learner and samplers, and the one order in which every process issues them.

JAX pairs the two ends of a cross-host copy by a per-process counter that every process advances on every
cross-host `device_put`, whether it takes part or not (xla/python/transfer/pjrt_transfer_server.cc). So all
processes must issue the same copies in the same order: the TransferLog is that order. The source of a copy must
have the destination's layout (same mesh shape and spec, as many devices), so it is resharded on the source side.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding


class TransferLog:
  """Append-only list of copies in the store: any process appends (an atomic counter gives the slot), every process
  reads it in order."""

  def __init__(self, store, poll_s: float = 0.2):
    self.store, self.poll_s = store, poll_s

  def append(self, entry: dict) -> int:
    slot = self.store.incr("xfer/n") - 1
    self.store.set(f"xfer/{slot}", entry)
    return slot

  def follow(self, stop: threading.Event) -> Iterator[dict | None]:
    """Entries in order; None every poll_s while waiting (a tick for periodic work) until `stop` is set."""
    slot = 0
    while not stop.is_set():
      try:
        entry = self.store.get(f"xfer/{slot}", self.poll_s)
      except TimeoutError:
        yield None
        continue
      slot += 1
      yield entry


def _whole(index: tuple, shape: tuple) -> bool:
  """Whether a shard index (a tuple of slices) covers the whole of `shape`."""
  return all(isinstance(i, slice) and i.indices(n) == (0, n, 1) for i, n in zip(index, shape, strict=True))


def source_devices(learner_devices: Sequence[Any], count: int, replica: int) -> list[Any]:
  """The `count` learner devices that send to sampler `replica`; replicas start at different devices to spread
  the sending over the learner hosts."""
  n = len(learner_devices)
  if count > n:
    raise ValueError(f"a sampler replica of {count} devices needs as many learner devices to send its weights "
                     f"from, but the learner has {n}")
  start = replica * count % n
  return [learner_devices[(start + i) % n] for i in range(count)]


def _mesh_like(mesh: Mesh, devices: Sequence[Any]) -> Mesh:
  return Mesh(np.array(devices, dtype=object).reshape(mesh.devices.shape), mesh.axis_names,
              axis_types=mesh.axis_types)


def _placeholder(shape, dtype, sharding) -> jax.Array:
  """A global array of which this process holds no shard (its side of a copy it does not send)."""
  return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


class WeightRoute:
  """Params from the learner to one sampler replica, bit for bit, in the replica's own layout."""

  def __init__(self, abstract_params, dst_shardings, src_devices: Sequence[Any]):
    leaves, self._treedef = jax.tree.flatten(abstract_params)
    dst = jax.tree.leaves(jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), dst_shardings, abstract_params))
    if len(dst) != len(leaves):
      raise ValueError(f"{len(dst)} destination shardings for {len(leaves)} parameters")
    self._avals = [(tuple(x.shape), x.dtype) for x in leaves]
    self._dst = dst
    self._src = [NamedSharding(_mesh_like(s.mesh, src_devices), s.spec) for s in dst]

  def stage(self, replicated_params) -> list[jax.Array]:
    """The source arrays: every local source device cuts its piece from its local replicated copy."""
    out = []
    for x, src, (shape, dtype) in zip(jax.tree.leaves(replicated_params), self._src, self._avals, strict=True):
      local = {s.device: s.data for s in x.addressable_shards}
      # A piece that is the whole array is the array (not an eager slicing op per leaf on the learner's core).
      pieces = [local[d] if _whole(index, shape) else local[d][index]
                for d, index in src.addressable_devices_indices_map(shape).items()]
      out.append(jax.make_array_from_single_device_arrays(shape, src, pieces, dtype=dtype))
    return out

  def placeholders(self) -> list[jax.Array]:
    return [_placeholder(shape, dtype, src) for (shape, dtype), src in zip(self._avals, self._src, strict=True)]

  def copy(self, sources: list[jax.Array]):
    """Issues the copy (every process calls it, with stage() or placeholders()); the params tree on the replica."""
    return jax.tree.unflatten(self._treedef, jax.device_put(sources, self._dst))


def copy_packet(packet: jax.Array | None, shape: tuple[int, int], src_device, dst_devices: Sequence[Any]
                ) -> list[jax.Array]:
  """A rollout packet from a sampler device to each of dst_devices (one per learner process), one copy each.

  packet: the source array on src_device where this process sends it, else None.
  """
  src = SingleDeviceSharding(src_device)
  if packet is None:
    packet = _placeholder(shape, np.int32, src)
  return [jax.device_put(packet, SingleDeviceSharding(d)) for d in dst_devices]


def save_local_shards(tree, path: str | Path) -> None:
  """Writes every shard this process holds, with the array's shape and the shard's index, to an .npz (for bitwise
  checks across processes)."""
  out = {}
  for key_path, x in jax.tree_util.tree_leaves_with_path(tree):
    name, shape = jax.tree_util.keystr(key_path), ",".join(map(str, x.shape))
    for shard in x.addressable_shards:
      index = ",".join(f"{s.start or 0}:{n if s.stop is None else s.stop}"
                       for s, n in zip(shard.index, x.shape, strict=True))
      out[f"{name}|{shape}|{index}"] = np.asarray(shard.data)
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  np.savez(path, **out)


def load_shards(paths: Sequence[str | Path]) -> dict[str, np.ndarray]:
  """Reassembles whole arrays (by parameter name) from save_local_shards files; every element must be covered and
  shards that overlap (replicas) must agree bit for bit."""
  out: dict[str, np.ndarray] = {}
  covered: dict[str, np.ndarray] = {}
  for path in paths:
    with np.load(path) as f:
      for key in f.files:
        name, shape, index = key.rsplit("|", 2)
        shape = tuple(int(n) for n in shape.split(",") if n)
        where = tuple(slice(*map(int, part.split(":"))) for part in index.split(",") if part)
        data = f[key]
        if name not in out:
          out[name], covered[name] = np.zeros(shape, data.dtype), np.zeros(shape, bool)
        seen = covered[name][where]
        if out[name][where][seen].tobytes() != data[seen].tobytes():
          raise ValueError(f"{name}: replicated shards disagree at {where}")
        out[name][where], covered[name][where] = data, True
  for name, mask in covered.items():
    if not mask.all():
      raise ValueError(f"{name}: shards do not cover the whole array")
  return out
