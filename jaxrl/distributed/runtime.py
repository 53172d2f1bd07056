"""Joining a multi-controller JAX job, the roles of its processes, and the coordination service's key-value store.

One `jax.distributed` job runs one process per host (or per accelerator). The learner mesh spans the first
processes; every later process is one sampler replica on its own devices. Small control data (versions, counters,
stop reasons) goes through the store that `jax.distributed.initialize` already runs on process 0.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import jax

from jaxrl import sharding

# Set by jaxrl.distributed.launch (or by hand); on TPU VMs and under Slurm jax.distributed detects them itself.
ENV_NUM_PROCESSES = "JAXRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRL_PROCESS_ID"
ENV_TRANSFER_ADDRESS = "JAXRL_TRANSFER_ADDRESS"  # "host:port" of this process's cross-host transfer socket


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, transfer_address: str | None = None,
               heartbeat_timeout_s: int = 60, shutdown_timeout_s: int = 60) -> None:
  """Joins the job; call before anything touches a JAX backend. Arguments left None come from the environment.

  transfer_address ("host:port", a real port: port 0 is advertised as is and cannot be reached) turns on JAX's
  socket (DCN) cross-host transfers, which backends without native ones (CPU) need.
  heartbeat_timeout_s is JAX's own backstop: the coordination service aborts every process when one stops
  heartbeating for this long. jaxrl's watchdog reacts sooner and says which process it was.
  """
  env = os.environ
  if num_processes is None and ENV_NUM_PROCESSES in env:
    num_processes = int(env[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in env:
    process_id = int(env[ENV_PROCESS_ID])
  transfer_address = transfer_address or env.get(ENV_TRANSFER_ADDRESS)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
  if transfer_address:
    if transfer_address.rsplit(":", 1)[-1] in ("", "0"):
      raise ValueError(f"transfer address {transfer_address!r} needs an explicit port")
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             shutdown_timeout_seconds=shutdown_timeout_s)
  if jax.process_count() > 1 and jax.default_backend() == "cpu":
    # A persistent compilation cache would make the processes of a CPU job run different executables of one
    # program: each process's own CPU topology enters its cache key, so only process 0, the one that writes, ever
    # finds an entry, and it runs the executable loaded from the cache while the others compile theirs. XLA:CPU's
    # loaded executable does not issue its collectives in a fresh compile's order: with the learner's layer scan
    # gathering weights (axes.constrain_rows), process 0 waited in an all-gather inside the scan and process 1 in
    # an all-reduce outside it, and the job trained no step. (TPU and GPU processes share one key.)
    # cache_process_local_programs turns it back on for a job with no program across processes.
    global _cache_wanted
    _cache_wanted = bool(jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_enable_compilation_cache", False)


_cache_wanted = False  # the persistent cache was on when initialize turned it off


def cache_process_local_programs(topology: Topology) -> bool:
  """Turns the persistent compilation cache back on (if initialize turned it off) when every program of the job
  runs on one process's devices: the learner on one process, as each sampler replica is. No program then has
  collectives across processes, and an executable loaded from the cache runs as a fresh compile does (only process 0
  writes entries: the learner's programs are the ones cached). Call before the first compile: JAX decides the
  cache's use once, at the first compile, so a later call leaves it off. Returns whether it is on."""
  if _cache_wanted and len(topology.learner_processes) == 1:
    jax.config.update("jax_enable_compilation_cache", True)
  return bool(jax.config.jax_enable_compilation_cache)


@dataclasses.dataclass(frozen=True)
class Topology:
  """Which process does what: the learner's devices (one mesh over the first processes), then one sampler replica
  per remaining process, each on that process's devices."""

  process_id: int
  learner_devices: tuple[Any, ...]
  sampler_devices: tuple[tuple[Any, ...], ...]  # one tuple per sampler process, in process order

  @classmethod
  def split(cls, num_sampler_devices: int | float, devices: Sequence[Any], process_id: int) -> Topology:
    learner, sampler = sharding.split_devices(num_sampler_devices, devices, whole_processes=True)
    replicas: dict[int, list] = {}
    for d in sampler:
      replicas.setdefault(d.process_index, []).append(d)
    return cls(process_id, tuple(learner), tuple(tuple(v) for _, v in sorted(replicas.items())))

  def devices_per_process(self) -> list[int]:
    """Each process's device count, in process order (what cli.validate_job checks a config against)."""
    devices = [*self.learner_devices, *(d for replica in self.sampler_devices for d in replica)]
    return [n for _, n in sorted(collections.Counter(d.process_index for d in devices).items())]

  @property
  def learner_processes(self) -> tuple[int, ...]:
    return tuple(sorted({d.process_index for d in self.learner_devices}))

  @property
  def sampler_processes(self) -> tuple[int, ...]:
    return tuple(r[0].process_index for r in self.sampler_devices)

  @property
  def lead(self) -> int:
    """The learner process that writes metrics and orders weight transfers."""
    return self.learner_processes[0]

  @property
  def role(self) -> str:
    return "learner" if self.process_id in self.learner_processes else "sampler"

  @property
  def sampler_rank(self) -> int:
    return self.sampler_processes.index(self.process_id)

  def name(self, process_id: int) -> str:
    """e.g. "learner 0" or "sampler 1"; used in every message about a process."""
    if process_id in self.learner_processes:
      return f"learner {self.learner_processes.index(process_id)}"
    return f"sampler {self.sampler_processes.index(process_id)}"


class Store:
  """JSON values and counters in the coordination service's key-value store, under one prefix.

  Wraps the client that jax.distributed.initialize created (jax keeps it in jax._src.distributed, as JAX's own
  multihost_utils and Orbax use it).
  """

  def __init__(self, client=None, prefix: str = "jaxrl"):
    if client is None:
      from jax._src import distributed

      client = distributed.global_state.client
      if client is None:
        raise RuntimeError("jax.distributed is not initialized: call jaxrl.distributed.runtime.initialize first")
    self._client, self._prefix = client, prefix

  def _key(self, key: str) -> str:
    return f"{self._prefix}/{key}"

  def set(self, key: str, value: Any) -> None:
    self._client.key_value_set(self._key(key), json.dumps(value), allow_overwrite=True)

  def get(self, key: str, timeout_s: float) -> Any:
    """Waits up to timeout_s for the key; raises TimeoutError."""
    try:
      return json.loads(self._client.blocking_key_value_get(self._key(key), max(1, int(timeout_s * 1000))))
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" in str(e):
        raise TimeoutError(f"no value for {key!r} within {timeout_s}s") from None
      raise

  def try_get(self, key: str, default: Any = None) -> Any:
    try:
      return json.loads(self._client.key_value_try_get(self._key(key)))
    except jax.errors.JaxRuntimeError as e:
      if "NOT_FOUND" in str(e):
        return default
      raise

  def incr(self, key: str, n: int = 1) -> int:
    """Atomically adds n to a counter (0 if absent) and returns the new value."""
    return int(self._client.key_value_increment(self._key(key), n))

  def count(self, key: str) -> int:
    """A counter's value (0 if absent)."""
    return self.incr(key, 0)

  def barrier(self, name: str, processes: Sequence[int], timeout_s: float = 3600.0) -> None:
    """Waits until every process in `processes` reaches the barrier of this name."""
    self._client.wait_at_barrier(self._key(name), int(timeout_s * 1000), process_ids=list(processes))
