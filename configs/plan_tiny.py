"""Tiny plan on this CPU: a 2-layer decoder, a pool of 4 host "devices"; runs in a second or two (tests).

  jaxrl-plan --config=configs/plan_tiny.py --outdir=/tmp/jaxrl-plan-tiny
"""

import ml_collections

from jaxrl.sim import plan_config


def get_config(arg: str | None = None):
  del arg
  c = plan_config.base()
  c.model = ml_collections.ConfigDict(dict(
      name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8))
  c.hardware = "cpu"
  c.pool = 4
  c.slot_tokens = 64
  c.max_batch_cap = 16
  c.overhead_s = 0.002
  c.sync_overhead_s = 0.001
  c.lengths = ml_collections.ConfigDict(dict(kind="lognormal", median=8.0, sigma=0.6, max_len=48))
  c.prompt_len = 8
  c.group_size = 4
  c.batch_sizes = (16, 32)
  c.ks = (0, 1, 2)
  c.staleness_bound = 1
  c.steps = 4
  c.length_factors = (0.5, 1.0, 2.0)
  c.outdir = "/tmp/jaxrl-plan-tiny"
  return c
