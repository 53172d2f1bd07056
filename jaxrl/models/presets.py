"""Model shapes by name, from each family's published config.json (no weights): `--config.model.preset=qwen2.5-7b`
replaces a config's model shape, so that a run can be sized, compiled for a target (jaxrl-compile) or trained from
random weights without downloading anything.

Each entry holds the config.json values the decoder reads (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings, rope; a MoE its experts) and the
parameter count the model card publishes (`PUBLISHED`, in billions; tests/test_presets.py pins every preset's count
to it within 1%).
Jax-free: config.validate checks a name before anything is built.
"""

from __future__ import annotations

# Llama 3.1 / 3.2's "llama3" RoPE frequency scaling (config.json rope_scaling), by original context 8192.
_LLAMA31_ROPE = dict(rope_type="llama3", rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                                        ("low_freq_factor", 1.0),
                                                        ("original_max_position_embeddings", 8192.0)))
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, rope_scaling=(("factor", 32.0), ("high_freq_factor", 4.0),
                                                   ("low_freq_factor", 1.0),
                                                   ("original_max_position_embeddings", 8192.0)))


def _qwen2(hidden, layers, heads, kv, mlp, *, vocab=151936, tied=False, eps=1e-6):
  return dict(architecture="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
              num_heads=heads, num_kv_heads=kv, head_dim=hidden // heads, rope_theta=1e6, rms_norm_eps=eps,
              tie_embeddings=tied, attention_bias=True, max_position_embeddings=32768, bos_token_id=151643,
              eos_token_ids=(151645, 151643), pad_token_id=151643)


def _qwen3(hidden, layers, heads, mlp, *, tied=False):
  return dict(architecture="qwen3", vocab_size=151936, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
              num_heads=heads, num_kv_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=tied,
              qk_norm=True, max_position_embeddings=40960, bos_token_id=151643, eos_token_ids=(151645, 151643),
              pad_token_id=151643)


def _qwen3_moe(hidden, layers, heads, kv, mlp, moe_mlp, experts, per_token):
  return dict(_qwen3(hidden, layers, heads, mlp), architecture="qwen3_moe", num_kv_heads=kv, num_experts=experts,
              num_experts_per_tok=per_token, moe_intermediate_size=moe_mlp, router_aux_loss_coef=0.001)


def _llama(hidden, layers, heads, kv, mlp, *, head_dim=128, tied=False, rope=_LLAMA31_ROPE):
  return dict(architecture="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
              num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=500000.0, rms_norm_eps=1e-5,
              tie_embeddings=tied, max_position_embeddings=131072, bos_token_id=128000,
              eos_token_ids=(128001, 128008, 128009), **rope)


def _smollm2(hidden, layers, heads, kv, mlp, theta):
  return dict(architecture="llama", vocab_size=49152, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
              num_heads=heads, num_kv_heads=kv, head_dim=64, rope_theta=theta, rms_norm_eps=1e-5,
              tie_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,), pad_token_id=2)


PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-3b": _qwen2(2048, 36, 16, 2, 11008, tied=True),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944, vocab=152064),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824, vocab=152064, eps=1e-5),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648, vocab=152064, eps=1e-5),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 6144, 768, 128, 8),
    "llama-3.1-8b": _llama(4096, 32, 32, 8, 14336),
    "llama-3.1-70b": _llama(8192, 80, 64, 8, 28672),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, head_dim=64, tied=True, rope=_LLAMA32_ROPE),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, tied=True, rope=_LLAMA32_ROPE),
    "smollm2-135m": _smollm2(576, 30, 9, 3, 1536, 100000.0),
    "smollm2-360m": _smollm2(960, 32, 15, 5, 2560, 100000.0),
    "smollm2-1.7b": _smollm2(2048, 24, 32, 32, 8192, 130000.0),
}

# Parameter counts on the model cards (billions; Qwen's cards also give the count without the embedding, second).
PUBLISHED: dict[str, tuple[float, float | None]] = {
    "qwen2.5-0.5b": (0.49, 0.36), "qwen2.5-1.5b": (1.54, 1.31), "qwen2.5-3b": (3.09, 2.77),
    "qwen2.5-7b": (7.61, 6.53), "qwen2.5-14b": (14.7, 13.1), "qwen2.5-32b": (32.5, 31.0),
    "qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6), "qwen3-8b": (8.2, 6.95),
    "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2),
    "qwen3-30b-a3b": (30.5, 29.9),
    "llama-3.1-8b": (8.03, None), "llama-3.1-70b": (70.6, None), "llama-3.2-1b": (1.24, None),
    "llama-3.2-3b": (3.21, None),
    "smollm2-135m": (0.135, None), "smollm2-360m": (0.36, None), "smollm2-1.7b": (1.7, None),
}


def shape(name: str) -> dict:
  """The ModelConfig fields of preset `name`; an unknown name is a ValueError listing the known ones."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return dict(PRESETS[name])

