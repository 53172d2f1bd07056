r"""Offline generation with the sampler engine: prompts in, completions (with behavior logprobs) out as JSON lines.

  jaxrl-generate --config=configs/default.py --workdir=runs/smollm2     # held-out eval of the trained policy
  jaxrl-generate --config=configs/default.py --workdir=runs/smollm2 --step=10   # ... of its step-10 checkpoint
  jaxrl-generate --config=configs/default.py --prompt="What is 7 * 8?"  # the config's base model and sampling
  jaxrl-generate --model_dir=~/.cache/jaxrl/smollm2-135m-instruct --prompt="What is 7 * 8?" \
      --n=4 --max_tokens=128 --temperature=0.7
  jaxrl-generate --tiny --prompt_ids=1,2,3 --greedy --max_tokens=16   # random tiny model, no tokenizer

The model is a run config's (--config: its model, sampler engine (sizes, KV layout, dtype, attention: the engine a
run builds) and sampling settings; with --workdir the newest
checkpoint of that run, i.e. the trained policy), a Hugging Face folder (--model_dir) or a random tiny model
(--tiny). Flags given explicitly override the config. Prompts come from --prompt (text; the chat template applies
unless --nochat), --prompt_ids (comma-separated token ids) or --prompts_file (JSON lines with a "prompt" or
"prompt_ids" field); with --config and no prompts, the config's task is evaluated: its first --num_examples
held-out examples answered greedily and scored by the task's reward, exactly as jaxrl-train's eval does (a summary
with the accuracy goes to stderr and to --summary_out). A progress line with tokens/s goes to stderr; one JSON
object per sample goes to --output (default stdout).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from jaxrl import config as config_lib
from jaxrl import platforms
from jaxrl.controller import sides
from jaxrl.models import Decoder, ModelConfig, hf, lora
from jaxrl.models.hf import load_config, load_params
from jaxrl.policy import load_policy
from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.sampler import Request, Sampler, make_engine
from jaxrl.sharding import make_mesh

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "run config (configs/<name>.py[:arg]): model, sampler sizes, sampling; without prompts its task's "
    "held-out examples are evaluated", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "with --config: the newest checkpoint of this run (a trained policy)")
_STEP = flags.DEFINE_integer("step", None, "with --workdir: this checkpoint step instead of the newest")
_NUM_EXAMPLES = flags.DEFINE_integer("num_examples", None, "with --config and no prompts: held-out examples to "
                                     "evaluate (default: the config's eval.num_examples, or 64 if that is 0)")
_SUMMARY_OUT = flags.DEFINE_string("summary_out", None, "with --config, no prompts: write the eval summary JSON here")
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Hugging Face model directory (config, safetensors, tokenizer).")
_TINY = flags.DEFINE_bool("tiny", False, "Use a random ModelConfig.tiny() model instead of --model_dir.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "Prompt text (repeatable).")
_PROMPT_IDS = flags.DEFINE_multi_string("prompt_ids", [], "Prompt as comma-separated token ids (repeatable).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, 'JSON lines with "prompt" or "prompt_ids".')
_CHAT = flags.DEFINE_bool("chat", True, "Wrap text prompts in the tokenizer's chat template.")
_N = flags.DEFINE_integer("n", 1, "Samples per prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 256, "Completion tokens per sample at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k filter (0: off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus filter (1: off).")
_GREEDY = flags.DEFINE_bool("greedy", False, "Argmax decoding.")
_STOP = flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_MAX_SLOTS = flags.DEFINE_integer("max_slots", 8, "Concurrent decode slots.")
_MAX_LEN = flags.DEFINE_integer("max_len", 1024, "KV cache length per slot (prompt + completion).")
_STEPS_PER_CALL = flags.DEFINE_integer("steps_per_call", 8, "Decode steps per host round trip.")
_TENSOR = flags.DEFINE_integer("tensor", 1, "Tensor-parallel degree; the other devices shard slots ('data').")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute and parameter dtype.")
_OUTPUT = flags.DEFINE_string("output", None, "Write JSON lines here instead of stdout.")


def _model_dir() -> Path | None:
  if _TINY.value == (_MODEL_DIR.value is not None):
    raise app.UsageError("give exactly one of --model_dir and --tiny")
  return None if _TINY.value else Path(_MODEL_DIR.value).expanduser()


def _tokenizer(path: Path | None):
  if path is None or not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
    return None
  import transformers  # only the CLI needs it

  return transformers.AutoTokenizer.from_pretrained(str(path))


def _load_model(path: Path | None) -> tuple[ModelConfig, object]:
  dtype = dict(dtype=_DTYPE.value, param_dtype=_DTYPE.value)
  if path is None:
    cfg = ModelConfig.tiny(**dtype)
    return cfg, nnx.split(Decoder(cfg, nnx.Rngs(_SEED.value)))[1]
  cfg, _, params = load_params(path, cfg=load_config(path).replace(**dtype))
  return cfg, params


def _prompts(tokenizer) -> list[tuple[str | None, list[int]]]:
  """(text or None, token ids) for every prompt given."""
  texts, ids = list(_PROMPT.value), [[int(t) for t in p.split(",") if t.strip()] for p in _PROMPT_IDS.value]
  if _PROMPTS_FILE.value:
    for line in Path(_PROMPTS_FILE.value).read_text().splitlines():
      if line.strip():
        row = json.loads(line)
        if "prompt_ids" in row:
          ids.append([int(t) for t in row["prompt_ids"]])
        else:
          texts.append(row["prompt"])
  if texts and tokenizer is None:
    raise app.UsageError("text prompts need a tokenizer in --model_dir; use --prompt_ids")
  out = [(None, p) for p in ids]
  for text in texts:
    if _CHAT.value and tokenizer.chat_template:
      text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    out.append((text, tokenizer(text, add_special_tokens=not _CHAT.value)["input_ids"]))
  if not out:
    raise app.UsageError("no prompts: give --prompt, --prompt_ids or --prompts_file")
  return out


def _record(r: Rollout, tokenizer) -> dict:
  row = dict(group_id=r.group_id, sample_index=r.sample_index, finish_reason=r.finish_reason,
             prompt_tokens=r.prompt_tokens.tolist(), completion_tokens=r.completion_tokens.tolist(),
             logprobs=[round(x, 6) for x in r.logprobs.tolist()], versions=r.versions.tolist(), **r.meta)
  if tokenizer is not None:
    row["completion"] = tokenizer.decode(r.completion_tokens.tolist(), skip_special_tokens=True)
  return row


def generate(sampler: Sampler, requests: Sequence[Request], out, progress=sys.stderr, tokenizer=None) -> list[Rollout]:
  """Runs every request through the sampler, writing one JSON line per sample and a progress line."""
  total = sum(r.n for r in requests)
  rollouts = []
  for r in sampler.run(requests):
    rollouts.append(r)
    out.write(json.dumps(_record(r, tokenizer)) + "\n")
    s = sampler.stats
    progress.write(f"\r{len(rollouts)}/{total} samples | {s.generated_tokens} tokens | {s.tokens_per_s:,.0f} tok/s "
                   f"| {s.useful_fraction:.0%} slot use")
  progress.write("\n")
  return rollouts


def _given(flag) -> bool:
  return flags.FLAGS[flag.name].present


def _setting(flag, config_value):
  """An explicitly given flag wins over the config's value."""
  return flag.value if _given(flag) else config_value


def _fail(message: str):
  print(f"jaxrl-generate: {message}", file=sys.stderr)
  sys.exit(2)


def _open_output():
  return open(_OUTPUT.value, "w") if _OUTPUT.value else sys.stdout


def _from_config(c):
  """(the validated RunConfig, policy, engine settings, sampling, max_tokens, seed) of --config (and --workdir),
  flags overriding."""
  if _MODEL_DIR.value is not None or _TINY.value:
    raise app.UsageError("give one of --config, --model_dir and --tiny")
  if _given(_DTYPE):
    raise app.UsageError("--dtype is for --model_dir and --tiny; with --config set --config.model.dtype")
  try:
    c = config_lib.validate(c)
    if _STEP.value is not None and _WORKDIR.value is None:
      raise app.UsageError("--step needs --workdir (a run's checkpoints)")
    policy = load_policy(c, _WORKDIR.value, step=_STEP.value)
  except (config_lib.ConfigError, hf.CheckpointError, FileNotFoundError) as e:
    _fail(str(e))
  s = c.sampler
  sampling = SamplingParams(temperature=_setting(_TEMPERATURE, s.temperature), top_k=_setting(_TOP_K, s.top_k),
                            top_p=_setting(_TOP_P, s.top_p), greedy=_GREEDY.value)
  sizes = dict(max_slots=_setting(_MAX_SLOTS, s.max_slots), max_len=_setting(_MAX_LEN, s.max_len),
               steps_per_call=_setting(_STEPS_PER_CALL, s.steps_per_call))
  return c, policy, sizes, sampling, _setting(_MAX_TOKENS, s.max_new_tokens), _setting(_SEED, c.seed)


def _sampler_params(policy):
  """(what the sampler places, a LoRA policy's frozen base or None): a run's sampler holds a LoRA base once and
  places the adapters on it (controller.sides.sampler_engine); the merged policy it makes is the same."""
  if policy.model_cfg.lora is None:
    return policy.params, None
  return lora.split(policy.params)


def _evaluate(c, policy, mesh, sizes) -> None:
  """The config's task on its held-out examples, greedy and scored, by the sampler side jaxrl-train evaluates with
  (controller.sides), its engine sized as flagged."""
  num = _NUM_EXAMPLES.value if _NUM_EXAMPLES.value is not None else (c.eval.num_examples or 64)
  if num < 1:
    raise app.UsageError(f"--num_examples must be >= 1 (got {num})")
  c = config_lib.replace(c, eval__num_examples=num, eval__max_new_tokens=_setting(_MAX_TOKENS, c.eval.max_new_tokens))
  params, base = _sampler_params(policy)
  try:
    side = sides.sampler_side(c, mesh, (policy.model_cfg, policy.tokenizer, policy.source_dir), base=base, **sizes)
  except config_lib.ConfigError as e:
    _fail(str(e))
  start = time.perf_counter()
  try:
    summary, rollouts = side.evaluate(params, policy.version)
  finally:
    side.score.close()
  out = _open_output()
  try:
    for r in rollouts:
      out.write(json.dumps(dict(_record(r, policy.tokenizer), reward=r.reward), default=str) + "\n")
  finally:
    if out is not sys.stdout:
      out.close()
  summary.update(checkpoint_step=policy.checkpoint_step, workdir=_WORKDIR.value, task=c.task.name,
                 seconds=round(time.perf_counter() - start, 2))
  if _SUMMARY_OUT.value:
    Path(_SUMMARY_OUT.value).write_text(json.dumps(summary, indent=2) + "\n")
  accuracy = (f"{summary['num_correct']}/{summary['num_examples']} correct ({summary['accuracy']:.1%}), "
              if "accuracy" in summary else "")
  print(f"held-out {c.task.name} at version {policy.version}: {accuracy}mean reward {summary['reward_mean']:.4f} "
        f"over {summary['num_examples']} examples", file=sys.stderr)
  print(json.dumps(summary), file=sys.stderr)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = _CONFIG.value
  if c is None:
    if _WORKDIR.value is not None or _NUM_EXAMPLES.value is not None or _SUMMARY_OUT.value is not None:
      raise app.UsageError("--workdir, --num_examples and --summary_out need --config")
    path = _model_dir()
    tokenizer = _tokenizer(path)
    prompts = _prompts(tokenizer)
    cfg, params = _load_model(path)
    version = 0
    sampling = SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                              greedy=_GREEDY.value)
    sizes = dict(max_slots=_MAX_SLOTS.value, max_len=_MAX_LEN.value, steps_per_call=_STEPS_PER_CALL.value)
    max_tokens, seed = _MAX_TOKENS.value, _SEED.value
  else:
    c, policy, sizes, sampling, max_tokens, seed = _from_config(c)
    cfg, params, version, tokenizer = policy.model_cfg, policy.params, policy.version, policy.tokenizer
    prompts = _prompts(tokenizer) if (_PROMPT.value or _PROMPT_IDS.value or _PROMPTS_FILE.value) else None
  devices = jax.devices()
  if len(devices) % _TENSOR.value:
    raise app.UsageError(f"--tensor={_TENSOR.value} does not divide the {len(devices)} devices")
  mesh = make_mesh({"data": len(devices) // _TENSOR.value, "tensor": _TENSOR.value}, devices)
  if c is not None and prompts is None:
    _evaluate(c, policy, mesh, sizes)
    return
  if c is None:
    engine = make_engine(cfg, mesh, **sizes)
  else:  # the run's own sampler engine: its KV layout (sampler.kv, pages), dtype and attention, sizes as flagged
    params, base = _sampler_params(policy)
    engine = sides.sampler_engine(c, cfg, mesh, policy.source_dir, base=base, **sizes)
  eos = set(cfg.eos_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    eos.add(tokenizer.eos_token_id)
  detokenize = tokenizer.decode if tokenizer is not None else None
  sampler = Sampler(engine, params, version, seed=seed, eos_token_ids=sorted(eos), detokenize=detokenize)
  requests = [Request(ids, group_id=i, n=_N.value, sampling=sampling, max_tokens=max_tokens,
                      stop_strings=tuple(_STOP.value), meta={} if text is None else {"prompt": text})
              for i, (text, ids) in enumerate(prompts)]
  start = time.perf_counter()
  out = _open_output()
  try:
    rollouts = generate(sampler, requests, out, tokenizer=tokenizer)
  finally:
    if out is not sys.stdout:
      out.close()
  print(f"{len(rollouts)} samples, {sampler.stats.generated_tokens} tokens in {time.perf_counter() - start:.1f}s "
        f"({sampler.stats.tokens_per_s:,.0f} tok/s in decode), {engine.compile_count()} compilations", file=sys.stderr)


def run():
  """Console entry point (jaxrl-generate)."""
  platforms.entry_point()
  app.run(main)


if __name__ == "__main__":
  run()
