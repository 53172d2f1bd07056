"""The generate CLI: a HF folder with a tokenizer and chat template in, greedy completions out as JSON lines."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from absl import app, flags
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jaxrl import generate
from jaxrl.models import ModelConfig, forward
from jaxrl.models.hf import abstract_params, save_params

CFG = ModelConfig.tiny(eos_token_ids=(1,))
CHAT = "{% for m in messages %}w2 {{ m['content'] }} w3{% endfor %}{% if add_generation_prompt %} w4{% endif %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A tiny random model with a word-level tokenizer (w2..w63), eos <eos> = 1 and a chat template."""
  root = tmp_path_factory.mktemp("generate")
  vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, CFG.vocab_size)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece()
  tok_dir = root / "tok"
  tok_dir.mkdir()
  tok.save(str(tok_dir / "tokenizer.json"))
  (tok_dir / "tokenizer_config.json").write_text(json.dumps(dict(
      tokenizer_class="PreTrainedTokenizerFast", eos_token="<eos>", pad_token="<pad>", chat_template=CHAT)))
  graphdef, abstract = abstract_params(CFG)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), abstract)
  return save_params(root / "model", CFG, params, tokenizer_dir=tok_dir), graphdef, params


@functools.partial(jax.jit, static_argnums=0)
def _next_token(graphdef, params, tokens_T, length):
  t = tokens_T.shape[0]
  logits = forward(graphdef, params, tokens_T[None], jnp.arange(t)[None], (jnp.arange(t) < length)[None].astype(int))
  return jnp.argmax(logits[0, length - 1])


def _greedy(graphdef, params, prompt, max_tokens):
  """Full forward and argmax at every step, stopping at eos (id 1)."""
  seq = list(prompt)
  for _ in range(max_tokens):
    seq.append(int(_next_token(graphdef, params, np.array(seq + [0] * (32 - len(seq))), len(seq))))
    if seq[-1] == 1:
      break
  return seq[len(prompt):]


def _main(argv):
  flags.FLAGS.unparse_flags()
  flags.FLAGS(["generate", *argv])
  try:
    generate.main(["generate"])
  finally:
    flags.FLAGS.unparse_flags()


def test_chat_prompts_generate_greedy_json_lines(model_dir, tmp_path):
  path, graphdef, params = model_dir
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
  prompts_file = tmp_path / "prompts.jsonl"
  prompts_file.write_text(json.dumps({"prompt_ids": [9, 8, 7]}) + "\n" + json.dumps({"prompt": "w6 w6"}) + "\n")
  prompt_ids = {0: [9, 8, 7], 1: [2, 5, 6, 3, 4], 2: [2, 6, 6, 3, 4]}  # chat template: w2 {content} w3 w4
  free = {g: _greedy(graphdef, params, p, 12) for g, p in prompt_ids.items()}
  stop = tokenizer.decode(free[1][2:4])
  out = tmp_path / "out.jsonl"
  _main([f"--model_dir={path}", "--prompt=w5 w6", f"--prompts_file={prompts_file}", "--greedy", "--n=2",
         "--max_tokens=12", "--max_len=32", "--max_slots=8", f"--stop={stop}", f"--output={out}"])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [(g, i) for g in range(3) for i in range(2)]
  for r in rows:
    g = r["group_id"]
    assert r["prompt_tokens"] == prompt_ids[g]
    cut = next((e for e in range(1, len(free[g]) + 1) if stop in tokenizer.decode(free[g][:e])), None)
    expect = free[g][:cut]
    assert r["completion_tokens"] == expect
    assert r["finish_reason"] == ("stop" if cut else "eos" if expect[-1] == 1 else "length")
    assert r["logprobs"] == [0.0] * len(expect) and r["versions"] == [0] * len(expect)
    assert r["completion"] == tokenizer.decode(expect, skip_special_tokens=True)
  assert [r["finish_reason"] for r in rows if r["group_id"] == 1] == ["stop", "stop"]
  assert "prompt" not in next(r for r in rows if r["group_id"] == 0)
  assert next(r for r in rows if r["group_id"] == 1)["prompt"] == "w2 w5 w6 w3 w4"


@pytest.mark.parametrize("argv, match", [
    (["--tiny", "--model_dir=/x", "--prompt_ids=1"], "exactly one of"),
    (["--tiny", "--prompt=hello"], "need a tokenizer"),
    (["--tiny"], "no prompts"),
])
def test_usage_errors(argv, match):
  with pytest.raises(app.UsageError, match=match):
    _main(argv)
