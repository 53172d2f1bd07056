"""Int8 weight-only quantization of the sampler's copy of the params (sampler.weight_dtype="int8").

Each large matmul weight becomes a `QuantizedWeight`: int8 values and one float32 scale per output channel
(symmetric: w ~ values * scale, |values| <= 127). The decoder's read sites call `einsum` / `matmul` / `take` here,
which dequantize at the read: `(x @ values.astype(dt)) * scale`, so a decode step reads int8 bytes from memory and
the per-channel scale multiplies the matmul's output, not the weight.

Quantized: q/k/v/o, gate/up/down and the head (lm_head, or the tied embedding, per vocab row, which is also the
embedding's lookup scale: one int8 copy serves both). Norm scales and biases stay float (a few KB).
The learner never sees these: it keeps float params, and the sampler's behaviour log-probs come from the quantized
model that sampled, so the learner's importance weights correct the quantization gap like any other lag.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

WEIGHT_DTYPES = ("float", "int8")  # the sampler's weights: as they are, or int8 (the run config's choices)

__all__ = ["CONTRACTED", "WEIGHT_DTYPES", "QuantizedWeight", "dequantize", "dequantize_params", "einsum",
           "is_quantized", "matmul", "quantize", "quantize_params", "quantized_shardings", "take"]

# Contracted (input) axes of each quantized weight, counted from the end (a leading stacked-layers axis is kept):
# the scale is per entry of the other axes, the einsum's output channels.
CONTRACTED = {"q_proj": (-3,), "k_proj": (-3,), "v_proj": (-3,), "o_proj": (-3, -2), "gate_proj": (-2,),
              "up_proj": (-2,), "down_proj": (-2,), "lm_head": (-2,), "embed": (-1,)}


@flax.struct.dataclass
class QuantizedWeight:
  """values: int8 of the weight's shape; scale: float32, the weight's shape without its contracted axes, in order
  (so it broadcasts over the output of the weight's einsum at each read site)."""

  values: jax.Array
  scale: jax.Array

  def __getitem__(self, index):
    """`param[...]` (how the decoder reads a Variable's value) is the weight itself."""
    if index is not Ellipsis:
      raise IndexError(f"a QuantizedWeight is read whole (param[...]), not at {index!r}")
    return self

  @property
  def T(self) -> QuantizedWeight:  # noqa: N802 - as jax.Array.T: the tied embedding's [V, E] as the head's [E, V]
    if self.values.ndim != 2:
      raise ValueError(f"QuantizedWeight.T is for the 2-D tied embedding (got {self.values.ndim} dims)")
    return QuantizedWeight(self.values.T, self.scale)


def quantize(w: jax.Array, contracted: tuple[int, ...]) -> QuantizedWeight:
  """Symmetric per-channel int8: scale = max |w| over the contracted axes / 127 (1 for an all-zero channel)."""
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=contracted, keepdims=True)
  scale = jnp.where(amax > 0, amax / 127.0, 1.0)
  values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
  return QuantizedWeight(values, jnp.squeeze(scale, contracted))


def dequantize(q: QuantizedWeight, contracted: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """The float weight the int8 one stands for (tests and float recomputations; decoding never builds it)."""
  scale = jnp.expand_dims(q.scale, tuple(a % q.values.ndim for a in contracted))
  return (q.values.astype(jnp.float32) * scale).astype(dtype)


def _name(path) -> str:
  return str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))


def _map_variables(fn, params, *more):
  """fn(name, value, *the same parameter's values in `more`) over every parameter of an nnx.State of Variables (each
  keeps its metadata) or of plain leaves in their place (shardings); name: the parameter's own key."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  value = lambda x: x.get_value() if is_var(x) else x
  return jax.tree_util.tree_map_with_path(
      lambda p, v, *m: (v.replace if is_var(v) else lambda x: x)(fn(_name(p), value(v), *map(value, m))),
      params, *more, is_leaf=is_var)


def is_quantized(params) -> bool:
  """Whether a params tree holds QuantizedWeights (already placed by an int8 publish)."""
  is_q = lambda x: isinstance(x, QuantizedWeight)
  return any(map(is_q, jax.tree.leaves(params, is_leaf=is_q)))


@functools.partial(jax.jit, static_argnums=1)
def quantize_params(params, dtype=None) -> nnx.State:
  """The sampler's params: the CONTRACTED weights as QuantizedWeight (already quantized ones kept), the others cast
  to dtype (None: kept). One compiled program, run where params are (the publisher's source side)."""

  def convert(name, value):
    if isinstance(value, QuantizedWeight):
      return value
    if name in CONTRACTED:
      return quantize(value, CONTRACTED[name])
    return value if dtype is None else value.astype(dtype)

  return _map_variables(convert, params)


def dequantize_params(params, dtype=jnp.float32) -> nnx.State:
  """Float params equal to the quantized ones' values (the reference a quantized model is checked against)."""
  return _map_variables(lambda name, v: dequantize(v, CONTRACTED[name], dtype) if isinstance(v, QuantizedWeight)
                        else v, params)


def quantized_shardings(float_shardings, params) -> nnx.State:
  """Shardings of quantize_params(params), from those of the float params (one per Variable, as
  sharding.param_shardings gives): each Variable of params holding its leaves' shardings; a quantized weight's
  values keep the float weight's sharding, its scale that sharding without the contracted axes."""

  def shard(name, value, sharding):
    if name not in CONTRACTED:
      return sharding
    spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
    cut = {a % value.ndim for a in CONTRACTED[name]}
    scale_spec = PartitionSpec(*(s for i, s in enumerate(spec) if i not in cut))
    return QuantizedWeight(sharding, NamedSharding(sharding.mesh, scale_spec))

  return _map_variables(shard, params, float_shardings)


def _scaled(out, w: QuantizedWeight):
  return out * w.scale.astype(out.dtype)


def einsum(spec: str, x, w, dtype=None, **kw):
  """jnp.einsum(spec, x, w) with w in dtype (None: x's); w a float array or a QuantizedWeight whose output channels
  end spec's output."""
  dtype = dtype or x.dtype
  if isinstance(w, QuantizedWeight):
    return _scaled(jnp.einsum(spec, x, w.values.astype(dtype), **kw), w)
  return jnp.einsum(spec, x, w.astype(dtype), **kw)


def matmul(x, w):
  """x @ w in x's dtype; w a float [in, out] array or a QuantizedWeight."""
  if isinstance(w, QuantizedWeight):
    return _scaled(x @ w.values.astype(x.dtype), w)
  return x @ w.astype(x.dtype)


def take(embed, tokens, dtype):
  """Rows `tokens` of a [V, E] embedding, float or quantized per row, in dtype."""
  if isinstance(embed, QuantizedWeight):
    return embed.values[tokens].astype(dtype) * embed.scale[tokens][..., None].astype(dtype)
  return embed.astype(dtype)[tokens]
