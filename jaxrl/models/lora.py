"""LoRA on the stacked decoder: low-rank adapters as their own nnx Variable type, merged into a weight where it is read.

A targeted projection W [in..., out...] gains A [in..., r] (random) and B [r, out...] (zero: step 0 is the base
model); the decoder reads W + (alpha / r) * A @ B at each read site (`weight`). Both live on the Block, so the
vmapped blocks stack them with a leading layer axis, as they stack W. Merging at the read (rather than computing
x @ W + s * (x @ A) @ B) keeps one weight-shaped operand per projection, so the learner's and the sampler's code
paths stay the same programs as without LoRA and the sampler's behaviour log-probs are those the learner scores.

`split` cuts a LoRA model's params into the trainable adapters and the frozen base (the learner trains, the
optimizer holds and a publish moves the adapters only); `merge` puts them back together; `merged` folds the adapters
into the base weights (an export, loadable as a plain model).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

# The projections LoRA can target, as "<module>.<name>", with the number of leading input axes of each weight.
PROJECTIONS = {"attn.q_proj": 1, "attn.k_proj": 1, "attn.v_proj": 1, "attn.o_proj": 2,
               "mlp.gate_proj": 1, "mlp.up_proj": 1, "mlp.down_proj": 1}
_A, _B = "_lora_a", "_lora_b"


class LoRAParam(nnx.Param):
  """A LoRA factor (A or B of one projection): the only parameters a LoRA run trains."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """targets: a regular expression matched in full against the names in PROJECTIONS ("attn.q_proj", ...)."""

  rank: int
  alpha: float
  targets: str = r".*"

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"LoRA rank must be >= 1 (got {self.rank})")
    if not self.alpha > 0:
      raise ValueError(f"LoRA alpha must be > 0 (got {self.alpha})")
    if not self.targeted:
      raise ValueError(f"LoRA targets {self.targets!r} match no projection of {tuple(PROJECTIONS)}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def targeted(self) -> tuple[str, ...]:
    try:
      pattern = re.compile(self.targets)
    except re.error as e:
      raise ValueError(f"LoRA targets {self.targets!r} is not a regular expression: {e}") from None
    return tuple(name for name in PROJECTIONS if pattern.fullmatch(name))


def attach(module: nnx.Module, group: str, cfg: LoRAConfig | None, rngs: nnx.Rngs) -> None:
  """Gives each of module's projections that cfg targets (named f"{group}.{attr}") its A and B factors."""
  if cfg is None:
    return
  module.lora_scale = cfg.scale
  for name in cfg.targeted:
    head, _, attr = name.partition(".")
    if head != group:
      continue
    w, n_in = getattr(module, attr), PROJECTIONS[name]
    shape, axes = w.get_value().shape, w.get_metadata()["axes"]
    fan_in = math.prod(shape[:n_in])
    a = jax.random.normal(rngs.params(), (*shape[:n_in], cfg.rank), w.get_value().dtype) / math.sqrt(fan_in)
    setattr(module, attr + _A, LoRAParam(a, axes=(*axes[:n_in], None)))
    setattr(module, attr + _B, LoRAParam(jnp.zeros((cfg.rank, *shape[n_in:]), a.dtype), axes=(None, *axes[n_in:])))


def weight(module: nnx.Module, attr: str, dtype) -> jax.Array:
  """module.<attr> with its adapters merged in if it has them: W + scale * A @ B in `dtype`, each factor cast to
  `dtype` first. The sampler holds the base and receives the adapters already cast to its dtype: merging in that
  dtype on both sides keeps its weights those the learner reads (master weights in float32, compute in bf16).
  Without adapters the weight is returned as stored (a float array or an int8 jaxrl.models.quant.QuantizedWeight):
  the read (quant.einsum / quant.matmul) casts or dequantizes it."""
  w = getattr(module, attr)[...]
  a = getattr(module, attr + _A, None)
  if a is None:
    return w
  w = w.astype(dtype)
  return merge_weight(w, a[...].astype(dtype), getattr(module, attr + _B)[...].astype(dtype), module.lora_scale)


def merge_weight(w, a, b, scale: float) -> jax.Array:
  """W + scale * A @ B, contracting A's last axis (the rank) with B's first, in W's dtype."""
  return w + (scale * jnp.tensordot(a, b, axes=1)).astype(w.dtype)


def init_adapters(make_model) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, adapters) of the LoRA model make_model() builds, initialising the adapters alone (one compiled
  program; the base weights it would draw are dead code there)."""
  graphdef = nnx.split(nnx.eval_shape(make_model))[0]
  return graphdef, jax.jit(lambda: split(nnx.split(make_model())[1])[0])()


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, base) of a LoRA model's params."""
  return nnx.split_state(params, LoRAParam, ...)


def merge(base: nnx.State, adapters: nnx.State) -> nnx.State:
  """The whole params of a LoRA model from its base and its adapters (no copy)."""
  return nnx.merge_state(base, adapters)


def merged(params: nnx.State, cfg: LoRAConfig) -> nnx.State:
  """A LoRA model's params as a plain model's: every adapted weight W replaced by W + scale * A @ B (the merge the
  decoder makes at its reads, stacked over the layers), the adapters dropped."""
  adapters, base = split(params)
  flat, factors = dict(nnx.to_flat_state(base)), dict(nnx.to_flat_state(adapters))
  for path, a in factors.items():
    if not path[-1].endswith(_A):
      continue
    attr = path[-1][: -len(_A)]
    w_path, b = (*path[:-1], attr), factors[(*path[:-1], attr + _B)]
    # Every projection is in the stacked blocks: W [N, ...], A [N, in..., r], B [N, r, out...], merged per layer.
    new = jax.vmap(lambda w, a, b: merge_weight(w, a, b, cfg.scale))(flat[w_path].get_value(), a.get_value(),
                                                                     b.get_value())
    flat[w_path] = flat[w_path].replace(new)
  return nnx.from_flat_state(flat)


ADAPTERS_FILE = "lora_adapters.safetensors"


def save_adapters(path: str | os.PathLike, adapters: nnx.State, cfg: LoRAConfig, base: str) -> None:
  """The adapters alone as safetensors (one tensor per factor, named by its path in the params, the layer axis
  first) with the LoRA settings and the base model's name in the file's metadata."""
  tensors = {".".join(str(k) for k in key): np.asarray(jax.device_get(v.get_value()))
             for key, v in nnx.to_flat_state(adapters)}
  meta = {"lora": json.dumps(dataclasses.asdict(cfg)), "base": base}
  save_file(tensors, str(path), metadata=meta)


def load_adapters(path: str | os.PathLike, abstract: nnx.State) -> nnx.State:
  """Adapters saved by save_adapters, into the structure of `abstract` (a LoRA model's adapters)."""
  tensors = load_file(str(path))
  flat = {key: v.replace(jnp.asarray(tensors[".".join(str(k) for k in key)]))
          for key, v in nnx.to_flat_state(abstract)}
  return nnx.from_flat_state(flat)
