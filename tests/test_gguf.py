"""GGUF -> HF conversion: synthetic round trips (exact and quantized), RoPE semantics, errors, and the real model."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file
from tiny_gguf import CHAT_TEMPLATE, TINY, TOKENS, gguf_name, tiny_hf_weights, write_tiny_llama_gguf

from jaxrl.models.gguf import GGUFError, convert_gguf_to_hf, unpermute_rotary_rows

pytest_plugins = ["conftest_assets"]  # the session fixture `smollm2_dir`

Q = gguf.GGMLQuantizationType


@pytest.fixture
def tiny(tmp_path):
  """(original HF weights, GGUF path) of a float32 tiny Llama."""
  weights = tiny_hf_weights()
  return weights, write_tiny_llama_gguf(tmp_path / "tiny.gguf", weights)


def test_unpermute_known_row_order():
  # llama.cpp writes head rows (0, 1, 2, 3) of a 4-dim head as (0, 2, 1, 3): the two halves interleaved.
  np.testing.assert_array_equal(unpermute_rotary_rows(np.array([0, 2, 1, 3]), 1), [0, 1, 2, 3])
  np.testing.assert_array_equal(unpermute_rotary_rows(np.array([0, 2, 1, 3, 4, 6, 5, 7]), 2), np.arange(8))
  with pytest.raises(ValueError, match="6 rows"):
    unpermute_rotary_rows(np.zeros(6), 2)


def test_float32_round_trip_is_exact(tiny, tmp_path):
  weights, path = tiny
  out = convert_gguf_to_hf(path, tmp_path / "hf")
  got = load_file(out / "model.safetensors")
  assert set(got) == set(weights)  # tied: no lm_head.weight
  for name, w in weights.items():
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], w, err_msg=name)

  cfg = transformers.AutoConfig.from_pretrained(out)
  assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == ("llama", 64, 128, 2)
  assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
  assert cfg.rms_norm_eps == 1e-5  # stored as float32 9.99999974e-06, written back as the decimal
  assert cfg.rope_parameters["rope_theta"] == 50000.0
  assert cfg.tie_word_embeddings is True
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size) == (1, 2, 2, len(TOKENS))
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
  assert json.loads((out / "generation_config.json").read_text()) == {
      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_untied_lm_head_is_written(tmp_path):
  weights = tiny_hf_weights(seed=1, tie=False)
  out = convert_gguf_to_hf(write_tiny_llama_gguf(tmp_path / "t.gguf", weights), tmp_path / "hf")
  np.testing.assert_array_equal(load_file(out / "model.safetensors")["lm_head.weight"], weights["lm_head.weight"])
  assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


# Max |error| of one quantized value of N(0, 1) weights: half a step of the block's scale (Q8_0: absmax/127,
# Q4_1: range/15), with margin. A Q/K row mix-up would give errors of order 1.
@pytest.mark.parametrize("qtype,atol", [(Q.Q8_0, 0.03), (Q.Q4_1, 0.3)])
def test_quantized_round_trip_within_tolerance(tmp_path, qtype, atol):
  weights = tiny_hf_weights(seed=2)
  path = write_tiny_llama_gguf(tmp_path / "q.gguf", weights, qtype=qtype)
  assert {t.tensor_type for t in gguf.GGUFReader(path).tensors} == {Q.F32, qtype}
  got = load_file(convert_gguf_to_hf(path, tmp_path / "hf") / "model.safetensors")
  for name, w in weights.items():
    err = np.abs(got[name] - w)
    assert err.max() <= atol, (name, err.max())
    if w.ndim == 2:
      assert 0 < err.mean() < atol / 2, (name, err.mean())


def _rope_rotate_half(x, pos, theta):
  """HF Llama RoPE: dim i pairs with dim i + D/2."""
  d = x.shape[-1]
  ang = pos[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  return x * cos + np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _rope_adjacent_pairs(x, pos, theta):
  """llama.cpp's RoPE for Llama (ROPE_TYPE_NORM): dim 2i pairs with dim 2i + 1."""
  d = x.shape[-1]
  ang = pos[:, None, None] * theta ** (-np.arange(0, d, 2) / d)
  x0, x1 = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2], out[..., 1::2] = x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang)
  return out


def test_converted_qk_with_hf_rope_match_gguf_qk_with_llamacpp_rope(tiny, tmp_path):
  """Attention scores are the same either way: the un-permutation is what makes HF RoPE correct."""
  _, path = tiny
  hf = load_file(convert_gguf_to_hf(path, tmp_path / "hf") / "model.safetensors")
  raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
  h, kv, d, theta = TINY["heads"], TINY["kv_heads"], TINY["head_dim"], TINY["rope_theta"]
  rng = np.random.default_rng(3)
  x = rng.standard_normal((7, TINY["hidden"]))
  pos = np.array([0, 1, 2, 5, 9, 40, 200], dtype=np.float64)

  def scores(wq, wk, rope):
    q = rope((x @ wq.T).reshape(-1, h, d), pos, theta)
    k = np.repeat(rope((x @ wk.T).reshape(-1, kv, d), pos, theta), h // kv, axis=1)
    return np.einsum("thd,shd->hts", q, k)

  for i in range(TINY["layers"]):
    want = scores(raw[f"blk.{i}.attn_q.weight"], raw[f"blk.{i}.attn_k.weight"], _rope_adjacent_pairs)
    got = scores(hf[f"model.layers.{i}.self_attn.q_proj.weight"], hf[f"model.layers.{i}.self_attn.k_proj.weight"],
                 _rope_rotate_half)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Without the un-permutation the scores differ: this test can tell.
    wrong = scores(raw[f"blk.{i}.attn_q.weight"], raw[f"blk.{i}.attn_k.weight"], _rope_rotate_half)
    assert np.abs(wrong - want).max() > 1.0


def test_tiny_tokenizer(tmp_path):
  out = convert_gguf_to_hf(write_tiny_llama_gguf(tmp_path / "t.gguf", tiny_hf_weights(), add_bos=True),
                           tmp_path / "hf")
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = {t: i for i, t in enumerate(TOKENS)}
  # add_bos_token in the file -> BOS first; "smollm" pre-tokenizer splits digits off before the byte-level regex,
  # so the two spaces stay one merged token.
  assert tok("a  2").input_ids == [ids["<|im_start|>"], ids["a"], ids["ĠĠ"], ids["2"]]
  assert tok(" the<|im_end|>", add_special_tokens=False).input_ids == [ids["Ġthe"], ids["<|im_end|>"]]
  assert tok.decode(tok("hi  2 the").input_ids, skip_special_tokens=True) == "hi  2 the"
  assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
      "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
  assert tok.chat_template == CHAT_TEMPLATE
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                 tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _no_leftovers(parent: Path, name: str) -> bool:
  return not any(p.name == name or p.name.startswith(f".{name}.") for p in parent.iterdir())


@pytest.mark.parametrize("cut", [100, 4000, -1000])
def test_truncated_file_is_named_and_leaves_nothing(tiny, tmp_path, cut):
  _, path = tiny
  data = path.read_bytes()
  bad = tmp_path / "cut.gguf"
  bad.write_bytes(data[:cut])
  with pytest.raises(GGUFError, match="cut.gguf") as e:
    convert_gguf_to_hf(bad, tmp_path / "hf")
  if cut == -1000:  # inside the tensor data: the tensor is named
    assert "truncated: tensor 'blk.1." in str(e.value)
  assert _no_leftovers(tmp_path, "hf")


def test_bad_magic_is_named(tiny, tmp_path):
  _, path = tiny
  bad = tmp_path / "magic.gguf"
  bad.write_bytes(b"GGUX" + path.read_bytes()[4:])
  with pytest.raises(GGUFError, match=r"magic\.gguf: not a readable GGUF file .*magic"):
    convert_gguf_to_hf(bad, tmp_path / "hf")
  assert _no_leftovers(tmp_path, "hf")


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
  weights = tiny_hf_weights()
  missing = write_tiny_llama_gguf(tmp_path / "missing.gguf", weights, drop=("blk.1.ffn_up.weight",))
  with pytest.raises(GGUFError, match=r"missing\.gguf: tensor 'blk\.1\.ffn_up\.weight' is missing"):
    convert_gguf_to_hf(missing, tmp_path / "hf")
  extra = write_tiny_llama_gguf(tmp_path / "extra.gguf", weights, extra={"rope_freqs.weight": np.ones(8, np.float32)})
  with pytest.raises(GGUFError, match=r"extra\.gguf: unexpected tensor 'rope_freqs\.weight'"):
    convert_gguf_to_hf(extra, tmp_path / "hf")
  weights[f"model.layers.0.{'mlp.up_proj'}.weight"] = np.zeros((TINY["ffn"], 32), np.float32)
  shape = write_tiny_llama_gguf(tmp_path / "shape.gguf", weights)
  with pytest.raises(GGUFError, match=r"shape\.gguf: tensor 'blk\.0\.ffn_up\.weight' has shape \(128, 32\)"):
    convert_gguf_to_hf(shape, tmp_path / "hf")
  assert _no_leftovers(tmp_path, "hf")
  assert gguf_name("model.layers.0.mlp.up_proj.weight") == "blk.0.ffn_up.weight"


def test_unsupported_architecture_and_existing_output(tiny, tmp_path):
  path = write_tiny_llama_gguf(tmp_path / "qwen.gguf", tiny_hf_weights(), arch="qwen2")
  with pytest.raises(GGUFError, match=r"qwen\.gguf: unsupported architecture 'qwen2'"):
    convert_gguf_to_hf(path, tmp_path / "hf")
  (tmp_path / "hf").mkdir()
  with pytest.raises(FileExistsError, match="hf"):
    convert_gguf_to_hf(tiny[1], tmp_path / "hf")
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "hf2")


# ---- the real SmolLM2-135M-Instruct ----

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT_TEXT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"


def test_smollm2_config_and_tokenizer(smollm2_dir):
  cfg = transformers.AutoConfig.from_pretrained(smollm2_dir)
  assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (49152, 576, 1536, 30)
  assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
  assert (cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"], cfg.max_position_embeddings) == (1e-5, 1e5, 8192)
  assert (cfg.tie_word_embeddings, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (True, 1, 2, 2)

  tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
  text = "Hello, world! In 2024 I ate 12 apples."
  ids = tok(text).input_ids
  # Digits one by one, the space before them on its own: SmolLM2's pre-tokenizer.
  assert tok.convert_ids_to_tokens(ids) == ["Hello", ",", "Ġworld", "!", "ĠIn", "Ġ", "2", "0", "2", "4", "ĠI", "Ġate",
                                            "Ġ", "1", "2", "Ġapples", "."]
  assert ids == [19556, 28, 905, 17, 533, 216, 34, 32, 34, 36, 339, 15563, 216, 33, 34, 13855, 30]
  assert tok.decode(ids) == text
  assert tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False) == PROMPT_TEXT
  assert tok(PROMPT_TEXT).input_ids == PROMPT_IDS
  assert tok.decode(ANSWER_IDS) == "The capital of France is Paris.<|im_end|>"
  assert tok.convert_ids_to_tokens(list(range(3))) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_smollm2_tensors(smollm2_dir):
  cfg = json.loads((smollm2_dir / "config.json").read_text())
  w = load_file(smollm2_dir / "model.safetensors")
  e, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
  block = {"input_layernorm": (e,), "post_attention_layernorm": (e,), "self_attn.q_proj": (9 * d, e),
           "self_attn.k_proj": (3 * d, e), "self_attn.v_proj": (3 * d, e), "self_attn.o_proj": (e, 9 * d),
           "mlp.gate_proj": (f, e), "mlp.up_proj": (f, e), "mlp.down_proj": (e, f)}
  want = {"model.embed_tokens.weight": (cfg["vocab_size"], e), "model.norm.weight": (e,)}
  want |= {f"model.layers.{i}.{k}.weight": s for i in range(cfg["num_hidden_layers"]) for k, s in block.items()}
  assert {k: v.shape for k, v in w.items()} == want  # tied: the LM head is the embedding, not stored twice
  for name, x in w.items():
    assert x.dtype == np.float32 and np.isfinite(x).all(), name
    if x.ndim == 2:  # dequantized matrices: centred, nonzero spread, no blow-ups
      assert abs(x.mean()) < 0.01 and 0.02 < x.std() < 1.0 and np.abs(x).max() < 20, name


def _reference_logits(w: dict[str, np.ndarray], cfg: dict, ids: list[int]) -> np.ndarray:
  """A plain numpy Llama forward pass (HF conventions, tied head) over one sequence; float32."""
  t, h, kv, d = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  rms = lambda x, s: x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg["rms_norm_eps"]) * s
  pos = np.arange(t, dtype=np.float32)
  causal = np.tril(np.ones((t, t), bool))
  x = w["model.embed_tokens.weight"][ids]
  for i in range(cfg["num_hidden_layers"]):
    g = lambda n: w[f"model.layers.{i}.{n}.weight"]  # noqa: B023
    a = rms(x, g("input_layernorm"))
    q = _rope_rotate_half((a @ g("self_attn.q_proj").T).reshape(t, h, d), pos, cfg["rope_theta"])
    k = _rope_rotate_half((a @ g("self_attn.k_proj").T).reshape(t, kv, d), pos, cfg["rope_theta"])
    v = (a @ g("self_attn.v_proj").T).reshape(t, kv, d)
    k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)
    s = np.where(causal, np.einsum("thd,shd->hts", q, k) / np.sqrt(d), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    x = x + (np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(t, h * d)
             @ g("self_attn.o_proj").T)
    a = rms(x, g("post_attention_layernorm"))
    gate = a @ g("mlp.gate_proj").T
    x = x + (gate / (1 + np.exp(-gate)) * (a @ g("mlp.up_proj").T)) @ g("mlp.down_proj").T
  return rms(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


@pytest.mark.slow
def test_smollm2_answers_a_question_under_a_numpy_reference(smollm2_dir):
  """Teacher-forced greedy check: each answer token is the argmax after the prompt and the tokens before it."""
  cfg = json.loads((smollm2_dir / "config.json").read_text())
  w = load_file(smollm2_dir / "model.safetensors")
  logits = _reference_logits(w, cfg, PROMPT_IDS + ANSWER_IDS[:-1])
  assert logits[len(PROMPT_IDS) - 1:].argmax(-1).tolist() == ANSWER_IDS
