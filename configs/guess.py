"""Guess the number: multi-turn RL of the real SmolLM2-135M-Instruct, at least 3 turns unless it guesses early.

  jaxrl-train --config=configs/guess.py --workdir=runs/guess

The env holds a number in [1, high] (high drawn in [8, task.kwargs.max_high] per problem); each model turn is a
guess, answered "Higher." or "Lower." as a tool turn of the chat template, until the guess is right (reward 1) or
the env's 5 turns run out (reward: the last guess's closeness, at most 0.5) (jaxrl/envs/guess.py). Held-out
success (finds only) is measured greedily before and after (summary.json). Sized like configs/calculator.py for a
2-core CPU: one virtual CPU device per role.
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = arg or "pipeline"
  c.num_steps = 16
  c.model.source = "smollm2"
  c.task.name = "guess"
  c.task.kwargs.max_high = 32  # 500 problems (secret, high)
  c.task.kwargs.eval_fraction = 0.25  # of them held out: 125, enough for the eval's 96
  # A miss scores 0.5 * (1 - |last guess - secret| / high): with reward 0 for a miss, 3 then 4 of the 4 groups of a
  # step were all-zero by step 5 (the base model finds ~10%), no signal, and the train reward fell to 0
  c.task.kwargs.partial_credit = 0.5
  c.task.max_prompt_tokens = 96
  c.mesh.num_devices = 2
  c.mesh.sampler_devices = 1
  c.sampler.max_slots = 16
  c.sampler.max_len = 256  # prompt + the episode (GuessEnv.max_tokens)
  c.sampler.max_new_tokens = 16  # per model turn: a guess
  c.sampler.temperature = 0.8
  c.rl.seq_len = 256
  c.rl.pack = True
  c.rl.compile_ahead = False  # a bucket at its first use
  c.rl.logprob_chunk = 512
  c.model.remat = True
  c.rl.group_size = 8
  c.rl.groups_per_step = 4
  c.rl.max_staleness = 1
  c.optimizer.learning_rate = 1e-5
  c.checkpoint.every_steps = 4
  c.eval.num_examples = 96
  c.eval.max_new_tokens = 16
  return c
