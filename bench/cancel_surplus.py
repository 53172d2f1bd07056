r"""Cancelling surplus groups (rl.cancel_surplus): what dynamic sampling's over-asked groups cost the sampler with and
without Sampler.cancel, on the same config and seed.

  PYTHONPATH=. .venv/bin/python -m bench.cancel_surplus --config=configs/default.py --steps=8   # SmolLM2, ~20 min
  PYTHONPATH=. .venv/bin/python -m bench.cancel_surplus --config=configs/tiny.py --steps=4 --modes=sync \
      --extra=--config.rl.filter_groups=zero_variance --out=/tmp/cancel_tiny.json   # a smoke run, ~1 min

Each mode (sync: one process; pipeline: a learner and a sampler process, as bench.headline runs them) runs twice,
cancel off then on, each its own program. Reported per run, from summary.json and metrics.jsonl: the samples and
completion tokens generated, the sampler's decode row-steps (sampler/slot_steps: the decode work, padding rows
included) and its cancelled samples, the samples dropped as surplus, and the summed step seconds after the first
step (compilation left out). The ratios on / off of decode row-steps and of step seconds say what cancelling saved.
JSON to bench/results/cancel_surplus_<config>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import headline
from bench.common import write_json


def one_run(mode: str, config: str, steps: int, seed: int, cancel: bool, scratch: Path,
            extra: tuple[str, ...]) -> dict[str, Any]:
  from jaxrl.metrics import read_jsonl

  workdir = scratch / f"{mode}_{'on' if cancel else 'off'}"
  flags = (f"--config.seed={seed}", "--config.eval.num_examples=0", f"--config.checkpoint.every_steps={steps}",
           f"--config.rl.cancel_surplus={cancel}", *extra)
  wall = headline.run(mode, config, workdir, steps, scratch / "xla_cache", flags)
  records = sorted(read_jsonl(workdir / "metrics.jsonl"), key=lambda r: r["step"])
  led = json.loads((workdir / "summary.json").read_text())["ledger"]
  last = records[-1]
  return {"wall_s": wall, "step_s_after_first": sum(r["step_time_s"] for r in records[1:]),
          "samples_generated": led["samples_generated"], "tokens_generated": led["tokens_generated"],
          "samples_trained": led["samples_trained"], "surplus_samples": led["dropped"].get("surplus", 0),
          "filtered_samples": led["dropped"].get("filtered", 0),
          "slot_steps": last.get("sampler/slot_steps", 0.0), "cancelled": last.get("sampler/cancelled", 0.0)}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/default.py")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--modes", default="sync,pipeline")
  p.add_argument("--extra", action="append", default=[], help="a flag every run adds (repeatable)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  scratch = Path(tempfile.mkdtemp(prefix="jaxrl-cancel-"))
  print(f"cancel_surplus: runs in {scratch}", file=sys.stderr, flush=True)
  out: dict[str, Any] = {"config": args.config, "steps": args.steps, "seed": args.seed, "extra": args.extra,
                         "modes": {}}
  for mode in args.modes.split(","):
    runs = {name: one_run(mode, args.config, args.steps, args.seed, cancel, scratch, tuple(args.extra))
            for name, cancel in (("off", False), ("on", True))}
    on, off = runs["on"], runs["off"]
    runs["on_over_off"] = {k: on[k] / off[k] if off[k] else float("nan")
                           for k in ("slot_steps", "tokens_generated", "step_s_after_first")}
    out["modes"][mode] = runs
    for name in ("off", "on"):
      r = runs[name]
      print(f"{mode} cancel {name}: {r['samples_generated']} samples / {r['tokens_generated']} tokens generated for "
            f"{r['samples_trained']} trained, {r['surplus_samples']} surplus, {r['cancelled']:.0f} cancelled; "
            f"{r['slot_steps']:.0f} decode row-steps; {r['step_s_after_first']:.1f} s of steps after the first",
            flush=True)
    print(f"{mode} on / off: " + ", ".join(f"{k} x{v:.2f}" for k, v in runs["on_over_off"].items()), flush=True)
  name = Path(args.config).stem
  write_json(args.out or headline.ROOT / f"bench/results/cancel_surplus_{name}.json", out)


if __name__ == "__main__":
  main()
