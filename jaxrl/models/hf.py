"""Hugging Face checkpoint directories <-> Decoder params.

Loading reads tensors lazily from safetensors (single file or sharded index), converts each to our layout and
places it straight onto its target sharding with `jax.make_array_from_callback`, so every device receives only
its own shard. Saving writes a standard directory (config.json, model.safetensors, tokenizer files) that
transformers and vLLM open.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrl import console
from jaxrl.models.config import ModelConfig
from jaxrl.models.decoder import Decoder

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be loaded: the message names the file and the tensor."""


@dataclasses.dataclass(frozen=True)
class _Entry:
  path: tuple[str, ...]  # our parameter path
  hf: str  # HF tensor name; "{i}" is the layer index for stacked block params
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  sparse: bool | None = None  # in a MoE model: held by the sparse layers only (True), the dense ones (False)
  per_expert: bool = False  # one HF tensor per expert ("{j}"), stacked along our leading expert axis


def _entries(cfg: ModelConfig) -> list[_Entry]:
  e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  same = lambda x: x
  t = lambda x: x.T
  out = [
      _Entry(("embed",), "model.embed_tokens.weight", same, same),
      _Entry(("final_norm", "scale"), "model.norm.weight", same, same),
      _Entry(("blocks", "input_norm", "scale"), "model.layers.{i}.input_layernorm.weight", same, same),
      _Entry(("blocks", "post_attn_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight", same, same),
      _Entry(("blocks", "attn", "q_proj"), "model.layers.{i}.self_attn.q_proj.weight",
             lambda x: x.T.reshape(e, h, d), lambda x: x.reshape(e, h * d).T),
      _Entry(("blocks", "attn", "k_proj"), "model.layers.{i}.self_attn.k_proj.weight",
             lambda x: x.T.reshape(e, k, d), lambda x: x.reshape(e, k * d).T),
      _Entry(("blocks", "attn", "v_proj"), "model.layers.{i}.self_attn.v_proj.weight",
             lambda x: x.T.reshape(e, k, d), lambda x: x.reshape(e, k * d).T),
      _Entry(("blocks", "attn", "o_proj"), "model.layers.{i}.self_attn.o_proj.weight",
             lambda x: x.T.reshape(h, d, e), lambda x: x.reshape(h * d, e).T),
  ]
  dense = False if cfg.is_moe else None
  if not all(cfg.sparse_layers):
    out += [_Entry(("blocks", "mlp", name), f"model.layers.{{i}}.mlp.{name}.weight", t, t, sparse=dense)
            for name in ("gate_proj", "up_proj", "down_proj")]
  if cfg.is_moe:  # the Hub's Qwen3-MoE layout: a router ("gate") and each expert's own three projections
    out.append(_Entry(("blocks", "moe", "router"), "model.layers.{i}.mlp.gate.weight", t, t, sparse=True))
    out += [_Entry(("blocks", "moe", f"expert_{ours}"), f"model.layers.{{i}}.mlp.experts.{{j}}.{name}.weight", t, t,
                   sparse=True, per_expert=True)
            for ours, name in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))]
  if cfg.attention_bias:
    out += [
        _Entry(("blocks", "attn", "q_bias"), "model.layers.{i}.self_attn.q_proj.bias",
               lambda x: x.reshape(h, d), lambda x: x.reshape(h * d)),
        _Entry(("blocks", "attn", "k_bias"), "model.layers.{i}.self_attn.k_proj.bias",
               lambda x: x.reshape(k, d), lambda x: x.reshape(k * d)),
        _Entry(("blocks", "attn", "v_bias"), "model.layers.{i}.self_attn.v_proj.bias",
               lambda x: x.reshape(k, d), lambda x: x.reshape(k * d)),
    ]
  if cfg.qk_norm:
    out += [
        _Entry(("blocks", "attn", "q_norm", "scale"), "model.layers.{i}.self_attn.q_norm.weight", same, same),
        _Entry(("blocks", "attn", "k_norm", "scale"), "model.layers.{i}.self_attn.k_norm.weight", same, same),
    ]
  if not cfg.tie_embeddings:
    out.append(_Entry(("lm_head",), "lm_head.weight", t, t))
  return out


def load_config(path: str | os.PathLike, **overrides) -> ModelConfig:
  """ModelConfig from a HF directory's config.json (through transformers.AutoConfig)."""
  import transformers

  path = Path(path)
  if not (path / "config.json").is_file():
    raise CheckpointError(f"{path / 'config.json'}: missing (not a Hugging Face model directory)")
  try:
    hf = transformers.AutoConfig.from_pretrained(str(path))
  except Exception as e:  # transformers raises several types for unknown/corrupt configs
    raise CheckpointError(f"{path / 'config.json'}: cannot be read by transformers.AutoConfig: {e}") from e
  try:
    return ModelConfig.from_hf(hf, **overrides)
  except ValueError as e:
    raise CheckpointError(f"{path / 'config.json'}: {e}") from e


class _TensorIndex:
  """Tensor name -> safetensors file, for a single file or a sharded index."""

  def __init__(self, path: Path):
    index = path / "model.safetensors.index.json"
    if index.is_file():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
      self.files = {name: path / f for name, f in weight_map.items()}
    else:
      files = sorted(path.glob("*.safetensors"))
      if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
      self.files = {}
      for f in files:
        for name in self._open(f).keys():
          self.files[name] = f
    self._handles: dict[Path, object] = {}

  @staticmethod
  def _open(f: Path):
    try:
      return safe_open(str(f), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from e

  def get(self, name: str) -> np.ndarray:
    f = self.files.get(name)
    if f is None:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint (files: "
                            f"{sorted({p.name for p in self.files.values()})})")
    if f not in self._handles:
      self._handles[f] = self._open(f)
    try:
      return self._handles[f].get_tensor(name)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{f}: tensor {name!r} cannot be read ({e})") from e


def abstract_params(cfg: ModelConfig):
  """(graphdef, abstract params) of a Decoder, without allocating weights."""
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))


def load_params(path: str | os.PathLike, cfg: ModelConfig | None = None, shardings=None):
  """Loads a HF directory into (cfg, graphdef, params); with `shardings` each shard is placed directly."""
  path = Path(path)
  cfg = cfg or load_config(path)
  graphdef, abstract = abstract_params(cfg)
  tensors = _TensorIndex(path)
  entries = {e.path: e for e in _entries(cfg)}
  flat = dict(nnx.to_flat_state(abstract))
  sharding_of = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  loaded = {}
  loading = console.count(f"loading {path.name}'s weights", len(flat))
  for key, var in flat.items():
    key = tuple(str(k) for k in key)
    entry = entries.get(key)
    if entry is None:
      raise CheckpointError(f"no Hugging Face tensor maps to parameter {'/'.join(key)}")
    want = tuple(var.get_value().shape)
    if key[0] == "blocks":
      host = np.stack([_layer(tensors, entry, i, want[1:], cfg) for i in range(cfg.num_layers)])
    else:
      host = _convert(tensors, entry, entry.hf, want)
    host = host.astype(var.get_value().dtype)
    sh = sharding_of.get(key)
    if sh is not None:
      sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh
      arr = jax.make_array_from_callback(host.shape, sh, lambda idx, h=host: h[idx])
    else:
      arr = jax.numpy.asarray(host)
    loaded[key] = arr
    loading(len(loaded))
  params = nnx.from_flat_state({k: flat[tuple(k)].replace(v) for k, v in ((tuple(k), v) for k, v in loaded.items())})
  return cfg, graphdef, params


def _layer(tensors: _TensorIndex, entry: _Entry, i: int, want: tuple[int, ...], cfg: ModelConfig) -> np.ndarray:
  """Layer i of a stacked parameter; zeros where the layer has no such tensor (a mixed MoE stack's other kind)."""
  if not _holds(entry, cfg, i):
    return np.zeros(want, np.float32)
  if entry.per_expert:
    return np.stack([_convert(tensors, entry, entry.hf.format(i=i, j=j), want[1:]) for j in range(want[0])])
  return _convert(tensors, entry, entry.hf.format(i=i), want)


def _holds(entry: _Entry, cfg: ModelConfig, i: int) -> bool:
  return entry.sparse is None or cfg.sparse_layers[i] == entry.sparse


def _convert(tensors: _TensorIndex, entry: _Entry, name: str, want: tuple[int, ...]) -> np.ndarray:
  raw = tensors.get(name)
  try:
    out = entry.to_ours(raw)
  except ValueError as e:
    raise CheckpointError(f"{tensors.files[name]}: tensor {name!r} has shape {raw.shape}, which does not fit "
                          f"the config ({e})") from e
  if out.shape != want:
    raise CheckpointError(f"{tensors.files[name]}: tensor {name!r} has shape {raw.shape}; the config expects "
                          f"{want} after conversion, got {out.shape}")
  return out


def hf_config_dict(cfg: ModelConfig) -> dict:
  """A transformers config for the decoder (model_type llama, qwen2, qwen3 or qwen3_moe)."""
  rope = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta, **cfg.rope_scaling_dict}
  eos = list(cfg.eos_token_ids)
  d = dict(
      model_type=cfg.architecture,
      architectures=[{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[cfg.architecture]],
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
      tie_word_embeddings=cfg.tie_embeddings, rope_parameters=rope, rope_theta=cfg.rope_theta,
      hidden_act="silu", bos_token_id=cfg.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
      pad_token_id=cfg.pad_token_id, torch_dtype=cfg.param_dtype, dtype=cfg.param_dtype,
  )
  if cfg.architecture == "llama":
    d["attention_bias"] = cfg.attention_bias
  if cfg.architecture == "qwen3_moe":
    d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=cfg.decoder_sparse_step,
             mlp_only_layers=list(cfg.mlp_only_layers), norm_topk_prob=cfg.norm_topk_prob,
             router_aux_loss_coef=cfg.router_aux_loss_coef)
  return d


def save_params(path: str | os.PathLike, cfg: ModelConfig, params, tokenizer_dir: str | os.PathLike | None = None):
  """Writes a HF directory atomically (a temp folder renamed into place); tokenizer files copied if given."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  flat = {tuple(str(k) for k in key): np.asarray(jax.device_get(v.get_value()))
          for key, v in nnx.to_flat_state(params)}
  tensors = {}
  for entry in _entries(cfg):
    arr = flat[entry.path]
    if entry.path[0] == "blocks":
      for i in (i for i in range(cfg.num_layers) if _holds(entry, cfg, i)):
        for j in range(arr.shape[1]) if entry.per_expert else (None,):
          layer = arr[i] if j is None else arr[i, j]
          tensors[entry.hf.format(i=i, j=j)] = np.ascontiguousarray(entry.to_hf(layer))
    else:
      tensors[entry.hf] = np.ascontiguousarray(entry.to_hf(arr))
  tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
  try:
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2))
    if tokenizer_dir is not None:
      for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
          shutil.copy2(Path(tokenizer_dir) / name, tmp / name)
    if path.exists():  # keep the old folder until the new one is in place
      old = path.with_name(f".{path.name}.old-{os.getpid()}")
      os.replace(path, old)
      os.replace(tmp, path)
      shutil.rmtree(old)
    else:
      os.replace(tmp, path)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  return path
