r"""Offline generation with the sampler engine: prompts in, completions (with behavior logprobs) out as JSON lines.

  python -m jaxrl.generate --model_dir=~/.cache/jaxrl/smollm2-135m-instruct --prompt="What is 7 * 8?" \
      --n=4 --max_tokens=128 --temperature=0.7
  python -m jaxrl.generate --tiny --prompt_ids=1,2,3 --greedy --max_tokens=16   # random tiny model, no tokenizer

Prompts come from --prompt (text; the chat template applies unless --nochat), --prompt_ids (comma-separated token
ids) or --prompts_file (JSON lines with a "prompt" or "prompt_ids" field). A progress line with tokens/s goes
to stderr; one JSON object per sample goes to --output (default stdout).
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

from jaxrl.models import Decoder, ModelConfig
from jaxrl.models.hf import load_config, load_params
from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.sampler import Engine, Request, Sampler
from jaxrl.sharding import make_mesh

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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  path = _model_dir()
  tokenizer = _tokenizer(path)
  prompts = _prompts(tokenizer)
  cfg, params = _load_model(path)
  sampling = SamplingParams(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
                            greedy=_GREEDY.value)
  eos = set(cfg.eos_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    eos.add(tokenizer.eos_token_id)
  devices = jax.devices()
  mesh = make_mesh({"data": len(devices) // _TENSOR.value, "tensor": _TENSOR.value}, devices)
  engine = Engine(cfg, mesh, max_slots=_MAX_SLOTS.value, max_len=_MAX_LEN.value, steps_per_call=_STEPS_PER_CALL.value)
  detokenize = tokenizer.decode if tokenizer is not None else None
  sampler = Sampler(engine, params, seed=_SEED.value, eos_token_ids=sorted(eos), detokenize=detokenize)
  requests = [Request(ids, group_id=i, n=_N.value, sampling=sampling, max_tokens=_MAX_TOKENS.value,
                      stop_strings=tuple(_STOP.value), meta={} if text is None else {"prompt": text})
              for i, (text, ids) in enumerate(prompts)]
  start = time.perf_counter()
  out = open(_OUTPUT.value, "w") if _OUTPUT.value else sys.stdout
  try:
    rollouts = generate(sampler, requests, out, tokenizer=tokenizer)
  finally:
    if out is not sys.stdout:
      out.close()
  print(f"{len(rollouts)} samples, {sampler.stats.generated_tokens} tokens in {time.perf_counter() - start:.1f}s "
        f"({sampler.stats.tokens_per_s:,.0f} tok/s in decode), {engine.compile_count()} compilations", file=sys.stderr)


def run():
  """Console entry point (jaxrl-generate)."""
  app.run(main)


if __name__ == "__main__":
  run()
