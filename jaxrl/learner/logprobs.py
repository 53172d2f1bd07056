"""Token logprobs and entropies under the distribution the sampler drew from (temperature, top-k, top-p).

Alignment follows jaxrl/rollout.py: entry t of a [B, L] output scores token t, predicted by the logits at
t - 1; entry 0 is never a target and holds 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.rollout import SamplingParams

_PLAIN = SamplingParams()  # temperature 1, no top-k/top-p


def support_mask(scaled_logits_xV: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Tokens the sampler can draw from logits already divided by the temperature.

  Top-k keeps logits >= the k-th largest; top-p then keeps, on the top-k renormalised distribution sorted by
  probability, each token whose preceding cumulative probability is < top_p (so at least one). Ties with the
  last kept logit are kept. The sampler must apply the same rule for renormalised logprobs to be exact.
  """
  x = scaled_logits_xV
  v = x.shape[-1]
  keep = jnp.ones(x.shape, bool)
  k = top_k if 0 < top_k < v else v
  if k < v or top_p < 1.0:
    # Sorting only the top k values keeps top-k + top-p at O(V log k).
    top_vals = jax.lax.top_k(x, k)[0]
    if k < v:
      keep = x >= top_vals[..., -1:]
    if top_p < 1.0:
      p_sorted = jax.nn.softmax(top_vals, axis=-1)
      before = jnp.cumsum(p_sorted, axis=-1) - p_sorted
      n_kept = jnp.sum(before < top_p, axis=-1, keepdims=True)
      threshold = jnp.take_along_axis(top_vals, n_kept - 1, axis=-1)
      keep = keep & (x >= threshold)
  return keep


def token_logprobs(logits_BxLxV: jax.Array, tokens_BxL: jax.Array,
                   sampling: SamplingParams = _PLAIN) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logprobs_BxL, in_support_BxL, entropy_BxL) of each token under the distribution `sampling` draws from.

  That is softmax(logits / temperature) restricted to the top-k/top-p support and renormalised, exactly what
  the sampler reports as behavior logprobs, so on-policy ratios are 1 by construction. A token outside the
  support (possible when the policy moved since sampling) gets in_support False and a finite logprob that
  callers must drop. Greedy is the point mass on the argmax (logprob 0, entropy 0, no gradient): it can be
  scored but not trained on (LossConfig rejects it). Entropy is that of the predicting distribution at t - 1.
  """
  if sampling.greedy:
    return _greedy(logits_BxLxV, tokens_BxL)
  scores = _score(logits_BxLxV[:, :-1].astype(jnp.float32) / sampling.temperature, tokens_BxL[:, 1:], sampling)
  return tuple(_front(a, fill) for a, fill in zip(scores, (0.0, True, 0.0), strict=True))


def chunked_token_logprobs(hidden_BxLxE: jax.Array, head_ExV: jax.Array, tokens_BxL: jax.Array,
                           sampling: SamplingParams = _PLAIN, chunk: int = 256, vocab_chunk: int = 8192):
  """token_logprobs(hidden @ head, ...) computed `chunk` positions by `vocab_chunk` vocabulary entries at a time
  (online log-sum-exp), each chunk's logits recomputed in the backward pass: the live logits are [B, chunk,
  vocab_chunk], never [B, L, V]. Same values as the unchunked path. Top-p without top-k needs the whole sorted
  vocabulary: that case scores all V entries of a position chunk at once. Greedy scores as token_logprobs does
  (a point mass), from the logits of one position chunk at a time."""
  b, l, e = hidden_BxLxE.shape
  n = -(-(l - 1) // chunk)
  pad = n * chunk - (l - 1)
  x_NxBxCxE = jnp.moveaxis(jnp.pad(hidden_BxLxE[:, :-1], ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, e), 1, 0)
  t_NxBxC = jnp.moveaxis(jnp.pad(tokens_BxL[:, 1:], ((0, 0), (0, pad))).reshape(b, n, chunk), 1, 0)
  head = head_ExV.astype(hidden_BxLxE.dtype)
  v = head.shape[1]
  filtered = sampling.top_k > 0 or sampling.top_p < 1.0
  by_vocab = not sampling.greedy and v > vocab_chunk and (not filtered or 0 < sampling.top_k < v)

  @jax.checkpoint
  def one_chunk(args):
    x_BxCxE, targets_BxC = args
    if by_vocab:
      return _score_by_vocab(x_BxCxE, head, targets_BxC, sampling, filtered, vocab_chunk)
    logits = jnp.einsum("bte,ev->btv", x_BxCxE, head, preferred_element_type=jnp.float32)
    if sampling.greedy:
      zeros = jnp.zeros(targets_BxC.shape, jnp.float32)
      return zeros, jnp.argmax(logits, axis=-1) == targets_BxC, zeros
    return _score(logits / sampling.temperature, targets_BxC, sampling)

  scores = jax.lax.map(one_chunk, (x_NxBxCxE, t_NxBxC))
  unchunk = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, n * chunk)[:, : l - 1]
  return tuple(_front(unchunk(a), fill) for a, fill in zip(scores, (0.0, True, 0.0), strict=True))


def _score_by_vocab(x_BxCxE, head_ExV, targets_BxC, sampling: SamplingParams, filtered: bool, vocab_chunk: int):
  """_score over the vocabulary in chunks: a running max m, sum l of exp(x - m) and sum s of exp(x - m) x over the
  support give log Z = m + log l and entropy log Z - s / l. With a top-k filter, a first pass merges each chunk's
  top k into the k largest logits, whence the support's threshold (top-p applied within the top k)."""
  e, v = head_ExV.shape
  n = -(-v // vocab_chunk)
  head_NxExU = jnp.moveaxis(jnp.pad(head_ExV, ((0, 0), (0, n * vocab_chunk - v))).reshape(e, n, vocab_chunk), 1, 0)
  ids_NxU = jnp.arange(n * vocab_chunk).reshape(n, vocab_chunk)
  lead = x_BxCxE.shape[:2]

  def logits(w_ExU):
    return jnp.einsum("bte,eu->btu", x_BxCxE, w_ExU, preferred_element_type=jnp.float32) / sampling.temperature

  threshold = jnp.full(lead, -jnp.inf)
  if filtered:
    def merge(top, xs):
      x = jnp.where(xs[1] < v, logits(xs[0]), -jnp.inf)
      return jax.lax.top_k(jnp.concatenate([top, x], axis=-1), sampling.top_k)[0], None

    top_vals, _ = jax.lax.scan(merge, jnp.full((*lead, sampling.top_k), -jnp.inf), (head_NxExU, ids_NxU))
    keep_top = support_mask(top_vals, sampling.top_k, sampling.top_p)  # the kept ones among the k largest
    threshold = jax.lax.stop_gradient(jnp.min(jnp.where(keep_top, top_vals, jnp.inf), axis=-1))

  @jax.checkpoint  # the backward pass recomputes each chunk's logits instead of keeping them
  def accumulate(carry, xs):
    m, l, s, target, hit = carry
    x = logits(xs[0])
    keep = (xs[1] < v) & (x >= threshold[..., None])
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(jnp.where(keep, x, -jnp.inf), axis=-1)))
    p = jnp.exp(jnp.where(keep, x - m_new[..., None], -jnp.inf))  # where inside exp: no inf * 0 in the gradient
    scale = jnp.exp(m - m_new)
    is_target = xs[1] == targets_BxC[..., None]
    return (m_new, l * scale + p.sum(-1), s * scale + jnp.sum(p * jnp.where(keep, x, 0.0), axis=-1),
            target + jnp.sum(jnp.where(is_target, x, 0.0), axis=-1), hit | jnp.any(is_target & keep, axis=-1)), None

  zeros = jnp.zeros(lead)
  init = (jnp.full(lead, -1e30), zeros, zeros, zeros, jnp.zeros(lead, bool))
  (m, l, s, target, hit), _ = jax.lax.scan(accumulate, init, (head_NxExU, ids_NxU))
  log_z = m + jnp.log(l)
  in_support = hit if filtered else jnp.ones(lead, bool)
  return target - log_z, in_support, log_z - s / l


def _front(a, fill):
  """Prepends entry 0 (never a target) to a [B, L - 1] array."""
  return jnp.concatenate([jnp.full((a.shape[0], 1), fill, a.dtype), a], axis=1)


def _greedy(logits_BxLxV, tokens_BxL):
  """Greedy's point mass on the argmax: logprob 0, entropy 0, in support where the token is the argmax."""
  targets_BxL = tokens_BxL[:, 1:]
  in_support = jnp.argmax(logits_BxLxV[:, :-1], axis=-1) == targets_BxL
  zeros = jnp.zeros(targets_BxL.shape, jnp.float32)
  return _front(zeros, 0.0), _front(in_support, True), _front(zeros, 0.0)


def _score(x_BxLxV, targets_BxL, sampling: SamplingParams):
  """(logprob, in_support, entropy) of each target under softmax of the scaled logits x predicting it."""
  target_logit = jnp.take_along_axis(x_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
  if sampling.top_k > 0 or sampling.top_p < 1.0:
    keep_BxLxV = jax.lax.stop_gradient(support_mask(x_BxLxV, sampling.top_k, sampling.top_p))
    in_support = jnp.take_along_axis(keep_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    log_z = jax.nn.logsumexp(jnp.where(keep_BxLxV, x_BxLxV, -jnp.inf), axis=-1)
    probs = jnp.exp(jnp.where(keep_BxLxV, x_BxLxV - log_z[..., None], -jnp.inf))
    # Zeroing (not -inf) the dropped logits keeps 0 * inf out of the entropy and its gradient.
    x_BxLxV = jnp.where(keep_BxLxV, x_BxLxV, 0.0)
  else:
    in_support = jnp.ones(targets_BxL.shape, bool)
    log_z = jax.nn.logsumexp(x_BxLxV, axis=-1)
    probs = jnp.exp(x_BxLxV - log_z[..., None])
  logp = target_logit - log_z
  entropy = log_z - jnp.sum(probs * x_BxLxV, axis=-1)
  return logp, in_support, entropy
