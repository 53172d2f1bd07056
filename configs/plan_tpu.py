"""Plan a TPU slice from what jaxrl-compile compiled for it (docs/TPU.md, docs/SIMULATOR.md): sync vs pipeline and the
split, with the compiled programs' costs, or (",roofline") with the model shape's datasheet roofline on the same chips.

  jaxrl-compile --config=configs/tpu.py --target=v5p:4x4x2 --out=bench/results/compile_qwen2.5-7b_v5p-4x4x2.json
  jaxrl-plan --config=configs/plan_tpu.py:bench/results/compile_qwen2.5-7b_v5p-4x4x2.json
  jaxrl-plan --config=configs/plan_tpu.py:bench/results/compile_qwen2.5-7b_v5p-4x4x2.json,roofline

The workload is configs/tpu.py's: 16 groups of 8 samples a step, prompts of 512 tokens, completions long-tailed
(lognormal, median 1000 tokens, p99 / median 10, capped at 3584), staleness bound 1. The sampler engine is the
report's replica; the pool is the report's slice, split on engine boundaries.
"""

import json
import math

from jaxrl.sim import plan_config


def get_config(arg: str | None = None):
  path, _, variant = (arg or "").partition(",")
  if not path or variant not in ("", "roofline"):
    raise ValueError("configs/plan_tpu.py:<jaxrl-compile report JSON>[,roofline]")
  with open(path) as f:
    report = json.load(f)
  m = report["model"]
  c = plan_config.base()
  c.model.update(name=m["preset"] or m["source"], **{k: m[k] for k in (
      "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
      "tie_embeddings")})
  c.hardware = report["chip"]
  c.compiled = "" if variant == "roofline" else path
  c.pool = report["chips"]
  c.devices_per_engine = report["split"]["sampler"]
  c.slot_tokens = report["run"]["max_len"]
  c.lengths.update(kind="lognormal", median=1000.0, sigma=math.log(10) / 2.326, max_len=3584)
  c.prompt_len = 512
  c.group_size = 8
  c.batch_sizes = (128,)
  c.ks = (0, 1)
  c.staleness_bound = 1
  c.outdir = "/tmp/jaxrl-plan-tpu"
  return c
