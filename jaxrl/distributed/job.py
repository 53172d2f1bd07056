"""One process of a multi-process jaxrl-train job (`python -m jaxrl.distributed.job`): every process runs this same
command, with the same config.

  python -m jaxrl.distributed.launch --num_processes=4 -- --config=configs/tiny.py --workdir=/tmp/jaxrl-mp
  (TPU VMs and Slurm: see launch/README.md)

The learner mesh spans the first processes (mesh.sampler_devices, counted from the end, must cover whole
processes); every later process is one sampler replica on its own devices, with mesh.sampler_axes and
sampler.max_slots per replica. The lead learner (the first learner process) writes workdir/metrics.jsonl and
workdir/summary.json. The learner processes checkpoint the train state together (each its own shards) into
workdir/checkpoints, which all of them must see; the same command on a workdir with a checkpoint resumes from it
(on the same or another split). Groups in flight at the checkpoint are generated again first, as single-host
jaxrl-train does: every admitted group is trained once or dropped with its reason (summary.json counts the samples
a resume discarded and regenerated).

SIGTERM on any process (a preempted TPU VM, a Slurm time limit) stops the whole job after the learners' current
step, with a checkpoint: every process exits with status 143 and the same command resumes. A second SIGTERM gets
the default handler (the process dies; the others stop as on any failure).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl import platforms, settings, sharding
from jaxrl.checkpoint import IntegrityError
from jaxrl.controller import build as build_lib
from jaxrl.controller import sides
from jaxrl.controller import summary as summary_lib
from jaxrl.controller.learner_loop import LearnerLoop
from jaxrl.controller.sampler_loop import SamplerLoop
from jaxrl.controller.spec import RunRecord
from jaxrl.distributed import cli, runtime
from jaxrl.distributed.cross_process import (
  Ferry,
  Inbox,
  LearnerPublisher,
  Outbox,
  ReceivedWeights,
  StoreCoordinator,
  request_job_stop,
)
from jaxrl.distributed.roles import LearnerProcess, SamplerProcess
from jaxrl.distributed.transfer import TransferLog, WeightRoute, source_devices
from jaxrl.distributed.watchdog import Watchdog, hard_exit
from jaxrl.envs.guard import RewardsBroken
from jaxrl.models import hf, lora, quant
from jaxrl.sampler.slot_engine import compute_dtype_name


def sampler_weights(s: settings.Sampler, abstract, model_cfg, mesh):
  """(what the learner applies to a version before sending it, the abstract params the samplers receive): the
  params as they are, or quantized to int8 in the sampler's compute dtype (sampler.weight_dtype="int8")."""
  if s.weight_dtype != "int8":
    return None, abstract
  dtype = jnp.dtype(compute_dtype_name(s.dtype, model_cfg, mesh))
  prepare = lambda params: quant.quantize_params(params, dtype)  # noqa: E731
  return prepare, jax.eval_shape(prepare, abstract)


def _sampler_shardings(s: settings.Sampler, abstract, mesh):
  shardings = sharding.param_shardings(abstract, mesh, sharding.SAMPLER_RULES)
  return quant.quantized_shardings(shardings, abstract) if s.weight_dtype == "int8" else shardings


EXIT_FAILED = 1  # this process failed (its traceback is printed above the one-line reason)


def roles(topology: runtime.Topology) -> sides.Roles:
  """The side of the run this process of the job holds (controller.sides): the learner (its share of the learner
  mesh) or one sampler replica."""
  sampler = topology.role == "sampler"
  return sides.Roles(topology.learner_devices, topology.sampler_devices, learner=not sampler,
                     sampler_rank=topology.sampler_rank if sampler else None, lead=topology.process_id == topology.lead)


def build(c, workdir: str | Path, topology: runtime.Topology, store, *, dump_dir: Path | None = None,
          poll_s: float = 0.05) -> LearnerProcess | SamplerProcess:
  """This process's role: the learner (state, train step, publisher) or one sampler replica (engine, task), made by
  the build of every topology (controller.sides.build) and joined by the store's channels."""
  return _build(_validate(c, Path(workdir), topology), Path(workdir), topology, store, dump_dir, poll_s)


def _validate(c, workdir: Path, topology: runtime.Topology) -> config_lib.RunConfig:
  """The typed RunConfig of c, checked against this job (one writer probes workdir)."""
  c = config_lib.validate(c, workdir if roles(topology).lead else None, num_devices=len(jax.devices()))
  cli.validate_job(c, topology.devices_per_process())
  return c


def _build(c: config_lib.RunConfig, workdir: Path, topology: runtime.Topology, store, dump_dir: Path | None,
           poll_s: float = 0.05) -> LearnerProcess | SamplerProcess:
  channels = JobChannels(c, topology, store, dump_dir=dump_dir, poll_s=poll_s)
  return sides.build(c, workdir, roles(topology), channels).runner


class JobChannels:
  """The channels of one process of a job (controller.sides.Channels): the coordination store and cross-host
  copies (distributed.cross_process). Every program is compiled before any runs (gloo gives up on a peer that
  reaches the first collective 30 s late, e.g. still compiling while another process found a cached binary); every
  learner process holds the whole (identical) host batch, which device_put cuts to its rows, and saves its own
  checkpoint shards; the learner quantizes each version once for an int8 sampler, before it is cut and sent."""

  compile_ahead = True

  def __init__(self, c: settings.RunConfig, topology: runtime.Topology, store, *, dump_dir: Path | None = None,
               poll_s: float = 0.05):
    self.topology, self.store, self.dump_dir, self.poll_s = topology, store, dump_dir, poll_s
    self.roles = roles(topology)
    self.log = TransferLog(store)
    model_cfg = build_lib.model_config(c.model, c.sampler.max_len)
    abstract = hf.abstract_params(model_cfg)[1]
    if model_cfg.lora is not None:  # a publish moves the adapters alone; each sampler holds the base
      abstract = lora.split(abstract)[0]
    self.replicas = self.roles.sampler_meshes(c.mesh)
    self.prepare, sent = sampler_weights(c.sampler, abstract, model_cfg, self.replicas[0])
    try:
      self.routes = [WeightRoute(sent, _sampler_shardings(c.sampler, abstract, mesh),
                                 source_devices(topology.learner_devices, mesh.size, rank))
                     for rank, mesh in enumerate(self.replicas)]
    except ValueError as e:
      raise config_lib.ConfigError(f"config: mesh.sampler_devices={c.mesh.sampler_devices}: {e}") from None

  def checkpointer_options(self) -> dict:
    learners = self.topology.learner_processes
    return dict(processes=learners, primary=learners[0])  # the lead also saves the run record

  def place(self, batch_shardings):
    return lambda batch: jax.device_put(batch, batch_shardings)

  def wire(self, built: sides.Built) -> LearnerProcess | SamplerProcess:
    if built.learner is not None:
      return self._learner(built.config, built.learner)
    return self._sampler(built.config, built.sampler)

  def _ferry(self, coord: StoreCoordinator, max_len: int, **channels) -> Ferry:
    return Ferry(self.topology, self.store, self.log, self.routes, max_len, coord, dump_dir=self.dump_dir,
                 **channels)

  def _sampler(self, c: settings.RunConfig, side: sides.SamplerSide) -> SamplerProcess:
    rank, num_samplers = self.roles.sampler_rank, len(self.replicas)
    spec = build_lib.run_spec(c)
    coord = StoreCoordinator(self.store, self.topology, RunRecord(), spec.num_steps, spec.rl.group_size,
                             spec.rl.max_failures_in_a_row, poll_s=self.poll_s)
    outbox = Outbox(self.store, self.log, rank, spec.rl.queue_groups, c.sampler.max_len,
                    self.topology.sampler_devices[rank][0], coord.stop, self.poll_s)
    received = ReceivedWeights()

    def make_loop(first):
      return SamplerLoop(spec, sampler=side.sampler(first.params, first.version), prompts=side.prompts,
                         score=side.score, rollouts=outbox, weights=received, coord=coord, num_samplers=num_samplers)

    evaluate = None
    if c.eval.num_examples and rank == 0:  # the first replica scores the held-out examples

      def evaluate(params, version):
        return side.evaluate(params, version)[0]

    ferry = self._ferry(coord, c.sampler.max_len, outbox=outbox, received=received)
    return SamplerProcess(make_loop, coord, ferry, received, side.score, evaluate, self.poll_s)

  def _learner(self, c: settings.RunConfig, side: sides.LearnerSide) -> LearnerProcess:
    lead, learners = self.roles.lead, self.topology.learner_processes
    publisher = LearnerPublisher(self.routes, NamedSharding(side.mesh, P()), self.log if lead else None,
                                 self.dump_dir, self.prepare)
    # Compile what has collectives before running any of it, then start together (the build compiled the step).
    publisher.compile(side.state.params)
    self.store.barrier("learners_compiled", learners)
    spec = side.spec
    rl = spec.rl
    coord = StoreCoordinator(self.store, self.topology, side.record, spec.num_steps, rl.group_size,
                             rl.max_failures_in_a_row, side.resumed_from, self.poll_s, rl.max_filtered_in_a_row)
    inbox = Inbox(len(self.replicas), coord.stop, self.store if lead else None, self.poll_s)
    loop = LearnerLoop(spec, train_step=side.train_step, state=side.state, rollouts=inbox, weights=publisher,
                       coord=coord, num_samplers=len(self.replicas), checkpointer=side.checkpointer,
                       metrics=side.metrics, trace=side.trace, telemetry=side.telemetry)
    ferry = self._ferry(coord, c.sampler.max_len, inbox=inbox, publisher=publisher)
    return LearnerProcess(loop, coord, ferry, self.log, side.record)


def summarize(c, parts: dict[int, dict], topology: runtime.Topology) -> dict[str, Any]:
  """The job's summary from every process's own: the lead learner's ledger plus the samplers' counts."""
  learner = parts[topology.lead]
  samplers = [parts[p] for p in topology.sampler_processes]
  evals = {k: samplers[0][k] for k in ("eval_before", "eval_after") if k in samplers[0]}
  return summary_lib.run_summary(
      c.mode, version=learner["version"], ledger=summary_lib.merge_ledgers(learner["ledger"],
                                                                           [s["ledger"] for s in samplers]),
      staleness=learner["trained_staleness"],
      samples_in_flight=learner["samples_in_flight"] + sum(s["samples_in_flight"] for s in samplers),
      busy={"learner": learner["busy"]["learner"], "samplers": [s["busy"]["sampler"] for s in samplers]},
      resumed_from=learner.get("resumed_from"), stopped_by=learner.get("stopped_by") or None,
      num_processes=len(parts), learner_processes=list(topology.learner_processes),
      sampler_processes=list(topology.sampler_processes), sampler_versions=[s["sampler_version"] for s in samplers],
      **evals, **({"episodes": summary_lib.merge_episode_stats([s["episodes"] for s in samplers])}
                  if "episodes" in samplers[0] else {}))


def train(c, workdir: str | Path, topology: runtime.Topology, store, *, dump_dir: Path | None = None,
          summary_timeout_s: float = 120.0) -> dict[str, Any]:
  """Runs this process's role to the end; the lead returns (and writes) the job's summary, others their own
  (`stopped_by` in either: the job was stopped early by that signal, after a checkpoint)."""
  workdir = Path(workdir)
  c = _validate(c, workdir, topology)  # once: the typed RunConfig from here on
  role = _build(c, workdir, topology, store, dump_dir)
  t0 = time.perf_counter()
  try:
    role.run()
  finally:
    role.close()
  own = role.summary()
  own["train_seconds"] = time.perf_counter() - t0
  store.set(f"summary/{topology.process_id}", own)
  if topology.process_id != topology.lead:
    return own
  # The first sampler posts its summary after the held-out eval of the trained policy, which can take a while; the
  # watchdog, not this timeout, catches a process that died meanwhile.
  timeout_s = max(summary_timeout_s, 3600.0) if c.eval.num_examples else summary_timeout_s
  parts = {p: store.get(f"summary/{p}", timeout_s) for p in range(jax.process_count())}
  summary = summarize(c, parts, topology)
  summary["train_seconds"] = own["train_seconds"]
  summary_lib.write_summary(workdir, summary)
  return summary


def main(argv=None):
  platforms.entry_point()
  from absl import flags

  flags_def = flags.FLAGS
  cli.define_flags(flags_def)
  config_lib.parse_cli("jaxrl.distributed.job", argv)  # bad flags end here with one line, before any work
  # JAX's own heartbeat abort is the backstop, well after the watchdog's.
  runtime.initialize(heartbeat_timeout_s=int(3 * flags_def.heartbeat_timeout_s) + 10)
  store = runtime.Store()
  c = flags_def.config
  me = jax.process_index()
  try:
    topology = runtime.Topology.split(c.mesh.sampler_devices, jax.devices(), me)
  except ValueError as e:
    print(f"jaxrl: process {me}: config: mesh.sampler_devices={c.mesh.sampler_devices}: {e}", file=sys.stderr)
    hard_exit(2)
  runtime.cache_process_local_programs(topology)
  watchdog = Watchdog(store, me, topology.name, jax.process_count(),
                      timeout_s=flags_def.heartbeat_timeout_s).start()
  workdir = Path(flags_def.workdir)
  # The store is written from a thread, not from inside the signal handler.
  stop = lambda name: threading.Thread(target=request_job_stop, args=(store, name), name="jaxrl-stop-request",
                                       daemon=True).start()
  message = f"jaxrl: process {me}: {{name}}: the job stops after the learners' current step, with a checkpoint"
  try:
    with summary_lib.stop_on_signals(stop, (signal.SIGTERM,), message):
      summary = train(c, workdir, topology, store,
                      dump_dir=workdir / "weights" if flags_def.dump_weights else None)
  except BaseException as e:  # noqa: BLE001 - any failure stops the whole job, on every process
    traceback.print_exc()
    watchdog.wait_for_cause()  # returns only if no other process is dead or failed first
    first_line = (str(e).splitlines() or [""])[0]
    reason = f"process {me} ({topology.name(me)}) failed: {type(e).__name__}: {first_line}"
    watchdog.stop_job(reason)
    print(f"jaxrl: {reason}", file=sys.stderr, flush=True)
    watchdog.leave(2 if isinstance(e, (config_lib.ConfigError, IntegrityError, RewardsBroken)) else EXIT_FAILED)
  watchdog.close()
  jax.distributed.shutdown()
  if me == topology.lead:
    print(json.dumps(summary, indent=2, default=str))
  stopped_by = summary.get("stopped_by")
  if stopped_by:
    print(f"jaxrl: process {me}: stopped by {stopped_by}; the learners saved a checkpoint; the same command "
          "resumes the job", file=sys.stderr, flush=True)
    sys.exit(summary_lib.exit_status(stopped_by))


if __name__ == "__main__":
  main()
