"""The learner as a library: a pure train step over a user's own model, and what it needs.

    config = StepConfig(model=graphdef, optimizer=make_optimizer(1e-3), loss=LossConfig(), batch_size=16, seq_len=64)
    step = jit_train_step(config)
    state, metrics = step(init_train_state(params, config.optimizer), batch, rng)

The parts (advantages, losses, logprobs, packing, optim) are modules of this package.
"""

from jaxrl.learner.config import LossConfig
from jaxrl.learner.logprobs import token_logprobs
from jaxrl.learner.optim import make_optimizer
from jaxrl.learner.state import TrainState, init_train_state, train_state_shardings
from jaxrl.learner.step import StepConfig, jit_train_step, train_step
from jaxrl.rollout import Batch  # the learner's input, shared with the controller's make_batch (see jaxrl.rollout)

__all__ = [
    "Batch",
    "LossConfig",
    "StepConfig",
    "TrainState",
    "init_train_state",
    "jit_train_step",
    "make_optimizer",
    "token_logprobs",
    "train_state_shardings",
    "train_step",
]
