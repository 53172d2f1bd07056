"""bench/headline.py: colocated sync (one process on both cores) vs pipeline (a learner process on one core, a
sampler process on the other), on forced long-tailed lengths ("" / "test") or SmolLM2's own ("smollm2").

  PYTHONPATH=. .venv/bin/python -m bench.headline                       # both workloads, ~12 min
  PYTHONPATH=. .venv/bin/python -m jaxrl.train --config=configs/bench_headline.py --config.mode=sync \
      --workdir=/tmp/h-sync                                            # one sync run as the benchmark runs it
  PYTHONPATH=. .venv/bin/python -m jaxrl.distributed.launch --num_processes=2 --devices_per_process=1 \
      --cpu_affinity=split -- --config=configs/bench_headline.py --workdir=/tmp/h-pipe

The argument picks the workload: "" (a random 2-layer decoder, lognormal lengths, median 12, p99 / median 10),
"test" (the same, fewer steps: tests/test_headline.py) or "smollm2" (the real SmolLM2-135M-Instruct on arithmetic
prompts, its own answer lengths). Every process has 2 devices' worth of roles: 1 learner device + 1 sampler device
(one process of 2 CPU devices for sync, two processes of 1 for the pipeline).
"""

import ml_collections

from jaxrl import config as config_lib


def get_config(arg: str | None = None):
  c = config_lib.base()
  c.mode = "pipeline"
  c.num_steps = 40  # 37 timed steps: the box's speed drifts between minutes, 13 steps were too few (see below)
  c.mesh.sampler_devices = 1  # of 2: one learner device, one sampler device (a whole process in the pipeline)
  c.model.source = "tiny"
  c.model.tiny = ml_collections.ConfigDict(dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                                                num_heads=2, num_kv_heads=1, head_dim=32))
  c.task.name = "target_token"  # 4-token random prompts
  c.sampler.max_slots = 16
  c.sampler.max_len = 128
  c.sampler.steps_per_call = 8
  c.sampler.max_new_tokens = 120
  c.sampler.forced_lengths.median = 12.0
  c.sampler.forced_lengths.p99_ratio = 10.0
  c.rl.group_size = 4
  c.rl.groups_per_step = 8  # batch of 32 samples
  c.rl.seq_len = 128
  c.rl.pack = True  # the train step costs the real tokens: comparable with the sampler's share
  c.rl.num_minibatches = 1
  # Chunks of <= 6 rows: a packed batch of 8+ rows in one chunk ran slower per row on one core (out of cache;
  # bench/headline_parts.py)
  c.rl.microbatch_rows = 6
  # The pipeline's settings (sync ignores both): with k = 1 a sampler that has its next share's groups admitted
  # has no room for more, so its slots empty while the share's long samples finish (the sync step's tail again), and
  # recomputing the KV cache of every in-flight sample at each update grows with k; k = 2 with keep_kv (continue
  # in-flight samples over the old keys/values, PipelineRL's in-flight update) gave the shortest pipeline step on this
  # box. Each choice here, with its figures: docs/BENCHMARKS_HISTORY.md, "The headline: colocated sync vs pipeline".
  c.rl.max_staleness = 2
  c.sampler.on_update = "keep_kv"
  c.rl.queue_groups = 16
  c.checkpoint.every_steps = 1000  # no checkpoint inside the timed steps (one at the end)
  c.log.tensorboard = False
  c.log.progress = False
  c.bench = ml_collections.ConfigDict(dict(warmup_steps=3, rounds=5))  # untimed first steps; rounds of both modes
  if arg == "test":
    c.num_steps = 7
    c.model.tiny.num_layers = 1
    c.rl.pack = False  # one train-step shape: a single-process run compiles no new row bucket mid-run
    c.rl.max_staleness = 1  # the simulator's check (tests/test_headline.py) at the bound and update it was made at
    c.sampler.on_update = "recompute"
    c.bench.rounds = 1
  elif arg == "smollm2":  # configs/default.py's model and task, a longer answer budget: the model's own lengths
    c.model.source = "smollm2"
    c.task.name = "arithmetic"
    c.task.kwargs.digits = 2
    c.task.kwargs.ops = ("+",)
    c.task.max_prompt_tokens = 56  # the chat template makes these prompts 52 tokens
    c.sampler.temperature = 0.7
    c.optimizer.learning_rate = 2e-5
    c.sampler.forced_lengths.median = 0.0
    c.sampler.max_slots = 16
    c.sampler.max_len = 160
    c.sampler.max_new_tokens = 96
    c.rl.groups_per_step = 4
    c.rl.seq_len = 160
    c.num_steps = 6
    c.bench.warmup_steps = 2
    c.bench.rounds = 2
    # mode=auto (bench/headline.py --auto) runs longer: a sync segment of 5 steps measures (4 left too few steps with
    # decode calls to calibrate the model), two of 4 follow
    c.bench.auto_steps = 13
    c.auto.measure_steps = 5
    c.auto.recheck_steps = 4
  elif arg:
    raise ValueError(f"configs/bench_headline.py: unknown argument {arg!r}; use '', 'test' or 'smollm2'")
  return c
