"""Token sampling (temperature, top-k, top-p, greedy) and the log-probabilities of the distribution sampled from.

The sampler draws from `filtered_logprobs`; the learner (jaxrl/learner/logprobs.py, `token_logprobs`) scores
tokens under the same support with the same tie rule, renormalised the same way (tests check both agree, ties
included, and that on-policy ratios from the real Sampler are 1). Filters apply in the order of SamplingParams:
logits / temperature, then top-k, then top-p on the renormalised top-k distribution. Ties at a cut-off value are
kept. Greedy is the point mass on the argmax of the raw logits (logprob 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.rollout import SamplingParams

_NEG_INF = -jnp.inf
_BLOCK = 128  # vocabulary block of the two-level inverse-CDF draw


def _filter(scaled_NxV, top_k_N, top_p_N):
  """Sets logits outside the top-k / top-p support to -inf."""
  v = scaled_NxV.shape[-1]
  desc_NxV = jnp.flip(jnp.sort(scaled_NxV, axis=-1), axis=-1)
  k_N = jnp.where((top_k_N > 0) & (top_k_N < v), top_k_N, v)
  in_top_k_NxV = jnp.arange(v)[None, :] < k_N[:, None]
  probs_NxV = jax.nn.softmax(jnp.where(in_top_k_NxV, desc_NxV, _NEG_INF), axis=-1)
  mass_before_NxV = jnp.cumsum(probs_NxV, axis=-1) - probs_NxV
  # top_p == 1 keeps everything even where rounding pushes the cumulative mass to 1 before the tail.
  keep_NxV = in_top_k_NxV & ((mass_before_NxV < top_p_N[:, None]) | (top_p_N[:, None] >= 1.0))
  last_kept_N = jnp.sum(keep_NxV, axis=-1) - 1  # the top token is always kept
  threshold_N = jnp.take_along_axis(desc_NxV, last_kept_N[:, None], axis=-1)
  return jnp.where(scaled_NxV >= threshold_N, scaled_NxV, _NEG_INF)


def filtered_logprobs(logits_NxV, temperature_N, top_k_N, top_p_N, greedy_N):
  """Log-probabilities (-inf off the support) of the distribution each row's token is drawn from."""
  logits_NxV = logits_NxV.astype(jnp.float32)
  v = logits_NxV.shape[-1]
  scaled_NxV = logits_NxV / jnp.where(greedy_N, 1.0, temperature_N)[:, None]
  # The sort over the vocabulary is the expensive part; skip it when no row filters.
  needs_filter = jnp.any(~greedy_N & (((top_k_N > 0) & (top_k_N < v)) | (top_p_N < 1.0)))
  masked_NxV = jax.lax.cond(needs_filter, _filter, lambda s, k, p: s, scaled_NxV, top_k_N, top_p_N)
  sampled_NxV = jax.nn.log_softmax(masked_NxV, axis=-1)
  is_argmax_NxV = jnp.arange(v)[None, :] == jnp.argmax(logits_NxV, axis=-1)[:, None]
  greedy_NxV = jnp.where(is_argmax_NxV, 0.0, _NEG_INF)
  return jnp.where(greedy_N[:, None], greedy_NxV, sampled_NxV)


def sampling_logprobs(logits, tokens, sampling: SamplingParams):
  """log p(token) under the distribution SamplingParams builds from `logits` (any leading shape, last axis V).

  For the learner: logits[..., t, :] are the logits that predicted tokens[..., t].
  """
  lead = tokens.shape
  if logits.shape[:-1] != lead:
    raise ValueError(f"logits {logits.shape} do not match tokens {tokens.shape} (expected logits [..., V])")
  logits_NxV = logits.reshape(-1, logits.shape[-1])
  full = lambda x, dtype: jnp.full((logits_NxV.shape[0],), x, dtype)
  lp_NxV = filtered_logprobs(logits_NxV, full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
                             full(sampling.top_p, jnp.float32), full(sampling.greedy, bool))
  return jnp.take_along_axis(lp_NxV, tokens.reshape(-1, 1).astype(jnp.int32), axis=-1).reshape(lead)


def _first_above(cum_NxM, target_N, weights_NxM):
  """Index of the first entry whose cumulative weight exceeds the target, among entries of positive weight.

  Float rounding may leave no such entry (a target at the very top); then the last entry of positive weight."""
  m = cum_NxM.shape[-1]
  positive_NxM = weights_NxM > 0
  above_NxM = positive_NxM & (cum_NxM > target_N[:, None])
  idx_M = jnp.arange(m)
  first_N = jnp.min(jnp.where(above_NxM, idx_M, m), axis=-1)
  last_N = jnp.max(jnp.where(positive_NxM, idx_M, -1), axis=-1)
  return jnp.where(first_N < m, first_N, last_N)


def _draw(keys_N, lp_NxV, block=_BLOCK):
  """One token per row from exp(lp) by inverse CDF over (blocks of the vocabulary, then tokens in the block).

  One uniform per row instead of Gumbel noise over the whole vocabulary (V random numbers per row, the larger
  cost of a decode step's sampling on CPU); linear in V. A token of probability 0 is never drawn."""
  n, v = lp_NxV.shape
  nb = -(-v // block)
  probs_NxV = jnp.pad(jnp.exp(lp_NxV), ((0, 0), (0, nb * block - v)))
  probs_NxBxP = probs_NxV.reshape(n, nb, block)
  mass_NxB = jnp.sum(probs_NxBxP, axis=-1)
  cum_NxB = jnp.cumsum(mass_NxB, axis=-1)
  u_N = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys_N)
  target_N = u_N * cum_NxB[:, -1]
  b_N = _first_above(cum_NxB, target_N, mass_NxB)
  in_block_NxP = jnp.take_along_axis(probs_NxBxP, b_N[:, None, None], axis=1)[:, 0]
  before_N = jnp.take_along_axis(cum_NxB - mass_NxB, b_N[:, None], axis=1)[:, 0]
  j_N = _first_above(jnp.cumsum(in_block_NxP, axis=-1), target_N - before_N, in_block_NxP)
  return (b_N * block + j_N).astype(jnp.int32)


def sample(keys_N, logits_NxV, temperature_N, top_k_N, top_p_N, greedy_N):
  """Draws one token per row; returns (tokens_N, logprobs_N) with the logprob under the filtered distribution."""
  lp_NxV = filtered_logprobs(logits_NxV, temperature_N, top_k_N, top_p_N, greedy_N)
  tokens_N = _draw(keys_N, lp_NxV)
  return tokens_N, jnp.take_along_axis(lp_NxV, tokens_N[:, None], axis=-1)[:, 0]
