"""Reasoning RL at real sizes on a TPU slice: compile it for the slice before renting it (docs/TPU.md).

  jaxrl-compile --config=configs/tpu.py --target=v5p:4x4x2 --out=report.json                 # Qwen2.5-7B
  jaxrl-compile --config=configs/tpu.py:qwen3-32b --target=v5p:8x8x2 --config.mesh.sampler_devices=64 \
      --config.mesh.sampler_axes.tensor=4
  jaxrl-compile --config=configs/tpu.py:qwen3-30b-a3b --target=v5p:4x4x2       # MoE: experts over 4 chips

The argument is a model preset (jaxrl.models.presets; default qwen2.5-7b): its shape, random weights. Half of
v5p:4x4x2 samples (whole hosts on a multi-host slice: one sampler replica per host, mesh.sampler_axes over its chips),
half learns (FSDP). Rows of 4096 tokens (512 of prompt), 16 groups of 8 samples a step in 2 mini-batches, one row
per chip at a time (rl.microbatch_rows), full remat, log-probs 1024 positions at a time; a paged KV cache of 64
slots per sampler replica. To train for real, set model.source to the model's HF folder (its weights and tokenizer)
and model.preset="". A mixture-of-experts preset (qwen3-30b-a3b) splits its experts over an "expert" mesh axis of
4 chips on both sides (docs/MOE.md).
"""

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.model.preset = arg or "qwen2.5-7b"
  c.model.source = "smollm2"  # the tokenizer of a run from this file (prompts); the preset gives the model's shape
  c.model.remat = True
  c.task.name = "reasoning_gym"
  c.task.max_prompt_tokens = 512
  c.mode = "pipeline"
  c.rl.max_staleness = 1
  c.mesh.num_devices = -1
  c.mesh.sampler_devices = 16  # half of v5p:4x4x2; on another slice set it (whole hosts: a multiple of 4 chips)
  c.sampler.kv = "paged"
  c.sampler.max_slots = 64
  c.sampler.max_len = 4096
  c.sampler.max_new_tokens = 3584
  c.sampler.steps_per_call = 16
  c.rl.seq_len = 4096
  c.rl.group_size = 8
  c.rl.groups_per_step = 16
  c.rl.num_minibatches = 2
  c.rl.microbatch_rows = 1
  c.rl.logprob_chunk = 1024
  c.rl.atomic_step = False  # no copy of the pre-step TrainState (params + Adam moments) while a step runs
  c.optimizer.learning_rate = 1e-6
  if c.model.preset == "qwen3-30b-a3b":
    c.mesh.learner_axes = dict(fsdp=-1, expert=4)
    c.mesh.sampler_axes = dict(data=-1, expert=4)
  return c
