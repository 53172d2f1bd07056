"""The two sides of a run, built the same way in every topology.

`learner_side` makes the learner's parts: its state restored from the newest checkpoint, the run record, the train
step (compiled ahead for every batch shape when asked, and always in a multi-process job), the checkpointer and, on
the process that writes them, the metrics writer, trace and roofline telemetry. `sampler_side` makes one sampler
replica's: the engine (a LoRA model's base held once, int8 weights as configured), the task with its prompts and
reward, the sampler factory and the held-out evaluation.

`Roles` says which sides this process holds and the devices of each. jaxrl.train (one process holding both sides)
and jaxrl.distributed.job (one side per process) make the meshes, call these builders and wire their own channels
(in-process queue and publisher, or the coordination store and cross-process transfers): the channels are all that
differs between topologies. jaxrl-generate builds its engine and evaluation here too, and jaxrl-profile profiles
what jaxrl.train.build makes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from jaxrl import sharding, telemetry
from jaxrl.checkpoint import Checkpointer
from jaxrl.controller import build as build_lib
from jaxrl.controller.data import evaluate_policy
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.learner.step import batch_shardings
from jaxrl.metrics import MetricsWriter, TraceWriter
from jaxrl.models import ModelConfig, lora
from jaxrl.sampler import Engine, Sampler
from jaxrl.sampler.slot_engine import compute_dtype_name
from jaxrl.settings import RunConfig


@dataclasses.dataclass(frozen=True)
class Roles:
  """Which sides of a run this process holds, and the devices of each.

  learner_devices: the learner mesh's (over one or more processes); sampler_devices: one tuple per sampler replica.
  learner: this process holds the learner (or its share of it); sampler_rank: the replica it holds (None: none).
  learner_processes: a multi-process job's learner processes, each saving its own shards, the first one the lead
  (None: one process holds every side); lead: this process writes the run's metrics, trace and telemetry."""

  learner_devices: tuple
  sampler_devices: tuple[tuple, ...]
  learner: bool = True
  sampler_rank: int | None = 0
  learner_processes: tuple[int, ...] | None = None
  lead: bool = True

  @classmethod
  def single(cls, c: RunConfig, devices) -> Roles:
    """Both sides in this process on c's split of `devices`: the learner the first, the sampler the last
    mesh.sampler_devices of them."""
    learner, sampler = sharding.split_devices(c.mesh.sampler_devices, devices)
    return cls(tuple(learner), (tuple(sampler),))

  @property
  def multi_process(self) -> bool:
    return self.learner_processes is not None

  def learner_mesh(self, c: RunConfig):
    return sharding.make_mesh(c.mesh.learner_axes.to_dict(), self.learner_devices)

  def sampler_meshes(self, c: RunConfig) -> list:
    """One mesh (mesh.sampler_axes) per sampler replica."""
    return [sharding.make_mesh(c.mesh.sampler_axes.to_dict(), devices) for devices in self.sampler_devices]


@dataclasses.dataclass
class LearnerSide:
  """What a LearnerLoop runs (state, record, train step, checkpointer, metrics, trace, telemetry) and what the
  channels around it read (the spec, the mesh, the learner's model and shardings)."""

  spec: RunSpec  # packed row counts are multiples of the learner mesh's batch devices
  mesh: Any
  learner: build_lib.Learner  # model config, graphdef, the jitted step, the state's and a batch's shardings
  state: Any  # restored from the newest checkpoint that verifies, else the initial state
  record: RunRecord
  resumed_from: int | None
  train_step: Any  # the jitted step, or build.CompiledSteps of it
  checkpointer: Checkpointer
  metrics: MetricsWriter | None = None  # these three on the lead process only
  trace: TraceWriter | None = None
  telemetry: telemetry.Telemetry | None = None


def learner_side(c: RunConfig, workdir: Path, roles: Roles, mesh, source, sampler_mesh) -> LearnerSide:
  """The learner's parts on `mesh`. source: build.model_source(c); sampler_mesh: one replica's (the telemetry's
  sampler rates and dtype)."""
  model_cfg, _, path = source
  spec = build_lib.run_spec(c, build_lib.rows_unit(mesh))  # the learner's packed row buckets
  learner = build_lib.build_learner(c, mesh, model_cfg, path, spec)
  # In a multi-process job every learner process saves its own shards (the lead also the run record).
  saving = dict(processes=roles.learner_processes, primary=roles.learner_processes[0]) if roles.multi_process else {}
  checkpointer = build_lib.open_checkpointer(c, workdir, **saving)
  state, record = build_lib.restore(checkpointer, learner.state, learner.state_shardings)
  resumed_from = checkpointer.restored_step  # the newest checkpoint that verifies
  train_step = learner.train_step
  if c.rl.compile_ahead or roles.multi_process:
    # A multi-process job compiles what has collectives before running any of it: gloo gives up on a peer that
    # reaches the first collective 30 s late (e.g. still compiling while another process found a cached binary).
    # Every learner process holds the whole (identical) numpy batch there; device_put keeps each one's rows.
    place = _placer(batch_shardings(learner.batch_sharding)) if roles.multi_process else (lambda batch: batch)
    train_step = build_lib.CompiledSteps(train_step, state, spec, c.rl.seq_len, jax.random.key(c.seed), place)
  side = LearnerSide(spec, mesh, learner, state, record, resumed_from, train_step, checkpointer)
  if roles.lead:  # the lead's loop sees every step, drop and checkpoint of the run
    side.metrics = build_lib.open_metrics(c, workdir, resumed_from)
    side.trace = TraceWriter(workdir / "trace.jsonl") if c.log.trace else None
    if c.log.telemetry:  # a multi-process job's sampler rates are per replica (summed counters, summed busy time)
      sampler_dtype = compute_dtype_name(c.sampler.dtype, model_cfg, sampler_mesh)  # the sampler engine's
      side.telemetry = telemetry.for_run(c, learner.model_config, learner_devices=mesh.size,
                                         sampler_devices=sampler_mesh.size, sampler_dtype=sampler_dtype)
  return side


def _placer(batch_sh):
  return lambda batch: jax.device_put(batch, batch_sh)


@dataclasses.dataclass
class SamplerSide:
  """One sampler replica's parts: its engine, the task with its prompts and reward; `sampler` makes the Sampler a
  SamplerLoop runs, `evaluate` scores a policy on the task's held-out examples."""

  c: RunConfig
  engine: Engine
  tokenizer: Any
  task: Any
  prompts: Any
  score: Any
  compile_rebuilds: bool = False  # compile the dense KV recompute of an in-flight update before the first step

  def sampler(self, params, version: int) -> Sampler:
    """The replica's Sampler from `params` at `version`. In a multi-process job a pipeline run's dense KV recompute
    (sampler.on_update="recompute") is compiled first, not at its first use mid-run, where every learner would wait
    on it."""
    c, engine = self.c, self.engine
    if self.compile_rebuilds and build_lib.max_staleness(c) and c.sampler.on_update == "recompute" and \
        engine.kv == "dense":
      build_lib.compile_rebuilds(engine, engine.place(params, version))
    return build_lib.build_sampler(c, engine, params, version, self.tokenizer)

  def evaluate(self, params, version: int) -> tuple[dict[str, float], list]:
    """(summary, rollouts): greedy completions of the task's first eval.num_examples held-out examples (at most
    eval.max_new_tokens each), scored by the run's reward (controller.data.evaluate_policy)."""
    c = self.c
    detokenize = self.tokenizer.decode if self.tokenizer is not None else None
    return evaluate_policy(self.engine, self.task, self.score, params, version, num_examples=c.eval.num_examples,
                           max_new_tokens=c.eval.max_new_tokens, seed=c.seed, detokenize=detokenize)


def sampler_engine(c: RunConfig, model_cfg: ModelConfig, mesh, path: Path | None = None, *, base=None,
                   **overrides) -> Engine:
  """The run's sampler engine on `mesh` (build.build_engine: sizes, KV layout, dtype, int8 weights, attention;
  `overrides`: Engine arguments a CLI flag set). A LoRA model's engine holds the frozen base once, so that a publish
  moves the adapters alone: `base` when this process has it already (the learner's, or a loaded policy's), else
  the config's model loaded from `path` onto the sampler mesh."""
  engine = build_lib.build_engine(c, model_cfg, mesh, **overrides)
  if model_cfg.lora is not None:
    if base is None:
      shardings_fn = lambda params: sharding.param_shardings(params, mesh, sharding.SAMPLER_RULES)  # noqa: E731
      base = lora.split(build_lib.base_params(c, model_cfg, path, shardings_fn)[2])[1]
    engine.hold_base(base)
  return engine


def sampler_side(c: RunConfig, roles: Roles | None, mesh, source, *, task=None, base=None,
                 **overrides) -> SamplerSide:
  """A sampler replica's parts on `mesh`. roles: this process's (None outside a run: jaxrl-generate); source:
  build.model_source(c); task: (task, prompts, score) when already built (jaxrl.train builds it first, so that bad
  data fails before any params load), else built here; base and overrides: as sampler_engine's."""
  model_cfg, tokenizer, path = source
  task, prompts, score = task or build_lib.build_task(c, tokenizer, model_cfg)
  engine = sampler_engine(c, model_cfg, mesh, path, base=base, **overrides)
  multi_process = roles is not None and roles.multi_process
  return SamplerSide(c, engine, tokenizer, task, prompts, score, compile_rebuilds=multi_process)
