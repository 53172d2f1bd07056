"""What the reasoning workload (configs/reasoning.py:long: SmolLM2-135M-Instruct, chain of thought, up to 256 new
tokens) would do on accelerators, from the systems model: sync vs pipeline on a pool of H100s at the workload's own
completion lengths.

  jaxrl-plan --config=configs/plan_reasoning.py --outdir=/tmp/jaxrl-plan-reasoning          # 8 x H100, roofline
  jaxrl-plan --config=configs/plan_reasoning.py:batch16 --outdir=/tmp/jaxrl-plan-reasoning  # the CPU run's batch

The lengths are a lognormal fit (capped at 256) of the completions the long variant trained on this CPU (below);
replace them with your own run's for a plan of your workload. The learner and sampler costs are the roofline
defaults of jaxrl/sim/plan_config.py for H100 (not calibrated on a GPU: no accelerator was lent when this was made).
"""

import ml_collections

from jaxrl.sim import plan_config

# Lognormal fit of the 80 completions the auto run's sync segment of bench/reasoning_headline.py --variant=long trained
# (2026-12-06: median 44, mean 56, max 256 tokens)
MEDIAN, SIGMA = 44.0, 0.82


def get_config(arg: str | None = None):
  if arg not in (None, "", "batch16"):
    raise ValueError(f"configs/plan_reasoning.py: unknown argument {arg!r}; use '' or 'batch16'")
  c = plan_config.base()
  c.model = ml_collections.ConfigDict(dict(  # SmolLM2-135M-Instruct's sizes (its config.json)
      name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
      num_kv_heads=3, head_dim=64, tie_embeddings=True))
  c.hardware = "h100"
  c.pool = 8
  c.slot_tokens = 512  # prompt (~50) + 256 new tokens, rounded up
  c.lengths = ml_collections.ConfigDict(dict(kind="lognormal", median=MEDIAN, sigma=SIGMA, max_len=256))
  c.prompt_len = 50
  c.group_size = 8
  c.batch_sizes = (16,) if arg == "batch16" else (512,)  # the CPU run's 2 groups of 8; a production 64 x 8
  c.ks = (0, 1, 2)
  c.staleness_bound = 2
  c.steps = 6
  c.outdir = "/tmp/jaxrl-plan-reasoning"
  return c
