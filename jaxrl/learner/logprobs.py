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
    targets_BxL = tokens_BxL[:, 1:]
    in_support = jnp.argmax(logits_BxLxV[:, :-1], axis=-1) == targets_BxL
    zeros = jnp.zeros(targets_BxL.shape, jnp.float32)
    return _front(zeros, 0.0), _front(in_support, True), _front(zeros, 0.0)
  x_BxLxV = logits_BxLxV[:, :-1].astype(jnp.float32) / sampling.temperature
  targets_BxL = tokens_BxL[:, 1:]
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
  return _front(logp, 0.0), _front(in_support, True), _front(entropy, 0.0)


def _front(a, fill):
  """Prepends entry 0 (never a target) to a [B, L - 1] array."""
  return jnp.concatenate([jnp.full((a.shape[0], 1), fill, a.dtype), a], axis=1)
