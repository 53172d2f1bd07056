"""Policy-gradient surrogates, off-policy corrections, KL and entropy terms, and loss aggregation.

All functions work on [B, L] arrays aligned with the batch's tokens (see jaxrl/rollout.py) and are pure. With
segment_ids_BxL (packed rows, see jaxrl/learner/packing.py) every per-sample sum runs over a segment, not a row.
`policy_objective` combines them as LossConfig says; it returns the scalar loss of one micro-batch and the
sums its metrics are made from, so that micro-batches and mini-batches add up exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.learner.config import LossConfig
from jaxrl.learner.packing import segment_sums, to_tokens

# Stats reduced by max / min across micro-batches; every other stat is a sum.
MAX_STATS = ("ratio_max",)
MIN_STATS = ("ratio_min", "is_cap_min")


def aggregation_weights(loss_mask_BxL, sample_mask_B, aggregation: str, norm_length: int = 0,
                        segment_ids_BxL=None):
  """Per-token weights w such that sum(w * loss_t) is the aggregated loss of these rows' samples.

  sample_mask_B: [B] (one sample per row) or [B, G] (packed: column g is segment g + 1, needs segment_ids_BxL).
  """
  sample_mask_B = sample_mask_B.astype(jnp.float32)
  if segment_ids_BxL is None:
    sample_BxL = sample_mask_B[:, None]
  else:
    sample_BxL = to_tokens(sample_mask_B, segment_ids_BxL)
  mask = loss_mask_BxL.astype(jnp.float32) * sample_BxL
  if aggregation == "token_mean":
    return mask / jnp.maximum(mask.sum(), 1.0)
  num_samples = jnp.maximum(sample_mask_B.sum(), 1.0)
  if aggregation == "seq_mean":
    return mask / jnp.maximum(segment_sums(mask, segment_ids_BxL), 1.0) / num_samples
  if aggregation == "seq_sum_norm":
    return mask / (num_samples * (norm_length or mask.shape[1]))
  raise ValueError(f"unknown aggregation {aggregation!r}")


def pg_surrogate(log_ratio_BxL, adv_BxL):
  """-u * A with u = exp(log_ratio): the unclipped importance-weighted policy gradient."""
  return -jnp.exp(log_ratio_BxL) * adv_BxL


def ppo_surrogate(log_ratio_BxL, adv_BxL, clip_low: float, clip_high: float):
  """PPO-clip with an asymmetric band [1 - clip_low, 1 + clip_high].

  Returns (loss, clipped_low, clipped_high): tokens whose gradient the clip removes (A < 0 below the band, A > 0
  above it).
  """
  u = jnp.exp(log_ratio_BxL)
  loss = -jnp.minimum(u * adv_BxL, jnp.clip(u, 1.0 - clip_low, 1.0 + clip_high) * adv_BxL)
  return loss, (adv_BxL < 0) & (u < 1.0 - clip_low), (adv_BxL > 0) & (u > 1.0 + clip_high)


def dual_clip(weighted_loss_BxL, adv_BxL, bound: float):
  """Dual clip (Ye et al. 2020) of a token's whole loss w * surrogate: for A < 0 it is at most -bound * A.

  For A < 0 the weighted surrogate is |A| w max(u, clip(u)), and w u is pi / mu, the token's ratio against the
  policy that sampled it (where w is not truncated). A stale token that pi now finds much likelier than mu did
  stops pushing once that product passes `bound`. Returns (loss, acted).
  """
  held = -bound * adv_BxL
  acted = (adv_BxL < 0) & (weighted_loss_BxL > held)
  return jnp.where(acted, held, weighted_loss_BxL), acted


def sequence_mean(x_BxL, mask_BxL, segment_ids_BxL=None):
  """Mean over each sample's masked entries (0 for a sample without any): [B, 1] with one sample per row, at
  every token of its segment [B, L] with packed rows (segment_ids_BxL)."""
  mask = mask_BxL.astype(jnp.float32)
  return (segment_sums(x_BxL * mask, segment_ids_BxL)
          / jnp.maximum(segment_sums(mask, segment_ids_BxL), 1.0))


def gspo_surrogate(log_ratio_BxL, adv_BxL, mask_BxL, clip_low: float, clip_high: float, segment_ids_BxL=None):
  """GSPO: PPO-clip on the sequence ratio exp(mean over the sample's tokens of log u), broadcast to tokens.

  Every token of a sample carries the sample's loss; seq_mean aggregation (LossConfig requires it) then counts
  each sample once, whatever its length.
  """
  adv = adv_BxL if segment_ids_BxL is not None else adv_BxL[:, :1]  # packed: per token, constant per segment
  out = ppo_surrogate(sequence_mean(log_ratio_BxL, mask_BxL, segment_ids_BxL), adv, clip_low, clip_high)
  return tuple(jnp.broadcast_to(x, log_ratio_BxL.shape) for x in out)


def ess_fraction(w_BxL, valid_BxL):
  """Kish effective sample size of the weights on valid entries, as a fraction of their number."""
  x = jnp.where(valid_BxL, w_BxL, 0.0)
  n = jnp.sum(valid_BxL.astype(jnp.float32))
  return jnp.sum(x) ** 2 / jnp.maximum(n * jnp.sum(x * x), 1e-30)


def ess_cap(w_BxL, valid_BxL, ess_min: float, max_log_cap: float, iterations: int = 40):
  """The largest cap c in [1, e^max_log_cap] with ess_fraction(min(w, c)) >= ess_min (1 if none).

  Raising the cap never raises the ESS (d log ESS / dc has the sign of sum min(w,c)(min(w,c) - c) <= 0), so
  bisection on log c finds it.
  """
  ok = lambda log_c: ess_fraction(jnp.minimum(w_BxL, jnp.exp(log_c)), valid_BxL) >= ess_min

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    good = ok(mid)
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  lo, _ = jax.lax.fori_loop(0, iterations, halve, (jnp.float32(0.0), jnp.float32(max_log_cap)))
  return jnp.exp(jnp.where(ok(jnp.float32(max_log_cap)), max_log_cap, lo))


def behavior_weights(prox_logp_BxL, behavior_logp_BxL, mask_BxL, cfg: LossConfig, segment_ids_BxL=None):
  """Importance weights prox / mu at token or sequence level, truncated and masked as cfg says.

  Returns (w_BxL, keep_BxL, truncated_BxL, cap); w carries no gradient; cap is the truncation applied (inf
  when none).
  """
  log_w = jnp.where(mask_BxL, prox_logp_BxL - behavior_logp_BxL, 0.0)
  if cfg.is_level == "sequence":
    log_w = jnp.broadcast_to(segment_sums(log_w, segment_ids_BxL), log_w.shape)
  elif cfg.is_level == "sequence_mean":
    log_w = jnp.broadcast_to(sequence_mean(log_w, mask_BxL, segment_ids_BxL), log_w.shape)
  w = jnp.exp(jnp.clip(jax.lax.stop_gradient(log_w), -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
  keep = jnp.ones(w.shape, bool)
  if cfg.is_mask_low is not None:
    keep &= w >= cfg.is_mask_low
  if cfg.is_mask_high is not None:
    keep &= w <= cfg.is_mask_high
  cap = jnp.float32(jnp.inf if cfg.is_cap is None else cfg.is_cap)
  if cfg.is_ess_min is not None:
    cap = jnp.minimum(cap, ess_cap(w, mask_BxL & keep, cfg.is_ess_min, cfg.log_ratio_clamp))
  truncated = w > cap
  return jnp.minimum(w, cap), keep, truncated, cap


def kl_k2(logp_BxL, ref_logp_BxL):
  """0.5 (log pi - log ref)^2 per token: its gradient (log pi - log ref) grad log pi has, on tokens drawn from
  pi, the expectation grad KL(pi || ref) of the token's distribution."""
  return 0.5 * jnp.square(logp_BxL - ref_logp_BxL)


def kl_k3(logp_BxL, ref_logp_BxL):
  """ref/pi - log(ref/pi) - 1 per token: an unbiased, non-negative estimate of KL(pi || ref) on tokens from pi
  (a metric here; as a loss its gradient is that of the other direction)."""
  d = ref_logp_BxL - logp_BxL
  return jnp.exp(d) - d - 1.0


def policy_objective(logp_BxL, behavior_logp_BxL, adv_B, weights_BxL, cfg: LossConfig, *, prox_logp_BxL=None,
                     ref_logp_BxL=None, entropy_BxL=None, in_support_BxL=None, prox_in_support_BxL=None,
                     ref_in_support_BxL=None, segment_ids_BxL=None):
  """(loss, stats) of one micro-batch: sum over tokens of weights * (w * surrogate + KL term - entropy bonus).

  adv_B: per sample [B], or per token [B, L] (packed rows, with segment_ids_BxL).
  prox_logp_BxL is required unless cfg.proximal == "behavior"; ref_logp_BxL when cfg.kl_coef > 0 (with
  kl_estimator="k1_reward" it only feeds the kl_ref metric: the penalty is in the advantages already);
  entropy_BxL when cfg.entropy_coef > 0.
  Supports (top-k / top-p): a token outside pi's (in_support_BxL False) counts nowhere: pi gives it probability 0.
  One outside prox's support has no ratio pi / prox and importance weight prox / mu = 0: it is dropped from the
  policy term. One outside ref's support is dropped from the KL term: KL(pi || ref) is infinite there, and no
  finite term estimates it. Both are counted (prox_out_of_support, ref_out_of_support); tokens with weight 0 do
  not count.
  """
  counted = weights_BxL > 0
  if in_support_BxL is not None:
    counted &= in_support_BxL
  # Off-token entries may hold anything (padding, NaN); zeroing them keeps NaN out of the gradients.
  behavior_logp_BxL = jnp.where(counted, behavior_logp_BxL, 0.0)
  logp_BxL = jnp.where(counted, logp_BxL, 0.0)
  adv_BxL = jnp.broadcast_to(adv_B if adv_B.ndim == 2 else adv_B[:, None], logp_BxL.shape)
  anchored = counted if prox_in_support_BxL is None else counted & prox_in_support_BxL
  on_ref = counted if ref_in_support_BxL is None else counted & ref_in_support_BxL
  policy_loss, policy_stats = _policy_term(logp_BxL, behavior_logp_BxL, prox_logp_BxL, adv_BxL, weights_BxL, cfg,
                                           anchored, segment_ids_BxL)
  # Drift from the behavior policy at the current params: ratio pi / mu and the k3 estimate of KL(mu || pi).
  clamp = cfg.log_ratio_clamp
  log_r = jnp.clip(jax.lax.stop_gradient(logp_BxL) - behavior_logp_BxL, -clamp, clamp)
  r = jnp.exp(log_r)
  kl_loss, kl_sum = _kl_term(logp_BxL, r, ref_logp_BxL, weights_BxL, cfg, on_ref)
  ent_loss = ent_sum = jnp.float32(0.0)
  if entropy_BxL is not None:
    ent = jnp.where(counted, entropy_BxL, 0.0)
    ent_sum = jnp.sum(jax.lax.stop_gradient(ent))
    if cfg.entropy_coef > 0:
      ent_loss = -cfg.entropy_coef * jnp.sum(weights_BxL * ent)
  f32 = lambda m: jnp.sum(m.astype(jnp.float32))
  stats = {
      "loss/policy": jax.lax.stop_gradient(policy_loss),
      "loss/kl": jax.lax.stop_gradient(kl_loss),
      "loss/entropy": jax.lax.stop_gradient(ent_loss),
      "tokens": f32(counted),
      "out_of_support": f32((weights_BxL > 0) & ~counted),
      "prox_out_of_support": f32(counted & ~anchored),
      "ref_out_of_support": f32(counted & ~on_ref) if cfg.kl_coef > 0 else jnp.float32(0.0),
      **{name: f32(anchored & flags) for name, flags in policy_stats.pop("flags").items()},
      **policy_stats,
      "ratio_sum": jnp.sum(jnp.where(counted, r, 0.0)),
      "ratio_sq_sum": jnp.sum(jnp.where(counted, r * r, 0.0)),
      "ratio_max": jnp.max(jnp.where(counted, r, -jnp.inf)),
      "ratio_min": jnp.min(jnp.where(counted, r, jnp.inf)),
      "kl_behavior_sum": jnp.sum(jnp.where(counted, (r - 1.0) - log_r, 0.0)),
      "kl_ref_sum": kl_sum,
      "entropy_sum": ent_sum,
  }
  return policy_loss + kl_loss + ent_loss, stats


def _policy_term(logp_BxL, behavior_logp_BxL, prox_logp_BxL, adv_BxL, weights_BxL, cfg: LossConfig, anchored_BxL,
                 segment_ids_BxL):
  """sum(weights * w * surrogate) over the tokens that have a ratio, and its stats (per-token flags under "flags",
  the weights applied, the IS cap)."""
  if cfg.proximal == "behavior":
    anchor = behavior_logp_BxL
  else:
    if prox_logp_BxL is None:
      raise ValueError(f"proximal={cfg.proximal!r} needs prox_logp_BxL")
    prox_logp_BxL = anchor = jax.lax.stop_gradient(jnp.where(anchored_BxL, prox_logp_BxL, 0.0))
  log_ratio = jnp.clip(logp_BxL - anchor, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  no = jnp.zeros(logp_BxL.shape, bool)
  if cfg.policy_loss == "pg":
    surrogate, clip_lo, clip_hi = pg_surrogate(log_ratio, adv_BxL), no, no
  elif cfg.policy_loss == "ppo":
    surrogate, clip_lo, clip_hi = ppo_surrogate(log_ratio, adv_BxL, cfg.clip_low, cfg.clip_high)
  else:
    surrogate, clip_lo, clip_hi = gspo_surrogate(log_ratio, adv_BxL, anchored_BxL, cfg.clip_low, cfg.clip_high,
                                                 segment_ids_BxL)
  if cfg.is_level == "none":
    w, keep, truncated, cap = jnp.ones(logp_BxL.shape), jnp.ones(logp_BxL.shape, bool), no, jnp.float32(jnp.inf)
  else:
    w, keep, truncated, cap = behavior_weights(prox_logp_BxL, behavior_logp_BxL, anchored_BxL, cfg, segment_ids_BxL)
  token_loss, dual = w * surrogate, no
  if cfg.dual_clip is not None:
    token_loss, dual = dual_clip(token_loss, adv_BxL, cfg.dual_clip)
  active = anchored_BxL & keep
  applied_w = jnp.where(active, w, 0.0)  # the weights the loss actually used (0 where masked or without a ratio)
  flags = {"clip_low": clip_lo, "clip_high": clip_hi, "clip_dual": dual & keep, "is_truncated": truncated,
           "is_masked": ~keep}
  return jnp.sum(weights_BxL * jnp.where(active, token_loss, 0.0)), {
      "flags": flags, "is_cap_min": cap, "w_sum": jnp.sum(applied_w), "w_sq_sum": jnp.sum(applied_w * applied_w)}


def _kl_term(logp_BxL, ratio_BxL, ref_logp_BxL, weights_BxL, cfg: LossConfig, on_BxL):
  """(kl_coef * the k2 loss, sum of the k3 estimates) of KL(pi || ref) over the tokens `on_BxL`.

  Both are weighted by the full ratio pi / mu (no gradient, not truncated: a truncated weight biases the gradient
  wherever pi / mu passes the cap), so that on tokens drawn from mu they are expectations under pi. The estimate
  is per position: the sum over a sample's positions t of KL(pi(.|y<t) || ref(.|y<t)) at the prefixes y<t the
  sampler drew; its gradient omits the score-function term of the sequence-level KL (how a token changes the
  later prefixes), whose variance grows with the length.
  """
  if cfg.kl_coef == 0:
    return jnp.float32(0.0), jnp.float32(0.0)
  if ref_logp_BxL is None:
    raise ValueError("kl_coef > 0 needs ref_logp_BxL (TrainState.ref_params)")
  ref_logp_BxL = jax.lax.stop_gradient(jnp.where(on_BxL, ref_logp_BxL, 0.0))
  kl_loss = jnp.float32(0.0)
  if cfg.kl_estimator == "k2":
    kl_loss = cfg.kl_coef * jnp.sum(weights_BxL * jnp.where(on_BxL, ratio_BxL * kl_k2(logp_BxL, ref_logp_BxL), 0.0))
  kl_sum = jnp.sum(jnp.where(on_BxL, ratio_BxL * kl_k3(jax.lax.stop_gradient(logp_BxL), ref_logp_BxL), 0.0))
  return kl_loss, kl_sum
