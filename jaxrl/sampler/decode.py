"""The device programs both caches share: prefill a prompt, fill a slot, run decode steps, stop a slot.

Pure functions of the decode state (sampler/decode_state.py); an engine jits them once with its shardings. What
differs between a dense and a paged cache (where a prefix's keys/values go, which writes an idle slot may make)
comes in as an argument, so the decode loop itself is one function for both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import forward_cached, init_cache
from jaxrl.sampler.decode_state import DecodeState, Prefix, ResultTokens, SlotSettings
from jaxrl.sampler.sampling import sample


def prefill(graphdef, cfg, params, tokens_P, length) -> Prefix:
  """The prompt's keys/values; a mixture-of-experts model's routing of every prompt position too (the learner
  replays it on the prompt's tokens, whose keys and values every completion token reads)."""
  bucket = tokens_P.shape[0]
  cache = init_cache(cfg, 1, bucket)
  if not cfg.is_moe:
    _, cache = forward_cached(graphdef, params, tokens_P[None], jnp.arange(bucket)[None], cache)
    return Prefix(cache, tokens_P, length)
  (_, cache), routing = forward_cached(graphdef, params, tokens_P[None], jnp.arange(bucket)[None], cache,
                                       routing=True)
  return Prefix(cache, tokens_P, length, experts_PxNxK=routing.experts_BxTxNxK[0].astype(jnp.int16))


def fill_slot(state: DecodeState, cache, prefix: Prefix, slot, settings: SlotSettings, num_generated
              ) -> DecodeState:
  """The slot's tokens, position and settings from a prefix, over a cache that already holds its keys/values;
  num_generated > 0 resumes a preempted sample (its prefix holds the completion so far)."""
  tokens = jax.lax.dynamic_update_slice(state.tokens_SxT, prefix.tokens_P[None], (slot, 0))
  put = lambda rows, value: rows.at[slot].set(value)
  return DecodeState(
      cache=cache,
      tokens_SxT=tokens,
      pos_S=put(state.pos_S, prefix.length - 1),
      active_S=put(state.active_S, True),
      num_generated_S=put(state.num_generated_S, num_generated),
      settings=jax.tree.map(put, state.settings, settings),
  )


def keep_cache(cache, state: DecodeState):
  """A dense cache before a decode step: unchanged (an idle row's writes land in its own row)."""
  del state
  return cache


def generate(graphdef, steps, params, version, state: DecodeState, forward=forward_cached, draw=sample,
             before_step=keep_cache):
  """`steps` decode steps. before_step(cache, state) prepares the cache for a step (paged: which rows may
  write); `forward` and `draw` are swappable only for bench/decode_baseline.py. A mixture-of-experts model's
  routing of every step is returned too (ResultTokens.experts_SxCxNxK), for the learner to replay."""
  num_slots, max_len = state.tokens_SxT.shape
  cfg = nnx.merge(graphdef, params).cfg
  routed = cfg.is_moe
  rows = jnp.arange(num_slots)
  s = state.settings
  request_keys = jax.random.wrap_key_data(s.key)

  def step(i, carry):
    state, out = carry
    token_S = state.tokens_SxT[rows, state.pos_S]
    cache = before_step(state.cache, state)
    # An idle row runs at position 0 (its output is dropped): attention reads stop at the live rows' positions.
    pos_S = jnp.where(state.active_S, state.pos_S, 0)
    if routed:
      (logits, cache), routing = forward(graphdef, params, token_S[:, None], pos_S[:, None], cache, routing=True)
      out = (*out[:3], out[3].at[:, i].set(routing.experts_BxTxNxK[:, 0].astype(jnp.int16)))
    else:
      logits, cache = forward(graphdef, params, token_S[:, None], pos_S[:, None], cache)
    keys = jax.vmap(jax.random.fold_in)(request_keys, state.num_generated_S)
    new_S, logprob_S = draw(keys, logits[:, 0], s.temperature, s.top_k, s.top_p, s.greedy)
    active = state.active_S
    next_pos = jnp.where(active, state.pos_S + 1, state.pos_S)
    tokens = state.tokens_SxT.at[rows, next_pos].set(jnp.where(active, new_S, state.tokens_SxT[rows, next_pos]))
    num_generated = state.num_generated_S + active
    stop = jnp.any(new_S[:, None] == s.stop_ids, axis=-1)
    done = active & (stop | (num_generated >= s.max_new) | (next_pos >= max_len - 1))
    state = state.replace(cache=cache, tokens_SxT=tokens, pos_S=next_pos, active_S=active & ~done,
                          num_generated_S=num_generated)
    out = (out[0].at[:, i].set(new_S), out[1].at[:, i].set(logprob_S), out[2].at[:, i].set(active), *out[3:])
    return state, out

  out = (jnp.zeros((num_slots, steps), jnp.int32), jnp.zeros((num_slots, steps), jnp.float32),
         jnp.zeros((num_slots, steps), bool))
  if routed:
    out += (jnp.full((num_slots, steps, cfg.num_layers, cfg.num_experts_per_tok), -1, jnp.int16),)
  new_state, (tokens, logprobs, valid, *experts) = jax.lax.fori_loop(0, steps, step, (state, out))
  done = state.active_S & ~new_state.active_S
  return new_state, ResultTokens(tokens, logprobs, valid, done, version, *experts)


def release(state: DecodeState, slot) -> DecodeState:
  return state.replace(active_S=state.active_S.at[slot].set(False))
