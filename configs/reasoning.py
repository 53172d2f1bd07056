"""Reasoning: pipeline RL of the real SmolLM2-135M-Instruct on a reasoning-gym task, with chain of thought, on CPU.

  pip install 'jaxrl[reasoning]'
  jaxrl-train --config=configs/reasoning.py --workdir=runs/reasoning
  jaxrl-train --config=configs/reasoning.py:sync --workdir=runs/reasoning-sync    # the synchronous baseline
  jaxrl-train --config=configs/reasoning.py:long --workdir=runs/reasoning-long    # 256 tokens to think (long tail)

The argument: a mode ("pipeline", the default, "sync" or "auto") and/or "long", comma-separated ("sync,long").

The model thinks step by step and ends with a line 'Answer: <number>'; the reward is reasoning-gym's own
score_answer, run in a sandboxed worker (jaxrl/envs/reasoning_gym_reward.py). Greedy held-out accuracy is measured
before and after training, with the two-proportion z of the change (summary.json: eval_accuracy_change). The
held-out problems are chosen by hashing their question (jaxrl/envs/records.py), never by a second generator seed.
Sized like configs/default.py for a 2-core CPU: one virtual CPU device per role.

What it learns (held-out accuracy before and after, with its z): docs/BENCHMARKS.md, "Learning on real work".
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  words = [w for w in (arg or "").split(",") if w]
  unknown = [w for w in words if w not in ("pipeline", "sync", "auto", "long")]
  if unknown:
    raise ValueError(f"configs/reasoning.py: unknown argument {unknown[0]!r}; use a mode and/or 'long'")
  c = config_lib.base()
  c.mode = next((w for w in words if w != "long"), "pipeline")
  c.num_steps = 20
  c.model.source = "smollm2"
  c.task.name = "reasoning_gym"
  c.task.kwargs.dataset = "basic_arithmetic"  # "Calculate 47 - 8."; 1 for the exact answer, partial credit for
  # an answer that contains it (accuracy counts the samples scored 0 or 1)
  # SmolLM2-135M reasons in prose ("4 + 7 equals 11.") and ignores the <answer> tags the system prompt asks for
  # (greedy: 0/128 held out with answer_from="tag"): take its final answer as jaxrl's gsm8k-style tasks do
  c.task.kwargs.answer_from = "final"
  # ... and asked for an explicit last line, which answer_from="final" reads before any other number
  c.task.kwargs.system = "Think through the problem step by step. Then write the final line as 'Answer: <number>'."
  # Two terms of one or two digits, + and - only: the 135M model gets some right, so groups carry a signal
  c.task.kwargs.config = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                              allow_parentheses=False, allow_negation=False)
  # 4000 items hold ~2100 distinct questions (small numbers repeat); a tenth of those is held out by question hash
  c.task.kwargs.size = 4000
  c.task.kwargs.eval_fraction = 0.1
  c.task.max_prompt_tokens = 64  # the chain-of-thought system prompt and the question: ~50 tokens
  c.mesh.num_devices = 2
  c.mesh.sampler_devices = 1
  c.sampler.max_slots = 16
  c.sampler.max_new_tokens = 96  # room to think: a short chain of thought, then the tagged answer
  c.sampler.max_len = 160
  c.sampler.temperature = 0.7
  c.rl.seq_len = 160
  c.rl.pack = True  # thoughts vary from ~10 to 96 tokens: pack them
  c.rl.compile_ahead = False  # a packed row bucket compiles at its first use, not all before the first step
  c.rl.logprob_chunk = 512  # no float32 [rows, 160, 49152] logits tensor
  c.model.remat = True
  c.rl.atomic_step = False  # as configs/default.py: no pre-step TrainState copy (memory)
  c.rl.group_size = 8
  c.rl.groups_per_step = 2
  c.rl.max_staleness = 1
  # Dynamic sampling: many groups here score alike (every thought right, or every one wrong) and carry no policy
  # gradient; training only groups with signal and generating replacements reached higher held-out accuracy in both
  # modes, at no slower steps, even though each generated thought costs more here than the main job's answer
  # (bench/time_to_accuracy.py; docs/BENCHMARKS.md, "The chain-of-thought workload").
  c.rl.filter_groups = "zero_variance"
  c.optimizer.learning_rate = 1e-5  # at 2e-5 the policy grew verbose within 6 steps (above)
  c.checkpoint.every_steps = 10
  c.eval.num_examples = 128
  c.eval.max_new_tokens = 96
  if "long" in words:  # room for a long chain of thought: most answers stay short, a tail runs to the budget
    c.sampler.max_new_tokens = 256
    c.sampler.max_len = c.rl.seq_len = 320
    c.eval.max_new_tokens = 256
  return c
