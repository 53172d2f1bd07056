"""LossConfig: every choice the RL objective makes, validated once at construction.

Notation used in the docs below, per completion token t of sample i:
  pi      current learner policy (the params being differentiated)
  mu      behavior policy: the params (possibly stale) that sampled the token; log mu comes from the sampler
  prox    proximal policy of decoupled PPO: the params at the start of the train step (version v0)
  A_i     the sample's advantage, broadcast over its tokens
"""

from __future__ import annotations

import dataclasses

from jaxrl.rollout import SamplingParams

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce")
AGGREGATIONS = ("token_mean", "seq_mean", "seq_sum_norm")
POLICY_LOSSES = ("pg", "ppo", "gspo")
PROXIMALS = ("behavior", "recompute", "interpolate")
IS_LEVELS = ("none", "token", "sequence", "sequence_mean")
KL_ESTIMATORS = ("k2", "k1_reward")
ROUTINGS = ("replay", "recompute")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The RL objective (the run config's loss section). Defaults: GRPO advantages, token-mean decoupled PPO (clip
  with clip-higher, dual clip for A < 0) against the pre-step policy, corrected for staleness by truncated token IS
  weights prox / mu; with rl.num_minibatches=2 (the run's default) the clip acts. Standard PPO/GRPO against the
  behavior policy: proximal="behavior", is_level="none", is_cap=None, dual_clip=None."""

  # Advantage of sample i from the rewards of its group (samples sharing a group id):
  #   grpo:      (r_i - mean_g) / (std_g + adv_eps), std over the group with ddof=0
  #   dr_grpo:   r_i - mean_g (Dr.GRPO: no std division; pair with aggregation="seq_sum_norm")
  #   rloo:      r_i - mean of the other samples of the group (0 for a group of one)
  #   reinforce: r_i - mean reward of the batch (groups ignored)
  advantage: str = "grpo"
  adv_eps: float = 1e-6

  # How per-token losses become one scalar (per optimizer update, over its whole mini-batch):
  #   token_mean:   sum over tokens / number of completion tokens
  #   seq_mean:     mean over samples of (mean over the sample's tokens)
  #   seq_sum_norm: sum over tokens / (number of samples * norm_length) (Dr.GRPO: no length bias)
  aggregation: str = "token_mean"
  norm_length: int = 0  # the constant of seq_sum_norm; 0 uses the batch's padded length L

  # Surrogate per token, with ratio u = pi / anchor (anchor = mu, or prox when proximal != "behavior"):
  #   pg:   -u * A (no trust region; gradient u * grad log pi * A)
  #   ppo:  -min(u * A, clip(u, 1 - clip_low, 1 + clip_high) * A) (clip_high > clip_low is DAPO's clip-higher)
  #   gspo: as ppo with the sequence ratio exp(mean_t log u_t) in place of u, one loss per sample averaged over
  #         samples as in the GSPO paper (needs aggregation="seq_mean"; use clips of ~3e-4..4e-4)
  policy_loss: str = "ppo"
  clip_low: float = 0.2
  clip_high: float = 0.28
  # Dual clip (Ye et al. 2020) for A < 0, on the token's whole loss w * surrogate (any surrogate): it is at most
  # -dual_clip * A, so a token whose ratio against the policy that sampled it, w * u = pi / mu (where w is not
  # truncated), grew past dual_clip (a stale, now much likelier token) stops pushing. With decoupled PPO u = pi /
  # prox alone rarely leaves [0.5, 2] within one step: bounding u would be inert; None: off. Must be > 1 +
  # clip_high.
  dual_clip: float | None = 3.0

  # The anchor of the ratio u and the source of prox:
  #   behavior:    anchor = mu (standard PPO/GRPO: the clipped ratio itself corrects for staleness)
  #   recompute:   anchor = prox, the policy at the start of the step (decoupled PPO, AReaL). With one update
  #                per step it is the current params (no extra pass): u = 1 and the clip never acts (the
  #                objective is then truncated-IS REINFORCE). With num_minibatches * num_epochs > 1 an extra
  #                forward pass over the batch computes it before the first update, and every update after the
  #                first is clipped against it: a real trust region (the default).
  #   interpolate: anchor = prox approximated without the extra pass, linearly in log space between the
  #                token's behavior version v_t and the current version v: log prox = log mu + a (log pi - log
  #                mu), a = (v0 - v_t) / (v - v_t) (a = 1 when v = v_t). Equals recompute for the first update.
  proximal: str = "recompute"

  # Off-policy correction by the behavior importance weight w = prox / mu (a constant, no gradient), which
  # multiplies the surrogate. Needs proximal != "behavior". A token outside prox's top-k/top-p support has
  # prox = 0: no ratio, w = 0; it is dropped from the policy term and counted (prox_out_of_support_frac).
  #   none:     w = 1 (ignores the behavior policy: biased when mu != prox)
  #   token:    w_t = prox(y_t) / mu(y_t)
  #   sequence: w_i = prod_t prox(y_t) / mu(y_t), the same for every token of sample i
  #   sequence_mean: w_i = exp(mean_t log(prox(y_t) / mu(y_t))), the length-normalised (geometric mean)
  #             sequence weight: biased, but its variance does not grow with the length
  is_level: str = "token"
  is_cap: float | None = 2.0  # truncated IS (TIS): w <- min(w, is_cap)
  # Cap from measured drift: per micro-batch, w <- min(w, c) with the largest c >= 1 for which the Kish
  # effective sample size (sum w)^2 / (n sum w^2) of the weights applied is >= is_ess_min * n (ESS falls as c
  # grows, so c is found by bisection). None: off. Both caps may be set; the smaller acts.
  is_ess_min: float | None = None
  # Masked IS: tokens (or whole samples, at sequence level) whose w lies outside [is_mask_low, is_mask_high]
  # are dropped from the loss (they still count in the aggregation denominator).
  is_mask_low: float | None = None
  is_mask_high: float | None = None

  # KL(pi || ref) to frozen reference params (TrainState.ref_params), weighted by kl_coef, estimated as:
  #   k2:        a loss term sg(r_t) * 0.5 (log pi(y_t) - log ref(y_t))^2 with r_t = pi/mu, never truncated (a
  #              cap would bias it wherever pi/mu passes it): on tokens drawn from mu its expected gradient is the
  #              gradient of the reverse KL(pi || ref) at each position, summed over the positions of the sampled
  #              prefixes (per position, not per sequence: the sequence-level gradient adds a score-function term
  #              for how each token changes later prefixes, whose variance grows with length). k1 as a loss has
  #              zero expected gradient; k3 as a loss follows the gradient of KL(ref || pi). A token outside ref's
  #              top-k/top-p support (KL infinite) is dropped from the term and counted (ref_out_of_support_frac).
  #   k1_reward: no loss term: each sample's reward becomes r_i - kl_coef * sum_t (log mu(y_t) - log ref(y_t))
  #              before advantages, a single-sample estimate of KL(mu || ref) of its sequence; no gradient
  #              flows through it (the RLHF "KL in the reward").
  kl_coef: float = 0.0
  kl_estimator: str = "k2"
  entropy_coef: float = 0.0  # weight of the entropy bonus: loss -= entropy_coef * entropy

  # The distribution the sampler drew from (the run's sampler settings). The learner scores every token under
  # exactly this distribution: softmax(logits / temperature) renormalised over the top-k/top-p support, as
  # the sampler's behavior logprobs are; tokens outside the support are dropped and counted. There is no
  # other choice, so on-policy ratios are 1. Greedy is rejected: a point mass has no gradient to train on.
  sampling: SamplingParams = SamplingParams()

  log_ratio_clamp: float = 20.0  # log-ratios are clamped to +-this before exp, against overflow

  # A mixture-of-experts policy's routing in the learner's passes (no effect on a dense model):
  #   replay:    each sampled token's input goes through the experts the sampler chose (Batch.experts_BxLxNxK),
  #              gated by the learner's own router probabilities over them (the router still learns): the
  #              learner scores exactly the distribution the token was drawn from, so on-policy ratios are 1
  #   recompute: every token routed afresh by the learner (a ratio then also measures routing differences)
  routing: str = "replay"

  def __post_init__(self):
    if self.kl_estimator in ("k1", "k3"):
      raise ValueError(f"kl_estimator={self.kl_estimator!r} is gone: as a loss k1 has zero expected gradient and "
                       "k3 follows KL(ref || pi); use 'k2' (a loss) or 'k1_reward' (in the reward)")
    for name, allowed in (("advantage", ADVANTAGES), ("aggregation", AGGREGATIONS),
                          ("policy_loss", POLICY_LOSSES), ("proximal", PROXIMALS), ("is_level", IS_LEVELS),
                          ("kl_estimator", KL_ESTIMATORS), ("routing", ROUTINGS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}; allowed: {allowed}")
    if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
      raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0 (got {self.clip_low}, {self.clip_high})")
    if self.is_level != "none" and self.proximal == "behavior":
      raise ValueError(f"is_level={self.is_level!r} weights by prox / mu, which needs proximal != 'behavior'")
    if self.is_level == "none" and (self.is_cap, self.is_mask_low, self.is_mask_high) != (None, None, None):
      raise ValueError("is_cap / is_mask_low / is_mask_high need is_level 'token' or 'sequence'")
    if self.is_cap is not None and not self.is_cap > 0:
      raise ValueError(f"is_cap must be > 0 (got {self.is_cap})")
    lo, hi = self.is_mask_low, self.is_mask_high
    if lo is not None and hi is not None and not lo < hi:
      raise ValueError(f"need is_mask_low < is_mask_high (got {lo}, {hi})")
    if self.norm_length < 0:
      raise ValueError(f"norm_length must be >= 0 (got {self.norm_length})")
    if self.sampling.greedy:
      raise ValueError("greedy sampling draws from a point mass on the argmax, which has no gradient: train on "
                       "temperature sampling (greedy is for evaluation)")
    if self.policy_loss == "gspo" and self.aggregation != "seq_mean":
      raise ValueError(f"policy_loss='gspo' has one loss per sample, averaged over samples: set "
                       f"aggregation='seq_mean' (got {self.aggregation!r}, which would weight samples by length)")
    if self.dual_clip is not None and not self.dual_clip > 1.0 + self.clip_high:
      raise ValueError(f"dual_clip must be > 1 + clip_high = {1.0 + self.clip_high} (got {self.dual_clip})")
    if self.is_ess_min is not None and (self.is_level == "none" or not 0 < self.is_ess_min <= 1):
      raise ValueError(f"is_ess_min needs is_level != 'none' and a value in (0, 1] (got {self.is_ess_min})")
    if self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError(f"kl_coef and entropy_coef must be >= 0 (got {self.kl_coef}, {self.entropy_coef})")
    if not self.log_ratio_clamp > 0:
      raise ValueError(f"log_ratio_clamp must be > 0 (got {self.log_ratio_clamp})")

  def replace(self, **kw) -> LossConfig:
    return dataclasses.replace(self, **kw)
