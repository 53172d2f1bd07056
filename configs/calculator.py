"""Calculator: multi-turn RL of the real SmolLM2-135M-Instruct on arithmetic word problems with a calculator tool.

  jaxrl-train --config=configs/calculator.py --workdir=runs/calculator
  python -m jaxrl.train --config=configs/calculator.py:sync --workdir=runs/calculator-sync

Each episode: the model may write <calc>expression</calc> (the turn ends there), the env answers with the value as
a tool turn of the chat template, and the model goes on; a turn without a call is its final answer, rewarded 1
when right (jaxrl/envs/calculator.py). Held-out success is measured greedily before and after (summary.json).
Sized like configs/default.py for a 2-core CPU: one virtual CPU device per role.
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = arg or "pipeline"
  c.num_steps = 16
  c.model.source = "smollm2"
  c.task.name = "calculator"
  c.task.kwargs.digits = 1  # one-digit numbers: the base model solves ~40%, so most groups carry a signal
  c.task.max_prompt_tokens = 144  # system prompt, the solved example episode, the word problem: 110-130 tokens
  c.mesh.num_devices = 2
  c.mesh.sampler_devices = 1
  c.sampler.max_slots = 16
  c.sampler.max_len = 256  # prompt + the episode (CalculatorEnv.max_tokens)
  c.sampler.max_new_tokens = 40  # per model turn
  c.sampler.temperature = 0.8
  c.rl.seq_len = 256
  c.rl.pack = True  # episodes vary from ~10 to ~100 tokens: pack them
  c.rl.compile_ahead = False  # a bucket at its first use: 8 buckets of this model would take minutes to start
  c.rl.logprob_chunk = 512  # no float32 [rows, 256, 49152] logits tensor (0.8 GB per 16 rows)
  c.model.remat = True  # the learner's activations are recomputed in the backward pass: peak memory, not speed
  c.rl.group_size = 8
  c.rl.groups_per_step = 4
  c.rl.max_staleness = 1
  c.optimizer.learning_rate = 1e-5  # 2e-5 with 4 groups per step collapsed the policy (two-digit problems)
  c.checkpoint.every_steps = 4
  c.eval.num_examples = 128
  c.eval.max_new_tokens = 40
  return c
