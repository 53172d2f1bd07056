"""GGUF file -> standard Hugging Face model directory (config, tokenizer, float32 safetensors), without torch.

Weights are dequantized with `gguf.dequantize` (numpy). llama.cpp stores the Llama Q and K projections with the
rows of each head interleaved for its rotary kernel; they are put back in HF's rotate-half order here. The
tokenizer is rebuilt by transformers' torch-free GGUF tokenizer conversion. Output is written to a temporary
folder next to the destination and renamed into place at the end, so a folder at `out_dir` is always complete.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers, processors
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_PRE_TOKENIZER_SPLITS,
    convert_gguf_tokenizer,
)

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF tensor name, for one decoder block.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Pre-tokenizers llama.cpp knows and transformers' GGUF conversion does not. SmolLM's tokenizer.json splits
# digits one by one before the GPT-2 byte-level regex; without the digit split "a  2" tokenizes differently.
_EXTRA_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]),
}
# Pre-tokenizer names that mean "the builder's own default" (GPT-2 byte-level regex, or sentencepiece).
_DEFAULT_PRE_TOKENIZERS = ("default", "gpt2")


class GGUFError(ValueError):
  """A GGUF file that cannot be converted; the message names the file and, where one is at fault, the tensor."""


class _Reader(gguf.GGUFReader):
  """GGUFReader that names the tensor whose data runs past the end of the file or has an unknown type."""

  def __init__(self, path: Path):
    self.path = path
    super().__init__(path)

  # GGUFReader maps every tensor while opening and fails with a bare reshape error on a truncated file; the
  # tensor table is already parsed at this point, so check each tensor's byte range first.
  def _build_tensors(self, start_offs, fields):
    for field in fields:
      _, name_data, _, dims, raw_type, offset = field.parts
      name = bytes(name_data).decode("utf-8", errors="replace")
      try:
        qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
      except ValueError:
        raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {int(raw_type[0])}") from None
      block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
      end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block_size
      if end > self.data.size:
        raise GGUFError(f"{self.path}: truncated: tensor {name!r} needs bytes up to {end}, "
                        f"the file has {self.data.size}")
    super()._build_tensors(start_offs, fields)


def open_gguf(gguf_path: str | Path) -> gguf.GGUFReader:
  """Opens a GGUF file; anything unreadable (bad magic, truncated, corrupt) raises GGUFError naming it."""
  path = Path(gguf_path)
  if not path.is_file():
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return _Reader(path)
  except GGUFError:
    raise
  except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
    raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _metadata(reader: gguf.GGUFReader, path: Path):
  """`get(key, default=required)`: a metadata value, or GGUFError naming the file and the missing key."""
  required = object()

  def get(key, default=required):
    field = reader.get_field(key)
    if field is None:
      if default is required:
        raise GGUFError(f"{path}: metadata key {key!r} is missing")
      return default
    return field.contents()

  return get


def _float32_decimal(x: float) -> float:
  # GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); keep the decimal the model was made with.
  return float(str(np.float32(x)))


def hf_config(reader: gguf.GGUFReader, path: Path) -> dict:
  """A transformers LlamaConfig dict from the GGUF metadata."""
  get = _metadata(reader, path)
  arch = get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise GGUFError(f"{path}: unsupported architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
  rope_scaling = get(f"{arch}.rope.scaling.type", "none")
  if rope_scaling != "none":
    raise GGUFError(f"{path}: rope scaling {rope_scaling!r} is not supported")
  hidden = get(f"{arch}.embedding_length")
  heads = get(f"{arch}.attention.head_count")
  head_dim = get(f"{arch}.attention.key_length", hidden // heads)
  rope_dim = get(f"{arch}.rope.dimension_count", head_dim)
  if rope_dim != head_dim:
    raise GGUFError(f"{path}: partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) "
                    "are not supported")
  names = {t.name for t in reader.tensors}
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": get(f"{arch}.vocab_size", None) or len(get("tokenizer.ggml.tokens")),
      "hidden_size": hidden,
      "intermediate_size": get(f"{arch}.feed_forward_length"),
      "num_hidden_layers": get(f"{arch}.block_count"),
      "num_attention_heads": heads,
      "num_key_value_heads": get(f"{arch}.attention.head_count_kv", heads),
      "head_dim": head_dim,
      "max_position_embeddings": get(f"{arch}.context_length"),
      "rms_norm_eps": _float32_decimal(get(f"{arch}.attention.layer_norm_rms_epsilon")),
      "rope_theta": _float32_decimal(get(f"{arch}.rope.freq_base", 10000.0)),
      "rope_scaling": None,
      "hidden_act": "silu",
      "attention_bias": False,
      "mlp_bias": False,
      # llama.cpp writes `output.weight` only when the LM head is not the embedding matrix.
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": get("tokenizer.ggml.bos_token_id", None),
      "eos_token_id": get("tokenizer.ggml.eos_token_id", None),
      "pad_token_id": get("tokenizer.ggml.padding_token_id", None),
      "torch_dtype": "float32",
  }


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's Q/K row permutation: per head, rows (0, d/2, 1, d/2+1, ...) back to (0, 1, ..., d-1)."""
  rows = w.shape[0]
  if rows % (2 * n_heads):
    raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
  """GGUF tensor name -> HF-order shape, for every tensor the model needs."""
  e, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
  q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
  block = {"attn_norm": (e,), "attn_q": (q, e), "attn_k": (kv, e), "attn_v": (kv, e), "attn_output": (e, q),
           "ffn_norm": (e,), "ffn_gate": (f, e), "ffn_up": (f, e), "ffn_down": (e, f)}
  shapes = {"token_embd.weight": (cfg["vocab_size"], e), "output_norm.weight": (e,)}
  if not cfg["tie_word_embeddings"]:
    shapes["output.weight"] = (cfg["vocab_size"], e)
  for i in range(cfg["num_hidden_layers"]):
    shapes.update({f"blk.{i}.{k}.weight": s for k, s in block.items()})
  return shapes


def _hf_name(gguf_name: str) -> str:
  fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
  if gguf_name in fixed:
    return fixed[gguf_name]
  _, i, kind, _ = gguf_name.split(".")
  return f"model.layers.{i}.{_BLOCK_TENSORS[kind]}.weight"


def hf_tensors(reader: gguf.GGUFReader, cfg: dict, path: Path) -> dict[str, np.ndarray]:
  """All tensors, dequantized to float32, Q/K un-permuted, under HF names; errors name the tensor."""
  expected = _expected_shapes(cfg)
  found = {t.name: t for t in reader.tensors}
  if unexpected := sorted(set(found) - set(expected)):
    raise GGUFError(f"{path}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all) for a "
                    f"{cfg['num_hidden_layers']}-layer Llama")
  out = {}
  for name, shape in expected.items():
    if name not in found:
      raise GGUFError(f"{path}: tensor {name!r} is missing")
    t = found[name]
    try:
      w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError as e:
      raise GGUFError(f"{path}: tensor {name!r}: cannot dequantize {t.tensor_type.name} ({e})") from e
    if w.shape != shape:
      raise GGUFError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape}")
    if not np.isfinite(w).all():
      raise GGUFError(f"{path}: tensor {name!r} holds non-finite values")
    if ".attn_q." in name:
      w = unpermute_rotary_rows(w, cfg["num_attention_heads"])
    elif ".attn_k." in name:
      w = unpermute_rotary_rows(w, cfg["num_key_value_heads"])
    out[_hf_name(name)] = np.ascontiguousarray(w)
  return out


def hf_tokenizer_files(reader: gguf.GGUFReader, path: Path) -> dict[str, str]:
  """tokenizer.json and tokenizer_config.json contents, from the GGUF tokenizer metadata."""
  get = _metadata(reader, path)
  tokens = get("tokenizer.ggml.tokens")
  pre = get("tokenizer.ggml.pre", "default")
  spec = {
      "tokenizer_type": get("tokenizer.ggml.model"),
      "pre_tokenizer_type": pre,
      "tokens": tokens,
      "token_type": get("tokenizer.ggml.token_type", None),
      "merges": get("tokenizer.ggml.merges", None),
      "scores": get("tokenizer.ggml.scores", None),
  }
  spec = {k: v for k, v in spec.items() if v is not None}
  if pre not in GGUF_PRE_TOKENIZER_SPLITS and pre not in _EXTRA_PRE_TOKENIZERS and pre not in _DEFAULT_PRE_TOKENIZERS:
    raise GGUFError(f"{path}: unknown pre-tokenizer {pre!r}; tokenizing with a guessed one would change token ids")
  try:
    tok, _ = convert_gguf_tokenizer(get("general.architecture"), spec)
  except ValueError as e:
    raise GGUFError(f"{path}: cannot build the tokenizer ({e})") from e
  if pre in _EXTRA_PRE_TOKENIZERS:
    tok.pre_tokenizer = _EXTRA_PRE_TOKENIZERS[pre]()

  ids = {name: get(f"tokenizer.ggml.{key}", None) for name, key in
         (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"), ("pad", "padding_token_id"))}
  # Like llama.cpp: a sentencepiece vocabulary that does not say otherwise gets a BOS.
  add_bos = get("tokenizer.ggml.add_bos_token", spec["tokenizer_type"] == "llama")
  add_eos = get("tokenizer.ggml.add_eos_token", False)
  # llama.cpp adds BOS/EOS around every encoded text when the file asks; a post-processor does the same here.
  for flag, which in ((add_bos, "bos"), (add_eos, "eos")):
    if flag and ids[which] is None:
      raise GGUFError(f"{path}: tokenizer.ggml.add_{which}_token is set but no {which} token id is given")
  single = [f"{tokens[ids['bos']]}:0"] * add_bos + ["$A:0"] + [f"{tokens[ids['eos']]}:0"] * add_eos
  specials = [(tokens[ids[w]], ids[w]) for w, flag in (("bos", add_bos), ("eos", add_eos)) if flag]
  pair = single + [x.replace("$A:0", "$B:1") for x in single]
  tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

  tokenizer_config = {
      # PreTrainedTokenizerFast reads tokenizer.json as is (transformers 4.x and 5.x).
      "tokenizer_class": "PreTrainedTokenizerFast",
      **{f"{name}_token": None if i is None else tokens[i] for name, i in ids.items()},
      "add_bos_token": add_bos,
      "add_eos_token": add_eos,
      "add_prefix_space": False,
      "clean_up_tokenization_spaces": False,
      "model_max_length": get(f"{get('general.architecture')}.context_length"),
  }
  if (template := get("tokenizer.chat_template", None)) is not None:
    tokenizer_config["chat_template"] = template
  return {"tokenizer.json": tok.to_str(pretty=True),
          "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"}


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path) -> Path:
  """Writes config.json, generation_config.json, tokenizer files and model.safetensors (float32) to `out_dir`.

  `out_dir` must not exist; it appears complete or not at all. Returns it.
  """
  path, out = Path(gguf_path), Path(out_dir)
  if out.exists():
    raise FileExistsError(f"{out} already exists")
  reader = open_gguf(path)
  cfg = hf_config(reader, path)
  files = {
      "config.json": json.dumps(cfg, indent=2) + "\n",
      "generation_config.json": json.dumps(
          {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=2) + "\n",
      **hf_tokenizer_files(reader, path),
  }
  tensors = hf_tensors(reader, cfg, path)

  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
  try:
    for name, text in files.items():
      (tmp / name).write_text(text, encoding="utf-8")
    # transformers refuses safetensors files without a known "format"; "pt" is what torch checkpoints carry.
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    # mkdtemp and safetensors create owner-only entries; the result is meant to be shared and read-only.
    for p in tmp.iterdir():
      p.chmod(0o644)
    tmp.chmod(0o755)
    tmp.rename(out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out
