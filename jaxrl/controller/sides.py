"""One build for every topology: `build(c, workdir, roles, channels)` makes the sides this process holds and hands
them to its channels, which join them into the loops.

`learner_side` makes the learner's parts: its state restored from the newest checkpoint, the run record, the train
step (compiled ahead for every batch shape when asked, or when the channels need it), the checkpointer and, on the
process that writes them, the metrics writer, trace and roofline telemetry. `sampler_side` makes one sampler
replica's: the engine (a LoRA model's base held once, int8 weights as configured), the task with its prompts and
reward, the sampler factory and the held-out evaluation.

`Roles` says which sides this process holds and the devices of each; `Channels` is everything that differs between
topologies: controller.local.LocalChannels (both loops in this process: a queue, a publisher, a LocalCoordinator)
and distributed.job.JobChannels (one loop per process of a jax.distributed job: the coordination store and
cross-host copies). jaxrl-generate builds its engine and evaluation here too, and jaxrl-profile profiles what
jaxrl.train.build makes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax

from jaxrl import settings as settings_lib
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
  learner: this process holds the learner (or its share of it); sampler_rank: the replica it holds (None: none);
  lead: this process writes the run's metrics, trace and telemetry."""

  learner_devices: tuple
  sampler_devices: tuple[tuple, ...]
  learner: bool = True
  sampler_rank: int | None = 0
  lead: bool = True

  @classmethod
  def single(cls, c: RunConfig, devices) -> Roles:
    """Both sides in this process on c's split of `devices`: the learner the first, the sampler the last
    mesh.sampler_devices of them."""
    learner, sampler = sharding.split_devices(c.mesh.sampler_devices, devices)
    return cls(tuple(learner), (tuple(sampler),))

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


class Channels(Protocol):
  """What a topology adds to the build: the channels between the loops and what they need of the sides. Nothing
  else in the build depends on where the other side runs."""

  compile_ahead: bool  # compile every program before running any (a job: a peer late to a collective fails it)

  def checkpointer_options(self) -> dict: ...  # the Checkpointer's saving processes (build.open_checkpointer)
  def place(self, batch_shardings) -> Callable: ...  # puts a host batch where the train step takes it

  def wire(self, built: Built) -> Any:
    """What runs this process's loops: both, joined in-process (LocalController), or this process's role."""


class OneProcess:
  """What Channels ask of a topology whose learner is one process: nothing compiled ahead unless rl.compile_ahead
  asks, a batch goes to the train step as it is, one checkpointer saves everything. Subclasses add `wire`."""

  compile_ahead = False

  def checkpointer_options(self) -> dict:
    return {}

  def place(self, batch_shardings):
    return lambda batch: batch


def build(c: RunConfig, workdir: Path, roles: Roles, channels: Channels) -> Built:
  """The sides this process holds, made the same way in every topology, joined by `channels` (Built.runner).
  The task comes first, so that bad data fails before any params load; a sampler beside the learner holds the
  learner's LoRA base (publishes move the adapters alone)."""
  source = build_lib.model_source(c)
  model_cfg, tokenizer, _ = source
  sampler_meshes = roles.sampler_meshes(c)
  rank = roles.sampler_rank
  task = build_lib.build_task(c, tokenizer, model_cfg) if rank is not None else None
  learner = sampler = None
  if roles.learner:
    learner = learner_side(c, workdir, roles, roles.learner_mesh(c), source, sampler_meshes[0], channels)
  if rank is not None:
    sampler = sampler_side(c, sampler_meshes[rank], source, task=task,
                           base=learner.state.frozen if learner is not None else None,
                           compile_rebuilds=channels.compile_ahead)
  built = Built(c, learner, sampler)
  built.runner = channels.wire(built)
  return built


def learner_side(c: RunConfig, workdir: Path, roles: Roles, mesh, source, sampler_mesh,
                 channels: Channels) -> LearnerSide:
  """The learner's parts on `mesh`. source: build.model_source(c); sampler_mesh: one replica's (the telemetry's
  sampler rates and dtype)."""
  model_cfg, _, path = source
  spec = build_lib.run_spec(c, build_lib.rows_unit(mesh))  # the learner's packed row buckets
  learner = build_lib.build_learner(c, mesh, model_cfg, path, spec)
  checkpointer = build_lib.open_checkpointer(c, workdir, **channels.checkpointer_options())
  state, record = build_lib.restore(checkpointer, learner.state, learner.state_shardings)
  resumed_from = checkpointer.restored_step  # the newest checkpoint that verifies
  train_step = learner.train_step
  if c.rl.compile_ahead or channels.compile_ahead:
    place = channels.place(batch_shardings(learner.batch_sharding))
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


@dataclasses.dataclass
class SamplerSide:
  """One sampler replica's parts: its engine, the task with its prompts and reward, and its sections' settings
  (sampler, eval); `sampler` makes the Sampler a SamplerLoop runs, `evaluate` scores a policy on the task's held-out
  examples."""

  settings: settings_lib.Sampler
  eval_settings: settings_lib.Eval
  seed: int
  engine: Engine
  tokenizer: Any
  task: Any
  prompts: Any
  score: Any
  # the dense KV recompute of an in-flight update compiled before the first step (a job's pipeline: at its first
  # use mid-run every learner would wait on it)
  compile_rebuilds: bool = False

  def sampler(self, params, version: int) -> Sampler:
    """The replica's Sampler from `params` at `version`."""
    if self.compile_rebuilds:
      build_lib.compile_rebuilds(self.engine, self.engine.place(params, version))
    return build_lib.build_sampler(self.settings, self.seed, self.engine, params, version, self.tokenizer)

  def evaluate(self, params, version: int) -> tuple[dict[str, float], list]:
    """(summary, rollouts): greedy completions of the task's first eval.num_examples held-out examples (at most
    eval.max_new_tokens each), scored by the run's reward (controller.data.evaluate_policy)."""
    e = self.eval_settings
    detokenize = self.tokenizer.decode if self.tokenizer is not None else None
    return evaluate_policy(self.engine, self.task, self.score, params, version, num_examples=e.num_examples,
                           max_new_tokens=e.max_new_tokens, seed=self.seed, detokenize=detokenize)


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


def sampler_side(c: RunConfig, mesh, source, *, task=None, base=None, compile_rebuilds: bool = False,
                 **overrides) -> SamplerSide:
  """A sampler replica's parts on `mesh`. source: build.model_source(c); task: (task, prompts, score) when already
  built (build makes it first, so that bad data fails before any params load), else built here; base and
  overrides: as sampler_engine's; compile_rebuilds: compile a pipeline's dense KV recompute ahead (the channels')."""
  model_cfg, tokenizer, path = source
  task, prompts, score = task or build_lib.build_task(c, tokenizer, model_cfg)
  engine = sampler_engine(c, model_cfg, mesh, path, base=base, **overrides)
  rebuilds = build_lib.max_staleness(c) > 0 and c.sampler.on_update == "recompute" and engine.kv == "dense"
  return SamplerSide(c.sampler, c.eval, c.seed, engine, tokenizer, task, prompts, score,
                     compile_rebuilds=compile_rebuilds and rebuilds)


@dataclasses.dataclass
class Built:
  """What build made for this process: the sides it holds (None: held by another process) and what runs them."""

  config: RunConfig
  learner: LearnerSide | None
  sampler: SamplerSide | None
  runner: Any = None  # channels.wire's
