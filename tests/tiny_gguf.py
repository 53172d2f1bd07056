"""A tiny synthetic Llama GGUF, written from known HF-layout weights the way llama.cpp's converter does
(Q/K rows permuted for its rotary kernel, matrices optionally quantized)."""

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

TINY = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16, rope_theta=50000.0, rms_eps=1e-5,
            context=256)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = [bytes_to_unicode()[b] for b in range(256)]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]
TOKENS = SPECIALS + BYTES + ["".join(m.split()) for m in MERGES]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """HF -> GGUF row order of a Q or K projection, as llama.cpp's convert_hf_to_gguf.py writes it."""
  return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_weights(seed: int = 0, tie: bool = True) -> dict[str, np.ndarray]:
  """Random float32 weights under HF names for the TINY config (norm scales around 1, matrices ~ N(0, 1))."""
  rng = np.random.default_rng(seed)
  e, f, d = TINY["hidden"], TINY["ffn"], TINY["head_dim"]
  q, kv = TINY["heads"] * d, TINY["kv_heads"] * d
  shapes = {"model.embed_tokens.weight": (len(TOKENS), e), "model.norm.weight": (e,)}
  if not tie:
    shapes["lm_head.weight"] = (len(TOKENS), e)
  for i in range(TINY["layers"]):
    p = f"model.layers.{i}."
    shapes |= {p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
               p + "self_attn.q_proj.weight": (q, e), p + "self_attn.k_proj.weight": (kv, e),
               p + "self_attn.v_proj.weight": (kv, e), p + "self_attn.o_proj.weight": (e, q),
               p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e), p + "mlp.down_proj.weight": (e, f)}
  return {k: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else rng.standard_normal(s)).astype(np.float32)
          for k, s in shapes.items()}


def gguf_name(hf_name: str) -> str:
  fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  if hf_name in fixed:
    return fixed[hf_name]
  blocks = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  _, _, i, rest = hf_name.split(".", 3)
  return f"blk.{i}.{blocks[rest.removesuffix('.weight')]}.weight"


def write_tiny_llama_gguf(path: Path, weights: dict[str, np.ndarray], *,
                          qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32, arch: str = "llama",
                          drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                          add_bos: bool = False) -> Path:
  """Writes `weights` (HF names and layout) as a llama.cpp-style GGUF; norms stay F32, matrices get `qtype`."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(TINY["layers"])
  w.add_context_length(TINY["context"])
  w.add_embedding_length(TINY["hidden"])
  w.add_feed_forward_length(TINY["ffn"])
  w.add_head_count(TINY["heads"])
  w.add_head_count_kv(TINY["kv_heads"])
  w.add_rope_dimension_count(TINY["head_dim"])
  w.add_rope_freq_base(TINY["rope_theta"])
  w.add_layer_norm_rms_eps(TINY["rms_eps"])
  w.add_vocab_size(len(TOKENS))
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(TOKENS)
  w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))  # 3: control, 1: normal
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_unk_token_id(0)
  w.add_pad_token_id(2)
  w.add_add_bos_token(add_bos)
  w.add_chat_template(CHAT_TEMPLATE)
  tensors = {gguf_name(k): v for k, v in weights.items()}
  for i in range(TINY["layers"]):
    tensors[f"blk.{i}.attn_q.weight"] = llamacpp_permute(tensors[f"blk.{i}.attn_q.weight"], TINY["heads"])
    tensors[f"blk.{i}.attn_k.weight"] = llamacpp_permute(tensors[f"blk.{i}.attn_k.weight"], TINY["kv_heads"])
  tensors |= extra or {}
  for name, x in tensors.items():
    if name in drop:
      continue
    if x.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
    else:
      w.add_tensor(name, gguf.quantize(x, qtype), raw_dtype=qtype)  # shape read from the blocks
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
