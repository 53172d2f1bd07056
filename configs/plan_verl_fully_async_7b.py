"""Published run: verl's fully async recipe, DAPO on Qwen2.5-Math-7B, H20 GPUs (colocated sync vs async split).

  jaxrl-plan --config=configs/plan_verl_fully_async_7b.py:128   # 128 GPUs: sync on all, async 64 rollout : 64 train
  jaxrl-plan --config=configs/plan_verl_fully_async_7b.py:64    # 64 GPUs, 32 : 32
  jaxrl-plan --config=configs/plan_verl_fully_async_7b.py:32    # 32 GPUs, 16 : 16
  python -m bench.sim_published                                 # refits the lengths, prints every error

Source: volcengine/verl, recipe/fully_async_policy/README.md (tables "colocate sync" vs "fully_async", updated
12/25/2025) and its shell/ launch scripts. Stated there: 512 prompts x 16 responses per step, max response 28,672
tokens (prompt 2,048), staleness_threshold 0.5 with partial rollouts, vLLM rollout at tensor parallel 4 with
gpu_memory_utilization 0.8, sync step = gen + old_log_prob + update_actor, async step = the trainer's step per
parameter sync (old log-probs not recomputed). Not stated, assumed here: the response-length distribution
(lognormal; its spread fitted once on the 128-GPU run's async step, its median per run so that the simulated
colocated sync generation equals the published `gen` phase of that run), a 200-token prompt, at most 1,024 live
sequences per engine, 5 ms per decode step of overhead, 80% of HBM bandwidth and 50% of peak FLOP/s in decode.
Learner throughput per mode and per device count comes from the published phase times (sync: update_actor +
old_log_prob on all GPUs; async: update_actor on the trainer GPUs) at the fitted mean length: calibration from the
run's own logs, as `jaxrl-profile` does for a jaxrl run.
"""

import ml_collections

from jaxrl.sim import plan_config

# Published per run: pool -> (sync step, sync gen, sync old_log_prob, sync update_actor, async step, async
# update_actor), seconds; async runs on pool / 2 rollout + pool / 2 train GPUs.
PUBLISHED = {
    32: (790.10, 357.41, 107.71, 269.80, 294.77, 313.81),
    64: (365.28, 150.72, 70.26, 133.41, 189.26, 156.98),
    128: (356.30, 177.85, 53.92, 113.81, 150.63, 113.16),
}
# Fitted by `python -m bench.sim_published`: the lengths' spread (once, on the 128-GPU async step) and median (per
# run, on its sync gen); the learner's tokens/s per device per mode at that length (sync on the pool, async on
# pool / 2). The 32-GPU async rate is 1.36x the H20's peak FLOP/s: the published phase times of that run cannot
# all refer to one step of 8,192 samples at any length this model fits (see docs/SIMULATOR.md).
SIGMA = 1.191
FITTED = {
    32: dict(median=1261.0, sync_tps=1827.0, async_tps=4395.8),
    64: dict(median=238.0, sync_tps=429.9, async_tps=1115.6),
    128: dict(median=356.9, sync_tps=352.9, async_tps=1046.1),
}


def get_config(arg: str | None = None):
  pool = int(arg or 128)
  if pool not in PUBLISHED:
    raise ValueError(f"published runs exist for {sorted(PUBLISHED)} GPUs (got {pool})")
  sync_step, gen, old_log_prob, update, async_step, async_update = PUBLISHED[pool]
  fit = FITTED[pool]
  c = plan_config.base()
  # Qwen2.5-Math-7B (Qwen2 architecture): 7.6B params, untied embeddings, GQA 28/4 heads.
  c.model = ml_collections.ConfigDict(dict(
      name="qwen2.5-math-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
      num_heads=28, num_kv_heads=4, head_dim=128))
  c.hardware = "h20"
  c.pool = pool
  c.devices_per_engine = 4
  c.slot_tokens = 4096  # a paged cache holds what sequences use; sized to about prompt + mean response
  c.kv_mem_fraction = 0.8
  c.max_batch_cap = 1024
  c.sync_overhead_s = 0.12  # verl's measured 7B parameter sync (checkpoint-engine table, NCCL)
  c.train_tps_by_devices = ((pool // 2, fit["async_tps"]),)
  c.sync_train_tps_by_devices = ((pool, fit["sync_tps"]),)
  c.lengths = ml_collections.ConfigDict(dict(kind="lognormal", median=fit["median"], sigma=SIGMA, max_len=28672))
  c.prompt_len = 200
  c.group_size = 16
  c.batch_sizes = (8192,)
  c.admission = "budget"
  c.admission_budget = 0.5  # staleness_threshold
  c.partial_rollouts = True
  c.ks = (1,)  # unused with an admission budget
  c.staleness_bound = 1000  # staleness is measured, not bounded, under a budget
  c.splits = (pool // 2,)
  c.steps = 6
  c.published = ml_collections.ConfigDict(dict(
      source=f"verl recipe/fully_async_policy/README.md, Qwen2.5-Math-7B on {pool} H20", sync_step_s=sync_step,
      pipeline_step_s=async_step, sampler_devices=pool // 2, sync_gen_s=gen, sync_train_s=old_log_prob + update,
      pipeline_train_s=async_update))
  c.outdir = f"/tmp/jaxrl-plan-verl-7b-{pool}"
  return c
