"""Mission plan: a ~32B dense model RL'd on a fixed pool of 32 H100s, long-tailed lengths, staleness bound 1.

  jaxrl-plan --config=configs/plan_mission.py --outdir=/tmp/jaxrl-plan-mission
  jaxrl-plan --config=configs/plan_mission.py:k2   # allow two steps of staleness

The response lengths match the long tail publicly reported for a synchronous RL step of a ~30B model
(Applied Compute, "Efficient Reinforcement Learning", AI Engineer 2025): 40 prompts x 32 samples, 99% of
samples done by ~40 s, the step ends near 120 s. Modelled as 99.5% lognormal(median 500, sigma 0.47) and a 0.5%
runaway component lognormal(median 6000, sigma 0.3), both capped at 8192 tokens (that reproduces the report on
every seed; a 1% tail often put the 99th percentile inside the tail).
"""

import ml_collections

from jaxrl.sim import plan_config


def get_config(arg: str | None = None):
  c = plan_config.base()
  # Qwen2.5-32B shapes (dense, GQA 40/8 heads, 64 layers): 32.8B params, 256 KiB of bf16 KV per token.
  c.model = ml_collections.ConfigDict(dict(
      name="qwen2.5-32b", vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
      num_heads=40, num_kv_heads=8, head_dim=128))
  c.hardware = "h100"
  # Learner and sampler sit on different 8-GPU hosts: weights cross InfiniBand (400 Gb/s per GPU).
  c.hardware_overrides = ml_collections.ConfigDict(dict(link_bandwidth=50e9))
  c.pool = 32
  c.devices_per_engine = 2  # tensor-parallel degree of one sampler engine (65 GB of weights on 2 x 80 GB)
  c.slot_tokens = 2048  # KV reserved per live sequence (paged cache sized to typical, not maximum, context)
  c.lengths = ml_collections.ConfigDict(dict(
      kind="mixture", weights=[0.995, 0.005],
      components=[dict(kind="lognormal", median=500.0, sigma=0.47, max_len=8192),
                  dict(kind="lognormal", median=6000.0, sigma=0.3, max_len=8192)]))
  c.prompt_len = 256
  c.group_size = 32
  c.batch_sizes = (1280,)  # 40 prompts x 32 samples
  c.staleness_bound = 2 if arg == "k2" else 1
  c.ks = tuple(range(c.staleness_bound + 1))
  c.length_factors = (0.25, 0.5, 1.0, 2.0, 4.0)
  c.outdir = "/tmp/jaxrl-plan-mission"
  return c
