"""The run configuration: every field with its meaning, and the checks made before any work starts.

Config files under configs/ start from `base()` and override what they need; `--config.key=value` on the
command line overrides further (ml_collections rejects unknown keys and wrong types).
"""

from __future__ import annotations

import os
from pathlib import Path

import ml_collections

MODES = ("pipeline", "sync")


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
  c.model.dtype = "float32"  # compute dtype of learner and sampler ("float32" | "bfloat16")
  c.model.param_dtype = "float32"  # master weights ("float32" | "bfloat16")
  c.model.remat = False  # rematerialise blocks in the backward pass (saves learner memory)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.num_devices = -1  # devices used in all (-1: every device)
  c.mesh.sampler_devices = 4  # devices of the sampler submesh: a count, or a fraction of the pool in (0, 1)
  c.mesh.learner_axes = ml_collections.ConfigDict(dict(fsdp=-1, tensor=1))  # learner mesh axes, -1: the rest
  c.mesh.sampler_axes = ml_collections.ConfigDict(dict(data=-1, tensor=1))  # sampler mesh axes, -1: the rest

  c.task = ml_collections.ConfigDict()
  c.task.name = "target_token"  # "target_token", "arithmetic", "countdown" or "gsm8k" (local JSONL)
  c.task.kwargs = ml_collections.ConfigDict()  # task-specific options (digits, ops, path, ...)
  c.task.reward = ""  # reward fn name in the registry; "" uses the task's own
  c.task.reward_timeout_s = 5.0  # a reward fn slower than this is counted as failed
  c.task.max_prompt_tokens = 64  # longer prompts are skipped and counted
  c.task.chat_template = True  # render prompts with the tokenizer's chat template (text tasks)

  c.sampler = ml_collections.ConfigDict()
  c.sampler.max_slots = 16  # concurrent decode slots (continuous batching)
  c.sampler.max_len = 48  # KV cache length per slot: prompt + completion
  c.sampler.steps_per_call = 8  # decode steps per host round trip
  c.sampler.max_new_tokens = 16  # completion budget per sample
  c.sampler.temperature = 1.0  # sampling temperature (the learner scores tokens at the same one)
  c.sampler.top_k = 0  # 0: off
  c.sampler.top_p = 1.0  # 1.0: off
  c.sampler.on_update = "recompute"  # in-flight update: "recompute" the KV cache with new params, or "finish"

  c.rl = ml_collections.ConfigDict()
  c.rl.group_size = 4  # samples per prompt (GRPO group)
  c.rl.groups_per_step = 4  # groups per learner step; batch = group_size * groups_per_step
  c.rl.seq_len = 48  # learner sequence length (prompt + completion, right-padded)
  c.rl.max_staleness = 1  # k: no sample is trained with staleness above k (pipeline mode)
  c.rl.queue_groups = 8  # rollout queue capacity, in groups (back-pressure beyond)

  c.loss = ml_collections.ConfigDict(dict(
      advantage="grpo", aggregation="token_mean", policy_loss="ppo", clip_low=0.2, clip_high=0.28,
      proximal="recompute", is_level="token", is_cap=2.0, kl_coef=0.0, entropy_coef=0.0))  # see LossConfig

  c.optimizer = ml_collections.ConfigDict(dict(
      learning_rate=3e-3, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0))  # see make_optimizer

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 5  # save every N learner steps (and at the end)
  c.checkpoint.max_to_keep = 2  # older checkpoints are deleted

  c.eval = ml_collections.ConfigDict()
  c.eval.num_examples = 0  # held-out examples scored greedily before and after training (0: none)
  c.eval.max_new_tokens = 16  # completion budget of each greedy eval answer

  c.log = ml_collections.ConfigDict()
  c.log.tensorboard = True  # TensorBoard event files in workdir/tb (metrics.jsonl is always written)
  c.log.progress = True  # one progress line per learner step on stderr
  return c


def validate(c: ml_collections.ConfigDict, workdir: str | os.PathLike | None = None, num_devices: int | None = None):
  """Raises ConfigError with one line naming the first bad field (before any model or data is loaded)."""

  def need(cond, msg):
    if not cond:
      raise ConfigError(f"config: {msg}")

  need(c.mode in MODES, f"mode={c.mode!r}; allowed: {MODES}")
  need(isinstance(c.num_steps, int) and c.num_steps >= 1, f"num_steps must be an int >= 1 (got {c.num_steps!r})")
  for name in ("group_size", "groups_per_step", "seq_len", "queue_groups"):
    v = c.rl[name]
    need(isinstance(v, int) and v >= 1, f"rl.{name} must be an int >= 1 (got {v!r})")
  need(isinstance(c.rl.max_staleness, int) and c.rl.max_staleness >= 0,
       f"rl.max_staleness must be an int >= 0 (got {c.rl.max_staleness!r})")
  for name in ("max_slots", "max_len", "steps_per_call", "max_new_tokens"):
    v = c.sampler[name]
    need(isinstance(v, int) and v >= 1, f"sampler.{name} must be an int >= 1 (got {v!r})")
  need(c.sampler.max_new_tokens < c.sampler.max_len,
       f"sampler.max_new_tokens={c.sampler.max_new_tokens} leaves no room for a prompt in max_len={c.sampler.max_len}")
  need(c.sampler.max_len <= c.rl.seq_len,
       f"sampler.max_len={c.sampler.max_len} exceeds rl.seq_len={c.rl.seq_len}: samples would not fit the batch")
  need(c.sampler.on_update in ("recompute", "finish"), f"sampler.on_update={c.sampler.on_update!r}")
  need(c.checkpoint.every_steps >= 1, f"checkpoint.every_steps must be >= 1 (got {c.checkpoint.every_steps})")
  need(c.task.reward_timeout_s > 0, f"task.reward_timeout_s must be > 0 (got {c.task.reward_timeout_s})")
  need(c.eval.num_examples >= 0, f"eval.num_examples must be >= 0 (got {c.eval.num_examples})")
  s = c.mesh.sampler_devices
  need(isinstance(s, (int, float)) and not isinstance(s, bool) and s > 0,
       f"mesh.sampler_devices must be a positive count or a fraction in (0, 1) (got {s!r})")
  if num_devices is not None:
    pool = num_devices if c.mesh.num_devices == -1 else c.mesh.num_devices
    need(1 <= pool <= num_devices, f"mesh.num_devices={c.mesh.num_devices} but {num_devices} devices exist")
    if isinstance(s, int):
      need(s < pool, f"mesh.sampler_devices={s} leaves no learner device in a pool of {pool}")
  if c.model.source not in ("tiny", "smollm2"):
    need(Path(c.model.source).is_dir(), f"model.source={c.model.source!r} is neither 'tiny', 'smollm2' nor a folder")
  if workdir is not None:
    _check_writable(Path(workdir))


def _check_writable(workdir: Path) -> None:
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / ".write_test"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"workdir {workdir} is not writable: {e.strerror or e}") from e
