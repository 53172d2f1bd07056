"""jaxrl-learner: the learner of a run whose samplers are independent programs (jaxrl-sampler), which join and
leave while it trains.

  jaxrl-learner --config=configs/tiny.py --workdir=/tmp/jaxrl-ind --port=7470
  jaxrl-sampler --config=configs/tiny.py --learner=127.0.0.1:7470 --secret_file=/tmp/jaxrl-ind/run.secret  # any time
  python -m jaxrl.distributed.launch --independent_samplers=2 -- --config=configs/tiny.py --workdir=/tmp/jaxrl-ind

It builds the learner side as every topology does (controller.sides.build) on the config's learner devices, and
serves, on --port: the hub (distributed.hub: registration, leases, data positions, rollouts) and the weights
(distributed.weight_service: each published version pulled over jax.experimental.transfer). The learner loop is the
single-host one. SIGTERM stops after the current step with a checkpoint (exit 143); the same command resumes from
it, and the samplers, which keep trying to register for --reconnect_s, start over with the restarted learner. When
the run ends, the samplers are told so and exit. workdir/summary.json counts every admitted group: trained,
dropped, pending, or generated again (groups_generated_again: sampler_lost, sampler_left, late) with the samples
refused (samples_refused: fenced, late, forged, sampling_mismatch, wrong_prompt, bad_values).

Every rpc peer proves the run's secret (distributed.rpc, distributed.secret: --secret_file, else JAXRL_RUN_SECRET,
else workdir/run.secret, made 0600 on the first start). --host is the address samplers are told (and the weight
transfer server's); --bind the address the rpc port listens on (default --host; 0.0.0.0 for every interface). What
one peer may cost is bounded (rpc.Limits: connections, handshakes, read timeout, a frame's bytes from the run's
packets); the hub checks every delivered group (hub.refusal) before anything counts (docs/SECURITY.md).

A learner over several hosts (a TPU slice) runs one jaxrl-learner per host, joined by jax.distributed among
themselves (the samplers stay outside that job):

  jaxrl-learner ... --num_processes=2 --process_id=0 --coordinator_address=HOST0:PORT --port=7470 --host=HOST0 \
      --secret_file=SECRET
  jaxrl-learner ... --num_processes=2 --process_id=1 --coordinator_address=HOST0:PORT --host=HOST1 --secret_file=SECRET
  python -m jaxrl.distributed.launch --independent_samplers=2 --learner_processes=2 -- --config=...  # loopback

The learner mesh (mesh.learner_axes) spans every device of every learner process. Process 0, the lead, serves the
hub on --port, as a single-process learner does; the others follow it (distributed.follow): they train exactly the
lead's batches and stop after the same step. Every learner process publishes each version (a full local copy,
replicated over the learner mesh) and serves pulls on its own port (chosen freely, told to the lead): a sampler
is told at registration which learner process to pull from (the n-th registration: process n mod the learner
processes). The learner processes checkpoint together (each its own shards; the lead the run record) and resume
together. SIGTERM on any learner process stops them all after the same step, with a checkpoint (a follower asks
the lead to stop). A lead that dies ends the others within --heartbeat_timeout_s (jax.distributed's own abort) or
--follow_timeout_s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl import config as config_lib
from jaxrl import platforms
from jaxrl.controller import build as build_lib
from jaxrl.controller import sides
from jaxrl.controller import summary as summary_lib
from jaxrl.controller.data import make_prompt_source
from jaxrl.controller.learner_loop import LearnerLoop
from jaxrl.distributed import packets, rpc, runtime
from jaxrl.distributed import secret as secret_lib
from jaxrl.distributed.follow import Follower, FollowLog, Lead, LeadHub
from jaxrl.distributed.hub import Hub
from jaxrl.distributed.watchdog import hard_exit
from jaxrl.distributed.weight_service import WeightServer, local_copy
from jaxrl.envs.env import EnvTask
from jaxrl.sampler.slot_engine import compute_dtype_name
from jaxrl.sharding import resolve_axis_sizes


@dataclasses.dataclass(frozen=True)
class Learners:
  """The learner processes of this jaxrl-learner (jax.distributed among themselves): this one's id, how many, and
  their coordination store (runtime.Store; None for one process). Process 0 is the lead."""

  process_id: int = 0
  num_processes: int = 1
  store: Any = None

  @property
  def lead(self) -> bool:
    return self.process_id == 0

  @property
  def many(self) -> bool:
    return self.num_processes > 1

  def wait(self, key: str, what: str, timeout_s: float):
    """The store's value at key, waited for at most timeout_s (one line naming what was waited for)."""
    try:
      return self.store.get(key, timeout_s=timeout_s)
    except TimeoutError:
      raise TimeoutError(f"learner process {self.process_id} waited {timeout_s:g}s for {what}") from None


class HubChannels(sides.OneProcess):
  """The learner program's channels (controller.sides.Channels): the hub and the weight server on one rpc port.
  A learner of several processes: the lead's hub records its loop for the others (distributed.follow), every
  process serves weights on its own port; programs are compiled ahead, a batch is cut to each process's rows and
  the state saved by every process (its own shards) as in a multi-process job (distributed.job.JobChannels)."""

  def __init__(self, *, host: str = "127.0.0.1", port: int = 0, lease_s: float = 10.0, orphan_s: float = 600.0,
               learners: Learners = Learners(), follow_timeout_s: float = 30.0, secret: bytes | None = None,
               bind: str | None = None, limits: rpc.Limits | None = None):
    """host: the address samplers are told; bind: the rpc port's listening address (None: host); secret: the run's
    (None: a follower learner process takes the lead's from the job's store); limits: rpc.Limits, whose
    max_frame_bytes is made the run's (frame_limit)."""
    self.host, self.port, self.lease_s, self.orphan_s = host, port, lease_s, orphan_s
    self.learners, self.follow_timeout_s = learners, follow_timeout_s
    self.secret, self.bind, self.limits = secret, bind or host, limits or rpc.Limits()
    self.compile_ahead = learners.many  # gloo gives up on a peer that reaches a collective late (still compiling)

  def checkpointer_options(self) -> dict:
    n = self.learners.num_processes
    return dict(processes=list(range(n)), primary=0) if n > 1 else {}

  def place(self, batch_shardings):
    if not self.learners.many:
      return super().place(batch_shardings)
    return lambda batch: jax.device_put(batch, batch_shardings)  # every process holds the whole host batch

  def wire(self, built: sides.Built) -> LearnerProgram:
    c, side, learners = built.config, built.learner, self.learners
    weights = self._weights(c, side)
    secret = self._secret()
    limits = dataclasses.replace(self.limits, max_frame_bytes=frame_limit(c, side.learner.model_config,
                                                                          self.limits.max_header_bytes))
    log = (FollowLog(range(1, learners.num_processes), c.sampler.max_len, end_wait_s=self.follow_timeout_s)
           if learners.many and learners.lead else None)
    hub = where = None
    if learners.lead:
      hub_args = (side.record, side.spec, c.sampler.max_len, side.resumed_from)
      hub_kw = dict(lease_s=self.lease_s, orphan_s=self.orphan_s, prompt_of=data_prompts(c),
                    vocab_size=side.learner.model_config.vocab_size)
      hub = LeadHub(*hub_args, log=log, **hub_kw) if log is not None else Hub(*hub_args, **hub_kw)
      where = [] if learners.many else None  # every learner process's rpc address, once they all serve
      server = rpc.Server(lead_handlers(hub, weights.describe, log, where), self.bind, self.port, secret=secret,
                          limits=limits)
    else:  # a follower's pulls are told by the lead's hub: what it checks here is the secret
      server = rpc.Server({"weights": weights.describe}, self.bind, 0, secret=secret, limits=limits)
    server.advertised = f"{self.host}:{server.address.rpartition(':')[2]}"
    coord = hub
    if learners.many:
      learners.store.set(f"learner/{learners.process_id}", server.advertised)
      # every learner process built and compiled (its programs and the weights' gather) and serving
      addresses = [learners.wait(f"learner/{p}", f"learner process {p} serving", 600.0)
                   for p in range(learners.num_processes)]
      if learners.lead:
        where[:] = addresses
      else:
        lead = Lead(addresses[0], learners.process_id, secret=secret, timeout_s=self.follow_timeout_s,
                    wait_s=self.orphan_s + 60)
        coord = Follower(lead, side.record, c.sampler.max_len, side.resumed_from)
    told = _TellingTheHub(weights, hub) if hub is not None else weights
    loop = LearnerLoop(side.spec, train_step=side.train_step, state=side.state, rollouts=coord, weights=told,
                       coord=coord, checkpointer=side.checkpointer, metrics=side.metrics, trace=side.trace,
                       telemetry=side.telemetry)
    return LearnerProgram(c, side, coord, loop, weights, server, learners, log, secret)

  def _secret(self) -> bytes:
    """The run's secret; a follower learner process given none takes the lead's from the job's store (the
    jax.distributed coordination service: the learner processes' own trusted network)."""
    learners = self.learners
    if learners.many and learners.lead:
      learners.store.set("learner/secret", self.secret.decode())
    if self.secret is not None:
      return self.secret
    if not learners.many:
      raise ValueError("jaxrl-learner: no run secret")
    return learners.wait("learner/secret", "the lead's run secret", 600.0).encode()

  def _weights(self, c, side: sides.LearnerSide) -> WeightServer:
    """This process's weight server, staging each version as the sampler engine takes it; over several learner
    processes each version is replicated over the learner mesh, then served from this process's own copy."""
    sampler_mesh = sides.Roles.single(c.mesh, jax.devices()[: c.mesh.num_devices]).sampler_meshes(c.mesh)[0]
    dtype = jnp.dtype(compute_dtype_name(c.sampler.dtype, side.learner.model_config, sampler_mesh))
    device, gather = None, None
    if self.learners.many:
      device = next(d for d in side.mesh.devices.flat if d.process_index == jax.process_index())
      gather = local_copy(side.mesh, device)
      gather.compile(side.state.params)
    return WeightServer(dtype=dtype, weight_dtype=c.sampler.weight_dtype, host=self.host, device=device,
                        gather=gather)


class _TellingTheHub:
  """The lead loop's weights: each version is told to the hub as it is published (the newest version a delivered
  token may carry: a sampler may pull it and deliver before the loop's next go_on), then published."""

  def __init__(self, weights: WeightServer, hub: Hub):
    self.weights, self.hub = weights, hub

  def publish(self, params, version: int) -> None:
    self.hub.published(version)
    self.weights.publish(params, version)

  def __getattr__(self, name: str):
    return getattr(self.weights, name)


def frame_limit(c, model_config, header_bytes: int) -> int:
  """The most bytes one rpc frame of this run needs: a delivery of rl.queue_groups groups (the samplers' packet,
  its routing as wide as the model's: every layer routed) and its header."""
  routing = (model_config.num_layers, model_config.num_experts_per_tok) if model_config.num_experts else None
  rows = c.rl.queue_groups * c.rl.group_size
  return header_bytes + 4 * rows * packets.packet_width(c.sampler.max_len, routing)


def data_prompts(c):
  """group id -> the prompt tokens of its data position, as the samplers render them (controller.data), for the
  hub's check of every delivered group; None for a multi-turn env task (its first turn is the env's own reset,
  which runs no code of an env on the learner)."""
  model_cfg, tokenizer, _ = build_lib.model_source(c.model, c.sampler.max_len)
  try:
    task, prompts = make_prompt_source(c.task, c.seed, tokenizer, model_cfg, episodes=False)
  except (ValueError, FileNotFoundError, RuntimeError) as e:  # the learner's host needs the task's data too
    raise config_lib.ConfigError(f"task {c.task.name!r} (the learner checks each delivered group's prompt): {e}") \
      from e
  if isinstance(task, EnvTask):
    return None
  return lambda gid: prompts(gid)[0]


def lead_handlers(hub: Hub, describe, log: FollowLog | None = None, where: list[str] | None = None) -> dict:
  """The lead's rpc methods: the hub's, the weights (described to registered samplers only) and, over several
  learner processes, the follow log and a follower's stop request."""
  followed = {"follow": log.serve, "stop": _stop_asked(hub)} if log is not None else {}
  return {**hub.handlers(), "register": _assigning(hub.handlers()["register"], where),
          "weights": _registered_only(hub, describe), **followed}


def _registered_only(hub: Hub, describe):
  """The lead's "weights": described (a pull registered) only for a sampler the hub holds a lease for."""
  def handler(request: dict) -> dict:
    if not hub.known(request):
      return {"version": -1, "expired": True}
    return describe(request)

  return handler


def _stop_asked(hub: Hub):
  """The lead's rpc "stop": a follower learner process got a signal (its host is preempted); the learner stops
  after the current step, with a checkpoint, as on the lead's own SIGTERM."""

  def handler(request: dict) -> dict:
    print(f"jaxrl-learner: learner process {request['process']} got {request['reason']}: stopping after the current "
          "step with a checkpoint", file=sys.stderr, flush=True)
    hub.request_stop(request["reason"])
    return {}

  return handler


def _assigning(register, where: list[str] | None):
  """The hub's register, telling each sampler which learner process to pull weights from: the n-th registration
  process n mod the learner processes (`where`: their rpc addresses, filled once every one serves: until then a
  sampler is asked to try again; None: one learner process, the one registered with)."""
  count = itertools.count()

  def handler(request: dict) -> dict:
    if where is None:
      return register(request)
    if not where:
      return {"stopping": True}  # not every learner process serves yet: the sampler tries again
    reply = register(request)
    if "sampler" in reply:
      reply["weights_at"] = where[next(count) % len(where)]
    return reply

  return handler


class LearnerProgram:
  """The learner loop over the hub (or, on a follower learner process, over the lead's record), and what it
  serves."""

  def __init__(self, c, side: sides.LearnerSide, hub: Hub | Follower, loop: LearnerLoop, weights: WeightServer,
               server: rpc.Server, learners: Learners = Learners(), log: FollowLog | None = None,
               secret: bytes = b""):
    self.c, self.side, self.hub, self.loop, self.weights, self.server = c, side, hub, loop, weights, server
    self.learners, self.log, self.secret = learners, log, secret

  def run(self, linger_s: float = 5.0) -> None:
    """Trains to num_steps (or a stop request); then tells the samplers, waiting up to linger_s for their goodbyes,
    and closes. The final state is checkpointed whatever stopped the loop."""
    if not self.learners.lead:
      return self._follow()
    loop, hub = self.loop, self.hub
    loop.log_start("sync" if loop.spec.max_staleness == 0 else "pipeline", self.side.record)
    loop.weights.publish(loop.state.params, loop.version)
    print(f"jaxrl-learner: serving samplers on {self.server.advertised} (listening on {self.server.address}) from "
          f"version {loop.version}", file=sys.stderr, flush=True)
    try:
      with summary_lib.stop_on_signals(hub.request_stop, (signal.SIGTERM,),
                                       "jaxrl-learner: {name}: stopping after the current step with a checkpoint"):
        hub.guarded("learner", loop.run)
    finally:
      if self.log is not None:  # the followers stop after the same step and checkpoint with the lead
        self.log.end(hub.stop_reason or ("error" if hub.errors else "done"))
      loop.finish()
      if loop.version >= loop.spec.num_steps:
        hub.finish()
        end = time.monotonic() + linger_s
        while hub.registered() and time.monotonic() < end:
          time.sleep(0.05)
      if self.log is not None:  # a follower still fetching the end would find the lead's server closed
        behind = self.log.wait_fetched()
        if behind:
          print(f"jaxrl-learner: learner processes {behind} did not fetch the lead's end", file=sys.stderr, flush=True)
      self.close()
    loop.drain()
    hub.raise_errors()

  def _follow(self) -> None:
    """A follower learner process: the lead's batches, in lock step, to the lead's end; then the checkpoint, with
    the lead. A lead that cannot be followed (dead, silent) ends this process without one (it would wait for the
    lead in the checkpoint's barriers)."""
    loop, follower = self.loop, self.hub
    loop.weights.publish(loop.state.params, loop.version)  # with the lead's first publish (a collective)
    print(f"jaxrl-learner: learner process {self.learners.process_id} follows the lead at {follower.lead.address}; "
          f"serving weights on {self.server.advertised} from version {loop.version}", file=sys.stderr, flush=True)
    with summary_lib.stop_on_signals(self._ask_the_lead_to_stop, (signal.SIGTERM,),
                                     "jaxrl-learner: {name}: asking the lead to stop after the current step"):
      follower.guarded("learner", loop.run)
    if follower.errors:
      follower.raise_errors()
    try:
      loop.finish()
    finally:
      self.close()

  def _ask_the_lead_to_stop(self, name: str) -> None:
    """From a signal handler: the lead decides when every learner process stops (a thread makes the call)."""
    def ask():
      try:
        rpc.call(self.hub.lead.address, "stop", {"reason": name, "process": self.learners.process_id},
                 timeout_s=10.0, secret=self.secret)
      except rpc.RpcError as e:
        print(f"jaxrl-learner: {e}", file=sys.stderr, flush=True)

    threading.Thread(target=ask, name="jaxrl-stop-request", daemon=True).start()

  def close(self) -> None:
    self.server.close()
    self.weights.close()
    self.side.checkpointer.close()
    for writer in (self.side.metrics, self.side.trace):
      if writer is not None:
        writer.close()

  def part(self) -> dict[str, Any]:
    """This learner process's part of the summary: its version, the versions it published (digests of their
    checksums: equal digests, bitwise-equal weights) and the sampler pulls it served."""
    return {"process": self.learners.process_id, "version": self.loop.version, "pulls_served": self.weights.served,
            "published": self.weights.digests}

  def summary(self, train_seconds: float) -> dict[str, Any]:
    loop, hub = self.loop, self.hub
    extra = {}
    if self.learners.many:
      parts = [self.learners.wait(f"learner_part/{p}", f"learner process {p}'s summary", 120.0)
               for p in range(1, self.learners.num_processes)]
      extra["learner_processes"] = [self.part(), *parts]
    return summary_lib.run_summary(self.c.mode, version=loop.version, ledger=hub.ledger.to_json(),
                                   staleness=loop.trained_staleness, samples_in_flight=loop.samples_in_flight(),
                                   busy={"learner": loop.busy}, resumed_from=self.side.resumed_from,
                                   stopped_by=hub.stop_reason, topology="independent_samplers",
                                   samplers=dict(hub.samplers), train_seconds=train_seconds, **extra)


def train(c, workdir: str | Path, learners: Learners = Learners(), **channels) -> dict[str, Any]:
  """Runs the learner of config c with independent samplers to c.num_steps; the lead returns (and writes) the
  summary, a follower learner process its own part (posted to the lead)."""
  workdir = Path(workdir)
  c = config_lib.validate(c, workdir if learners.lead else None, num_devices=len(jax.devices()))
  roles = sides.Roles.single(c.mesh, jax.devices()[: c.mesh.num_devices])
  learner_devices = roles.learner_devices
  if learners.many:  # the learner mesh spans every device of every learner process
    learner_devices = tuple(jax.devices())
    try:
      resolve_axis_sizes(c.mesh.learner_axes.to_dict(), len(learner_devices))
    except (TypeError, ValueError) as e:
      raise config_lib.ConfigError(f"config: mesh.learner_axes over the {len(learner_devices)} devices of "
                                   f"{learners.num_processes} learner processes: {e}") from None
  held = sides.Roles(learner_devices, roles.sampler_devices, learner=True, sampler_rank=None, lead=learners.lead)
  program = sides.build(c, workdir, held, HubChannels(learners=learners, **channels)).runner
  t0 = time.perf_counter()
  program.run()
  if not learners.lead:
    part = program.part()
    learners.store.set(f"learner_part/{learners.process_id}", part)
    return part
  summary = program.summary(time.perf_counter() - t0)
  summary_lib.write_summary(workdir, summary)
  return summary


def main(argv=None):
  platforms.entry_point()
  from absl import flags
  from ml_collections import config_flags

  flags_def = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py[:arg]", lock_config=True)
  flags.DEFINE_string("workdir", None, "run folder: checkpoints, metrics, summary; an existing checkpoint resumes")
  flags.DEFINE_string("host", "127.0.0.1", "the address samplers are told to reach this learner process at (and "
                      "the weight transfer server's)")
  flags.DEFINE_string("bind", None, "the address the rpc port listens on (default: --host; 0.0.0.0: every interface)")
  flags.DEFINE_string("secret_file", None, "the run's secret (else $JAXRL_RUN_SECRET, else workdir/run.secret, made "
                      "0600 on the first start); every sampler and learner process of the run must be given it")
  flags.DEFINE_float("rpc_read_timeout_s", 30.0, "an rpc peer silent this long in a request is closed")
  flags.DEFINE_integer("rpc_max_connections", 64, "rpc requests served at once (a thread each); more are closed")
  flags.DEFINE_integer("port", 0, "the port samplers call (0: a free one, printed); the lead's (other learner "
                       "processes serve weights on a free port)")
  flags.DEFINE_float("lease_s", 10.0, "a sampler silent this long is dropped; its groups are generated again")
  flags.DEFINE_float("orphan_s", 600.0, "give up (one line) when the learner waited this long for groups and none came")
  flags.DEFINE_integer("num_processes", 1, "learner processes (jax.distributed among themselves; 1: none)")
  flags.DEFINE_integer("process_id", 0, "this learner process's id (0: the lead, which serves the hub)")
  flags.DEFINE_string("coordinator_address", None, "HOST:PORT of jax.distributed's coordinator (the lead's host)")
  flags.DEFINE_float("heartbeat_timeout_s", 60.0, "a learner process that stops heartbeating this long ends the "
                     "others (jax.distributed's own abort; a dead one ends them at once)")
  flags.DEFINE_float("follow_timeout_s", 30.0, "a follower learner process that hears nothing from the lead this "
                     "long stops (one line)")
  flags.mark_flags_as_required(["config", "workdir"])
  config_lib.parse_cli("jaxrl-learner", argv)
  learners = Learners()
  if flags_def.num_processes > 1:
    runtime.initialize(flags_def.coordinator_address, flags_def.num_processes, flags_def.process_id,
                       heartbeat_timeout_s=max(1, int(flags_def.heartbeat_timeout_s)))
    learners = Learners(flags_def.process_id, flags_def.num_processes, runtime.Store())
  try:
    secret = (secret_lib.for_learner(flags_def.workdir, flags_def.secret_file) if learners.lead
              else secret_lib.read(flags_def.secret_file))
    limits = rpc.Limits(max_connections=flags_def.rpc_max_connections, read_timeout_s=flags_def.rpc_read_timeout_s)
    summary = train(flags_def.config, flags_def.workdir, learners, host=flags_def.host, port=flags_def.port,
                    lease_s=flags_def.lease_s, orphan_s=flags_def.orphan_s,
                    follow_timeout_s=flags_def.follow_timeout_s, secret=secret, bind=flags_def.bind, limits=limits)
  except (config_lib.ConfigError, secret_lib.SecretError) as e:
    print(f"jaxrl-learner: {e}", file=sys.stderr)
    sys.exit(2)
  except Exception as e:  # a learner process of several: the others are left in collectives; end at once
    if not learners.many:
      raise
    print(f"jaxrl-learner: learner process {learners.process_id}: {type(e).__name__}: "
          f"{(str(e).splitlines() or [''])[0]}", file=sys.stderr, flush=True)
    hard_exit(1)
  if learners.many:
    jax.distributed.shutdown()
  print(json.dumps(summary, indent=2, default=str))
  if "stopped_by" in summary:
    sys.exit(summary_lib.exit_status(summary["stopped_by"]))


if __name__ == "__main__":
  main()
