"""ModelConfig: the decoder's hyper-parameters, read from a transformers PretrainedConfig."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.kernels import train_attention
from jaxrl.models.lora import LoRAConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPES = tuple(_DTYPES)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Llama / Qwen2 / Qwen3 / Qwen3-MoE family decoder. Sizes follow transformers' names, shortened."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  # ("default" | "linear" | "llama3", {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings})
  rope_type: str = "default"
  rope_scaling: tuple[tuple[str, float], ...] = ()
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  attention_bias: bool = False  # Qwen2: bias on q, k, v projections
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
  max_position_embeddings: int = 2048
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"
  remat: bool = False  # rematerialise each block in the backward pass (learner memory)
  # What a rematerialised block keeps from its forward pass: a jax.checkpoint_policies name
  # (nothing_saveable: recompute everything; dots_with_no_batch_dims_saveable: keep the weight matmuls).
  remat_policy: str = "nothing_saveable"
  # Layers per iteration of the layer scan (>= num_layers: unrolled, each layer's weights a static slice of the
  # stacked params; compile time grows with it). Unrolling trades compile time for fewer loop overheads
  # (bench.headline_parts measures it; docs/BENCHMARKS_HISTORY.md, "The headline: colocated sync vs pipeline");
  # 1: a loop.
  scan_unroll: int = 1
  # The learner's full-sequence attention (jaxrl/kernels/train_attention.py): "auto" is cuDNN flash on GPU in
  # bf16/fp16, splash (Pallas) on TPU, the chunked XLA path on CPU for rows longer than attention_block.
  train_attention: str = "auto"
  attention_block: int = 512  # query and key block of the chunked path
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  architecture: str = "llama"
  lora: LoRAConfig | None = None  # low-rank adapters on the targeted projections (jaxrl/models/lora.py)
  # Mixture of experts (Qwen3-MoE; jaxrl/models/moe.py). num_experts 0: every layer dense. Otherwise layer i is
  # sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; a sparse layer's MLP is
  # num_experts experts of moe_intermediate_size, each token going to its num_experts_per_tok most probable ones
  # (dropless), weighted by their router probabilities (renormalised over the chosen ones if norm_topk_prob).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  norm_topk_prob: bool = True
  # The learner's load-balance terms (Switch-style auxiliary loss, ST-MoE router z-loss), added to the RL loss
  # with these weights; transformers' router_aux_loss_coef is the first.
  router_aux_loss_coef: float = 0.0
  router_z_loss_coef: float = 0.0

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive (got {getattr(self, name)})")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE (got {self.head_dim})")
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"unsupported rope_type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if self.train_attention not in ("auto", *train_attention.IMPLEMENTATIONS):
      raise ValueError(f"ModelConfig.train_attention={self.train_attention!r}; allowed: "
                       f"{('auto', *train_attention.IMPLEMENTATIONS)}")
    if not callable(getattr(jax.checkpoint_policies, self.remat_policy, None)):
      raise ValueError(f"ModelConfig.remat_policy={self.remat_policy!r} is not a jax.checkpoint_policies policy")
    if self.scan_unroll < 1:
      raise ValueError(f"ModelConfig.scan_unroll must be >= 1 (got {self.scan_unroll})")
    if self.attention_block < 1:
      raise ValueError(f"ModelConfig.attention_block must be positive (got {self.attention_block})")
    if self.num_experts:
      if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
        raise ValueError(f"ModelConfig: {self.num_experts} experts need 0 < num_experts_per_tok <= num_experts and "
                         f"moe_intermediate_size > 0 (got {self.num_experts_per_tok}, {self.moe_intermediate_size})")
      if self.decoder_sparse_step < 1 or any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
        raise ValueError(f"ModelConfig: decoder_sparse_step={self.decoder_sparse_step} must be >= 1 and "
                         f"mlp_only_layers={self.mlp_only_layers} layer indices below {self.num_layers}")
    if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
      raise ValueError(f"ModelConfig: router_aux_loss_coef and router_z_loss_coef must be >= 0 (got "
                       f"{self.router_aux_loss_coef}, {self.router_z_loss_coef})")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {tuple(_DTYPES)} (got {getattr(self, name)!r})")

  @property
  def sparse_layers(self) -> tuple[bool, ...]:
    """Per layer: whether its MLP is the mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
    return tuple(bool(self.num_experts) and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                 for i in range(self.num_layers))

  @property
  def is_moe(self) -> bool:
    return any(self.sparse_layers)

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def rope_scaling_dict(self) -> dict[str, float]:
    return dict(self.rope_scaling)

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A few-thousand-parameter decoder for tests and the `tiny` config."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, max_position_embeddings=256)
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def tiny_moe(cls, **overrides) -> ModelConfig:
    """tiny() with a mixture of 8 experts, 2 per token, in every layer (Qwen3-MoE)."""
    kw = dict(architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
              router_aux_loss_coef=0.001)
    kw.update(overrides)
    return cls.tiny(**kw)

  @classmethod
  def from_hf(cls, hf: Any, **overrides) -> ModelConfig:
    """Reads a transformers PretrainedConfig (v5 `rope_parameters` or legacy `rope_theta`/`rope_scaling`)."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
      raise ValueError(f"unsupported architecture model_type={model_type!r}; supported: {SUPPORTED_ARCHITECTURES}")
    if getattr(hf, "use_sliding_window", False):
      raise ValueError(f"{model_type}: sliding-window attention is not supported (use_sliding_window=True)")
    if getattr(hf, "mlp_bias", False):
      raise ValueError(f"{model_type}: mlp_bias=True is not supported")
    if getattr(hf, "hidden_act", "silu") != "silu":
      raise ValueError(f"{model_type}: hidden_act={hf.hidden_act!r} is not supported (only silu)")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if not rope:  # legacy configs
      rope = dict(getattr(hf, "rope_scaling", None) or {})
      rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(rope.pop("rope_theta", getattr(hf, "rope_theta", 10000.0) or 10000.0))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      raise ValueError(f"{model_type}: partial_rotary_factor != 1 is not supported")
    rope.pop("partial_rotary_factor", None)
    scaling = tuple(sorted((k, float(v)) for k, v in rope.items() if isinstance(v, (int, float))))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = hf.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    kw = dict(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_type=rope_type,
        rope_scaling=scaling,
        rms_norm_eps=hf.rms_norm_eps,
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=hf.max_position_embeddings,
        bos_token_id=hf.bos_token_id,
        eos_token_ids=eos,
        pad_token_id=getattr(hf, "pad_token_id", None),
        architecture=model_type,
    )
    if model_type == "qwen3_moe":
      kw.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                moe_intermediate_size=hf.moe_intermediate_size, decoder_sparse_step=hf.decoder_sparse_step,
                mlp_only_layers=tuple(hf.mlp_only_layers or ()), norm_topk_prob=bool(hf.norm_topk_prob),
                router_aux_loss_coef=float(hf.router_aux_loss_coef))
    kw.update(overrides)
    return cls(**kw)
