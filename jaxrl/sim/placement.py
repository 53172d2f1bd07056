"""Where a run's processes compute, and the time-sharing of the devices (cores, chips) they share.

A Placement names the devices of a run and, for the learner and each sampler engine, the devices it computes on
(e.g. a 2-core box: the learner and a joining sampler on core 0, the first sampler on core 1; or four engines on
two chips). A device shared by several processes is time-shared equally among those that want it at the moment
(processor sharing, as a CPU scheduler shares a core among runnable processes): a process runs at 1 / (1 + the
others runnable on its device). In mean field, each other process j is runnable a fraction u_j of the time,
independently, so a process's rate on a device is E[1 / (1 + N)], N the number of its co-tenants runnable
(a sum of Bernoulli(u_j)); on several devices (a sharded engine) it runs at the pace of its slowest one. Two
processes both always runnable on one core each get half of it; a process alone on its devices runs at rate 1.
The planner (jaxrl.sim.planner.predict) finds the busy fractions and the stretches 1 / rate that reproduce each
other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np


def shared_rate(others_busy: Sequence[float]) -> float:
  """E[1 / (1 + N)] with N the number of the co-tenants runnable, each independently with its busy fraction."""
  dist = np.array([1.0])  # P(N = n)
  for u in others_busy:
    if not 0 <= u <= 1:
      raise ValueError(f"a busy fraction must lie in [0, 1] (got {u})")
    dist = np.concatenate([dist * (1 - u), [0.0]]) + np.concatenate([[0.0], dist * u])
  return float(np.sum(dist / np.arange(1, dist.size + 1)))


@dataclasses.dataclass(frozen=True)
class Placement:
  """The devices of a run and which of them the learner and each engine compute on (names of any kind)."""

  devices: tuple[Hashable, ...]
  learner: tuple[Hashable, ...]
  engines: tuple[tuple[Hashable, ...], ...]  # engine i's devices, in the simulator's engine order
  # CPU seconds per learner step that the learner's process spends beside its train step and publish, on its own
  # devices (a hub serving the samplers: their rpcs, rollout packets, weight pulls): load on a shared device.
  learner_host_s: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "devices", tuple(self.devices))
    object.__setattr__(self, "learner", tuple(self.learner))
    object.__setattr__(self, "engines", tuple(tuple(e) for e in self.engines))
    if not self.devices or len(set(self.devices)) != len(self.devices):
      raise ValueError(f"Placement.devices must name distinct devices, at least one (got {self.devices})")
    if not self.engines:
      raise ValueError("Placement.engines is empty: a run has at least one sampler engine")
    for who, names in (("the learner", self.learner), *((f"engine {i}", e) for i, e in enumerate(self.engines))):
      if not names:
        raise ValueError(f"Placement: {who} computes on no device")
      missing = [d for d in names if d not in self.devices]
      if missing:
        raise ValueError(f"Placement: {who} names device {missing[0]!r}, which is not one of {self.devices}")
    if not self.learner_host_s >= 0:
      raise ValueError(f"Placement.learner_host_s must be >= 0 (got {self.learner_host_s})")

  @property
  def processes(self) -> tuple[tuple[Hashable, ...], ...]:
    """Each process's devices: the learner first, then the engines (RunSpec.stretch's order)."""
    return (self.learner, *self.engines)

  def rates(self, busy: Sequence[float]) -> np.ndarray:
    """Each process's rate (learner first, then the engines) when its co-tenants are runnable these fractions of
    the time: on each of its devices shared_rate of the others there, the least of them."""
    procs = self.processes
    if len(busy) != len(procs):
      raise ValueError(f"{len(busy)} busy fractions for {len(procs)} processes (the learner and "
                       f"{len(self.engines)} engines)")
    return np.array([min(shared_rate([busy[j] for j, q in enumerate(procs) if j != i and d in q]) for d in mine)
                     for i, mine in enumerate(procs)])
