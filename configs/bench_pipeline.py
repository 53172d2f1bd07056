"""bench/pipeline.py: sync vs pipeline on a long-tailed length distribution (8 CPU devices, sampler 4 / learner 4).

  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.pipeline --config=configs/bench_pipeline.py
  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.pipeline --config=configs/bench_pipeline.py:test
  JAX_NUM_CPU_DEVICES=8 PYTHONPATH=. .venv/bin/python -m jaxrl.cost_profile --config=configs/bench_pipeline.py \
      --out=/tmp/cal.json

The argument picks the size: "" (the benchmark) or "test" (the small run of tests/test_sim_validation.py).
A small random model and the target_token task; completion lengths are forced per group (EOS ignored).
"""

import ml_collections

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = "pipeline"
  c.model.source = "tiny"
  c.model.tiny = ml_collections.ConfigDict(dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                                num_heads=2, num_kv_heads=1, head_dim=32))
  c.task.name = "target_token"  # 4-token random prompts
  c.mesh.sampler_devices = 4
  c.sampler.max_slots = 16
  c.sampler.max_len = 128  # prompt + the longest forced completion
  c.sampler.steps_per_call = 8
  c.sampler.max_new_tokens = 124  # unused: bench/pipeline.py forces every group's length
  c.rl.group_size = 4
  c.rl.groups_per_step = 4  # batch of 16 samples
  c.rl.seq_len = 128
  c.rl.max_staleness = 1
  c.rl.queue_groups = 8
  c.log.tensorboard = False
  c.log.progress = False

  c.bench = ml_collections.ConfigDict()
  c.bench.median = 12.0  # median completion length of a group
  c.bench.p99_ratio = 10.0  # p99 / median (lognormal sigma = ln(10) / 2.326 ~ 0.99)
  c.bench.max_groups = 4096  # the forced-length table (groups the runs may admit)
  c.bench.measured_steps = 12  # learner steps timed per mode, after k + 1 warm-up steps
  c.bench.profile_decode_calls = 6  # jaxrl.cost_profile: generate calls timed per live-batch size
  c.bench.profile_train_reps = 3  # jaxrl.cost_profile: train steps timed alone (and again with decode running)
  c.bench.repeats = 3  # rounds of (profile, sync, pipeline); the report gives each and the medians
  if arg == "test":  # one layer (faster compiles), shorter runs
    c.model.tiny.num_layers = 1
    c.bench.measured_steps = 6
    c.bench.profile_decode_calls = 3
    c.bench.profile_train_reps = 2
    c.bench.repeats = 1
  elif arg:
    raise ValueError(f"configs/bench_pipeline.py: unknown argument {arg!r}; use '' or 'test'")
  return c
