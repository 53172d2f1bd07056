"""The single-host Controller, one role per process: learner processes run its learner loop (SPMD over the learner
mesh, in lock step), every sampler process runs its sampler loop on its own devices. Admission, deadline-based
batch assembly (each sampler assembles its share of every step from its own groups), the train step and versions
are the Controller's own code; what changes is the wiring:

  sampler loop --Outbox--> transfer log --(cross-host copy of a packet)--> Inbox --> learner loop
  learner loop --LearnerPublisher--> transfer log --(cross-host copy of the params)--> ReceivedWeights --> sampler

One Ferry thread per process follows the transfer log and issues every copy in order. Counters that cross
(groups taken by the learner, shares the learner asked for, updates it skipped, sampler versions) go through the
store. The learners take share after share, sampler by sampler, so every learner process builds the same batch.
Sync mode is this same pipeline with max_staleness 0: a sampler admits a step's groups only once it holds the
params of that step, which is the single-host sync schedule.

A stop request (a preemption's SIGTERM on any process: `request_job_stop`) must end every learner process after the
same step, or the others would wait in a collective for ever: before every step the lead decides, from the store,
whether to go on, and the other learners wait for that decision (one store round trip a step). The learners then
checkpoint together and end the job as at its last step.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl.controller.assembly import DeadlineBook
from jaxrl.controller.loops import Controller
from jaxrl.controller.queue import Stopped
from jaxrl.distributed import packets
from jaxrl.distributed.transfer import TransferLog, WeightRoute, copy_packet, save_local_shards
from jaxrl.rollout import Rollout
from jaxrl.sharding import Versioned


def request_job_stop(store, reason: str) -> None:
  """Asks the job (from any of its processes) to stop after the learners' current step, with a checkpoint."""
  store.set("stop_request", reason)


class Inbox:
  """The learner's end of the rollout queue: one FIFO per sampler, each in transfer-log order, which is the same on
  every learner process. The lead counts the groups it takes; that count frees room for the samplers (see Outbox)."""

  def __init__(self, num_samplers: int, stop: threading.Event, store=None, poll_s: float = 0.05):
    self._qs: list[queue.Queue[list[Rollout]]] = [queue.Queue() for _ in range(num_samplers)]
    self._stop, self._store, self._poll_s = stop, store, poll_s

  def put(self, rank: int, group: list[Rollout]) -> None:
    self._qs[rank].put(group)

  def get(self, rank: int) -> list[Rollout]:
    """The next group from sampler `rank`."""
    while True:
      if self._stop.is_set():
        raise Stopped
      try:
        group = self._qs[rank].get(timeout=self._poll_s)
      except queue.Empty:
        continue
      if self._store is not None:
        self._store.incr("consumed")
      return group

  def qsize(self) -> int:
    return sum(q.qsize() for q in self._qs)

  def drain(self) -> list[list[Rollout]]:
    out = []
    for q in self._qs:
      while not q.empty():
        out.append(q.get_nowait())
    return out


class Outbox:
  """The sampler's end of the rollout queue. put() waits while `capacity` groups, over all samplers, are sent and
  not yet taken by the learner (the single-host queue's bound), then puts the group's packet on this process's
  first device and appends it to the transfer log; the Ferry sends it when the log reaches it."""

  def __init__(self, store, log: TransferLog, rank: int, capacity: int, max_len: int, device,
               stop: threading.Event, poll_s: float = 0.05):
    self.store, self.log, self.rank, self.capacity, self.max_len = store, log, rank, capacity, max_len
    self.device, self._stop, self._poll_s = device, stop, poll_s
    self._lock = threading.Lock()
    self._pending: dict[int, tuple[jax.Array, int]] = {}  # seq -> (packet, samples), appended and not yet sent
    self._seq = 0

  def put(self, group: list[Rollout]) -> None:
    ticket = self.store.incr("sent")
    while ticket - self.store.count("consumed") > self.capacity:  # back-pressure: the learner is behind
      if self._stop.wait(self._poll_s):
        raise Stopped
    packet = packets.encode([group], self.max_len)
    with self._lock:
      seq, self._seq = self._seq, self._seq + 1
      self._pending[seq] = (jax.device_put(packet, self.device), len(group))
    self.log.append({"kind": "rollouts", "sampler": self.rank, "seq": seq, "rows": len(packet)})

  def take(self, seq: int) -> jax.Array:
    with self._lock:
      return self._pending.pop(seq)[0]

  def samples_pending(self) -> int:
    with self._lock:
      return sum(n for _, n in self._pending.values())


class LearnerPublisher:
  """The learner's side of the weight publisher: each version is replicated over the learner mesh, cut into every
  replica's layout and held for the Ferry; the lead appends it to the transfer log."""

  def __init__(self, routes: list[WeightRoute], replicated_sharding, log: TransferLog | None,
               dump_dir: Path | None = None):
    self.routes, self.log, self.dump_dir = routes, log, dump_dir
    self._replicate = jax.jit(lambda params: params, out_shardings=replicated_sharding)
    self._staged: dict[int, list[list[jax.Array]]] = {}
    self._cond = threading.Condition()
    self.published = 0

  def compile(self, params) -> None:
    self._replicate.lower(params).compile()

  def publish(self, params, version: int) -> None:
    if self.dump_dir is not None:  # the learner's own shards, before any copy: what the samplers must end up with
      save_local_shards(params, self.dump_dir / f"v{version}_process{jax.process_index()}.npz")
    replicated = self._replicate(params)
    staged = [route.stage(replicated) for route in self.routes]
    with self._cond:
      self._staged[version] = staged
      self._cond.notify_all()
    self.published += 1
    if self.log is not None:
      self.log.append({"kind": "weights", "version": version})

  def take(self, version: int, stop: threading.Event) -> list[list[jax.Array]]:
    """The staged sources of `version` (waits for this process's learner loop to publish it)."""
    with self._cond:
      while version not in self._staged:
        if stop.is_set():
          raise Stopped
        self._cond.wait(0.05)
      return self._staged.pop(version)


class ReceivedWeights:
  """The sampler's side of the weight publisher: the newest params the Ferry received."""

  def __init__(self):
    self._lock = threading.Lock()
    self._latest: Versioned | None = None
    self._arrived = threading.Event()

  def deliver(self, versioned: Versioned) -> None:
    with self._lock:
      self._latest = versioned
    self._arrived.set()

  def take_newer(self, version: int) -> Versioned | None:
    with self._lock:
      latest = self._latest
    return latest if latest is not None and latest.version > version else None

  def wait_first(self, stop: threading.Event, poll_s: float = 0.05) -> Versioned:
    while not self._arrived.wait(poll_s):
      if stop.is_set():
        raise Stopped
    return self._latest


class DistributedController(Controller):
  """A Controller for one process of a multi-process job (see the module docstring)."""

  def __init__(self, spec, *, topology, store, log: TransferLog, routes: list[WeightRoute], max_len: int,
               make_sampler: Callable[[Versioned], Any] | None = None, dump_dir: Path | None = None,
               poll_s: float = 0.05, resumed_from: int | None = None,
               evaluate: Callable[[Any, int], dict] | None = None, **kwargs):
    super().__init__(spec, **kwargs)
    # The held-out eval (a sampler process's, on its own engine): before training on a fresh run, after on a
    # finished one, as single-host jaxrl-train does.
    self.evaluate = evaluate
    self.evals: dict[str, dict] = {}
    self.resumed_from = resumed_from  # the checkpoint step the learners restored (None: a fresh run)
    self.topology, self.store, self.log, self.routes = topology, store, log, routes
    self.max_len, self.make_sampler, self.dump_dir, self.poll_s = max_len, make_sampler, dump_dir, poll_s
    self.is_learner = topology.role == "learner"
    self.is_lead = topology.process_id == topology.lead
    self._wake = threading.Event()
    self._abort = threading.Event()  # a thread of this process failed (self.stop is also set by a normal end)
    self._learner_inputs = [next(d for d in topology.learner_devices if d.process_index == p)
                            for p in topology.learner_processes]
    # Each sampler assembles its share of every step's groups (groups_per_step divides evenly; build checks it) by
    # deadline, from its own groups alone; the learners take share after share, sampler by sampler.
    self.share = spec.groups_per_step // len(topology.sampler_processes)
    if self.is_learner:
      self.inbox = Inbox(len(topology.sampler_processes), self.stop, store if self.is_lead else None, poll_s)
    else:
      rank, num = topology.sampler_rank, len(topology.sampler_processes)
      self.record.next_group_id = rank  # data positions rank, rank + num, ...: disjoint, and no coordination
      self.group_stride = num
      self.outbox = Outbox(store, log, rank, spec.queue_groups, max_len, topology.sampler_devices[rank][0],
                           self.stop, poll_s)
      self.received = ReceivedWeights()
      self.publisher = self.received
    self.ferry = threading.Thread(target=self._guarded, args=("transfer", self._follow_log), name="jaxrl-ferry",
                                  daemon=True)
    self._rounds = 0  # learner loop iterations: the same on every learner process (they run in lock step)

  # ---- stopping early, on every process at the same step -----------------------------------------------------------

  def _done(self) -> bool:
    if super()._done():
      return True
    self._rounds += 1
    key = f"go_on/{self._rounds}"
    if self.is_lead:
      reason = self.store.try_get("stop_request")
      if reason is not None:
        # Before "done": every process reads it once its loop has ended.
        self.store.set("stopped_by", reason)
      self.store.set(key, reason)
    else:
      while True:
        try:
          reason = self.store.get(key, timeout_s=20 * self.poll_s)
          break
        except TimeoutError:
          if self._abort.is_set() or self.stop.is_set():
            raise Stopped from None
    if reason is not None:
      self.stop_reason = reason
      return True
    return False

  # ---- the Controller's pieces, extended -------------------------------------------------------------------------

  def _guarded(self, name: str, loop: Callable, *args) -> None:
    super()._guarded(name, loop, *args)
    if self.errors:
      self._abort.set()

  def _admit_one(self) -> bool:
    admitted = super()._admit_one()
    # Published before any sample of the group exists, so a checkpoint's data position is past every group that
    # can have been trained (see save_checkpoint).
    self.store.set(f"next_group/{self.topology.sampler_rank}", self.record.next_group_id)
    return admitted

  def save_checkpoint(self, force: bool = False) -> None:
    """Every learner process saves its shards together; the record's data position is past every group any sampler
    has admitted (groups in flight are not generated again after a resume: the samplers start there)."""
    if self.is_lead:
      positions = [self.store.try_get(f"next_group/{r}", 0) for r in range(len(self.topology.sampler_processes))]
      self.record.next_group_id = max(self.record.next_group_id, *positions)
    super().save_checkpoint(force)

  def _complete_groups(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
    if rollouts:  # this sampler's costs so far, for the lead learner's metrics (jaxrl-profile --from-run)
      self.store.set(f"sampler_costs/{self.topology.sampler_rank}", *self._sampler_costs())
    return super()._complete_groups(rollouts)

  def _train(self, groups: list[list[Rollout]]) -> dict[str, Any]:
    metrics = super()._train(groups)
    if not metrics["applied"] and self.is_lead:
      self.store.incr("updates_skipped")  # the samplers' next shares come a step earlier
    return metrics

  def _updates_skipped(self) -> int:
    return self.store.count("updates_skipped")

  def _sampler_costs(self) -> list[dict]:
    if not self.is_learner:
      return super()._sampler_costs()
    posted = [self.store.try_get(f"sampler_costs/{r}") for r in range(len(self.topology.sampler_processes))]
    return [d for d in posted if d is not None]

  def _shares_asked(self) -> int:
    return self.store.count("shares_asked")

  def _ask(self) -> None:
    if self.is_lead:
      self.store.incr("shares_asked")

  # ---- the transfer log --------------------------------------------------------------------------------------------

  def _follow_log(self) -> None:
    for entry in self.log.follow(self._abort):
      if entry is None:
        continue
      if entry["kind"] == "weights":
        self._copy_weights(entry["version"])
      elif entry["kind"] == "rollouts":
        self._copy_rollouts(entry)
      elif entry["kind"] == "done":
        self.stop.set()
        return
      else:
        raise ValueError(f"unknown transfer log entry {entry}")

  def _copy_weights(self, version: int) -> None:
    sources = self.publisher.take(version, self._abort) if self.is_learner else None
    for rank, route in enumerate(self.routes):
      params = route.copy(sources[rank] if sources else route.placeholders())
      if not self.is_learner and rank == self.topology.sampler_rank:
        jax.block_until_ready(params)
        if self.dump_dir is not None:
          save_local_shards(params, self.dump_dir / f"v{version}_process{self.topology.process_id}.npz")
        self.received.deliver(Versioned(params, version))
        self.store.set(f"sampler_version/{rank}", version)
        self._wake.set()

  def _copy_rollouts(self, entry: dict) -> None:
    rank = entry["sampler"]
    mine = not self.is_learner and rank == self.topology.sampler_rank
    shape = (entry["rows"], packets.packet_width(self.max_len))
    copies = copy_packet(self.outbox.take(entry["seq"]) if mine else None, shape,
                         self.topology.sampler_devices[rank][0], self._learner_inputs)
    if self.is_learner:
      received = copies[self.topology.learner_processes.index(self.topology.process_id)]
      for group in packets.decode(np.asarray(received), self.max_len):
        self.inbox.put(rank, group)

  # ---- the two roles -----------------------------------------------------------------------------------------------

  def run(self) -> None:
    """Runs this process's role until the lead's learner reaches num_steps (then every Ferry sees "done")."""
    self.ferry.start()
    try:
      if self.is_learner:
        self._run_learner()
      else:
        self._run_sampler()
    finally:
      self.stop.set()
    self.raise_errors()

  def _run_learner(self) -> None:
    self._log_start("distributed")
    if self.is_lead:  # where the samplers start: past every group admitted before the checkpoint resumed from
      self.store.set("resume", {"next_group_id": self.record.next_group_id, "version": self.version,
                                "fresh": self.resumed_from is None})
    self.publisher.publish(self.state.params, self.version)
    sources = [(functools.partial(self.inbox.get, r), self.share) for r in range(len(self.topology.sampler_processes))]
    self._guarded("learner", self._learner_loop, sources, self.inbox.qsize)
    if not self.errors:
      self.finish()  # on every learner process (a save over all of them), the final state
      self.checkpointer.close()
      if self.is_lead:
        self.log.append({"kind": "done"})
    self.ferry.join()  # every copy up to "done" is issued: the samplers' last pulls can complete
    self._leftover = self.inbox.drain()

  def _run_sampler(self) -> None:
    try:
      first = self.received.wait_first(self.stop)
    except Stopped:
      return  # the transfer thread failed; run() raises its error
    self.sampler = self.make_sampler(first)
    resume = self.store.get("resume", timeout_s=60.0)  # set before the first weights were published
    if self.evaluate is not None and resume["fresh"]:
      self.evals["eval_before"] = self.evaluate(first.params, first.version)
    num = len(self.topology.sampler_processes)
    self.record.next_group_id = -(-resume["next_group_id"] // num) * num + self.topology.sampler_rank
    self.book = DeadlineBook(self.spec.max_staleness, self.share, resume["version"], self.spec.num_steps,
                             self.spec.queue_groups // len(self.topology.sampler_processes))
    self.ledger.groups_admitted = resume["version"] * self.share  # as if it had admitted its share of each step
    self._guarded("sampler", self._sampler_loop, self.outbox, self.poll_s)
    self.ferry.join()
    if self.evaluate is not None and not self.errors and self.store.try_get("stopped_by") is None:
      final = self.received.take_newer(-1)  # every version up to "done" has arrived: the trained policy
      self.evals["eval_after"] = self.evaluate(final.params, final.version)

  def samples_in_flight(self) -> int:
    """This process's share: open groups and unsent packets (sampler), received and untrained groups (learner)."""
    pending = 0 if self.is_learner else self.outbox.samples_pending()
    return super().samples_in_flight() + pending

  def process_summary(self) -> dict[str, Any]:
    out = {"process": self.topology.process_id, "role": self.topology.name(self.topology.process_id),
           "ledger": self.ledger.to_json(), "samples_in_flight": self.samples_in_flight(), "busy": dict(self.busy),
           "stopped_by": self.store.try_get("stopped_by")}
    if self.is_learner:
      out.update(version=self.version, trained_staleness=self.trained_staleness, resumed_from=self.resumed_from)
    else:
      newest = self.received.take_newer(-1)
      out.update(sampler_version=newest.version if newest is not None else None,  # the newest params received
                 generated_tokens=self.sampler.stats.generated_tokens if self.sampler is not None else 0,
                 **self.evals)
    return out

