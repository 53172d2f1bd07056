"""Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder in Flax NNX, with a full-sequence path and a KV-cache path.

Every parameter carries logical axis names in its `axes` metadata (see jaxrl/sharding.py for the rules that map
them to mesh axes). Blocks are stacked along a leading `layers` axis and run with `jax.lax.scan`, so compile
time does not grow with depth. A Qwen3-MoE layer's MLP is a mixture of experts (jaxrl/models/moe.py); in a stack
that mixes dense and sparse layers every layer holds both and runs the one its index says (lax.cond).
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.axes import constrain_rows
from jaxrl.kernels import cached_attention, paged_attention
from jaxrl.kernels.paged_attention import LAYOUTS as PAGED_LAYOUTS
from jaxrl.kernels.train_attention import attention
from jaxrl.models import lora, moe, quant
from jaxrl.models.config import ModelConfig
from jaxrl.models.moe import Routing


@flax.struct.dataclass
class KVCache:
  """Preallocated keys and values of every layer; entry t of a row holds the token at position t."""

  k_NxSxTxKxD: jax.Array
  v_NxSxTxKxD: jax.Array

  @property
  def max_len(self) -> int:
    return self.k_NxSxTxKxD.shape[2]


@flax.struct.dataclass
class PagedKVCache:
  """Keys and values of every layer in a pool of pages: row s's position t is entry t % Z of page
  table_SxM[s, t // Z] (Z positions per page). Rows write only positions < write_end_S; other writes (idle
  slots, padding of a rebuild chunk) are dropped, so a row never touches a page it was not given for writing.

  layout of k_pages / v_pages: "NPZKD" ([N, P, Z, K, D], the XLA path's) or "KNPZD" ([K, N, P, Z, D], the Pallas
  decode kernels': their [K, pages, Z, D] pool with every layer's pages side by side, so a layer is a page offset,
  never a copy). attention: the decode attention (kernels.paged_attention's impl; queries of a prefill chunk always
  take the XLA path over the same layout), interpret: Pallas interpret mode (tests on CPU)."""

  k_pages: jax.Array
  v_pages: jax.Array
  table_SxM: jax.Array  # int32; unused entries = the pool size P
  write_end_S: jax.Array  # int32
  layout: str = flax.struct.field(pytree_node=False, default="NPZKD")
  attention: str = flax.struct.field(pytree_node=False, default="xla")
  interpret: bool = flax.struct.field(pytree_node=False, default=False)

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[2 if self.layout == "KNPZD" else 1]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[3 if self.layout == "KNPZD" else 2]

  def write(self, layer, page_SxC, offset_SxC, k_SxCxKxD, v_SxCxKxD) -> PagedKVCache:
    """This layer's keys/values of each row's queries at (page, offset); page ids >= P are dropped."""
    if self.layout == "KNPZD" and page_SxC.shape[1] == 1:
      return self._write_steps(layer, page_SxC[:, 0], offset_SxC[:, 0], k_SxCxKxD[:, 0], v_SxCxKxD[:, 0])
    return self._set((layer, page_SxC, offset_SxC), 2, k_SxCxKxD, v_SxCxKxD)

  def write_pages(self, dest_W, k_NxWxZxKxD, v_NxWxZxKxD) -> PagedKVCache:
    """Whole pages of every layer into the pages dest_W lists (ids >= P are dropped)."""
    return self._set((slice(None), dest_W), 3, k_NxWxZxKxD, v_NxWxZxKxD)

  def _set(self, at, heads_axis, k, v) -> PagedKVCache:
    """k, v (laid out as in NPZKD, their K at heads_axis) into the pool at index `at` of the NPZKD layout."""
    if self.layout == "KNPZD":
      at, put = (slice(None), *at), lambda x: jnp.moveaxis(x, heads_axis, 0)
    else:
      put = lambda x: x
    return self.replace(k_pages=self.k_pages.at[at].set(put(k).astype(self.k_pages.dtype), mode="drop"),
                        v_pages=self.v_pages.at[at].set(put(v).astype(self.v_pages.dtype), mode="drop"))

  def _write_steps(self, layer, page_S, offset_S, k_SxKxD, v_SxKxD) -> PagedKVCache:
    """KNPZD, one position per row (a decode step; rows write distinct pages): each row's page of this layer read
    whole, its position replaced, and written back whole, as [Z, D] blocks: the layout that reading pages wants.
    Written as [K, D] entries instead, XLA:TPU laid the scatter out with K and D innermost and copied the whole pool
    to Z and D innermost after every layer of every decode step (docs/TPU.md)."""
    kh, _, p, _, _ = self.k_pages.shape
    heads_Kx1, rows_S = jnp.arange(kh)[:, None], jnp.arange(page_S.shape[0])

    def put(pool, x_SxKxD):
      blocks_KxSxZxD = pool[heads_Kx1, layer, jnp.minimum(page_S, p - 1)[None]]
      blocks_KxSxZxD = blocks_KxSxZxD.at[:, rows_S, offset_S].set(jnp.moveaxis(x_SxKxD, 1, 0).astype(pool.dtype))
      return pool.at[heads_Kx1, layer, page_S[None]].set(blocks_KxSxZxD, mode="drop")

    return self.replace(k_pages=put(self.k_pages, k_SxKxD), v_pages=put(self.v_pages, v_SxKxD))


def init_paged_cache(cfg: ModelConfig, batch: int, num_pages: int, page_size: int, pages_per_row: int,
                     dtype=None, *, layout: str = "NPZKD", attention: str = "xla",
                     interpret: bool = False) -> PagedKVCache:
  if layout not in PAGED_LAYOUTS:
    raise ValueError(f"paged KV cache: layout must be one of {PAGED_LAYOUTS} (got {layout!r})")
  n, k, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  shape = (n, num_pages, page_size, k, d) if layout == "NPZKD" else (k, n, num_pages, page_size, d)
  dtype = dtype or cfg.compute_dtype
  return PagedKVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                      jnp.full((batch, pages_per_row), num_pages, jnp.int32), jnp.zeros((batch,), jnp.int32),
                      layout=layout, attention=attention, interpret=interpret)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dtype = dtype or cfg.compute_dtype
  return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _param(rngs: nnx.Rngs, shape, axes, cfg: ModelConfig, fan_in: int | None = None, value: float | None = None):
  if value is not None:
    init = jnp.full(shape, value, cfg.weight_dtype)
  else:
    std = 1.0 / math.sqrt(fan_in) if fan_in else 0.02
    init = std * jax.random.normal(rngs.params(), shape, cfg.weight_dtype)
  return nnx.Param(init, axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, axis_name: str | None, cfg: ModelConfig, rngs: nnx.Rngs):
    self.eps = cfg.rms_norm_eps
    self.scale = _param(rngs, (dim,), (axis_name,), cfg, value=1.0)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * y.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies of rotary embeddings, with linear or Llama-3 scaling."""
  d = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  s = cfg.rope_scaling_dict
  if cfg.rope_type == "linear":
    inv_freq = inv_freq / s["factor"]
  elif cfg.rope_type == "llama3":
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    inv_freq = jnp.where(medium, smoothed, scaled)
  return inv_freq


def apply_rope(x_BxTxHxD, positions_BxT, inv_freq):
  """Rotates halves (HF layout): x * cos + rotate_half(x) * sin."""
  angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # BxTx(D/2)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxHxD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxHxD.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.q_proj = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), cfg, fan_in=e)
    self.k_proj = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), cfg, fan_in=e)
    self.v_proj = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), cfg, fan_in=e)
    self.o_proj = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), cfg, fan_in=h * d)
    if cfg.attention_bias:
      self.q_bias = _param(rngs, (h, d), ("heads", "head_dim"), cfg, value=0.0)
      self.k_bias = _param(rngs, (k, d), ("kv_heads", "head_dim"), cfg, value=0.0)
      self.v_bias = _param(rngs, (k, d), ("kv_heads", "head_dim"), cfg, value=0.0)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(d, "head_dim", cfg, rngs)
      self.k_norm = RMSNorm(d, "head_dim", cfg, rngs)
    lora.attach(self, "attn", cfg.lora, rngs)

  def __call__(self, x_BxTxE, positions_BxT, inv_freq, *, segment_ids_BxT=None, cache_kv=None):
    cfg, dt = self.cfg, x_BxTxE.dtype
    q = quant.einsum("bte,ehd->bthd", x_BxTxE, lora.weight(self, "q_proj", dt))
    k = quant.einsum("bte,ekd->btkd", x_BxTxE, lora.weight(self, "k_proj", dt))
    v = quant.einsum("bte,ekd->btkd", x_BxTxE, lora.weight(self, "v_proj", dt))
    if cfg.attention_bias:
      q, k, v = q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt), v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxT, inv_freq)
    k = apply_rope(k, positions_BxT, inv_freq)

    if cache_kv is not None:
      b, t, h, d = q.shape
      q = q.reshape(b, t, cfg.num_kv_heads, h // cfg.num_kv_heads, d)
      return self._cached(q, k, v, positions_BxT, cache_kv)
    # Full sequence: causal by index within equal, non-zero segment ids (the learner's kernel per backend).
    impl = None if cfg.train_attention == "auto" else cfg.train_attention
    out = attention(q, k, v, segment_ids_BxT, impl, cfg.attention_block)
    return quant.einsum("bthd,hde->bte", out, lora.weight(self, "o_proj", dt), dt), None

  def _cached(self, q_SxCxKxGxD, k_SxCxKxD, v_SxCxKxD, positions_SxC, cache_kv):
    """Writes the new keys/values into this layer of the whole cache (in place) and attends over its live part.
    cache_kv: (k, v, layer) of a dense cache, or (PagedKVCache, layer)."""
    s, c, kh, g, d = q_SxCxKxGxD.shape
    if not isinstance(cache_kv[0], PagedKVCache):
      k_cache, v_cache, layer = cache_kv
      at = (layer, jnp.arange(s)[:, None], positions_SxC)  # positions past the cache (rebuild's last chunk) drop
      k_cache = k_cache.at[at].set(k_SxCxKxD.astype(k_cache.dtype), mode="drop")
      v_cache = v_cache.at[at].set(v_SxCxKxD.astype(v_cache.dtype), mode="drop")
      out, new_cache = cached_attention(q_SxCxKxGxD, k_cache, v_cache, layer, positions_SxC), (k_cache, v_cache)
    else:
      pool, layer = cache_kv
      table_SxM, z = pool.table_SxM, pool.page_size
      index_SxC = positions_SxC // z
      page_SxC = jnp.take_along_axis(table_SxM, jnp.minimum(index_SxC, table_SxM.shape[1] - 1), axis=1)
      writes = (positions_SxC < pool.write_end_S[:, None]) & (index_SxC < table_SxM.shape[1])
      new_cache = pool.write(layer, jnp.where(writes, page_SxC, pool.num_pages), positions_SxC % z, k_SxCxKxD,
                             v_SxCxKxD)
      out = paged_attention(q_SxCxKxGxD, new_cache.k_pages, new_cache.v_pages, layer, table_SxM, positions_SxC,
                            layout=pool.layout, impl=pool.attention, interpret=pool.interpret)
    out = out.reshape(s, c, kh * g, d)
    dt = q_SxCxKxGxD.dtype
    return quant.einsum("bthd,hde->bte", out, lora.weight(self, "o_proj", dt), dt), new_cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    e, m = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = _param(rngs, (e, m), ("embed", "mlp"), cfg, fan_in=e)
    self.up_proj = _param(rngs, (e, m), ("embed", "mlp"), cfg, fan_in=e)
    self.down_proj = _param(rngs, (m, e), ("mlp", "embed"), cfg, fan_in=m)
    lora.attach(self, "mlp", cfg.lora, rngs)

  def __call__(self, x):
    dt = x.dtype
    gate = jax.nn.silu(quant.matmul(x, lora.weight(self, "gate_proj", dt)))
    return quant.matmul(gate * quant.matmul(x, lora.weight(self, "up_proj", dt)), lora.weight(self, "down_proj", dt))


class MoE(nnx.Module):
  """Top-k routed SwiGLU experts, dropless (moe.experts_mlp). Names apart from MLP's: int8 quantization and LoRA
  leave the experts alone."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    x, e, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    self.cfg = cfg
    self.router = _param(rngs, (e, x), ("embed", None), cfg, fan_in=e)
    self.expert_gate = _param(rngs, (x, e, f), ("expert", "embed", "mlp"), cfg, fan_in=e)
    self.expert_up = _param(rngs, (x, e, f), ("expert", "embed", "mlp"), cfg, fan_in=e)
    self.expert_down = _param(rngs, (x, f, e), ("expert", "mlp", "embed"), cfg, fan_in=f)

  def __call__(self, x_BxTxE, mask_BxT, recorded_BxTxK=None, with_logits: bool = False):
    """(output, per-layer routing tuple: experts_BxTxK, counts_X, probs_X, zsq, tokens[, logits_BxTxX])."""
    b, t, e = x_BxTxE.shape
    x_MxE = x_BxTxE.reshape(b * t, e)
    logits_MxX = jnp.matmul(x_MxE, self.router[...].astype(x_MxE.dtype), preferred_element_type=jnp.float32)
    k = self.cfg.num_experts_per_tok
    recorded = None if recorded_BxTxK is None else recorded_BxTxK.reshape(b * t, k)
    experts_MxK, gates_MxK, probs_MxX = moe.route(logits_MxX, k, self.cfg.norm_topk_prob, recorded)
    y = moe.experts_mlp(x_MxE, experts_MxK, gates_MxK, self.expert_gate[...], self.expert_up[...],
                        self.expert_down[...])
    stats = moe.layer_statistics(logits_MxX, probs_MxX, experts_MxK, mask_BxT.reshape(-1).astype(jnp.float32))
    out = (experts_MxK.reshape(b, t, k), *stats)
    if with_logits:
      out += (logits_MxX.reshape(b, t, -1),)
    return y.reshape(b, t, e), out


def _dense_routing(cfg: ModelConfig, b: int, t: int, with_logits: bool):
  """A dense layer's entry in a mixed stack's routing: no experts (-1), no statistics."""
  x, k = cfg.num_experts, cfg.num_experts_per_tok
  zero = jnp.zeros((), jnp.float32)
  out = (jnp.full((b, t, k), -1, jnp.int32), jnp.zeros((x,), jnp.float32), jnp.zeros((x,), jnp.float32), zero, zero)
  return out + ((jnp.zeros((b, t, x), jnp.float32),) if with_logits else ())


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(cfg.hidden_size, "embed", cfg, rngs)
    self.attn = Attention(cfg, rngs)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, "embed", cfg, rngs)
    if not all(cfg.sparse_layers):
      self.mlp = MLP(cfg, rngs)
    if cfg.is_moe:
      self.moe = MoE(cfg, rngs)

  def __call__(self, x, positions, inv_freq, *, segment_ids=None, cache_kv=None, sparse=None, recorded=None,
               with_logits: bool = False):
    """(x, cache_kv, routing): routing None in a dense model, else this layer's MoE.__call__ tuple (sparse: a
    traced bool, this layer's kind in a mixed stack)."""
    h, cache_kv = self.attn(self.input_norm(x), positions, inv_freq, segment_ids_BxT=segment_ids, cache_kv=cache_kv)
    x = x + h
    h = self.post_attn_norm(x)
    if not hasattr(self, "moe"):
      return x + self.mlp(h), cache_kv, None
    mask = jnp.ones(h.shape[:2], bool) if segment_ids is None else segment_ids > 0
    sparse_fn = lambda h: self.moe(h, mask, recorded, with_logits)
    if not hasattr(self, "mlp"):
      y, routing = sparse_fn(h)
    else:
      dense_fn = lambda h: (self.mlp(h), _dense_routing(self.moe.cfg, *h.shape[:2], with_logits))
      y, routing = jax.lax.cond(sparse, sparse_fn, dense_fn, h)
    return x + y, cache_kv, routing


class Decoder(nnx.Module):
  """Token ids -> next-token logits (float32)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg, fan_in=None)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(cfg, rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.hidden_size, "embed", cfg, rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg, fan_in=cfg.hidden_size)

  def head(self) -> jax.Array:
    """The [E, V] output projection (the tied embedding, transposed, or lm_head); a quant.QuantizedWeight in an
    int8 sampler's model."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def __call__(self, tokens_BxT, positions_BxT, segment_ids_BxT=None, *,
               cache: KVCache | PagedKVCache | None = None, hidden: bool = False,
               experts_BxTxNxK: jax.Array | None = None, routing: bool = False, router_logits: bool = False):
    """Full-sequence logits (cache None; segment_ids required) or a cached step returning (logits, cache).

    hidden: return the final-normed hidden states [B, T, E] instead of logits (full path; the learner applies
    head() in chunks, never holding [B, T, V] logits).
    MoE: experts_BxTxNxK replays recorded routing (rows of -1 route afresh); routing=True returns (the output
    above, moe.Routing), router_logits=True puts the router logits in it.
    """
    cfg = self.cfg
    if cache is None and segment_ids_BxT is None:
      raise ValueError("the full-sequence path needs segment_ids_BxT (0 marks padding)")
    if (routing or experts_BxTxNxK is not None) and not cfg.is_moe:
      raise ValueError("routing / experts_BxTxNxK need a mixture-of-experts model (ModelConfig.num_experts > 0)")
    x = quant.take(self.embed[...], tokens_BxT, cfg.compute_dtype)
    inv_freq = rope_inv_freq(cfg)
    graphdef, stacked = nnx.split(self.blocks)
    unroll = min(cfg.scan_unroll, cfg.num_layers)
    # Per layer, scanned beside its weights: its kind (sparse or dense) and its recorded experts.
    per_layer = (jnp.asarray(cfg.sparse_layers),
                 None if experts_BxTxNxK is None else jnp.moveaxis(experts_BxTxNxK, 2, 0))

    def run(state, x, layer_in, **kw):
      x, kv, layer_routing = nnx.merge(graphdef, state)(x, positions_BxT, inv_freq, sparse=layer_in[0],
                                                        recorded=layer_in[1], with_logits=router_logits, **kw)
      return x, kv, layer_routing

    if cache is None:
      def body(x, xs):
        state, layer_in = xs
        x, _, layer_routing = run(state, constrain_rows(x), layer_in, segment_ids=segment_ids_BxT)
        return x, layer_routing

      if cfg.remat:
        body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, cfg.remat_policy))
      x, per_layer_routing = jax.lax.scan(body, x, (stacked, per_layer), unroll=unroll)
      x = constrain_rows(x)
    else:
      # The whole cache is carried through the layer loop (not passed as xs -> ys), so each layer's update is
      # in place and no second cache-sized buffer exists.
      if isinstance(cache, PagedKVCache):
        carried, done = cache, lambda pool: pool
      else:
        carried, done = (cache.k_NxSxTxKxD, cache.v_NxSxTxKxD), lambda kv: KVCache(*kv)

      def cached_body(carry, layer_state):
        x, kv = carry
        layer, state, layer_in = layer_state
        at = (kv, layer) if isinstance(kv, PagedKVCache) else (*kv, layer)
        x, kv, layer_routing = run(state, x, layer_in, cache_kv=at)
        return (x, kv), layer_routing

      (x, carried), per_layer_routing = jax.lax.scan(
          cached_body, (x, carried), (jnp.arange(cfg.num_layers), stacked, per_layer), unroll=unroll)
      cache = done(carried)
    x = self.final_norm(x)
    if hidden and cache is None:
      out = x
    else:
      logits = quant.einsum("bte,ev->btv", x, self.head(), preferred_element_type=jnp.float32)
      out = logits if cache is None else (logits, cache)
    return (out, _routing(per_layer_routing)) if routing else out


def _routing(per_layer) -> Routing:
  """The scan's per-layer routing tuples ([N, ...] each) as one Routing ([B, T, N, ...] per token)."""
  experts, counts, probs, zsq, tokens, *logits = per_layer
  return Routing(jnp.moveaxis(experts, 0, 2), counts, probs, zsq, tokens,
                 jnp.moveaxis(logits[0], 0, 2) if logits else None)


def forward(graphdef, params, tokens_BxL, positions_BxL, segment_ids_BxL):
  """Pure full-sequence forward over (graphdef, params) from `nnx.split(model)`."""
  return nnx.merge(graphdef, params)(tokens_BxL, positions_BxL, segment_ids_BxL)


def forward_cached(graphdef, params, tokens_BxT, positions_BxT, cache: KVCache | PagedKVCache, routing: bool = False):
  """Pure cached step: writes the tokens' keys/values at their positions and returns (logits, cache); routing
  (MoE): ((logits, cache), moe.Routing)."""
  return nnx.merge(graphdef, params)(tokens_BxT, positions_BxT, cache=cache, routing=routing)


def init_params(cfg: ModelConfig, seed: int = 0):
  """(graphdef, params) of a freshly initialised Decoder, built in one compiled program.

  The same values as `nnx.split(Decoder(cfg, nnx.Rngs(seed)))`, without running every initializer eagerly (one
  dispatch and compilation per op): a small gain on CPU (docs/BENCHMARKS.md, "Figures moved here from
  docstrings")."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(seed))))
  params = jax.jit(lambda: nnx.split(Decoder(cfg, nnx.Rngs(seed)))[1])()
  return graphdef, params
