"""The decode step as it was before issue 14 (commit 020e8fe), kept as the baseline of bench/decode.py.

Frozen on purpose: the KV cache goes through the layer scan as xs -> ys (a second cache-sized buffer every step),
attention reads all max_len positions of every slot, and tokens are drawn with Gumbel noise over the vocabulary
(`jax.random.categorical`), all in float32. The engine's generate loop around it is today's. With
`Sampler(overlap=False)` (the host reads each call before dispatching the next) this is the old sampler.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import KVCache
from jaxrl.models.decoder import apply_rope, rope_inv_freq
from jaxrl.sampler import decode
from jaxrl.sampler.engine import Engine, make_engine
from jaxrl.sampler.sampling import filtered_logprobs


def _forward_cached(graphdef, params, tokens_Sx1, pos_Sx1, cache: KVCache):
  model = nnx.merge(graphdef, params)
  cfg = model.cfg
  if cfg.attention_bias or cfg.qk_norm:
    raise ValueError("the frozen baseline covers Llama-style blocks only (no attention bias, no qk norm)")
  block_graphdef, stacked = nnx.split(model.blocks)
  inv_freq = rope_inv_freq(cfg)
  x = model.embed[...][tokens_Sx1]
  positions = pos_Sx1
  rows = jnp.arange(tokens_Sx1.shape[0])[:, None]

  def body(x, layer):
    state, k_cache, v_cache = layer
    block = nnx.merge(block_graphdef, state)
    a, h = block.attn, block.input_norm(x)
    q = apply_rope(jnp.einsum("bte,ehd->bthd", h, a.q_proj[...]), positions, inv_freq)
    k = apply_rope(jnp.einsum("bte,ekd->btkd", h, a.k_proj[...]), positions, inv_freq)
    v = jnp.einsum("bte,ekd->btkd", h, a.v_proj[...])
    keys = k_cache.at[rows, positions].set(k, mode="drop")
    values = v_cache.at[rows, positions].set(v, mode="drop")
    b, t, nh, d = q.shape
    q = q.reshape(b, t, cfg.num_kv_heads, nh // cfg.num_kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys) / math.sqrt(d)
    mask = jnp.arange(keys.shape[1])[None, None, :] <= positions[:, :, None]
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -1e30), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(b, t, nh, d)
    x = x + jnp.einsum("bthd,hde->bte", out, a.o_proj[...])
    return x + block.mlp(block.post_attn_norm(x)), (keys, values)

  x, (k_cache, v_cache) = jax.lax.scan(body, x, (stacked, cache.k_NxSxTxKxD, cache.v_NxSxTxKxD))
  x = model.final_norm(x)
  head = model.embed[...].T if cfg.tie_embeddings else model.lm_head[...]
  return jnp.einsum("bte,ev->btv", x, head, preferred_element_type=jnp.float32), KVCache(k_cache, v_cache)


def _gumbel_sample(keys_S, logits_SxV, temperature_S, top_k_S, top_p_S, greedy_S):
  lp = filtered_logprobs(logits_SxV, temperature_S, top_k_S, top_p_S, greedy_S)
  tokens_S = jax.vmap(jax.random.categorical)(keys_S, lp).astype(jnp.int32)
  return tokens_S, jnp.take_along_axis(lp, tokens_S[:, None], axis=-1)[:, 0]


def baseline_engine(cfg, mesh, **kw) -> Engine:
  """An Engine (float32) whose generate call is the frozen pre-issue-14 one; everything else is today's."""
  engine = make_engine(cfg, mesh, dtype="float32", **kw)
  generate = functools.partial(decode.generate, engine.graphdef, engine.steps_per_call,
                               forward=_forward_cached, draw=_gumbel_sample)
  engine._generate = jax.jit(generate, donate_argnums=2, out_shardings=(engine._state_shardings, None))
  return engine
