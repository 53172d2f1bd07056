"""Weights from the learner to sampler programs that are not in its jax.distributed job (issue 43), over
jax.experimental.transfer: one TransferServer per process; the learner's `describe` (an RPC the hub mounts as
"weights") registers the newest version for one pull under a fresh uuid and says where and what to pull; the
sampler pulls it, checks it against the learner's checksums and places it on its own shardings.

What the transfer API does on this jaxlib (probed on CPU, docs/RELIABILITY.md "Weight pull"):
- one await_pull serves one pull: each buffer can be fetched once ("has already been fetched"), so every describe
  makes its own uuid (the arrays are shared by reference, not copied);
- the destination must hold as many shards as the source, in the same order ("Buffer id out of range" otherwise):
  the learner serves each version on one device and the sampler pulls onto one of its devices, then reshards
  locally (device_put onto the engine's shardings);
- await_pull's timeout drops the entry, and the pull's own timeout is not enforced (a pull of an unknown or expired
  uuid waits until the connection closes): every pull here is bounded by a thread that is left behind on timeout;
- TransferServer has no close: the process's server lives as long as the process.

The transfer server's port has no authentication of its own: a pull needs the uuid of a registration, which only
`describe` gives (to a caller that proved the run's secret over rpc, and, on the lead, to a registered sampler).
The uuid is 62 bits from `secrets`, registered for one pull: a one-time capability. Registrations cannot be
cancelled, and each holds its version's arrays until pulled or expired (serve_s): a sampler may hold max_pending
registrations it has not pulled (a describe with a newer "have" says it pulled or gave up the older ones), the
server max_pending_total in all; past either, describe answers without a pull ("busy") and the sampler asks again.
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import json
import secrets
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer as jax_transfer
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.sharding import Versioned, transfer


class ChecksumError(ValueError):
  """Pulled weights whose bytes differ from what the learner published."""


# Bytes per transferred piece: the server's default (256 MiB) moves a large array as one piece over one stream;
# smaller pieces go max_num_parallel_copies (8) at a time (bench/weight_pull.py --chunk_mib compares).
CHUNK_BYTES = 16 << 20


@functools.cache
def transfer_server(host: str = "127.0.0.1", chunk_bytes: int = CHUNK_BYTES) -> jax_transfer.TransferServer:
  """This process's transfer server, listening on host (a free port)."""
  return jax_transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"],
                                            transfer_size=chunk_bytes)


def _words(x: jax.Array) -> jax.Array:
  """x's bytes as uint32 words: 4 bytes a word (a last partial word widened), 8-byte elements as two."""
  x = x.reshape(-1)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  size = x.dtype.itemsize
  if size >= 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  x, per = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")), 4 // size
  whole = x.size - x.size % per
  packed = jax.lax.bitcast_convert_type(x[:whole].reshape(-1, per), jnp.uint32)
  return jnp.concatenate([packed, x[whole:].astype(jnp.uint32)]) if whole < x.size else packed


@jax.jit
def _checksums(leaves: list[jax.Array]) -> jax.Array:
  """[leaves, 2] uint32: per leaf, the sum of its words and the sum of word * (position + 1), both mod 2**32
  (Fletcher-style: any change of one word changes the first, a reordering almost surely the second). One pass over
  the bytes on the arrays' device; not a defence against a forger."""
  def one(x):
    w = _words(x)
    return jnp.stack([w.sum(dtype=jnp.uint32), (w * (jnp.arange(w.size, dtype=jnp.uint32) + 1)).sum(dtype=jnp.uint32)])
  return jnp.stack([one(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def checksums(leaves: list[jax.Array]) -> list[list[int]]:
  return np.asarray(_checksums(list(leaves))).tolist()


def digest(sums: list[list[int]]) -> str:
  """One short string for a tree's checksums: equal trees, equal digests."""
  return hashlib.sha256(json.dumps(sums).encode()).hexdigest()[:16]


def local_copy(mesh, device) -> Callable:
  """params sharded over `mesh` (a learner over several processes) -> a full copy on `device`, one of this
  process's: the params replicated over the mesh, then this process's replica on `device`. The replication is a
  collective, so every learner process gathers every version, in the same order (`.compile(params)` ahead)."""
  replicate = jax.jit(lambda params: params, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def gather(params):
    return jax.tree.map(lambda x: next(s.data for s in x.addressable_shards if s.device == device),
                        replicate(params))

  gather.compile = lambda params: replicate.lower(params).compile()
  return gather


def _bounded(fn: Callable, timeout_s: float, what: str):
  """fn() in a daemon thread, waited for at most timeout_s (TimeoutError(what) after; the thread is left behind:
  neither the rpc nor a transfer pull can be cancelled)."""
  out: dict = {}

  def run():
    try:
      out["value"] = fn()
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      out["error"] = e

  thread = threading.Thread(target=run, daemon=True, name="weights-wait")
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    raise TimeoutError(what)
  if "error" in out:
    raise out["error"]
  return out["value"]


def _names(tree) -> list[str]:
  """Leaf paths, without the `.value` of an nnx Variable (a params tree has them, a tree of its shardings not)."""
  return [jax.tree_util.keystr(tuple(k for k in path if k != jax.tree_util.GetAttrKey("value")))
          for path, _ in jax.tree_util.tree_leaves_with_path(tree)]


class WeightServer:
  """The learner's lead process: publish() stages each version on one device, cast (dtype) or int8-quantized
  (weight_dtype) exactly as an in-process publish places them for the sampler engine (sharding.transfer), with its
  checksums; describe() serves the newest to one sampler pull. A LoRA learner publishes its adapters alone."""

  def __init__(self, *, dtype=None, weight_dtype: str = "float", host: str = "127.0.0.1", device=None,
               serve_s: float = 120.0, chunk_bytes: int = CHUNK_BYTES, gather: Callable | None = None,
               max_pending: int = 2, max_pending_total: int = 16):
    """serve_s: how long a described pull stays registered (then the transfer server drops it and its references);
    gather: params -> a full copy on `device`, for params this process does not hold whole (local_copy);
    max_pending(_total): registrations not yet pulled, per sampler and in all (module docstring)."""
    self._dtype, self._weight_dtype, self._serve_s, self._gather = dtype, weight_dtype, serve_s, gather
    self._where = SingleDeviceSharding(device or jax.local_devices()[0])
    self._server = transfer_server(host, chunk_bytes)
    self.address = self._server.address()
    self._lock = threading.Lock()
    self._newest: tuple[int, list[jax.Array], dict] | None = None
    self.max_pending, self.max_pending_total = max_pending, max_pending_total
    self._pending: list[tuple[str, int, float]] = []  # registrations not known pulled: (sampler, version, expiry)
    self.published = 0
    self.served = 0  # pulls registered for samplers (describe)
    self.busy = 0  # describes answered without a pull: too many registrations not pulled
    self.digests: dict[int, str] = {}  # version -> a digest of its checksums, for every version published
    self.timings: dict[str, float] = {}  # the last publish's seconds: staging (cast, quantize, copy), checksums

  def publish(self, params, version: int) -> None:
    start = time.perf_counter()
    if self._gather is not None:
      params = self._gather(params)
    staged = transfer(params, version, self._where, self._dtype, self._weight_dtype).params
    # The learner donates its params to the next step: what is served must not share their buffers (a leaf that
    # needed no cast nor move, already on this device, does).
    held = {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params) for s in x.addressable_shards}
    leaves = jax.block_until_ready([jnp.copy(x) if x.unsafe_buffer_pointer() in held else x
                                    for x in jax.tree.leaves(staged)])
    staged_at = time.perf_counter()
    info = {"checksums": checksums(leaves), "names": _names(staged),
            "leaves": [[list(x.shape), str(x.dtype)] for x in leaves]}
    self.timings = {"stage_s": staged_at - start, "checksum_s": time.perf_counter() - staged_at}
    with self._lock:
      if self._newest is not None and version <= self._newest[0]:
        raise ValueError(f"published version {version} is not newer than {self._newest[0]}")
      self._newest = (int(version), leaves, info)  # older versions live on only in pulls still registered
      self.published += 1
      self.digests[int(version)] = digest(info["checksums"])

  def describe(self, request: dict) -> dict:
    """{"sampler", "have"} -> {"version": the newest (-1: none yet)}, plus, when newer than "have", the pull:
    "address", "uuid" (registered for one pull for serve_s), "names", "leaves" ([shape, dtype]) and "checksums"."""
    have, sampler = int(request.get("have", -1)), str(request.get("sampler"))
    with self._lock:
      newest = self._newest
      if newest is None or newest[0] <= have:
        return {"version": -1 if newest is None else newest[0]}
      now = time.monotonic()
      self._pending = [(s, v, end) for s, v, end in self._pending if end > now and not (s == sampler and v <= have)]
      if (sum(s == sampler for s, _, _ in self._pending) >= self.max_pending
          or len(self._pending) >= self.max_pending_total):
        self.busy += 1
        return {"version": newest[0], "busy": True}
      self._pending.append((sampler, newest[0], now + self._serve_s))
      self.served += 1
    version, leaves, info = newest
    uuid = secrets.randbits(62)  # unguessable: the transfer port takes any pull of a registered uuid
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=self._serve_s)
    self._server.await_pull(uuid, leaves, timeout=deadline)
    return {"version": version, "address": self.address, "uuid": uuid, **copy.deepcopy(info)}  # a caller's own

  def close(self) -> None:
    """Serves nothing more (the transfer server itself has no close; registered pulls expire after serve_s)."""
    with self._lock:
      self._newest = None


class WeightClient:
  """A sampler program's side: take_newer asks the learner (describe), pulls a newer version onto one device of
  the engine's shardings, checks its checksums and places it on the shardings (engine.publish_shardings: the
  engine's place() then takes it unchanged)."""

  def __init__(self, describe: Callable[[dict], dict], shardings, *, sampler: str = "0", timeout_s: float = 60.0,
               host: str = "127.0.0.1", chunk_bytes: int = CHUNK_BYTES):
    self._describe, self._sampler, self.timeout_s = describe, str(sampler), timeout_s
    self._dst, self._treedef = jax.tree.flatten(shardings)
    self._names = _names(shardings)
    device = min(self._dst[0].device_set, key=lambda d: d.id)
    self._one = SingleDeviceSharding(device)
    self._server = transfer_server(host, chunk_bytes)
    self._connections: dict[str, object] = {}
    self.pulled = 0
    self.timings: dict[str, float] = {}  # the last pull's seconds: describe, pull, check, place

  def take_newer(self, version: int) -> Versioned | None:
    """The learner's newest params if newer than `version`, else None; TimeoutError (one line: the peer, the
    version, what was waited for) when the learner does not answer or the pull does not complete in timeout_s;
    ChecksumError when the bytes differ from the learner's."""
    start = time.perf_counter()
    reply = _bounded(lambda: self._describe({"sampler": self._sampler, "have": int(version)}), self.timeout_s,
                     f"weights: no answer to describe (have v{version}) from the learner within {self.timeout_s}s")
    if "uuid" not in reply or reply["version"] <= version:
      return None
    return self._pull(reply, time.perf_counter() - start)

  def _pull(self, reply: dict, describe_s: float) -> Versioned:
    version, address = int(reply["version"]), reply["address"]
    if reply["names"] != self._names:
      diff = next((f"{a} != {b}" for a, b in zip(reply["names"], self._names, strict=False) if a != b),
                  f"{len(reply['names'])} leaves != {len(self._names)}")
      raise ValueError(f"weights v{version} from {address}: the learner's tree is not the engine's ({diff})")
    specs = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=self._one)
             for shape, dtype in reply["leaves"]]
    if address not in self._connections:
      self._connections[address] = self._server.connect(address)
    conn = self._connections[address]
    # The pull's own timeout is not enforced by this jaxlib (module docstring); passed for builds that do.
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout_s)
    start = time.perf_counter()
    pulled = _bounded(lambda: jax.block_until_ready(conn.pull(reply["uuid"], specs, timeout=deadline)),
                      self.timeout_s, f"weights: pull of v{version} from {address} (uuid {reply['uuid']}, "
                      f"{len(specs)} arrays) not complete within {self.timeout_s}s")
    pulled_at = time.perf_counter()
    got = checksums(pulled)
    checked_at = time.perf_counter()
    if got != reply["checksums"]:
      bad = next(n for n, a, b in zip(self._names, got, reply["checksums"], strict=True) if a != b)
      raise ChecksumError(f"weights v{version} from {address}: checksum of {bad} is {got[self._names.index(bad)]}, "
                          f"the learner's {reply['checksums'][self._names.index(bad)]}")
    placed = jax.block_until_ready(jax.device_put(pulled, self._dst))
    self.pulled += 1
    self.timings = {"describe_s": describe_s, "pull_s": pulled_at - start, "check_s": checked_at - pulled_at,
                    "place_s": time.perf_counter() - checked_at}
    return Versioned(jax.tree.unflatten(self._treedef, placed), version)
