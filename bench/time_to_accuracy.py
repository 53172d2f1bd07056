r"""Time to accuracy (issue 44): how fast each mode makes the model better, in wall seconds and in generated tokens.

  PYTHONPATH=. .venv/bin/python -m bench.time_to_accuracy --config=configs/default.py --seeds=0,1 --steps=20
  PYTHONPATH=. .venv/bin/python -m bench.time_to_accuracy --config=configs/reasoning.py --seeds=0 --every=4
  PYTHONPATH=. .venv/bin/python -m bench.time_to_accuracy --config=configs/tiny.py --seeds=0 --steps=4 \
      --num_examples=8 --extra=--config.mesh.num_devices=2 --extra=--config.mesh.sampler_devices=1   # ~5 min

Variants, same config, seed and prompts, each its own program as bench.headline runs them (sync: one process on
every core; pipeline: a learner and a sampler process pinned to half the cores each): sync, pipeline, and each with
dynamic sampling (rl.filter_groups="zero_variance"). A run keeps a checkpoint every `every` steps and runs no
evaluation of its own; afterwards each checkpoint, and the initial policy, is scored greedily on the task's first
`num_examples` held-out problems by `jaxrl-generate --config --workdir --step` (offline, so no run's clock holds
an evaluation). A checkpoint's time is its run's summed step seconds up to it (metrics.jsonl step_time_s: start-up
and compilation left out, the same for every variant), its tokens the samplers' generated tokens so far. The target
of a seed is the accuracy plain sync ends at; a variant's time to target is its first checkpoint at or above it.
JSON to bench/results/time_to_accuracy_<config>.json, plots of accuracy against seconds and against generated
tokens beside it (PNG, not committed); `--plot=JSON` draws a saved report's into docs/img (committed, shown in
docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import headline
from bench.common import write_json

FILTER = "--config.rl.filter_groups=zero_variance"
VARIANTS = {"sync": ("sync", ()), "pipeline": ("pipeline", ()), "sync_filter": ("sync", (FILTER,)),
            "pipeline_filter": ("pipeline", (FILTER,))}


def run_flags(seed: int, every: int) -> tuple[str, ...]:
  """What every run of the benchmark adds to its config: the seed, every `every`-th checkpoint kept, no eval."""
  return (f"--config.seed={seed}", f"--config.checkpoint.every_steps={every}", "--config.checkpoint.max_to_keep=10000",
          "--config.eval.num_examples=0")


def evaluate(config: str, workdir: Path | None, step: int | None, num_examples: int, out: Path,
             extra: tuple[str, ...] = ()) -> float:
  """The held-out accuracy of one checkpoint (the initial policy with workdir None), by jaxrl-generate; a task
  whose reward marks no right answers is scored by its mean reward."""
  argv = [sys.executable, "-m", "jaxrl.generate", f"--config={config}", f"--num_examples={num_examples}",
          f"--summary_out={out}", f"--output={os.devnull}", *extra]
  if workdir is not None:
    argv += [f"--workdir={workdir}", f"--step={step}"]
  proc = subprocess.run(argv, cwd=headline.ROOT, env={**os.environ, "PYTHONPATH": str(headline.ROOT)},
                        capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"evaluation failed: {' '.join(argv)}\n{proc.stderr[-3000:]}")
  summary = json.loads(out.read_text())
  return summary.get("accuracy", summary["reward_mean"])


def curve(records: list[dict], accuracy: dict[int, float]) -> list[dict[str, float]]:
  """Accuracy against summed step seconds and generated tokens: one point per evaluated step (0: the initial
  policy, at 0 s and 0 tokens), from a run's metrics.jsonl records."""
  points, seconds = [], 0.0
  if 0 in accuracy:
    points.append({"step": 0, "seconds": 0.0, "tokens": 0.0, "accuracy": accuracy[0]})
  for r in sorted(records, key=lambda r: r["step"]):
    seconds += r["step_time_s"]
    if r["step"] in accuracy:
      points.append({"step": r["step"], "seconds": seconds, "tokens": r.get("sampler/generated_tokens", 0.0),
                     "accuracy": accuracy[r["step"]]})
  return points


def time_to(points: list[dict[str, float]], target: float) -> dict[str, float] | None:
  """The first point at or above `target` accuracy (its step, seconds, tokens), or None if the run never got there."""
  return next(({k: p[k] for k in ("step", "seconds", "tokens")} for p in points if p["accuracy"] >= target), None)


def ratios(runs: dict[str, dict]) -> dict[str, float]:
  """Each variant's seconds to the target over plain sync's (below 1: faster), where both reached it."""
  base = runs["sync"]["to_target"]
  return {name: run["to_target"]["seconds"] / base["seconds"] for name, run in runs.items()
          if name != "sync" and run["to_target"] is not None and base is not None and base["seconds"] > 0}


def run_seed(config: str, seed: int, steps: int, every: int, num_examples: int, scratch: Path,
             variants: tuple[str, ...], extra: tuple[str, ...] = ()) -> dict[str, Any]:
  from jaxrl.metrics import read_jsonl

  cache = scratch / "xla_cache"
  base = evaluate(config, None, None, num_examples, scratch / f"base_{seed}.json", extra)
  runs = {}
  for name in variants:
    mode, variant = VARIANTS[name]
    workdir = scratch / f"{name}_{seed}"
    wall = headline.run(mode, config, workdir, steps, cache, run_flags(seed, every) + variant + extra)
    kept = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    accuracy = {0: base} | {s: evaluate(config, workdir, s, num_examples, scratch / f"{name}_{seed}_{s}.json",
                                        extra) for s in kept}
    records = read_jsonl(workdir / "metrics.jsonl")
    summary = json.loads((workdir / "summary.json").read_text())
    runs[name] = {"wall_s": wall, "points": curve(records, accuracy), "busy": summary["busy"],
                  "filtered_groups": summary["ledger"].get("filtered_groups", 0),
                  "samples_generated": summary["ledger"]["samples_generated"]}
    print(f"seed {seed} {name}: accuracy {base:.3f} -> {runs[name]['points'][-1]['accuracy']:.3f}, "
          f"{runs[name]['points'][-1]['seconds']:.0f} s of steps", flush=True)
  target = runs["sync"]["points"][-1]["accuracy"]
  for run in runs.values():
    run["to_target"] = time_to(run["points"], target)
  return {"seed": seed, "target": target, "runs": runs, "ratios": ratios(runs)}


def plot(seeds: list[dict], path: Path) -> None:
  """Held-out accuracy against summed step seconds and against generated tokens: a row of two panels per seed,
  a line per variant, the seed's target (plain sync's final accuracy) dashed."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(seeds), 2, figsize=(11, 3.6 * len(seeds)), squeeze=False)
  for row, result in zip(axes, seeds, strict=True):
    for name, run in result["runs"].items():
      for ax, x in zip(row, ("seconds", "tokens"), strict=True):
        ax.plot([p[x] for p in run["points"]], [p["accuracy"] for p in run["points"]], marker="o", label=name)
    for ax, x in zip(row, ("summed step seconds", "generated tokens"), strict=True):
      ax.axhline(result["target"], color="grey", linestyle="--", linewidth=0.8)
      ax.set_xlabel(x)
      ax.set_ylabel(f"greedy held-out accuracy (seed {result['seed']})")
    row[0].legend(fontsize=7)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=80)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--seeds", default="0,1")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--every", type=int, default=2, help="checkpoint (and evaluate) every this many steps")
  p.add_argument("--num_examples", type=int, default=64)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--out", default=None)
  p.add_argument("--extra", action="append", default=[], help="a --config.x=y flag for every run (repeatable)")
  p.add_argument("--plot", default=None, help="only draw this saved report's plot (a JSON of this bench) to "
                 "docs/img/<its name>.png, the plot docs/BENCHMARKS.md shows")
  args = p.parse_args(argv)
  if args.plot:
    report = Path(args.plot)
    plot(json.loads(report.read_text())["seeds"], headline.ROOT / "docs" / "img" / report.with_suffix(".png").name)
    return
  variants = tuple(args.variants.split(","))
  if "sync" not in variants or not set(variants) <= set(VARIANTS):
    raise SystemExit(f"--variants: a subset of {list(VARIANTS)} holding sync (the target), got {variants}")
  name = Path(args.config.split(":")[0]).stem
  out = Path(args.out or headline.ROOT / "bench" / "results" / f"time_to_accuracy_{name}.json")
  with tempfile.TemporaryDirectory(prefix="jaxrl-tta-") as scratch:
    seeds = [run_seed(args.config, int(s), args.steps, args.every, args.num_examples, Path(scratch), variants,
                      tuple(args.extra)) for s in args.seeds.split(",")]
  report = {"config": args.config, "steps": args.steps, "every": args.every, "num_examples": args.num_examples,
            "seeds": seeds}
  write_json(out, report)
  plot(seeds, out.with_suffix(".png"))
  for result in seeds:
    print(f"seed {result['seed']}: target {result['target']:.3f}; seconds to target / sync's: "
          + ", ".join(f"{k} {v:.2f}" for k, v in result["ratios"].items()))


if __name__ == "__main__":
  main()
