"""Every run setting, declared once as a field of a frozen dataclass: its default, the values it takes and what it
means. The sections (`Model`, `Sampler`, `RL`, ...) nest under `RunConfig` with the names of the config's keys, so a
validated run config reads as the ml_collections config did (`cfg.rl.group_size`); the classes a component already
takes (LossConfig, AutoStaleness) are sections themselves. `SETTINGS`, the flat list of dotted settings, is derived
from them: `config.base()` is built from it and `--config_help` prints it. `from_tree` checks every value against
its setting and every section by its own rules (a section's `check`, or its class's own); config.validate adds the
rules across sections.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
from pathlib import Path
from typing import Any

# Each module owns the values its options take; the settings offer them.
from jaxrl.controller.adaptive import AutoStaleness
from jaxrl.controller.assembly import FILTER_GROUPS
from jaxrl.envs import TASKS
from jaxrl.kernels.paged_attention import IMPLS as PAGED_ATTENTION
from jaxrl.kernels.train_attention import IMPLEMENTATIONS as TRAIN_ATTENTION
from jaxrl.learner.config import LossConfig
from jaxrl.learner.optim import make_optimizer
from jaxrl.models import ModelConfig
from jaxrl.models.lora import LoRAConfig
from jaxrl.models.presets import PRESETS
from jaxrl.models.quant import WEIGHT_DTYPES
from jaxrl.rollout import SamplingParams
from jaxrl.sampler.engine import KV_LAYOUTS
from jaxrl.sampler.sampler import ON_UPDATE
from jaxrl.telemetry import PEAK_MODES
from jaxrl.trackers import check_backends

MODES = ("pipeline", "sync", "auto")
DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", *DTYPES)
DECODE_ATTENTION = ("auto", *PAGED_ATTENTION)  # "auto": the Pallas kernel where one runs, else XLA
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


class ConfigError(ValueError):
  """A bad configuration, found before any work starts."""


def need(cond, msg: str) -> None:
  if not cond:
    raise ConfigError(f"config: {msg}")


def is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting. kind: "int" (>= lo), "real" (a finite number passing `ok`, described by `what`), "bool",
  "choice" (one of `choices`), "type" (a field of a class that checks its own values: a value of its default's type,
  None too if `nullable`), or "other" (checked by its section's `check`)."""

  name: str
  default: Any
  doc: str
  kind: str = "other"
  lo: int = 0
  ok: Any = None
  what: str = ""
  choices: tuple = ()
  any_type: bool = False  # the config holds values of several types here (an int or "auto"): checked by check;
  # set for every field declared as a union (_settings)
  nullable: bool = False

  def allowed(self) -> str:
    """The values it takes, in words."""
    if self.kind == "type":
      kind = {int: "an int", float: "a number", str: "a string", bool: "True or False"}[self.ok]
      return kind + " or None" * self.nullable
    return {"int": f"an int >= {self.lo}", "real": f"a number {self.what}", "bool": "True or False",
            "choice": f"one of {self.choices}"}.get(self.kind, "see its section's check")

  def error(self, v) -> str | None:
    """What is wrong with value v (the config error's text without its "config: " prefix), or None."""
    if self.kind == "int" and not (is_int(v) and v >= self.lo):
      return f"{self.name} must be an int >= {self.lo} (got {v!r})"
    if self.kind == "real" and not (is_real(v) and self.ok(v)):
      return f"{self.name} must be a number {self.what} (got {v!r})"
    if self.kind == "bool" and not isinstance(v, bool):
      return f"{self.name} must be True or False (got {v!r})"
    if self.kind == "choice" and not (isinstance(v, str) and v in self.choices):
      return f"{self.name}={v!r}; allowed: {self.choices}"
    if self.kind == "type" and not (v is None and self.nullable or _of_type(v, self.ok)):
      return f"{self.name} must be {self.allowed()} (got {v!r})"
    return None


def _of_type(v, kind) -> bool:
  return {int: is_int, float: is_real}.get(kind, lambda v: isinstance(v, kind))(v)


def _derived(cls, f) -> Setting:
  """The setting of a field of a class that checks its own values (LossConfig, AutoStaleness)."""
  return Setting("", f.default, f"see {cls.__name__}.{f.name} in {cls.__module__}", "type",
                 ok=float if f.default is None else type(f.default), nullable="None" in str(f.type))


class Frozen(dict):
  """A read-only dict: the value of a dict-valued setting (model sizes, mesh axes, task options) in a RunConfig.
  Its keys read as attributes too, as the config's did (`cfg.model.tiny.num_layers`)."""

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(f"no {name!r} in {sorted(self)}") from None

  def _read_only(self, *args, **kwargs):
    raise TypeError("a RunConfig is read-only: make a changed copy with config.replace")

  __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

  def __reduce__(self):  # pickle and deepcopy rebuild it whole (item by item would be a write)
    return Frozen, (dict(self),)

  def to_dict(self) -> dict:
    """A plain, writable copy (nested Frozen dicts made dicts too), e.g. keyword arguments to fill in."""
    return {k: v.to_dict() if isinstance(v, Frozen) else v for k, v in self.items()}


def freeze(value):
  """value with every dict (or ConfigDict) in it made a Frozen and every list a tuple."""
  if hasattr(value, "to_dict"):  # an ml_collections.ConfigDict (or a Frozen)
    value = value.to_dict()
  if isinstance(value, dict):
    return Frozen({k: freeze(v) for k, v in value.items()})
  if isinstance(value, (list, tuple)):
    return tuple(freeze(v) for v in value)
  return value


def _field(setting: Setting):
  """A dataclass field holding one setting (its name is filled in from its place in RunConfig)."""
  metadata = {"setting": setting}
  if isinstance(setting.default, (dict, list)):
    return dataclasses.field(default_factory=lambda: freeze(setting.default), metadata=metadata)
  return dataclasses.field(default=setting.default, metadata=metadata)


def Int(default, lo, doc):  # noqa: N802 - reads as a type in the declarations below
  return _field(Setting("", default, doc, "int", lo=lo))


def Real(default, ok, what, doc):  # noqa: N802
  return _field(Setting("", default, doc, "real", ok=ok, what=what))


def Bool(default, doc):  # noqa: N802
  return _field(Setting("", default, doc, "bool"))


def Choice(default, choices, doc):  # noqa: N802
  return _field(Setting("", default, doc, "choice", choices=tuple(choices)))


def Other(default, doc, *, any_type: bool = False):  # noqa: N802
  """A setting its section's check() checks (a dict of options, a count or a fraction, ...)."""
  return _field(Setting("", default, doc, any_type=any_type))


def Section(cls):  # noqa: N802
  """A nested section of settings (e.g. model.lora), at its defaults unless given."""
  return dataclasses.field(default_factory=cls, metadata={"section": cls})


positive = lambda v: v > 0  # noqa: E731


@dataclasses.dataclass(frozen=True)
class Auto:
  # mode="auto": a sync segment measures the run's costs, the simulator predicts each candidate (sync, pipeline at
  # k = 1..k_max), later segments run the best-scoring one (a measurement replaces its prediction)
  measure_steps: int = Int(5, 4, 'mode="auto": steps of the first (sync) segment, which calibrates the model')
  recheck_steps: int = Int(8, 4, 'mode="auto": steps of every later segment (the choice is re-made after each)')
  k_max: int = Int(2, 1, 'mode="auto": the largest staleness bound it tries for the pipeline')
  warmup_steps: int = Int(1, 1, 'mode="auto": steps of each segment left out of its measurement (compilation)')
  splits: tuple[int, ...] = Other((), 'mode="auto": sampler device counts to try for the pipeline (a new split is a '
                                  "new build or launch, resumed exactly); empty: mesh.sampler_devices only")

  def check(self):
    need(isinstance(self.splits, tuple) and all(is_int(x) and x >= 1 for x in self.splits),
         f"auto.splits must be a tuple of sampler device counts >= 1 (got {self.splits!r})")


@dataclasses.dataclass(frozen=True)
class LoRA:
  enabled: bool = Bool(False, "train low-rank adapters on a frozen base model (jaxrl/models/lora.py); a publish moves "
                       "the adapters only")
  rank: int = Int(8, 1, "LoRA rank r of every adapter")
  alpha: float = Real(16.0, positive, "> 0", "LoRA scale numerator: adapters add (alpha / rank) * A @ B")
  targets: str = Other(r".*", "regular expression matched in full against the projections LoRA adapts: "
                       "attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj")

  def check(self):
    if self.enabled:
      need(isinstance(self.targets, str), f"model.lora.targets must be a regular expression string (got "
                                          f"{self.targets!r})")
      try:
        LoRAConfig(self.rank, self.alpha, self.targets)
      except (ValueError, re.error) as e:
        raise ConfigError(f"config: model.lora.targets: {e}") from None


@dataclasses.dataclass(frozen=True)
class Model:
  source: str = Other("tiny", '"tiny" (random ModelConfig.tiny), "smollm2" (fetched by jaxrl-assets), or a HF folder')
  # A published model's shape by name (jaxrl/models/presets.py): sizing, jaxrl-compile or training from random
  # weights without downloading the model; the tokenizer (text tasks) is still model.source's
  preset: str = Other("", 'a model shape by name ("qwen2.5-7b", "llama-3.1-70b", ...; jaxrl.models.presets) that '
                      "replaces model.source's, random weights, none read; \"\": off")
  tiny: Frozen = Other(dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=8), 'sizes of the "tiny" model (and eos_token_ids=(...): ids '
                       "that end a sample; none by default, so every sample runs to sampler.max_new_tokens)")
  dtype: str = Choice("auto", COMPUTE_DTYPES, 'compute dtype of learner and sampler ("auto": bf16 on GPU/TPU)')
  param_dtype: str = Choice("float32", DTYPES, "master weights")
  remat: bool = Bool(False, "rematerialise blocks in the backward pass (saves learner memory)")
  remat_policy: str = Choice("nothing_saveable", REMAT_POLICIES, "what a remat block keeps")
  train_attention: str = Choice("auto", ("auto", *TRAIN_ATTENTION), "learner attention")
  scan_unroll: int = Int(1, 1, "layers per iteration of the layer scan (>= num_layers: unrolled)")
  lora: LoRA = Section(LoRA)

  def check(self):
    source = self.source
    need(isinstance(source, str) and source, f"model.source must be 'tiny', 'smollm2' or a folder (got {source!r})")
    if source == "tiny":
      need(isinstance(self.tiny, dict), f"model.tiny must be a dict of sizes (got {self.tiny!r})")
      for k, v in self.tiny.items():
        if k == "eos_token_ids":  # ids that end a sample: natural completion lengths (jaxrl-profile --from-run)
          need(isinstance(v, tuple) and all(is_int(i) and i >= 0 for i in v),
               f"model.tiny.eos_token_ids must be a tuple of ids >= 0 (got {v!r})")
        elif k not in ("architecture", "qk_norm", "router_aux_loss_coef", "router_z_loss_coef"):  # ModelConfig's
          need(is_int(v) and v >= 1, f"model.tiny.{k} must be an int >= 1 (got {v!r})")
      try:
        ModelConfig.tiny(**self.tiny.to_dict())
      except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"config: model.tiny: {e}") from None
    elif source != "smollm2":
      need(Path(source).is_dir(), f"model.source={source!r} is neither 'tiny', 'smollm2' nor a folder")
    need(self.preset == "" or self.preset in PRESETS, f"model.preset={self.preset!r}; known: {sorted(PRESETS)}")


@dataclasses.dataclass(frozen=True)
class Mesh:
  num_devices: int = Other(-1, "devices used in all (-1: every device)")
  sampler_devices: int | float = Other(4, "devices of the sampler submesh: a count, or a fraction of the pool in "
                                       "(0, 1)")
  learner_axes: Frozen = Other(dict(fsdp=-1, tensor=1), "learner mesh axes, -1: the rest")
  sampler_axes: Frozen = Other(dict(data=-1, tensor=1), "sampler mesh axes, -1: the rest")

  def check(self):
    n, s = self.num_devices, self.sampler_devices
    need(is_int(n) and (n == -1 or n >= 2), f"mesh.num_devices must be -1 (all) or an int >= 2 (got {n!r})")
    need(is_int(s) and s >= 1 or isinstance(s, float) and 0 < s < 1,
         f"mesh.sampler_devices must be a positive count or a fraction in (0, 1) (got {s!r})")


@dataclasses.dataclass(frozen=True)
class Task:
  name: str = Other("target_token", '"target_token", "arithmetic", "countdown", "gsm8k" (local JSONL), '
                    '"reasoning_gym" or "dataset" (parquet / JSONL / hub; optional extras); multi-turn envs: '
                    '"calculator", "guess", "token_turns" (jaxrl.envs.env)')
  kwargs: Frozen = Other({}, "task-specific options (digits, ops, path, ...)")
  reward: str = Other("", 'reward fn name in the registry; "" uses the task\'s own')
  reward_timeout_s: float = Real(5.0, positive, "> 0",
                                 "a reward fn (or a multi-turn env's step) slower than this is counted as failed")
  env_workers: int = Int(4, 1, "multi-turn env tasks: env steps run at once (threads; worker processes if "
                         "untrusted)")
  max_prompt_tokens: int = Int(64, 1, "longer prompts are skipped and counted")
  chat_template: bool = Bool(True, "render prompts with the tokenizer's chat template (text tasks)")
  # Rewards and envs cannot fail silently (jaxrl/envs/guard.py): before the first prompt each scores known right and
  # wrong answers in its real (sandboxed) worker; once running, more than max_failure_frac of the last
  # failure_window scored samples failing stops the run, after a checkpoint, with one line naming the reward and
  # its most common error. A transient failure (a timeout on a loaded host) is dropped and counted instead
  self_check: bool = Bool(True, "score each reward's known right and wrong answers in its real worker at start-up")
  # UNSAFE when True: a run with sandboxed rewards (code or text a model wrote) needs Landlock and a private mount
  # namespace to keep that code from writing outside its scratch; without them it stops at start-up (exit 2) unless
  # this is set, and then its sandboxes have only the Python-level guards (docs/SECURITY.md)
  allow_unsafe_sandbox: bool = Bool(False, "UNSAFE: run sandboxed rewards without kernel isolation where the kernel "
                                    "refuses it")
  # A sandboxed reward (one that handles a model's text as code) scores each item in a process of its own, which
  # holds no channel to the trainer: code that takes the scorer over answers for that item alone. False trades that
  # for throughput: the worker's one confined process then scores every item, and a scorer taken over may answer
  # the worker's later items too (still plain data, never run by the trainer; docs/SECURITY.md)
  reward_process_per_item: bool = Bool(True, "sandboxed rewards: score each item in a process of its own")
  failure_window: int = Int(64, 1, "scored samples in the reward-failure window")
  max_failure_frac: float = Real(0.5, lambda v: 0 <= v < 1, "in [0, 1)",
                                 "failed samples in the window above this fraction stop the run")
  # A prompt whose last pass_rate_filter groups all scored alike (all right or all wrong: no signal) is skipped for
  # the next pass_rate_aside_steps steps' worth of data positions, counted (jaxrl/controller/pass_rate.py): for
  # datasets a run goes through more than once
  pass_rate_filter: int = Int(0, 0, "groups in a row scoring alike that set a prompt aside (0: off)")
  pass_rate_aside_steps: int = Int(10, 1, "steps' worth of data positions a prompt is set aside for")

  def check(self):
    need(isinstance(self.name, str) and self.name in TASKS, f"task.name={self.name!r}; known: {sorted(TASKS)}")
    need(isinstance(self.kwargs, dict), "task.kwargs must be a ConfigDict")
    need(isinstance(self.reward, str), f"task.reward must be a reward name (got {self.reward!r})")


@dataclasses.dataclass(frozen=True)
class ForcedLengths:
  # Benchmarks only (jaxrl/sampler/forced.py): median > 0 forces group g's completion length, lognormal from
  # (seed, g) with p99 / median = p99_ratio, clipped to [1, max_new_tokens]; EOS and stop ids are ignored
  median: float = Real(0.0, lambda v: v >= 0, ">= 0 (0: off)", "forced completion lengths' median (benchmarks; 0: "
                       "off)")
  p99_ratio: float = Real(10.0, lambda v: v >= 1, ">= 1", "forced lengths' p99 / median")


@dataclasses.dataclass(frozen=True)
class Sampler:
  max_slots: int = Int(16, 1, "concurrent decode slots (continuous batching)")
  max_len: int = Int(48, 2, "KV cache length per slot: prompt + completion")
  steps_per_call: int = Int(8, 1, "decode steps per host round trip")
  dtype: str = Choice("auto", COMPUTE_DTYPES, 'sampler weights + KV cache ("auto": bf16 on TPU/GPU, f32 on CPU)')
  # "int8": q/k/v/o, gate/up/down and the head quantized per output channel when published (jaxrl/models/quant.py);
  # behaviour log-probs come from that quantized model, and the learner (float weights) corrects the gap with its
  # importance weights
  weight_dtype: str = Choice("float", WEIGHT_DTYPES, '"float": sampler weights in sampler.dtype; "int8": '
                             "weight-only int8 for decoding")
  max_new_tokens: int = Int(16, 1, "completion budget per sample")
  temperature: float = Real(SamplingParams.temperature, positive, "> 0", "sampling temperature (the learner scores "
                            "tokens at the same one)")
  top_k: int = Int(SamplingParams.top_k, 0, "0: off")
  top_p: float = Real(SamplingParams.top_p, lambda v: 0 < v <= 1, "in (0, 1]", "1.0: off")
  on_update: str = Choice("recompute", ON_UPDATE, 'in-flight update: "recompute" the KV cache, "finish" first, or '
                          '"keep_kv"')
  kv: str = Choice("dense", KV_LAYOUTS, 'KV cache: "dense" (max_len per slot) or "paged" (a page pool shared by the '
                   "slots)")
  page_size: int = Int(16, 1, "paged: positions per page (must divide max_len)")
  attention: str = Choice("auto", DECODE_ATTENTION, 'paged: decode attention ("auto": the Pallas kernel on a GPU or '
                          "TPU sampler, in shard_map over its mesh; TPU: head_dim % 128 == 0; XLA otherwise)")
  num_pages: int = Int(0, 0, "paged: pages in the pool; 0: the dense cache's memory (max_slots * max_len / "
                       "page_size)")
  forced_lengths: ForcedLengths = Section(ForcedLengths)

  @functools.cached_property
  def sampling(self) -> SamplingParams:
    """The distribution the sampler draws from (the learner scores every token under it), made once."""
    return SamplingParams(self.temperature, self.top_k, self.top_p)

  def check(self):
    need(self.max_new_tokens < self.max_len,
         f"sampler.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in max_len={self.max_len}")
    need(self.kv != "paged" or self.max_len % self.page_size == 0,
         f"sampler.max_len={self.max_len} must be a multiple of sampler.page_size={self.page_size} "
         "(sampler.kv='paged')")
    need(self.num_pages == 0 or self.num_pages * self.page_size >= self.max_len,
         f"sampler.num_pages={self.num_pages} pages of {self.page_size} cannot hold one sample of "
         f"max_len={self.max_len}")


@dataclasses.dataclass(frozen=True)
class RL:
  group_size: int = Int(4, 1, "samples per prompt (GRPO group)")
  groups_per_step: int = Int(4, 1, "groups per learner step; batch = group_size * groups_per_step")
  # Dynamic sampling: "zero_variance" trains no group whose rewards are all equal (its policy-gradient term is zero
  # while it costs a forward and backward); it is dropped as "filtered", counted with its samples and tokens, and
  # its place in the admission window goes to a new prompt, so every step still trains groups_per_step groups
  filter_groups: str = Choice("none", FILTER_GROUPS, 'groups not trained: "zero_variance" (all rewards equal)')
  max_filtered_in_a_row: int = Int(1000, 1, "groups filtered in a row with no applied update before the run stops "
                                   "(a prompt set the policy always solves or always fails)")
  # An over-asked group a share left out past its deadline is never trained: still generating, it holds decode slots
  # and pages that groups a step can train could use
  cancel_surplus: bool = Bool(True, "end a surplus group still generating at once (Sampler.cancel), not when it "
                              "finishes")
  seq_len: int = Int(48, 2, "learner sequence length (prompt + completion, right-padded), the packed row length")
  # Several samples per row of seq_len tokens (first-fit decreasing, each sample its own segment), rows rounded up
  # to a few buckets (one compilation each): train cost follows the real tokens, not batch x seq_len
  pack: bool = Bool(False, "pack the learner's batches")
  max_segments: int = Int(16, 1, "samples per packed row at most")
  # Every packed row bucket compiled before the first step, so no step pays a compilation mid-run (a multi-process
  # job always does: a late compile stalls every learner's collectives). False: each at its first use (a shorter
  # start on CPU, where a real model's bucket takes tens of seconds to compile, and not every bucket is met)
  compile_ahead: bool = Bool(True, "compile the train step for every packed row bucket before the first step")
  logprob_chunk: int = Int(0, 0, "> 0: log-probs computed this many positions at a time (no [B, L, V] logits)")
  # Gradient accumulation by size: each update's rows are run in the fewest chunks of at most this many rows per
  # learner device (per row bucket; the same update up to summation order). Bounds activation memory; on
  # XLA:CPU small chunks stay in the core's cache (bench/headline_parts.py; docs/BENCHMARKS_HISTORY.md, "The
  # headline: colocated sync vs pipeline"). 0: one chunk
  microbatch_rows: int = Int(0, 0, "rows per gradient-accumulation chunk per device at most (0: whole update)")
  # k: a group admitted at sampler version v is trained by step v + k, late or not (nothing is dropped for
  # staleness): every trained token has staleness <= k, in learner steps (pipeline mode; sync is k = 0). "auto":
  # admission moves k within [auto_staleness.k_min, auto_staleness.k_max] from the measured drift
  # (jaxrl/controller/adaptive.py); k_max stays the hard bound
  max_staleness: int | str = Other(1, 'an int >= 0 or "auto"', any_type=True)
  auto_staleness: AutoStaleness = Section(AutoStaleness)  # its options: jaxrl/controller/adaptive.py
  # Optimizer updates per learner step: the step's samples, shuffled by (seed, step), are dealt into
  # num_minibatches disjoint mini-batches by sample (packed or not); every epoch runs them all, in its own order.
  # A step makes one policy version however many updates it runs. With loss.proximal="recompute", updates after
  # the first are clipped against the pre-step policy (decoupled PPO): 2 makes the trust region act.
  num_minibatches: int = Int(2, 1, "optimizer updates per epoch of a learner step (see above)")
  num_epochs: int = Int(1, 1, "PPO epochs: passes over the batch per learner step")
  # True: a non-finite update skips its whole step (a version is all its updates or none), which keeps the
  # pre-step TrainState while the step runs: one more state of memory (params + Adam moments) with 2+ updates per
  # step. False: a non-finite update skips only itself (optax.apply_if_finite's rule) and no copy is kept; its
  # step applies if any update did, counted in summary.json as partial_steps
  atomic_step: bool = Bool(True, "a non-finite update skips its whole step (+1 TrainState of memory)")
  queue_groups: int = Int(8, 1, "rollout queue capacity, in groups (back-pressure beyond)")
  max_failures_in_a_row: int = Int(100, 1, "skipped prompts + dropped groups + skipped updates in a row (no applied "
                                   "update between) before the run stops with an error: broken data or rewards fail "
                                   "loudly, not for ever")

  @property
  def batch_size(self) -> int:
    return self.group_size * self.groups_per_step

  def check(self):
    k = self.max_staleness
    need(k == "auto" or is_int(k) and k >= 0, f"rl.max_staleness must be an int >= 0 or 'auto' (got {k!r})")
    need(self.filter_groups == "none" or self.group_size >= 2, f"rl.filter_groups={self.filter_groups!r} would filter "
         "every group of rl.group_size=1 (one reward has no variance): use groups of 2 or more")
    need(self.batch_size % self.num_minibatches == 0, f"the batch of {self.batch_size} rows does not split into "
         f"rl.num_minibatches={self.num_minibatches} mini-batches")


_OPT = {k: p.default for k, p in inspect.signature(make_optimizer).parameters.items()}  # its defaults


@dataclasses.dataclass(frozen=True)
class Optimizer:
  # make_optimizer's options (jaxrl/learner/optim.py) at its defaults, but the learning rate
  learning_rate: float = Real(3e-3, positive, "> 0", "peak learning rate")
  warmup_steps: int = Int(_OPT["warmup_steps"], 0, "linear warmup, in learner steps")
  decay_steps: int = Int(_OPT["decay_steps"], 0, "learner steps of the cosine decay that follows the warmup (0: "
                         'num_steps); mode="auto" gives every segment the whole run\'s')
  weight_decay: float = Real(_OPT["weight_decay"], lambda v: v >= 0, ">= 0", "AdamW weight decay")
  max_grad_norm: float | None = Other(_OPT["max_grad_norm"], "global gradient-norm clip (None: off)")
  end_lr_ratio: float = Real(_OPT["end_lr_ratio"], lambda v: v >= 0, ">= 0", "cosine decay's final learning rate, "
                             "a fraction of the peak")
  b1: float = Real(_OPT["b1"], lambda v: 0 <= v < 1, "in [0, 1)", "AdamW first-moment decay")
  b2: float = Real(_OPT["b2"], lambda v: 0 <= v < 1, "in [0, 1)", "AdamW second-moment decay")
  eps: float = Real(_OPT["eps"], positive, "> 0", "AdamW denominator epsilon")

  def check(self):
    v = self.max_grad_norm
    need(v is None or (is_real(v) and v > 0), f"optimizer.max_grad_norm must be a number > 0 or None (got {v!r})")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  every_steps: int = Int(5, 1, "save every N learner steps (and at the end)")
  max_to_keep: int = Int(2, 1, "older checkpoints are deleted")
  # zstd: less disk for weights, but a save holds the compressed state in host memory until written (a higher
  # peak RSS) and takes longer (docs/BENCHMARKS_HISTORY.md, "Under 4 GB (2026-12-05)")
  compress: bool = Bool(False, "zstd-compress the saved arrays")


@dataclasses.dataclass(frozen=True)
class Eval:
  num_examples: int = Int(0, 0, "held-out examples scored greedily before and after training (0: none)")
  max_new_tokens: int = Int(16, 1, "completion budget of each greedy eval answer")


@dataclasses.dataclass(frozen=True)
class Log:
  # Every step's scalars go to each backend under the same names: "jsonl" (workdir/metrics.jsonl, required),
  # "tensorboard" (workdir/tb), "wandb", "mlflow" (optional extra `trackers`; see jaxrl/trackers.py)
  backends: tuple[str, ...] = Other(("jsonl", "tensorboard"), "experiment trackers (jaxrl.trackers.BACKENDS), jsonl "
                                    "included")
  project: str = Other("jaxrl", "tracker project (wandb project, MLflow experiment)")
  run_name: str = Other("", "tracker run name (\"\": the workdir's name)")
  tensorboard: bool = Bool(True, "False drops \"tensorboard\" from log.backends (the older switch, still honoured)")
  progress: bool = Bool(True, "one progress line per learner step on stderr")
  # Roofline telemetry (jaxrl/telemetry.py): learner_/sampler_ flops_per_s, bytes_per_s, mfu, mbu per step, the
  # peaks from the accelerator's datasheet (jaxrl.sim.hardware) or measured at start (a CPU, or log.peak="measure")
  telemetry: bool = Bool(True, "log each side's achieved FLOP/s and bytes/s and their fractions of peak (MFU/MBU)")
  peak: str = Choice("auto", PEAK_MODES, '"auto": the device table\'s peak (measured for a device not in it); '
                     '"measure": a matmul and a read measured at start')
  peak_flops: float = Real(0.0, lambda v: v >= 0, ">= 0", "per-device peak FLOP/s for MFU (0: from log.peak)")
  peak_bandwidth: float = Real(0.0, lambda v: v >= 0, ">= 0", "per-device memory bandwidth, bytes/s, for MBU (0: "
                               "from log.peak)")
  trace: bool = Bool(False, "workdir/trace.jsonl: which samples each step trained, drops, skips, checkpoints "
                     "(debugging)")

  def check(self):
    try:
      check_backends(self.backends)
    except ValueError as e:
      raise ConfigError(f"config: {e}") from None
    for key in ("project", "run_name"):
      need(isinstance(getattr(self, key), str), f"log.{key} must be a string (got {getattr(self, key)!r})")
    need(self.project, "log.project must not be empty")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A validated run configuration (config.validate makes it): every setting, typed and read-only, in the config's
  sections. Each component reads its own section (cfg.sampler, cfg.log, ...)."""

  seed: int = Int(0, 0, "seeds params init (tiny), the learner's rng and every prompt's sampling key")
  mode: str = Choice("pipeline", MODES, '"pipeline": sampler and learner run at once; "sync": sample a batch, train, '
                     'repeat (the pipeline with max_staleness 0); "auto": measured segments, the mode and k that train '
                     "the most tokens/s (jaxrl/controller/auto.py)")
  auto: Auto = Section(Auto)
  num_steps: int = Int(20, 1, "learner steps (policy versions) to train for")
  model: Model = Section(Model)
  mesh: Mesh = Section(Mesh)
  task: Task = Section(Task)
  sampler: Sampler = Section(Sampler)
  rl: RL = Section(RL)
  loss: LossConfig = Section(LossConfig)  # the RL objective; its sampling is the sampler's (config.validate)
  optimizer: Optimizer = Section(Optimizer)
  checkpoint: Checkpoint = Section(Checkpoint)
  eval: Eval = Section(Eval)
  log: Log = Section(Log)


def _fields(section):
  """(field, its section class or None) of a section's fields that are settings or sections. A class that checks its
  own values (LossConfig) declares no Setting: each field is one, but for one holding a dataclass (LossConfig's
  sampling: the sampler's settings give it)."""
  for f in dataclasses.fields(section):
    if "section" in f.metadata or "setting" in f.metadata or not dataclasses.is_dataclass(f.default):
      yield f, f.metadata.get("section")


def _settings(section, prefix: str = ""):
  for f, sub in _fields(section):
    if sub is not None:
      yield from _settings(sub, f"{prefix}{f.name}.")
    else:
      setting = f.metadata.get("setting") or _derived(section, f)
      # A field declared with several types (int | float, float | None) takes each of them on the command line.
      yield dataclasses.replace(setting, name=prefix + f.name, any_type=setting.any_type or "|" in str(f.type))


SETTINGS = tuple(_settings(RunConfig))  # every setting, by its dotted name, in declaration order
_BY_NAME = {s.name: s for s in SETTINGS}


def from_tree(tree, section=RunConfig, prefix: str = ""):
  """The section (RunConfig: the whole config) holding the values of `tree`, a config or any nested mapping with
  every setting's key, checked: each value against its setting, then the section by its own rules. Other keys at
  the top are left out (a config file's own, for its script); in a section they are errors. Dicts in it are made
  Frozen, lists tuples. A bad or missing value raises ConfigError naming it."""
  values = {}
  known = set()
  for f, sub in _fields(section):
    known.add(f.name)
    try:
      node = tree[f.name]
    except (KeyError, TypeError, AttributeError):
      raise ConfigError(f"config: missing field {prefix}{f.name}") from None
    if sub is not None:
      values[f.name] = from_tree(node, sub, f"{prefix}{f.name}.")
    else:
      error = _BY_NAME[prefix + f.name].error(node)
      need(error is None, error)
      values[f.name] = freeze(node)
  unknown = sorted(set(tree.keys()) - known) if prefix else []
  need(not unknown, f"{prefix}{unknown[0] if unknown else ''} is not an option (options: {sorted(known)})")
  try:
    out = section(**values)
  except (TypeError, ValueError) as e:  # a class that checks its own values (LossConfig, AutoStaleness)
    raise ConfigError(f"config: {prefix.rstrip('.')}: {e}") from None
  if hasattr(out, "check"):
    out.check()
  return out


def help_text() -> str:
  """Every setting, one line each: its --config flag at the default, the values it takes and what it means."""
  return "\n".join(f"--config.{s.name}={s.default!r}  [{s.allowed()}]  {s.doc}" for s in SETTINGS)
