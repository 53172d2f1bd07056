"""The run configuration: every field with its meaning, and the checks made before any work starts.

Config files under configs/ start from `base()` and override what they need; `--config.key=value` on the
command line overrides further (ml_collections rejects unknown keys and wrong types).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
from pathlib import Path

import ml_collections

MODES = ("pipeline", "sync")
DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", *DTYPES)
# Settings that no longer exist, with what replaced them: a config, an override or a flag that sets one is an error
# that says so (rather than "no such field").
REMOVED = {"rl.on_stale": "batch assembly is deadline-based: no group is dropped for staleness and every trained "
                          "token's staleness is <= rl.max_staleness; delete the setting"}


class ConfigError(ValueError):
  """A bad configuration, found before any work starts."""


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # seeds params init (tiny), the learner's rng and every prompt's sampling key
  c.mode = "pipeline"  # "pipeline": sampler and learner run at once; "sync": sample a batch, train, repeat
  c.num_steps = 20  # learner steps (policy versions) to train for

  c.model = ml_collections.ConfigDict()
  c.model.source = "tiny"  # "tiny" (random ModelConfig.tiny), "smollm2" (fetched by jaxrl-assets), or a HF dir
  c.model.tiny = ml_collections.ConfigDict(dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                                                num_heads=4, num_kv_heads=2, head_dim=8))  # sizes for "tiny"
  c.model.dtype = "auto"  # compute dtype of learner and sampler: "float32" | "bfloat16" | "auto" (bf16 on GPU/TPU)
  c.model.param_dtype = "float32"  # master weights ("float32" | "bfloat16")
  c.model.remat = False  # rematerialise blocks in the backward pass (saves learner memory)
  c.model.remat_policy = "nothing_saveable"  # what a remat block keeps: a jax.checkpoint_policies name
  c.model.train_attention = "auto"  # learner attention: "auto" | "reference" | "chunked" | "cudnn" | "splash"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_devices = -1  # devices used in all (-1: every device)
  c.mesh.sampler_devices = 4  # devices of the sampler submesh: a count, or a fraction of the pool in (0, 1)
  c.mesh.learner_axes = ml_collections.ConfigDict(dict(fsdp=-1, tensor=1))  # learner mesh axes, -1: the rest
  c.mesh.sampler_axes = ml_collections.ConfigDict(dict(data=-1, tensor=1))  # sampler mesh axes, -1: the rest

  c.task = ml_collections.ConfigDict()
  c.task.name = "target_token"  # "target_token", "arithmetic", "countdown", "gsm8k" (local JSONL); multi-turn envs:
  # "calculator", "guess", "token_turns" (jaxrl.envs.env)
  c.task.kwargs = ml_collections.ConfigDict()  # task-specific options (digits, ops, path, ...)
  c.task.reward = ""  # reward fn name in the registry; "" uses the task's own
  c.task.reward_timeout_s = 5.0  # a reward fn (or a multi-turn env's step) slower than this is counted as failed
  c.task.env_workers = 4  # multi-turn env tasks: env steps run at once (threads; worker processes if untrusted)
  c.task.max_prompt_tokens = 64  # longer prompts are skipped and counted
  c.task.chat_template = True  # render prompts with the tokenizer's chat template (text tasks)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_slots = 16  # concurrent decode slots (continuous batching)
  c.sampler.max_len = 48  # KV cache length per slot: prompt + completion
  c.sampler.steps_per_call = 8  # decode steps per host round trip
  c.sampler.dtype = "auto"  # sampler weights + KV cache: "float32" | "bfloat16" | "auto" (bf16 on TPU/GPU, f32 on CPU)
  c.sampler.max_new_tokens = 16  # completion budget per sample
  c.sampler.temperature = 1.0  # sampling temperature (the learner scores tokens at the same one)
  c.sampler.top_k = 0  # 0: off
  c.sampler.top_p = 1.0  # 1.0: off
  c.sampler.on_update = "recompute"  # in-flight update: "recompute" the KV cache, "finish" first, or "keep_kv"
  c.sampler.kv = "dense"  # KV cache: "dense" (max_len per slot) or "paged" (a page pool shared by the slots)
  c.sampler.page_size = 16  # paged: positions per page (must divide max_len)
  c.sampler.num_pages = 0  # paged: pages in the pool; 0: the dense cache's memory (max_slots * max_len / page_size)

  c.rl = ml_collections.ConfigDict()
  c.rl.group_size = 4  # samples per prompt (GRPO group)
  c.rl.groups_per_step = 4  # groups per learner step; batch = group_size * groups_per_step
  c.rl.seq_len = 48  # learner sequence length (prompt + completion, right-padded), the packed row length
  # Several samples per row of seq_len tokens (first-fit decreasing, each sample its own segment), rows rounded up
  # to a few buckets (one compilation each): train cost follows the real tokens, not batch x seq_len
  c.rl.pack = False  # pack the learner's batches
  c.rl.max_segments = 16  # samples per packed row at most
  c.rl.logprob_chunk = 0  # > 0: log-probs computed this many positions at a time (no [B, L, V] logits)
  # k: a group admitted at sampler version v is trained by step v + k, late or not (nothing is dropped for
  # staleness): every trained token has staleness <= k, in learner steps (pipeline mode; sync is k = 0). "auto":
  # admission moves k within [auto_staleness.k_min, auto_staleness.k_max] from the measured drift
  # (jaxrl/controller/adaptive.py); k_max stays the hard bound
  c.rl.max_staleness = ml_collections.FieldReference(1, field_type=object)  # an int >= 0 or "auto"
  c.rl.auto_staleness = ml_collections.ConfigDict(dict(
      k_min=0, k_max=4, ess_low=0.7, ess_high=0.9, kl_high=0.05, window=3))  # see AutoStaleness
  # Optimizer updates per learner step: each epoch splits the batch into num_minibatches disjoint mini-batches.
  # A step makes one policy version however many updates it runs. With loss.proximal="recompute", updates after
  # the first are clipped against the pre-step policy (decoupled PPO): 2 makes the trust region act.
  c.rl.num_minibatches = 2  # optimizer updates per epoch of a learner step (see above)
  c.rl.num_epochs = 1  # PPO epochs: passes over the batch per learner step
  c.rl.queue_groups = 8  # rollout queue capacity, in groups (back-pressure beyond)
  # Skipped prompts + dropped groups + skipped updates in a row (no applied update between) before the run stops
  c.rl.max_failures_in_a_row = 100  # with an error: broken data or rewards fail loudly instead of looping forever

  # See LossConfig. Default: decoupled PPO (clip-higher, dual clip for A < 0) against the pre-step policy,
  # corrected for staleness by truncated token IS weights prox / mu.
  c.loss = ml_collections.ConfigDict(dict(
      advantage="grpo", aggregation="token_mean", policy_loss="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0,
      proximal="recompute", is_level="token", is_cap=2.0, is_ess_min=None, kl_coef=0.0, kl_estimator="k2",
      entropy_coef=0.0))

  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0))  # see make_optimizer; warmup in steps

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 5  # save every N learner steps (and at the end)
  c.checkpoint.max_to_keep = 2  # older checkpoints are deleted

  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 0  # held-out examples scored greedily before and after training (0: none)
  c.eval.max_new_tokens = 16  # completion budget of each greedy eval answer

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True  # TensorBoard event files in workdir/tb (metrics.jsonl is always written)
  c.log.progress = True  # one progress line per learner step on stderr
  c.log.trace = False  # workdir/trace.jsonl: which samples each step trained, drops, skips, checkpoints (debugging)
  return c


def override(c: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """Sets dotted fields in place, as `--config.a.b=v` does on the command line; `__` also stands for a dot, for
  keyword arguments: `override(c, rl__max_staleness=2, **{"sampler.max_slots": 8})`. Returns c.

  A field the config does not have is a ConfigError naming it (ConfigDict's types are still checked on set)."""
  for key, value in fields.items():
    node, path = c, key.replace("__", ".").split(".")
    if ".".join(path) in REMOVED:
      raise ConfigError(f"config: {'.'.join(path)} was removed: {REMOVED['.'.join(path)]}")
    for i, part in enumerate(path):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise ConfigError(f"config: no field {'.'.join(path[:i + 1])!r} (setting {'.'.join(path)})")
      if i < len(path) - 1:
        node = node[part]
    node[path[-1]] = value
  return c


def parse_cli(prog: str, argv=None, flag_values=None) -> None:
  """Parses a CLI's absl flags, ml_collections config overrides (--config.<key>=...) included. A bad flag (unknown
  config key, wrong type, missing value) or a stray argument ends the process with one line `prog: ...` and exit
  status 2, before any work."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  argv = list(sys.argv if argv is None else argv)
  saved, sys.argv = sys.argv, argv  # ml_collections reads the --config.* overrides from sys.argv
  try:
    rest = flag_values(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: a --config.<key> the config does not have
    removed = [f"--config.{k} was removed: {why}" for k, why in REMOVED.items() if f"--config.{k}" in " ".join(argv)]
    _cli_error(prog, removed[0] if removed else f"unknown config key {str(e).strip(chr(34))}")
  except (flags.Error, TypeError, ValueError) as e:
    _cli_error(prog, f"bad flag: {e}")
  finally:
    sys.argv = saved
  if len(rest) > 1:
    _cli_error(prog, f"unexpected arguments: {rest[1:]}")


def _cli_error(prog: str, message: str):
  print(f"{prog}: {message}", file=sys.stderr)
  sys.exit(2)


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# (field, smallest allowed value) of every integer field.
_INTS = (("seed", 0), ("num_steps", 1), ("rl.group_size", 1), ("rl.groups_per_step", 1), ("rl.seq_len", 2),
         ("rl.queue_groups", 1), ("rl.max_failures_in_a_row", 1),
         ("rl.num_minibatches", 1), ("rl.num_epochs", 1), ("sampler.max_slots", 1),
         ("sampler.max_len", 2), ("sampler.steps_per_call", 1), ("sampler.max_new_tokens", 1), ("sampler.top_k", 0),
         ("sampler.page_size", 1), ("sampler.num_pages", 0),
         ("task.max_prompt_tokens", 1), ("task.env_workers", 1), ("checkpoint.every_steps", 1),
         ("checkpoint.max_to_keep", 1),
         ("eval.num_examples", 0), ("eval.max_new_tokens", 1), ("optimizer.warmup_steps", 0),
         ("rl.max_segments", 1), ("rl.logprob_chunk", 0))
# (field, check, what it must be) of every real-valued field.
_REALS = (("task.reward_timeout_s", lambda v: v > 0, "> 0"), ("sampler.temperature", lambda v: v > 0, "> 0"),
          ("sampler.top_p", lambda v: 0 < v <= 1, "in (0, 1]"), ("optimizer.learning_rate", lambda v: v > 0, "> 0"),
          ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"))
_BOOLS = ("model.remat", "task.chat_template", "log.tensorboard", "log.progress", "log.trace", "rl.pack")
_CHOICES = (("mode", MODES), ("model.dtype", COMPUTE_DTYPES), ("model.param_dtype", DTYPES),
            ("model.train_attention", ("auto", "reference", "chunked", "cudnn", "splash")),
            ("model.remat_policy", ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                                    "everything_saveable")),
            ("sampler.on_update", ("recompute", "finish", "keep_kv")), ("sampler.dtype", ("auto", *DTYPES)),
            ("sampler.kv", ("dense", "paged")))


def validate(c: ml_collections.ConfigDict, workdir: str | os.PathLike | None = None, num_devices: int | None = None):
  """Raises ConfigError with one line naming the first bad field (before any model or data is loaded)."""

  def need(cond, msg):
    if not cond:
      raise ConfigError(f"config: {msg}")

  def get(path):
    node = c
    for part in path.split("."):
      try:
        node = node[part]
      except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"config: missing field {path}") from None
    return node

  for path, why in REMOVED.items():
    head, _, leaf = path.rpartition(".")
    need(leaf not in get(head), f"{path} was removed: {why}")
  for path, choices in _CHOICES:
    v = get(path)
    need(isinstance(v, str) and v in choices, f"{path}={v!r}; allowed: {choices}")
  for path, lo in _INTS:
    v = get(path)
    need(_is_int(v) and v >= lo, f"{path} must be an int >= {lo} (got {v!r})")
  for path, ok, what in _REALS:
    v = get(path)
    need(_is_real(v) and ok(v), f"{path} must be a number {what} (got {v!r})")
  for path in _BOOLS:
    v = get(path)
    need(isinstance(v, bool), f"{path} must be True or False (got {v!r})")
  v = get("optimizer.max_grad_norm")
  need(v is None or (_is_real(v) and v > 0), f"optimizer.max_grad_norm must be a number > 0 or None (got {v!r})")
  need(c.sampler.max_new_tokens < c.sampler.max_len,
       f"sampler.max_new_tokens={c.sampler.max_new_tokens} leaves no room for a prompt in max_len={c.sampler.max_len}")
  need(c.sampler.max_len <= c.rl.seq_len,
       f"sampler.max_len={c.sampler.max_len} exceeds rl.seq_len={c.rl.seq_len}: samples would not fit the batch")
  k = get("rl.max_staleness")
  need(k == "auto" or _is_int(k) and k >= 0, f"rl.max_staleness must be an int >= 0 or 'auto' (got {k!r})")
  if k == "auto":
    auto_staleness(c)
  s = c.sampler
  need(s.kv != "paged" or s.max_len % s.page_size == 0,
       f"sampler.max_len={s.max_len} must be a multiple of sampler.page_size={s.page_size} (sampler.kv='paged')")
  need(s.num_pages == 0 or s.num_pages * s.page_size >= s.max_len,
       f"sampler.num_pages={s.num_pages} pages of {s.page_size} cannot hold one sample of max_len={s.max_len}")
  _validate_objective(c)
  _validate_model_and_task(c, need, get)
  _validate_mesh(c, need, get, num_devices)
  batch = c.rl.group_size * c.rl.groups_per_step
  need(batch % c.rl.num_minibatches == 0,
       f"the batch of {batch} rows does not split into rl.num_minibatches={c.rl.num_minibatches} mini-batches")
  if workdir is not None:
    _check_writable(Path(workdir))


def auto_staleness(c):
  """The AutoStaleness of rl.max_staleness="auto" (ConfigError if rl.auto_staleness is bad); None for an int."""
  from jaxrl.controller.adaptive import AutoStaleness

  if c.rl.max_staleness != "auto":
    return None
  try:
    return AutoStaleness(**c.rl.auto_staleness.to_dict())
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config: rl.auto_staleness: {e}") from None


def engine_kwargs(c: ml_collections.ConfigDict) -> dict:
  """Keyword arguments of the sampler's Engine from a (validated) config."""
  s = c.sampler
  return dict(max_slots=s.max_slots, max_len=s.max_len, steps_per_call=s.steps_per_call, dtype=s.dtype, kv=s.kv,
              page_size=s.page_size, num_pages=s.num_pages or None)


def _validate_objective(c) -> None:
  """The loss, optimizer and sampling settings: types here, values by the classes that will hold them."""
  from jaxrl.learner.config import LossConfig
  from jaxrl.learner.optim import make_optimizer
  from jaxrl.rollout import SamplingParams

  options = set(inspect.signature(make_optimizer).parameters) - {"decay_steps"}  # decay_steps follows num_steps
  unknown = sorted(set(c.optimizer) - options)
  if unknown:
    raise ConfigError(f"config: optimizer.{unknown[0]} is not an option (options: {sorted(options)})")
  defaults = {f.name: f.default for f in dataclasses.fields(LossConfig) if f.name != "sampling"}
  for k, v in c.loss.items():
    if k not in defaults:
      raise ConfigError(f"config: loss.{k} is not a LossConfig option (options: {sorted(defaults)})")
    want = defaults[k]
    ok = {str: isinstance(v, str), bool: isinstance(v, bool), int: _is_int(v), float: _is_real(v),
          type(None): v is None or _is_real(v)}[type(want)]
    if not ok:
      kind = "a number or None" if want is None else f"a {type(want).__name__}"
      raise ConfigError(f"config: loss.{k} must be {kind} (got {v!r})")
  try:
    sampling = SamplingParams(temperature=c.sampler.temperature, top_k=c.sampler.top_k, top_p=c.sampler.top_p)
    LossConfig(**c.loss.to_dict(), sampling=sampling)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config: loss: {e}") from None


def _validate_model_and_task(c, need, get) -> None:
  from jaxrl.envs import TASKS
  from jaxrl.models import ModelConfig

  source = get("model.source")
  need(isinstance(source, str) and source, f"model.source must be 'tiny', 'smollm2' or a folder (got {source!r})")
  if source == "tiny":
    for k, v in get("model.tiny").items():
      need(_is_int(v) and v >= 1, f"model.tiny.{k} must be an int >= 1 (got {v!r})")
    try:
      ModelConfig.tiny(**c.model.tiny.to_dict())
    except (AttributeError, TypeError, ValueError) as e:
      raise ConfigError(f"config: model.tiny: {e}") from None
  elif source != "smollm2":
    need(Path(source).is_dir(), f"model.source={source!r} is neither 'tiny', 'smollm2' nor a folder")
  name = get("task.name")
  need(isinstance(name, str) and name in TASKS, f"task.name={name!r}; known: {sorted(TASKS)}")
  need(not (source == "tiny" and TASKS[name].text_prompts),
       f"task {name!r} has text prompts and the 'tiny' model has no tokenizer; use model.source='smollm2' or a "
       "HF folder, or a token-level task (target_token)")
  need(isinstance(get("task.kwargs"), ml_collections.ConfigDict), "task.kwargs must be a ConfigDict")
  need(isinstance(get("task.reward"), str), f"task.reward must be a reward name (got {c.task.reward!r})")


def _validate_mesh(c, need, get, num_devices: int | None) -> None:
  from jaxrl.sharding import resolve_axis_sizes

  n, s = get("mesh.num_devices"), get("mesh.sampler_devices")
  need(_is_int(n) and (n == -1 or n >= 2), f"mesh.num_devices must be -1 (all) or an int >= 2 (got {n!r})")
  need(_is_int(s) and s >= 1 or isinstance(s, float) and 0 < s < 1,
       f"mesh.sampler_devices must be a positive count or a fraction in (0, 1) (got {s!r})")
  if num_devices is None:
    return
  pool = num_devices if n == -1 else n
  need(pool <= num_devices, f"mesh.num_devices={n} but {num_devices} devices exist")
  need(pool >= 2, f"a pool of {pool} device(s) cannot hold a sampler and a learner")
  sampler = s if _is_int(s) else max(1, round(s * pool))
  need(sampler < pool, f"mesh.sampler_devices={s} leaves no learner device in a pool of {pool}")
  sizes = {}
  for role, count in (("learner", pool - sampler), ("sampler", sampler)):
    axes = get(f"mesh.{role}_axes")
    try:
      sizes[role] = resolve_axis_sizes(axes.to_dict() if hasattr(axes, "to_dict") else axes, count)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config: mesh.{role}_axes on {count} {role} device(s): {e}") from None
  shards = sizes["learner"].get("data", 1) * sizes["learner"].get("fsdp", 1)
  batch = c.rl.group_size * c.rl.groups_per_step
  need(batch % shards == 0, f"the batch of rl.group_size * rl.groups_per_step = {batch} rows is not divisible by "
                            f"the {shards} learner devices it is split over (mesh.learner_axes)")
  need(batch % (shards * c.rl.num_minibatches) == 0,
       f"each of rl.num_minibatches={c.rl.num_minibatches} mini-batches of the {batch}-row batch must split evenly "
       f"over the {shards} learner devices (mesh.learner_axes)")


def _check_writable(workdir: Path) -> None:
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / ".write_test"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"workdir {workdir} is not writable: {e.strerror or e}") from e
