"""One build path for a run's pieces, used by jaxrl-train, the multi-process entry point and jaxrl.policy: the model
source, the task (prompts and rewards), the learner (train step and state on its mesh), the sampler engine, the
checkpointer, the restore and the metrics writer. Each piece takes the sections of a validated RunConfig
(config.validate) it reads, or the few values it needs, never the whole config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl import config as config_lib
from jaxrl import console, settings, sharding
from jaxrl.assets import smollm2_path
from jaxrl.checkpoint import Checkpointer
from jaxrl.controller.data import make_prompt_source, make_scorer
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.learner import StepConfig, init_train_state, jit_train_step, make_optimizer, train_state_shardings
from jaxrl.learner.config import LossConfig
from jaxrl.learner.packing import pack_batch, row_buckets
from jaxrl.learner.step import batch_shards, needs_ref_pass
from jaxrl.metrics import MetricsWriter
from jaxrl.models import Decoder, ModelConfig, hf, init_params, lora, presets
from jaxrl.models.lora import LoRAConfig
from jaxrl.rollout import make_batch, with_routing
from jaxrl.sampler import Engine, Sampler, make_engine
from jaxrl.sampler.forced import ForcedLengths, LognormalLengths
from jaxrl.settings import RunConfig


def model_source(m: settings.Model, max_len: int) -> tuple[ModelConfig, Any, Path | None]:
  """(model config, tokenizer, HF folder of the weights or None) of a run's model section: cheap, read before any
  params are loaded. With model.preset the weights are random (no folder), the tokenizer still model.source's.
  max_len: the sampler's (a tiny model's positions)."""
  cfg = model_config(m, max_len)
  if m.source == "tiny":
    return cfg, None, None
  path = _source_path(m)  # fetched and converted on first use
  with console.phase(f"loading the tokenizer of {path}"):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
  return cfg, tokenizer, None if m.preset else path


def model_config(m: settings.Model, max_len: int, platform: str | None = None) -> ModelConfig:
  """The ModelConfig of a run's model section for a run on `platform` (default: this host's backend): model.preset's
  shape, the "tiny" sizes (max_len positions), or the HF folder's config.json (no weights read)."""
  # bfloat16 compute (float32 master weights by default) on accelerators; float32 on CPU, where bf16 is slow.
  platform = platform or jax.default_backend()
  dtype = m.dtype if m.dtype != "auto" else "float32" if platform == "cpu" else "bfloat16"
  overrides = dict(dtype=dtype, param_dtype=m.param_dtype, remat=m.remat, remat_policy=m.remat_policy,
                   train_attention=m.train_attention, scan_unroll=m.scan_unroll, lora=lora_config(m.lora))
  if m.preset:
    return ModelConfig(**{**presets.shape(m.preset), **overrides})
  if m.source == "tiny":
    return ModelConfig.tiny(**m.tiny.to_dict(), **overrides, max_position_embeddings=max_len)
  return hf.load_config(_source_path(m), **overrides)


def _source_path(m: settings.Model) -> Path:
  if m.source == "smollm2":
    return smollm2_path()
  return Path(m.source).expanduser()


def run_shapes(c: RunConfig) -> tuple[int, float]:
  """(prompt tokens of the run's first prompt, bytes of its model's params): what a calibration from a run's logs
  needs besides them (cost_profile.from_run; mode="auto")."""
  model_cfg, tokenizer, _ = model_source(c.model, c.sampler.max_len)
  weight_bytes = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(hf.abstract_params(model_cfg)[1])))
  return len(make_prompt_source(c.task, c.seed, tokenizer, model_cfg)[1](0)[0]), weight_bytes


def lora_config(lo: settings.LoRA) -> LoRAConfig | None:
  """The adapters of a run's model.lora, None when it is off."""
  return LoRAConfig(lo.rank, lo.alpha, lo.targets) if lo.enabled else None


def base_params(seed: int, cfg: ModelConfig, path: Path | None, shardings_fn) -> tuple[ModelConfig, Any, Any]:
  """(model config, graphdef, params placed by shardings_fn(abstract params)): the model a run starts from. With
  LoRA (cfg.lora) the base model's params (as without it) and fresh adapters (B = 0: the base model's outputs)."""
  plain = cfg.replace(lora=None)
  if path is None:
    graphdef, params = init_params(plain, seed)
    params = jax.device_put(params, shardings_fn(params))
  else:
    abstract = hf.abstract_params(plain)[1]
    plain, graphdef, params = hf.load_params(path, plain, shardings=shardings_fn(abstract))
  if cfg.lora is None:
    return plain, graphdef, params
  cfg = plain.replace(lora=cfg.lora)
  graphdef, adapters = lora.init_adapters(lambda: Decoder(cfg, nnx.Rngs(seed)))
  return cfg, graphdef, lora.merge(params, jax.device_put(adapters, shardings_fn(adapters)))


def max_staleness(mode: str, rl: settings.RL) -> int:
  """The hard staleness bound of a run: 0 in sync mode, auto_staleness.k_max under "auto"."""
  if mode != "pipeline":
    return 0
  return rl.auto_staleness.k_max if rl.max_staleness == "auto" else rl.max_staleness


def run_spec(c: RunConfig, rows_unit: int = 1) -> RunSpec:
  """The loops' spec of a config: its rl, sampler and task sections and what follows from them (sync mode is the
  pipeline with max_staleness 0); packed row counts are multiples of rows_unit (the learner's batch devices,
  rows_unit(learner mesh)) times rl.num_minibatches, so that every mini-batch of a packed batch splits evenly over
  those devices too."""
  rl = c.rl
  buckets = row_buckets(rl.batch_size, rows_unit * rl.num_minibatches) if rl.pack else ()
  auto = rl.auto_staleness if c.mode == "pipeline" and rl.max_staleness == "auto" else None
  return RunSpec(rl=rl, sampler=c.sampler, task=c.task, num_steps=c.num_steps, seed=c.seed,
                 max_staleness=max_staleness(c.mode, rl), auto_staleness=auto, row_buckets=buckets,
                 routing=_routing(model_config(c.model, c.sampler.max_len)))


def _routing(cfg: ModelConfig) -> tuple[int, int] | None:
  return (cfg.num_layers, cfg.num_experts_per_tok) if cfg.is_moe else None


def rows_unit(mesh) -> int:
  """Devices a learner batch's rows are split over on `mesh`: packed row counts are multiples of it."""
  return batch_shards(sharding.batch_sharding(mesh, sharding.LEARNER_RULES))


def build_task(t: settings.Task, seed: int, num_eval: int, tokenizer, model_cfg):
  """(task, prompts, score) of a run's task section, with num_eval held-out examples; a bad data file, a missing chat
  template or an unknown reward is a ConfigError (checked before any params are loaded or compiled)."""
  try:
    with console.phase(f"preparing task {t.name!r} (prompts, the reward's self-check)"):
      task, prompts = make_prompt_source(t, seed, tokenizer, model_cfg)
      if num_eval:  # a task too small for the eval would fail only at the first eval, the model built
        task.eval_examples(num_eval)
      return task, prompts, make_scorer(t, task, tokenizer)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    raise config_lib.ConfigError(f"task {t.name!r}: {e}") from e


@dataclasses.dataclass
class Learner:
  """The learner on its mesh: the pure train step and the initial state."""

  model_config: ModelConfig
  graphdef: Any
  train_step: Any  # (state, batch, key) -> (state, metrics), jitted with in/out shardings
  state: Any
  state_shardings: Any
  batch_sharding: Any  # the rows of a batch over the learner mesh


def _param_shardings(mesh):
  return lambda params: sharding.param_shardings(params, mesh, sharding.LEARNER_RULES)


def run_optimizer(o: settings.Optimizer, rl: settings.RL, num_steps: int):
  """The optimizer of a run's optimizer section. Its schedule counts optimizer updates, rl.num_minibatches *
  rl.num_epochs per learner step, so warmup and decay (in learner steps in the config) are scaled to updates here."""
  per_step = rl.num_minibatches * rl.num_epochs
  options = dataclasses.asdict(o)
  options["warmup_steps"] *= per_step
  decay = options.pop("decay_steps") or num_steps
  return make_optimizer(**options, decay_steps=decay * per_step)


def build_learner(mesh, model_cfg: ModelConfig, path: Path | None, spec: RunSpec, *, seed: int, rl: settings.RL,
                  loss: LossConfig, optimizer) -> Learner:
  """The learner of a run's sections (optimizer: run_optimizer's); with LoRA its state trains the adapters (params)
  on the frozen base (frozen)."""
  model_cfg, graphdef, params = base_params(seed, model_cfg, path, _param_shardings(mesh))
  frozen = None
  if model_cfg.lora is not None:
    params, frozen = lora.split(params)
  step = learner_step(rl, loss, optimizer, mesh, graphdef, params, spec, frozen)
  # The KL reference is the initial policy: with LoRA its adapters (B = 0) on the shared base, a small copy.
  state = init_train_state(params, optimizer, rng=seed, shardings=step.state_shardings, frozen=frozen,
                           ref_params=jax.tree.map(jnp.copy, params) if needs_ref_pass(loss) else None)
  return Learner(model_cfg, graphdef, step.train_step, state, step.state_shardings, step.batch_sharding)


@dataclasses.dataclass(frozen=True)
class LearnerStep:
  train_step: Any  # (state, batch, key) -> (state, metrics), jitted with in/out shardings
  state_shardings: Any
  batch_sharding: Any


def learner_step(rl: settings.RL, loss: LossConfig, optimizer, mesh, graphdef, params, spec: RunSpec,
                 frozen=None) -> LearnerStep:
  """The run's train step on `mesh` for params (arrays, or abstract ones: jaxrl-compile builds the step from
  shapes alone) and, with LoRA, the frozen base."""
  frozen_sh = None if frozen is None else _param_shardings(mesh)(frozen)
  state_sh = train_state_shardings(params, optimizer, _param_shardings(mesh)(params), mesh,
                                   with_ref=needs_ref_pass(loss), frozen=frozen, frozen_shardings=frozen_sh)
  rows = sharding.batch_sharding(mesh, sharding.LEARNER_RULES)
  step_config = StepConfig(model=graphdef, optimizer=optimizer, loss=loss, batch_size=spec.rl.batch_size,
                           seq_len=rl.seq_len, num_minibatches=rl.num_minibatches, num_epochs=rl.num_epochs,
                           batch_sharding=rows, row_buckets=spec.row_buckets, logprob_chunk=rl.logprob_chunk,
                           atomic=rl.atomic_step, microbatch_rows=rl.microbatch_rows)
  return LearnerStep(jit_train_step(step_config, state_sh), state_sh, rows)


def abstract_init_state(seed: int, loss: LossConfig, optimizer, params, frozen=None):
  """The shapes of the run's initial TrainState from (abstract) params: what init_train_state makes."""
  with_ref = needs_ref_pass(loss)
  return jax.eval_shape(lambda p, f: init_train_state(p, optimizer, rng=seed, frozen=f,
                                                      ref_params=p if with_ref else None), params, frozen)


def abstract_train_state(seed: int, loss: LossConfig, optimizer, abstract_params, mesh, *, adapters: bool):
  """The shapes and shardings of a run's TrainState on `mesh` (what a checkpoint of the run restores into; with
  LoRA `adapters` the adapters' state, without the base: checkpoints leave it out)."""
  if adapters:
    abstract_params = lora.split(abstract_params)[0]
  state_sh = train_state_shardings(abstract_params, optimizer, _param_shardings(mesh)(abstract_params), mesh,
                                   needs_ref_pass(loss))
  abstract = abstract_init_state(seed, loss, optimizer, abstract_params)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)


def build_engine(s: settings.Sampler, model_cfg: ModelConfig, mesh, **overrides) -> Engine:
  """The sampler engine of a run's sampler section (its sizes, KV layout, dtype and attention); `overrides`: Engine
  arguments a CLI flag set (jaxrl-generate's --max_slots, --max_len, --steps_per_call)."""
  return make_engine(model_cfg, mesh, **{**engine_kwargs(s), **overrides})


def engine_kwargs(s: settings.Sampler) -> dict:
  """Keyword arguments of the sampler's Engine from a run's sampler settings (RunConfig.sampler)."""
  return dict(max_slots=s.max_slots, max_len=s.max_len, steps_per_call=s.steps_per_call, dtype=s.dtype,
              weight_dtype=s.weight_dtype, kv=s.kv, page_size=s.page_size, num_pages=s.num_pages or None,
              attention=s.attention)


def build_sampler(s: settings.Sampler, seed: int, engine: Engine, params, version: int, tokenizer) -> Sampler:
  """The host-side Sampler of a run's sampler settings over `engine`, from `params` at `version`."""
  detok = tokenizer.decode if tokenizer is not None else None
  kw = dict(seed=seed, on_update=s.on_update, detokenize=detok)
  forced = s.forced_lengths
  if forced.median > 0:  # benchmarks: long-tailed lengths whatever the model generates
    lengths = LognormalLengths(forced.median, forced.p99_ratio, s.max_new_tokens, seed)
    return ForcedLengths(lengths, engine, params, version, **kw)
  return Sampler(engine, params, version, **kw)


def compile_rebuilds(engine: Engine, params) -> None:
  """Compiles the dense KV recompute of an in-flight update at every cache-length bucket now, not at its first use
  mid-run (where, in a multi-process job, every learner would wait on it). params: a Versioned of the engine's."""
  state = engine.init_decode_state()
  for length in engine.buckets:
    state = engine.rebuild(params, state, length)
  jax.block_until_ready(state)


def train_step_batches(spec: RunSpec, seq_len: int) -> list:
  """An empty batch of every shape the run's train step can see (spec.make_batch's): every packed row bucket when
  packing, else the padded batch of batch_size rows."""
  if spec.rl.pack:
    batches = [pack_batch([], seq_len, (b,), spec.rl.max_segments) for b in spec.row_buckets or (spec.rl.batch_size,)]
  else:
    batches = [make_batch([], spec.rl.batch_size, seq_len)]
  return [with_routing(b, spec.routing) for b in batches]


def _shapes(batch) -> tuple:
  dtype = lambda x: np.dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))  # an array's, or a scalar's
  return tuple((np.shape(x), dtype(x).str) for x in jax.tree.leaves(batch))


class CompiledSteps:
  """The train step compiled ahead of time for every batch shape the run can see (train_step_batches), called
  like the jitted step. A packed row bucket met first mid-run would otherwise stall that step by its tracing and
  compilation (docs/BENCHMARKS.md, "Figures moved here from docstrings"; minutes for a real model on a TPU slice)
  and, in a multi-process job, every other learner's collectives with it; an ahead-of-time lowering alone does not
  spare the jitted function its own trace at first call. A batch of another shape falls back to the jitted step
  (counted in `fallbacks`). place: puts a numpy batch where the step takes it (a multi-process learner's
  device_put)."""

  def __init__(self, train_step, state, spec: RunSpec, seq_len: int, key, place=lambda batch: batch):
    self.jitted, self.place, self.fallbacks = train_step, place, 0
    self.compiled = {}
    batches = train_step_batches(spec, seq_len)
    compiling = console.count("compiling the train step for each batch shape", len(batches))
    for i, empty in enumerate(batches):
      batch = place(empty)
      self.compiled[_shapes(batch)] = train_step.lower(state, batch, key).compile()
      compiling(i + 1)

  def __call__(self, state, batch, key):
    batch = self.place(batch)
    step = self.compiled.get(_shapes(batch))
    if step is None:
      self.fallbacks += 1
      step = self.jitted
    return step(state, batch, key)


def open_checkpointer(ck: settings.Checkpoint, workdir: Path, **kw) -> Checkpointer:
  """workdir/checkpoints, saved as a run's checkpoint section says; kw: the saving processes of a multi-process
  job."""
  return Checkpointer(workdir / "checkpoints", max_to_keep=ck.max_to_keep, every_steps=ck.every_steps,
                      compress=ck.compress, **kw)


def open_metrics(log: settings.Log, workdir: Path, resumed_from: int | None, *, num_steps: int,
                 record: dict) -> MetricsWriter:
  """The metrics writer of a run's log section; the trackers record `record`, the whole config as plain dicts
  (config.as_dict)."""
  backends = [b for b in log.backends if log.tensorboard or b != "tensorboard"]
  return MetricsWriter(workdir, backends=backends, project=log.project, run_name=log.run_name, config=record,
                       progress=log.progress, total_steps=num_steps, resume_step=resumed_from or 0)


def restore(checkpointer: Checkpointer, live, state_shardings) -> tuple[Any, RunRecord]:
  """(state, run record) from the newest checkpoint, placed on `state_shardings`; (live, a new record) if none.

  Samples finished but not trained at the checkpoint are discarded, and counted so (samples_discarded_at_resume):
  their groups, pending in the record, are generated again in every topology."""
  if not checkpointer.all_steps():
    return live, RunRecord()
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), live, state_shardings)
  state, saved = checkpointer.restore(abstract)
  state = state.replace(frozen=live.frozen)  # a LoRA run's base: the loaded model, never in a checkpoint
  record = RunRecord.from_json(saved)
  record.ledger.samples_discarded_at_resume += record.ledger.held_at_checkpoint()
  return state, record
