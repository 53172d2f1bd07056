r"""Multi-turn episodes with a slow tool: pipeline vs sync per trained token, side by side in one process.

  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.episodes            # ~4 min on a loaded 2-core CPU
  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.episodes --quick    # one latency, one round

The tiny config on the token_turns env (three model turns of up to 8 tokens, two observations, so each episode
waits on its tool twice): every env step sleeps a lognormal time (median `latency` s, p99 / median = 10, drawn per
problem and turn, so both modes wait on the same tools). The env steps run on a pool of 16 threads (one per decode
slot); a slot parks while its tool works and continuous batching goes on around it. For each tool latency, rounds
of a sync and a pipeline run (same config otherwise, max_staleness 0 vs 1) after one warm-up run that compiles
everything; reports wall seconds per trained model token (observation tokens excluded) and their ratio. Writes
bench/results/episodes.json; docs/BENCHMARKS.md, "Multi-turn episodes with a slow tool", explains the figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import numpy as np

from jaxrl.config import override
from jaxrl.train import train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402

Z99 = 2.3263  # the standard normal's 99th percentile
P99_RATIO = 10.0
STEPS = 8
OBSERVED_PER_EPISODE = 4  # token_turns: two observations of two tokens


def config(mode: str, latency: float, steps: int = STEPS):
  c = override(tiny.get_config(mode), **{
      "task.name": "token_turns", "sampler.max_len": 64, "rl.seq_len": 64, "sampler.max_new_tokens": 8,
      "task.env_workers": 16, "num_steps": steps, "eval.num_examples": 0, "log.tensorboard": False,
      "log.progress": False, "checkpoint.every_steps": 1000})
  c.task.kwargs.tool_latency_s = latency
  c.task.kwargs.tool_latency_sigma = math.log(P99_RATIO) / Z99
  return c


def run(mode: str, latency: float) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    s = train(config(mode, latency), workdir)
  led, episodes = s["ledger"], s["episodes"]
  assert episodes["ends"] == {"done": episodes["episodes"]} and not led["dropped"], (episodes, led)
  model_tokens = led["tokens_trained"] - OBSERVED_PER_EPISODE * led["samples_trained"]
  return {"mode": mode, "latency_median_s": latency, "train_seconds": s["train_seconds"],
          "samples_trained": led["samples_trained"], "model_tokens_trained": model_tokens,
          "us_per_model_token": 1e6 * s["train_seconds"] / model_tokens, "env_steps": episodes["env_steps"],
          "env_seconds": episodes["env_seconds"], "staleness_mean": s["staleness_mean"],
          "sampler_busy_s": s["busy"]["sampler"], "learner_busy_s": s["busy"]["learner"]}


def main(argv: list[str]) -> None:
  quick = "--quick" in argv
  latencies, rounds = ((0.05,), 1) if quick else ((0.0, 0.05, 0.2), 2)
  load = os.getloadavg()
  print(f"warm-up (compiles); load average {load}", flush=True)
  run("pipeline", 0.0)
  run("sync", 0.0)
  rows = []
  for latency in latencies:
    for r in range(rounds):
      for mode in ("sync", "pipeline"):
        row = run(mode, latency)
        row["round"] = r
        rows.append(row)
        print(json.dumps(row), flush=True)
  ratios = {}
  for latency in latencies:
    per = {m: np.median([x["us_per_model_token"] for x in rows if x["latency_median_s"] == latency
                         and x["mode"] == m]) for m in ("sync", "pipeline")}
    ratios[str(latency)] = {"sync_us_per_token": per["sync"], "pipeline_us_per_token": per["pipeline"],
                            "sync_over_pipeline": per["sync"] / per["pipeline"]}
    print(f"tool latency median {latency} s (p99 {latency * P99_RATIO:g} s): sync {per['sync']:.0f} us/token, "
          f"pipeline {per['pipeline']:.0f} us/token, sync / pipeline = {per['sync'] / per['pipeline']:.2f}")
  out = {"rows": rows, "ratios": ratios, "steps": STEPS, "p99_over_median": P99_RATIO, "load_before": load,
         "load_after": os.getloadavg(), "machine": platform.platform(), "cpus": os.cpu_count(),
         "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
  path = REPO / "bench" / "results" / ("episodes_quick.json" if quick else "episodes.json")
  path.write_text(json.dumps(out, indent=2))
  print(f"wrote {path}")


if __name__ == "__main__":
  main(sys.argv[1:])
