"""The three channels across processes: learner processes run the learner loop (SPMD over the learner mesh, in
lock step), every sampler process runs the sampler loop on its own devices; the loops are the single-host ones,
only the channels differ:

  rollouts      sampler loop --Outbox--> transfer log --(cross-host copy of a packet)--> Inbox --> learner loop
  weights       learner loop --LearnerPublisher--> transfer log --(cross-host copy of the params)--> ReceivedWeights
  coordinator   StoreCoordinator: counters in the coordination store (groups taken by the learner, shares the
                learner asked for, updates it skipped, data positions, sampler versions)

One Ferry thread per process follows the transfer log and issues every copy in order. The learners take share
after share, sampler by sampler, so every learner process builds the same batch. Sync mode is this same pipeline
with max_staleness 0: a sampler admits a step's groups only once it holds the params of that step, which is the
single-host sync schedule.

A stop request (a preemption's SIGTERM on any process: `request_job_stop`) must end every learner process after the
same step, or the others would wait in a collective for ever: before every step the lead decides, from the store,
whether to go on, and the other learners wait for that decision (one store round trip a step). The learners then
checkpoint together and end the job as at its last step.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np

from jaxrl.controller.assembly import scored_groups
from jaxrl.controller.coordinator import Coordination
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord
from jaxrl.controller.summary import SAMPLER_COUNTS, merge_ledgers
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
    self._taken = 0  # groups taken and not yet counted in the store

  def deliver(self, rank: int, group: list[Rollout]) -> None:
    """A group of sampler `rank`, as the Ferry received it."""
    self._qs[rank].put(group)

  def get(self, rank: int) -> list[Rollout]:
    """The next group from sampler `rank`. The lead counts what it takes in the store once its queue is empty (a
    share arrives in one packet: one store call a share, not one a group: each call costs the learner's core) and
    before it waits, so a sampler waiting for room always sees every group taken."""
    q = self._qs[rank]
    while True:
      if self._stop.is_set():
        raise Stopped
      try:
        group = q.get_nowait()
      except queue.Empty:
        self._count_taken()
        try:
          group = q.get(timeout=self._poll_s)
        except queue.Empty:
          continue
      self._taken += 1
      if q.empty():
        self._count_taken()
      return group

  def _count_taken(self) -> None:
    if self._store is not None and self._taken:
      self._store.incr("consumed", self._taken)
    self._taken = 0

  def depth(self) -> int:
    return sum(q.qsize() for q in self._qs)

  def unsent(self) -> int:
    return 0

  def drain(self) -> list[list[Rollout]]:
    out = []
    for q in self._qs:
      while not q.empty():
        out.append(q.get_nowait())
    return out


class Outbox:
  """The sampler's end of the rollout queue. put_all() waits while `capacity` groups, over all samplers, are sent
  and not yet taken by the learner (the single-host queue's bound), then puts the groups' packet (up to `capacity`
  groups each) on this process's first device and appends it to the transfer log; the Ferry sends it when the log
  reaches it."""

  def __init__(self, store, log: TransferLog, rank: int, capacity: int, max_len: int, device,
               stop: threading.Event, poll_s: float = 0.05):
    self.store, self.log, self.rank, self.capacity, self.max_len = store, log, rank, capacity, max_len
    self.device, self._stop, self._poll_s = device, stop, poll_s
    self._lock = threading.Lock()
    self._pending: dict[int, tuple[jax.Array, int]] = {}  # seq -> (packet, samples), appended and not yet sent
    self._seq = 0
    self.send_s = 0.0  # seconds put_all spent sending (encoding, store calls, device_put), not waiting for room

  def put(self, group: list[Rollout]) -> None:
    self.put_all([group])

  def put_all(self, groups: list[list[Rollout]]) -> None:
    """The groups in packets of up to `capacity` groups: one cross-process copy and a few store calls for a whole
    share (a packet per group made the learner wait on every group's round trip: docs/BENCHMARKS_HISTORY.md,
    "The headline: colocated sync vs pipeline").
    Each chunk leaves `groups` once it is on its way."""
    while groups:
      t0 = time.perf_counter()
      chunk = groups[: self.capacity]
      ticket = self.store.incr("sent", len(chunk))
      while ticket - self.store.count("consumed") > self.capacity:  # back-pressure: the learner is behind
        t_wait = time.perf_counter()
        if self._stop.wait(self._poll_s):
          raise Stopped
        t0 += time.perf_counter() - t_wait  # waiting for room is not sending work
      packet = packets.encode(chunk, self.max_len)
      with self._lock:
        seq, self._seq = self._seq, self._seq + 1
        self._pending[seq] = (jax.device_put(packet, self.device), len(packet))
      self.log.append({"kind": "rollouts", "sampler": self.rank, "seq": seq, "rows": len(packet),
                       "width": packet.shape[1]})  # a mixture-of-experts policy's packets carry its routing too
      del groups[: len(chunk)]
      self.send_s += time.perf_counter() - t0

  def take(self, seq: int) -> jax.Array:
    with self._lock:
      return self._pending.pop(seq)[0]

  def unsent(self) -> int:
    """Samples put and not yet sent by the Ferry."""
    with self._lock:
      return sum(n for _, n in self._pending.values())

  def drain(self) -> list[list[Rollout]]:
    return []  # nothing waits on this side but the unsent packets, counted by unsent()


class LearnerPublisher:
  """The learner's side of the weight publisher: each version is replicated over the learner mesh, cut into every
  replica's layout and held for the Ferry; the lead appends it to the transfer log."""

  def __init__(self, routes: list[WeightRoute], replicated_sharding, log: TransferLog | None,
               dump_dir: Path | None = None, prepare=None):
    """prepare: applied to each version on the learner before it is cut for the routes (e.g. int8 quantization:
    jaxrl.distributed.job.sampler_weights); None sends the params as they are."""
    self.routes, self.log, self.dump_dir = routes, log, dump_dir
    prepare = prepare or (lambda params: params)
    self._replicate = jax.jit(lambda params: prepare(params), out_shardings=replicated_sharding)
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




class StoreCoordinator(Coordination):
  """The coordinator of one process of a job: counters in the store, written by the lead learner (shares asked,
  updates skipped, the decision to go on) or by each sampler (what it has admitted, its counts and costs).

  Resume is exact in every topology: the lead's checkpoint record holds every group some sampler admitted and the
  learners have not settled (trained or dropped) as pending, and the positions below the record's data position
  that no sampler admitted yet as unadmitted; a resumed job's samplers admit both first (sampler_started)."""

  def __init__(self, store, topology, record: RunRecord, num_steps: int, group_size: int,
               max_failures_in_a_row: int, resumed_from: int | None = None, poll_s: float = 0.05,
               max_filtered_in_a_row: int = 1000):
    num_samplers = len(topology.sampler_processes)
    super().__init__(record, max_failures_in_a_row, resumed_from, max_filtered_in_a_row, stride=num_samplers)
    self.store, self.topology, self.num_steps, self.poll_s = store, topology, num_steps, poll_s
    self.group_size = group_size
    self.is_lead = topology.process_id == topology.lead
    self.num_samplers = num_samplers
    self._rounds = 0  # learner loop iterations: the same on every learner process (they run in lock step)
    self._asks_made = 0  # the lead's asks so far (a job's asks start at 1, a resumed job's too: a new store)
    self.settled: set[int] = set()  # lead: groups trained or dropped since this job started
    self._skips_seen: set[int] = set()  # lead: prompts the samplers skipped, as their posts said
    self._skips_untraced: list[tuple[int, str]] = []
    self._resume: dict | None = None  # lead: where the samplers started (learner_started)
    self._admit_k: int | None = None  # lead: the admission bound its learner loop chose last (bound)
    self._skipped_total = 0  # lead: updates skipped so far
    # Sampler side: the lead's asks as the watcher thread last saw them (no store call in the sampler loop).
    self._asks = Asks(0, 0, None)

  # learner side
  def go_on(self, version: int) -> bool:
    """Whether the learners train another step: the lead decides (a stop request in the store ends every learner
    after the same step) and the other learners wait for its decision."""
    if version >= self.num_steps:
      return False
    self._rounds += 1
    key = f"go_on/{self._rounds}"
    if self.is_lead:
      reason = self.store.try_get("stop_request")
      if reason is not None:
        self.store.set("stopped_by", reason)  # before "done": every process reads it once its loop has ended
      if len(self.topology.learner_processes) > 1:  # only the other learners read it (a store call a step)
        self.store.set(key, reason)
    else:
      while True:
        try:
          reason = self.store.get(key, timeout_s=20 * self.poll_s)
          break
        except TimeoutError:
          if self.abort.is_set() or self.stop.is_set():
            raise Stopped from None
    if reason is not None:
      self.stop_reason = reason
      return False
    return True

  def ask(self) -> None:
    """The lead asks every sampler for its next share: a key per ask (asked/1, asked/2, ... numbered by the lead, the
    only asker) holding the updates skipped so far and the admission bound (rl.max_staleness="auto"), on which each
    sampler's watcher thread blocks. The coordination service runs in the lead's process: each store call costs the
    learner's core time, so one call an ask."""
    if self.is_lead:
      self._asks_made += 1
      self.store.set(f"asked/{self._asks_made}", {"skipped": self._skipped_total, "admit_k": self._admit_k})

  def bound(self, admit_k: int | None) -> None:
    self._admit_k = admit_k  # sent with the next ask

  def update_done(self, applied: bool, partial: bool = False) -> None:
    if applied:
      self._applied(partial)
      return
    self.ledger.skipped_updates += 1
    if self.is_lead:
      self._skipped_total = self.store.incr("updates_skipped")
    self.fail("update_skipped")

  def settle(self, groups: list[list[Rollout]], dropped: str | None = None) -> None:
    super().settle(groups, dropped)
    with self._lock:
      self.settled.update(g[0].group_id for g in groups)

  def learner_started(self, version: int, fresh: bool) -> None:
    """Where the samplers start: each first generates again its part of the groups pending at the checkpoint
    resumed from, then admits the positions no sampler had admitted, then new positions base + rank,
    base + rank + samplers, ... (base: the record's data position rounded up to a multiple of the samplers)."""
    if not self.is_lead:
      return
    num, record = self.num_samplers, self._record
    base = -(-record.next_group_id // num) * num
    unadmitted = sorted(record.unadmitted_group_ids) + list(range(record.next_group_id, base))
    self.ledger.samples_regenerated += len(record.pending_group_ids) * self.group_size
    self._resume = {"version": version, "fresh": fresh, "base": base, "admit_k": self._admit_k,
                    "pass_rate": copy.deepcopy(record.pass_rate),
                    "filter": scored_groups(record.ledger, self.group_size),
                    "regenerate": [sorted(g for g in record.pending_group_ids if g % num == r) for r in range(num)],
                    "unadmitted": [[g for g in unadmitted if g % num == r] for r in range(num)]}
    self.store.set("resume", self._resume)

  def sampler_costs(self) -> list[dict]:
    """What every sampler posted last (a sampler that has posted nothing yet is left out)."""
    posted = [self.store.try_get(f"sampler/{r}") for r in range(self.num_samplers)]
    self._note_skips([d["admitted"] for d in posted if d is not None])
    return [d["costs"] for d in posted if d is not None]

  def _note_skips(self, posts: list[dict]) -> None:
    """Keeps the skips of these posts that the lead has not seen yet, for its trace (skips_to_trace)."""
    with self._lock:
      for post in posts:
        for gid, reason in zip(post["skipped"], post["skip_reasons"], strict=True):
          if gid not in self._skips_seen:
            self._skips_seen.add(gid)
            self._skips_untraced.append((gid, reason))

  def skips_to_trace(self) -> list[tuple[int, str]]:
    with self._lock:
      out, self._skips_untraced = self._skips_untraced, []
    return out

  def checkpoint_record(self) -> dict:
    """The lead's record (the one saved): admitted = the groups regenerated, the unadmitted positions some sampler
    admitted and each sampler's new positions up to its last post; pending = admitted and not settled; unadmitted =
    positions below the data position no sampler admitted. The ledger adds the samplers' counts of that same post
    (every group the learners trained was sent after a post that counts it)."""
    if not self.is_lead:
      return super().checkpoint_record()  # only the lead's record is saved
    num, resume = self.num_samplers, self._resume
    posts = [(self.store.try_get(f"sampler/{r}") or {}).get("admitted") for r in range(num)]
    self._note_skips([post for post in posts if post is not None])  # traced before the record that counts them
    with self._lock:
      admitted, left, skipped, ends = set(), set(), set(), [resume["base"]]
      for rank, post in enumerate(posts):
        if post is None:  # admitted nothing yet
          post = {"next": resume["base"] + rank, "left": resume["regenerate"][rank] + resume["unadmitted"][rank],
                  "skipped": []}
        admitted.update(range(resume["base"] + rank, post["next"], num))
        left.update(post["left"])
        skipped.update(post["skipped"])
        ends.append(post["next"] - num + 1)  # past its last new position
      regenerated = {g for part in resume["regenerate"] for g in part}
      unadmitted = {g for part in resume["unadmitted"] for g in part}
      admitted |= regenerated | (unadmitted - left)
      self._record.next_group_id = max(ends)
      gaps = (unadmitted & left) | (set(range(resume["base"], self._record.next_group_id)) - admitted)
      done = self.settled | skipped
      self._record.pending_group_ids = sorted(admitted - done)
      self._record.unadmitted_group_ids = sorted(gaps - done)
      out = self._record.to_json()
    out["ledger"] = merge_ledgers(out["ledger"], [post["ledger"] for post in posts if post is not None])
    return out

  # sampler side
  def sampler_started(self) -> dict:
    """Waits for the learners' resume point (learner_started): what this sampler admits first, and from where."""
    resume = self.store.get("resume", timeout_s=60.0)  # set before the first weights were published
    rank = self.topology.sampler_rank
    self._record.next_group_id = resume["base"] + rank
    self._regenerate, self._unadmitted = list(resume["regenerate"][rank]), list(resume["unadmitted"][rank])
    self._asks = Asks(0, 0, resume["admit_k"])
    self.resumed_pass_rate = resume["pass_rate"]
    self.resumed_filter = tuple(resume["filter"])
    threading.Thread(target=self.guarded, args=("asks", self._watch_asks), name="jaxrl-asks", daemon=True).start()
    return resume

  def _watch_asks(self) -> None:
    """Follows the lead's asks (asked/1, asked/2, ...) and wakes the sampler loop at each: its per-iteration
    checks (shares asked, updates skipped, the admission bound) read these fields instead of store round trips
    (each a round trip on a core the decode shares)."""
    while not self.stop.is_set():
      try:
        ask = self.store.get(f"asked/{self._asks.shares + 1}", timeout_s=20 * self.poll_s)
      except TimeoutError:
        continue
      except Exception:
        if self.stop.is_set():  # the job is ending: the coordination service may already be gone
          return
        raise
      self._asks = Asks(self._asks.shares + 1, ask["skipped"], ask["admit_k"])  # one snapshot: read whole
      self.wake()

  def progress(self) -> Asks:
    return self._asks

  def sending(self, costs: dict) -> None:
    """Before any group leaves this sampler, one post (a store call is a round trip): its costs, and what it
    has admitted (its next new position, what it has yet to regenerate or admit, the prompts it skipped) with its
    counts, one consistent snapshot (the sampler loop's thread admits, counts and sends): checkpoint_record."""
    admitted = {"next": self._record.next_group_id, "left": self._regenerate + self._unadmitted,
                "skipped": list(self._skipped), "skip_reasons": list(self._skipped.values()),
                "ledger": {k: getattr(self.ledger, k) for k in SAMPLER_COUNTS}}
    self.store.set(f"sampler/{self.topology.sampler_rank}", {"costs": costs, "admitted": admitted})


class Ferry:
  """This process's thread that follows the transfer log and issues every copy in log order (the same order on
  every process, as JAX cross-host copies need): weights from the learners to every sampler, packets from a sampler
  to every learner."""

  def __init__(self, topology, store, log: TransferLog, routes: list[WeightRoute], max_len: int,
               coord: Coordination, *, inbox: Inbox | None = None, outbox: Outbox | None = None,
               publisher: LearnerPublisher | None = None, received: ReceivedWeights | None = None,
               dump_dir: Path | None = None):
    self.topology, self.store, self.log, self.routes, self.max_len = topology, store, log, routes, max_len
    self.coord, self.inbox, self.outbox, self.publisher, self.received = coord, inbox, outbox, publisher, received
    self.dump_dir = dump_dir
    self.is_learner = topology.role == "learner"
    self._learner_inputs = [next(d for d in topology.learner_devices if d.process_index == p)
                            for p in topology.learner_processes]
    self.thread = threading.Thread(target=coord.guarded, args=("transfer", self._follow_log), name="jaxrl-ferry",
                                   daemon=True)

  def _follow_log(self) -> None:
    for entry in self.log.follow(self.coord.abort):
      if entry is None:
        continue
      if entry["kind"] == "weights":
        self._copy_weights(entry["version"])
      elif entry["kind"] == "rollouts":
        self._copy_rollouts(entry)
      elif entry["kind"] == "done":
        self.coord.stop.set()
        return
      else:
        raise ValueError(f"unknown transfer log entry {entry}")

  def _copy_weights(self, version: int) -> None:
    sources = self.publisher.take(version, self.coord.abort) if self.is_learner else None
    for rank, route in enumerate(self.routes):
      params = route.copy(sources[rank] if sources else route.placeholders())
      if not self.is_learner and rank == self.topology.sampler_rank:
        jax.block_until_ready(params)
        if self.dump_dir is not None:
          save_local_shards(params, self.dump_dir / f"v{version}_process{self.topology.process_id}.npz")
        self.received.deliver(Versioned(params, version))
        self.store.set(f"sampler_version/{rank}", version)
        self.coord.wake()

  def _copy_rollouts(self, entry: dict) -> None:
    rank = entry["sampler"]
    mine = not self.is_learner and rank == self.topology.sampler_rank
    shape = (entry["rows"], entry["width"])
    copies = copy_packet(self.outbox.take(entry["seq"]) if mine else None, shape,
                         self.topology.sampler_devices[rank][0], self._learner_inputs)
    if self.is_learner:
      received = copies[self.topology.learner_processes.index(self.topology.process_id)]
      for group in packets.decode(np.asarray(received), self.max_len):
        self.inbox.deliver(rank, group)
