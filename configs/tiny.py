"""Tiny: a random 2-layer decoder learns a dense token-level reward in well under a minute on CPU.

  jaxrl-train --config=configs/tiny.py --workdir=/tmp/jaxrl-tiny
  jaxrl-train --config=configs/tiny.py:sync --workdir=/tmp/jaxrl-tiny-sync

The argument picks the controller ("pipeline", the default, or "sync"). Used by the end-to-end tests.
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = arg or "pipeline"
  c.num_steps = 12
  c.model.source = "tiny"
  c.task.name = "target_token"  # reward: fraction of completion tokens equal to the target id
  c.sampler.max_slots = 16
  c.sampler.max_len = 32
  c.sampler.max_new_tokens = 16
  c.rl.seq_len = 32
  c.rl.group_size = 4
  c.rl.groups_per_step = 4
  c.rl.max_staleness = 1
  c.optimizer.learning_rate = 1e-2
  c.checkpoint.every_steps = 4
  return c
