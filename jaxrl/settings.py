"""Every run setting, declared once: its dotted name, default, the values it takes and what it means. `config.base()`
is built from this list and `config.validate` checks every value against it (then the rules that tie settings
together); `RunSpec`, `LossConfig`, the Engine and the Sampler are made from the validated values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MODES = ("pipeline", "sync", "auto")
DTYPES = ("float32", "bfloat16")
COMPUTE_DTYPES = ("auto", *DTYPES)
ON_UPDATE = ("recompute", "finish", "keep_kv")  # what the sampler does with samples in flight at a params update
KV_LAYOUTS = ("dense", "paged")
WEIGHT_DTYPES = ("float", "int8")  # the sampler's weights (jaxrl.models.quant)
PEAK_MODES = ("auto", "measure")  # roofline telemetry's peak: the device table's (else measured), or measured
DECODE_ATTENTION = ("auto", "xla", "pallas_gpu", "pallas_tpu")  # paged decode attention (kernels.paged_attention)
TRAIN_ATTENTION = ("reference", "chunked", "cudnn", "splash")  # learner attention implementations
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One setting. kind: "int" (>= lo), "real" (a finite number passing `ok`, described by `what`), "bool",
  "choice" (one of `choices`), or "other" (checked by config.validate's rules, e.g. a section of options)."""

  name: str
  default: Any
  doc: str
  kind: str = "other"
  lo: int = 0
  ok: Any = None
  what: str = ""
  choices: tuple = ()
  any_type: bool = False  # the config holds values of several types here (an int or "auto"): checked by validate

  def allowed(self) -> str:
    """The values it takes, in words."""
    return {"int": f"an int >= {self.lo}", "real": f"a number {self.what}", "bool": "True or False",
            "choice": f"one of {self.choices}"}.get(self.kind, "see config.validate")

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
    return None


def help_text() -> str:
  """Every setting, one line each: its --config flag at the default, the values it takes and what it means."""
  return "\n".join(f"--config.{s.name}={s.default!r}  [{s.allowed()}]  {s.doc}" for s in SETTINGS)


def Int(name, default, lo, doc):  # noqa: N802 - reads as a type in the table below
  return Setting(name, default, doc, "int", lo=lo)


def Real(name, default, ok, what, doc):  # noqa: N802
  return Setting(name, default, doc, "real", ok=ok, what=what)


def Bool(name, default, doc):  # noqa: N802
  return Setting(name, default, doc, "bool")


def Choice(name, default, choices, doc):  # noqa: N802
  return Setting(name, default, doc, "choice", choices=tuple(choices))


positive = lambda v: v > 0  # noqa: E731

SETTINGS = (
    Int("seed", 0, 0, "seeds params init (tiny), the learner's rng and every prompt's sampling key"),
    Choice("mode", "pipeline", MODES, '"pipeline": sampler and learner run at once; "sync": sample a batch, train, '
           'repeat (the pipeline with max_staleness 0); "auto": measured segments, the mode and k that train the '
           "most tokens/s (jaxrl/controller/auto.py)"),
    # mode="auto": a sync segment measures the run's costs, the simulator predicts each candidate (sync, pipeline at
    # k = 1..k_max), later segments run the best-scoring one (a measurement replaces its prediction)
    Int("auto.measure_steps", 5, 4, 'mode="auto": steps of the first (sync) segment, which calibrates the model'),
    Int("auto.recheck_steps", 8, 4, 'mode="auto": steps of every later segment (the choice is re-made after each)'),
    Int("auto.k_max", 2, 1, 'mode="auto": the largest staleness bound it tries for the pipeline'),
    Int("auto.warmup_steps", 1, 1, 'mode="auto": steps of each segment left out of its measurement (compilation)'),
    Setting("auto.splits", (), 'mode="auto": sampler device counts to try for the pipeline (a new split is a new build '
            "or launch, resumed exactly); empty: mesh.sampler_devices only"),
    Int("num_steps", 20, 1, "learner steps (policy versions) to train for"),

    Setting("model.source", "tiny", '"tiny" (random ModelConfig.tiny), "smollm2" (fetched by jaxrl-assets), or a HF '
            "folder"),
    Setting("model.tiny", dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, head_dim=8), 'sizes of the "tiny" model (and eos_token_ids=(...): ids '
            "that end a sample; none by default, so every sample runs to sampler.max_new_tokens)"),
    Choice("model.dtype", "auto", COMPUTE_DTYPES, 'compute dtype of learner and sampler ("auto": bf16 on GPU/TPU)'),
    Choice("model.param_dtype", "float32", DTYPES, "master weights"),
    Bool("model.remat", False, "rematerialise blocks in the backward pass (saves learner memory)"),
    Choice("model.remat_policy", "nothing_saveable", REMAT_POLICIES, "what a remat block keeps"),
    Choice("model.train_attention", "auto", ("auto", *TRAIN_ATTENTION), "learner attention"),
    Int("model.scan_unroll", 1, 1, "layers per iteration of the layer scan (>= num_layers: unrolled)"),
    Bool("model.lora.enabled", False, "train low-rank adapters on a frozen base model (jaxrl/models/lora.py); a "
         "publish moves the adapters only"),
    Int("model.lora.rank", 8, 1, "LoRA rank r of every adapter"),
    Real("model.lora.alpha", 16.0, positive, "> 0", "LoRA scale numerator: adapters add (alpha / rank) * A @ B"),
    Setting("model.lora.targets", r".*", "regular expression matched in full against the projections LoRA adapts: "
            "attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj"),

    Setting("mesh.num_devices", -1, "devices used in all (-1: every device)"),
    Setting("mesh.sampler_devices", 4, "devices of the sampler submesh: a count, or a fraction of the pool in (0, 1)"),
    Setting("mesh.learner_axes", dict(fsdp=-1, tensor=1), "learner mesh axes, -1: the rest"),
    Setting("mesh.sampler_axes", dict(data=-1, tensor=1), "sampler mesh axes, -1: the rest"),

    Setting("task.name", "target_token", '"target_token", "arithmetic", "countdown", "gsm8k" (local JSONL), '
            '"reasoning_gym" or "dataset" (parquet / JSONL / hub; optional extras); multi-turn envs: "calculator", '
            '"guess", "token_turns" (jaxrl.envs.env)'),
    Setting("task.kwargs", {}, "task-specific options (digits, ops, path, ...)"),
    Setting("task.reward", "", 'reward fn name in the registry; "" uses the task\'s own'),
    Real("task.reward_timeout_s", 5.0, positive, "> 0",
         "a reward fn (or a multi-turn env's step) slower than this is counted as failed"),
    Int("task.env_workers", 4, 1, "multi-turn env tasks: env steps run at once (threads; worker processes if "
        "untrusted)"),
    Int("task.max_prompt_tokens", 64, 1, "longer prompts are skipped and counted"),
    Bool("task.chat_template", True, "render prompts with the tokenizer's chat template (text tasks)"),

    Int("sampler.max_slots", 16, 1, "concurrent decode slots (continuous batching)"),
    Int("sampler.max_len", 48, 2, "KV cache length per slot: prompt + completion"),
    Int("sampler.steps_per_call", 8, 1, "decode steps per host round trip"),
    Choice("sampler.dtype", "auto", COMPUTE_DTYPES, 'sampler weights + KV cache ("auto": bf16 on TPU/GPU, f32 on '
           "CPU)"),
    # "int8": q/k/v/o, gate/up/down and the head quantized per output channel when published (jaxrl/models/quant.py);
    # behaviour log-probs come from that quantized model, and the learner (float weights) corrects the gap with its
    # importance weights
    Choice("sampler.weight_dtype", "float", WEIGHT_DTYPES, '"float": sampler weights in sampler.dtype; "int8": '
           "weight-only int8 for decoding"),
    Int("sampler.max_new_tokens", 16, 1, "completion budget per sample"),
    Real("sampler.temperature", 1.0, positive, "> 0", "sampling temperature (the learner scores tokens at the same "
         "one)"),
    Int("sampler.top_k", 0, 0, "0: off"),
    Real("sampler.top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]", "1.0: off"),
    Choice("sampler.on_update", "recompute", ON_UPDATE, 'in-flight update: "recompute" the KV cache, "finish" '
           'first, or "keep_kv"'),
    Choice("sampler.kv", "dense", KV_LAYOUTS, 'KV cache: "dense" (max_len per slot) or "paged" (a page pool shared '
           "by the slots)"),
    Int("sampler.page_size", 16, 1, "paged: positions per page (must divide max_len)"),
    Choice("sampler.attention", "auto", DECODE_ATTENTION, 'paged: decode attention ("auto": the Pallas kernel on '
           "a GPU or TPU sampler of one device, XLA otherwise)"),
    Int("sampler.num_pages", 0, 0, "paged: pages in the pool; 0: the dense cache's memory (max_slots * max_len / "
        "page_size)"),
    # Benchmarks only (jaxrl/sampler/forced.py): median > 0 forces group g's completion length, lognormal from
    # (seed, g) with p99 / median = p99_ratio, clipped to [1, max_new_tokens]; EOS and stop ids are ignored
    Real("sampler.forced_lengths.median", 0.0, lambda v: v >= 0, ">= 0 (0: off)", "forced completion lengths' "
         "median (benchmarks; 0: off)"),
    Real("sampler.forced_lengths.p99_ratio", 10.0, lambda v: v >= 1, ">= 1", "forced lengths' p99 / median"),

    Int("rl.group_size", 4, 1, "samples per prompt (GRPO group)"),
    Int("rl.groups_per_step", 4, 1, "groups per learner step; batch = group_size * groups_per_step"),
    Int("rl.seq_len", 48, 2, "learner sequence length (prompt + completion, right-padded), the packed row length"),
    # Several samples per row of seq_len tokens (first-fit decreasing, each sample its own segment), rows rounded up
    # to a few buckets (one compilation each): train cost follows the real tokens, not batch x seq_len
    Bool("rl.pack", False, "pack the learner's batches"),
    Int("rl.max_segments", 16, 1, "samples per packed row at most"),
    # Every packed row bucket compiled before the first step, so no step pays a compilation mid-run (a multi-process
    # job always does: a late compile stalls every learner's collectives). False: each at its first use (a shorter
    # start on CPU, where a real model's bucket takes 10-60 s to compile, and not every bucket is met)
    Bool("rl.compile_ahead", True, "compile the train step for every packed row bucket before the first step"),
    Int("rl.logprob_chunk", 0, 0, "> 0: log-probs computed this many positions at a time (no [B, L, V] logits)"),
    # Gradient accumulation by size: each update's rows are run in the fewest chunks of at most this many rows per
    # learner device (per row bucket; the same update up to summation order). Bounds activation memory; on
    # XLA:CPU small chunks stay in the core's cache (docs/BENCHMARKS.md). 0: one chunk
    Int("rl.microbatch_rows", 0, 0, "rows per gradient-accumulation chunk per device at most (0: whole update)"),
    # k: a group admitted at sampler version v is trained by step v + k, late or not (nothing is dropped for
    # staleness): every trained token has staleness <= k, in learner steps (pipeline mode; sync is k = 0). "auto":
    # admission moves k within [auto_staleness.k_min, auto_staleness.k_max] from the measured drift
    # (jaxrl/controller/adaptive.py); k_max stays the hard bound
    Setting("rl.max_staleness", 1, 'an int >= 0 or "auto"', any_type=True),
    Setting("rl.auto_staleness", dict(k_min=0, k_max=4, ess_low=0.7, ess_high=0.9, kl_high=0.05, window=3),
            "see AutoStaleness"),
    # Optimizer updates per learner step: the step's samples, shuffled by (seed, step), are dealt into
    # num_minibatches disjoint mini-batches by sample (packed or not); every epoch runs them all, in its own order.
    # A step makes one policy version however many updates it runs. With loss.proximal="recompute", updates after
    # the first are clipped against the pre-step policy (decoupled PPO): 2 makes the trust region act.
    Int("rl.num_minibatches", 2, 1, "optimizer updates per epoch of a learner step (see above)"),
    Int("rl.num_epochs", 1, 1, "PPO epochs: passes over the batch per learner step"),
    # True: a non-finite update skips its whole step (a version is all its updates or none), which keeps the
    # pre-step TrainState while the step runs: one more state of memory (params + Adam moments) with 2+ updates per
    # step. False: a non-finite update skips only itself (optax.apply_if_finite's rule) and no copy is kept; its
    # step applies if any update did, counted in summary.json as partial_steps
    Bool("rl.atomic_step", True, "a non-finite update skips its whole step (+1 TrainState of memory)"),
    Int("rl.queue_groups", 8, 1, "rollout queue capacity, in groups (back-pressure beyond)"),
    Int("rl.max_failures_in_a_row", 100, 1, "skipped prompts + dropped groups + skipped updates in a row (no applied "
        "update between) before the run stops with an error: broken data or rewards fail loudly, not for ever"),

    # See LossConfig (each option's values are checked there). Default: decoupled PPO (clip-higher, dual clip for
    # A < 0) against the pre-step policy, corrected for staleness by truncated token IS weights prox / mu.
    Setting("loss", dict(advantage="grpo", aggregation="token_mean", policy_loss="ppo", clip_low=0.2, clip_high=0.28,
                         dual_clip=3.0, proximal="recompute", is_level="token", is_cap=2.0, is_ess_min=None,
                         kl_coef=0.0, kl_estimator="k2", entropy_coef=0.0), "the RL objective: LossConfig's options"),
    Real("optimizer.learning_rate", 3e-3, positive, "> 0", "peak learning rate"),
    Int("optimizer.warmup_steps", 0, 0, "linear warmup, in learner steps"),
    Int("optimizer.decay_steps", 0, 0, "learner steps of the cosine decay that follows the warmup (0: num_steps); "
        'mode="auto" gives every segment the whole run\'s'),
    Real("optimizer.weight_decay", 0.0, lambda v: v >= 0, ">= 0", "AdamW weight decay"),
    Setting("optimizer.max_grad_norm", 1.0, "global gradient-norm clip (None: off); see make_optimizer"),

    Int("checkpoint.every_steps", 5, 1, "save every N learner steps (and at the end)"),
    Int("checkpoint.max_to_keep", 2, 1, "older checkpoints are deleted"),
    # zstd: less disk for weights, but a save holds the compressed state in host memory until written (a higher
    # peak RSS) and takes longer (docs/BENCHMARKS.md)
    Bool("checkpoint.compress", False, "zstd-compress the saved arrays"),

    Int("eval.num_examples", 0, 0, "held-out examples scored greedily before and after training (0: none)"),
    Int("eval.max_new_tokens", 16, 1, "completion budget of each greedy eval answer"),

    # Every step's scalars go to each backend under the same names: "jsonl" (workdir/metrics.jsonl, required),
    # "tensorboard" (workdir/tb), "wandb", "mlflow" (optional extra `trackers`; see jaxrl/trackers.py)
    Setting("log.backends", ("jsonl", "tensorboard"), "experiment trackers (jaxrl.trackers.BACKENDS), jsonl included"),
    Setting("log.project", "jaxrl", "tracker project (wandb project, MLflow experiment)"),
    Setting("log.run_name", "", "tracker run name (\"\": the workdir's name)"),
    Bool("log.tensorboard", True, "False drops \"tensorboard\" from log.backends (the older switch, still honoured)"),
    Bool("log.progress", True, "one progress line per learner step on stderr"),
    # Roofline telemetry (jaxrl/telemetry.py): learner_/sampler_ flops_per_s, bytes_per_s, mfu, mbu per step, the
    # peaks from the accelerator's datasheet (jaxrl.sim.hardware) or measured at start (a CPU, or log.peak="measure")
    Bool("log.telemetry", True, "log each side's achieved FLOP/s and bytes/s and their fractions of peak (MFU/MBU)"),
    Choice("log.peak", "auto", PEAK_MODES, '"auto": the device table\'s peak (measured for a device not in '
           'it); "measure": a matmul and a read measured at start'),
    Real("log.peak_flops", 0.0, lambda v: v >= 0, ">= 0", "per-device peak FLOP/s for MFU (0: from log.peak)"),
    Real("log.peak_bandwidth", 0.0, lambda v: v >= 0, ">= 0", "per-device memory bandwidth, bytes/s, for MBU (0: "
         "from log.peak)"),
    Bool("log.trace", False, "workdir/trace.jsonl: which samples each step trained, drops, skips, checkpoints "
         "(debugging)"),
)
