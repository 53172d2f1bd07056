"""The learner: advantages, policy losses with off-policy corrections, TrainState and the jitted train step."""

from jaxrl.learner.advantages import (
    compute_advantages,
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from jaxrl.learner.config import LossConfig
from jaxrl.learner.logprobs import support_mask, token_logprobs
from jaxrl.learner.losses import (
    aggregation_weights,
    behavior_weights,
    dual_clip,
    ess_cap,
    ess_fraction,
    gspo_surrogate,
    kl_k2,
    kl_k3,
    pg_surrogate,
    policy_objective,
    ppo_surrogate,
)
from jaxrl.learner.optim import make_optimizer
from jaxrl.learner.state import TrainState, init_train_state, train_state_shardings
from jaxrl.learner.step import as_logits_fn, batch_shardings, batch_shards, check_batch, make_train_step, timed_step

__all__ = [
    "LossConfig",
    "TrainState",
    "aggregation_weights",
    "as_logits_fn",
    "batch_shardings",
    "batch_shards",
    "behavior_weights",
    "check_batch",
    "dual_clip",
    "compute_advantages",
    "dr_grpo_advantages",
    "grpo_advantages",
    "gspo_surrogate",
    "init_train_state",
    "ess_cap",
    "ess_fraction",
    "kl_k2",
    "kl_k3",
    "make_optimizer",
    "make_train_step",
    "pg_surrogate",
    "policy_objective",
    "ppo_surrogate",
    "reinforce_advantages",
    "rloo_advantages",
    "support_mask",
    "timed_step",
    "token_logprobs",
    "train_state_shardings",
]
