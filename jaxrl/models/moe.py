"""Mixture-of-experts routing and the dropless expert MLP (Qwen3-MoE), pure functions of flat [M, ...] tokens.

Routing: softmax of the router logits in float32, each token's top-k experts, their probabilities renormalised over
the k (norm_topk_prob). Routing replay gives recorded experts instead (the sampler's choice): the gates are then the
current router's probabilities of those experts, so the router still gets a gradient while the choice is held.

Dropless: the M * k (token, expert) pairs are sorted by expert and every expert's rows go through its weights in
one grouped matmul (jax.lax.ragged_dot); no capacity factor, no token dropped.

X is the number of experts, k the experts per token.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def route(logits_MxX: jax.Array, k: int, norm_topk_prob: bool, recorded_MxK: jax.Array | None = None):
  """(experts_MxK int32, gates_MxK float32, probs_MxX float32). A token whose recorded row is >= 0 keeps those
  experts (replay); a row of -1 (no record: a prompt token, padding) is routed afresh."""
  probs_MxX = jax.nn.softmax(logits_MxX.astype(jnp.float32), axis=-1)
  top_MxK, experts_MxK = jax.lax.top_k(probs_MxX, k)
  if recorded_MxK is not None:
    experts_MxK = jnp.where(recorded_MxK[:, :1] >= 0, recorded_MxK, experts_MxK)
    top_MxK = jnp.take_along_axis(probs_MxX, experts_MxK, axis=-1)
  if norm_topk_prob:
    top_MxK = top_MxK / jnp.sum(top_MxK, axis=-1, keepdims=True)
  return experts_MxK.astype(jnp.int32), top_MxK, probs_MxX


def experts_mlp(x_MxE, experts_MxK, gates_MxK, gate_XxExF, up_XxExF, down_XxFxE) -> jax.Array:
  """sum_k gate_k * expert_k(x) per token: SwiGLU experts over the token copies sorted by expert (ragged_dot).

  Expert parallel under a mesh with an "expert" axis (the mesh in scope: jaxrl.sharding.under_mesh): in shard_map,
  each device holds X / n experts (whole: their fsdp / tensor shards are gathered at the boundary, as FSDP gathers a
  dense weight). Token rows are split over the "data", "fsdp" and "expert" axes (the learner's batch rule); each
  device gathers the rows of its expert group (all-gather over the expert axis), runs its experts on them, and the
  partial outputs are summed and split back to their rows (reduce-scatter): no all-to-all."""
  mesh = jax.sharding.get_abstract_mesh()
  n = 1 if mesh.empty else dict(mesh.shape).get("expert", 1)
  if n == 1:
    return _local_experts(x_MxE, experts_MxK, gates_MxK, gate_XxExF, up_XxExF, down_XxFxE)
  if gate_XxExF.shape[0] % n:
    raise ValueError(f"{gate_XxExF.shape[0]} experts do not split over the mesh's expert axis of {n} devices")
  rows = tuple(a for a in ("data", "fsdp", "expert") if dict(mesh.shape).get(a, 1) > 1)
  while rows and x_MxE.shape[0] % math.prod(mesh.shape[a] for a in rows):
    rows = rows[:-1]  # as logical_to_spec: what does not divide stays whole (then every expert device has them all)
  tokens = P(rows or None, None)
  split = "expert" in rows

  def local(x, experts, gates, gate, up, down):
    first = jax.lax.axis_index("expert") * gate.shape[0]
    if not split:
      return jax.lax.psum(_local_experts(x, experts - first, gates, gate, up, down), "expert")
    group = [jax.lax.all_gather(a, "expert", tiled=True) for a in (x, experts, gates)]
    y = _local_experts(group[0], group[1] - first, group[2], gate, up, down)
    return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)

  return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, P("expert"), P("expert"), P("expert")),
                       out_specs=tokens, check_vma=False)(x_MxE, experts_MxK, gates_MxK, gate_XxExF, up_XxExF,
                                                          down_XxFxE)


def _local_experts(x_MxE, experts_MxK, gates_MxK, gate_XxExF, up_XxExF, down_XxFxE) -> jax.Array:
  """experts_mlp over the experts held here (ids 0..X-1 of these weights); other ids contribute nothing: their
  copies sort last, past every group of the ragged matmuls."""
  m, k = experts_MxK.shape
  x = gate_XxExF.shape[0]
  flat = experts_MxK.reshape(-1)
  mine = (flat >= 0) & (flat < x)
  order = jnp.argsort(jnp.where(mine, flat, x), stable=True)
  token = order // k
  sizes_X = jnp.bincount(jnp.where(mine, flat, x), length=x + 1)[:x].astype(jnp.int32)
  dt = x_MxE.dtype
  xs = x_MxE[token]
  h = jax.nn.silu(jax.lax.ragged_dot(xs, gate_XxExF.astype(dt), sizes_X)) * jax.lax.ragged_dot(
      xs, up_XxExF.astype(dt), sizes_X)
  y = jax.lax.ragged_dot(h, down_XxFxE.astype(dt), sizes_X) * gates_MxK.reshape(-1)[order][:, None].astype(dt)
  return jnp.zeros_like(x_MxE).at[token].add(jnp.where(mine[order][:, None], y, 0.0))


@flax.struct.dataclass
class Routing:
  """What the MoE layers of one forward chose, per layer n (dense layers: experts -1, statistics 0).

  The statistics are sums over the non-padding tokens, so that layers and micro-batches add up exactly."""

  experts_BxTxNxK: jax.Array  # int32: the experts each token went to
  counts_NxX: jax.Array  # float32: tokens routed to each expert (each token counted k times)
  probs_NxX: jax.Array  # float32: sum of the router probabilities of each expert
  zsq_N: jax.Array  # float32: sum of logsumexp(router logits)^2
  tokens_N: jax.Array  # float32: tokens routed (0 on a dense layer)
  logits_BxTxNxX: jax.Array | None = None  # float32 router logits, when asked for

  def aux_loss(self) -> jax.Array:
    """Switch / transformers' load-balancing loss: X * sum_x f_x P_x, with f_x the fraction of routed (token, slot)
    pairs per token and P_x the mean router probability, both over every sparse layer's tokens together."""
    total = jnp.maximum(jnp.sum(self.tokens_N), 1.0)
    f_X = jnp.sum(self.counts_NxX, axis=0) / total
    p_X = jnp.sum(self.probs_NxX, axis=0) / total
    return self.counts_NxX.shape[1] * jnp.sum(f_X * p_X)

  def z_loss(self) -> jax.Array:
    """ST-MoE's router z-loss: the mean over routed tokens (and layers) of logsumexp(router logits)^2."""
    return jnp.sum(self.zsq_N) / jnp.maximum(jnp.sum(self.tokens_N), 1.0)


def layer_statistics(logits_MxX, probs_MxX, experts_MxK, mask_M):
  """(counts_X, probs_X, zsq, tokens) of one layer over the tokens where mask_M (float) is 1."""
  x = probs_MxX.shape[1]
  counts_X = jnp.sum(jax.nn.one_hot(experts_MxK, x, dtype=jnp.float32).sum(1) * mask_M[:, None], axis=0)
  probs_X = jnp.sum(probs_MxX * mask_M[:, None], axis=0)
  zsq = jnp.sum(jax.nn.logsumexp(logits_MxX.astype(jnp.float32), axis=-1) ** 2 * mask_M)
  return counts_X, probs_X, zsq, jnp.sum(mask_M)
