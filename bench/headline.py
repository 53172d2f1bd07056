r"""The headline: colocated sync (one process on every core: sample with all of them, then train with all of them)
vs pipeline (a learner process pinned to one half of the cores, a sampler process to the other), same config,
same initial state, same prompts; and what the simulator predicts for each run from that run's own logs.

  PYTHONPATH=. .venv/bin/python -m bench.headline                                # forced long tail (a), ~6 min
  PYTHONPATH=. .venv/bin/python -m bench.headline --workload=smollm2 --out=bench/results/headline_smollm2.json
  PYTHONPATH=. .venv/bin/python -m bench.headline --workload=test --out=/tmp/headline.json   # ~2 min

Each run is its own program, as a user runs it (configs/bench_headline.py[:workload]):
  sync:     python -m jaxrl.train --config.mode=sync  (JAX_NUM_CPU_DEVICES=2: a learner and a sampler device of one
            process, whose XLA thread pool spans every core; sync never runs them at once)
  pipeline: python -m jaxrl.distributed.launch --num_processes=2 --devices_per_process=1 --cpu_affinity=split
  auto:     python -m jaxrl.distributed.launch ... -- --config.mode=auto  (with --auto; bench.auto_steps steps: its
            sync segments run colocated as the sync baseline does, its pipeline segments as the pipeline's two
            processes). Two figures: after its measuring segment (the segments that follow it, each after its
            own warm-up step: what a long run settles to, the issue's measure) and over the whole run after warm-up
            (its sync measuring segment and the restarts between segments included)
An untimed first round of each mode fills a persistent compilation cache, so that no timed run compiles mid-run
(a new packed-row bucket or KV-recompute length); then `rounds` rounds alternate which mode goes first. From every
run's metrics.jsonl: seconds per trained (completion) token and per step (least-squares slope of step log times)
after `warmup_steps`, the sampler's and the learner's idle fractions, staleness; and `jaxrl-profile --from-run`'s
calibration of that run, the simulator's step time for it, and its error (forced lengths only: natural lengths are
not logged per group). Medians over rounds; JSON to bench/results/headline.json.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_json

ROOT = Path(__file__).parents[1]
MODES = ("sync", "pipeline")
AUTO = "auto"


def command(mode: str, config: str, workdir: Path, steps: int) -> tuple[list[str], dict[str, str]]:
  """(argv, extra environment) of one run of `mode`."""
  flags = [f"--config={config}", f"--workdir={workdir}", f"--config.num_steps={steps}"]
  if mode == "sync":
    return [sys.executable, "-m", "jaxrl.train", *flags, f"--config.mode={mode}"], {"JAX_NUM_CPU_DEVICES": "2"}
  mode_flag = [f"--config.mode={AUTO}"] if mode == AUTO else []
  return [sys.executable, "-m", "jaxrl.distributed.launch", "--num_processes=2", "--devices_per_process=1",
          "--cpu_affinity=split", "--timeout_s=1800", "--", *flags, *mode_flag], {}


def run(mode: str, config: str, workdir: Path, steps: int, cache: Path, extra: tuple[str, ...] = ()) -> float:
  """Runs one job to the end (`extra`: more flags for its processes); returns its wall seconds (start-up and
  compilation included)."""
  argv, env = command(mode, config, workdir, steps)
  argv = [*argv, *extra]
  env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  t0 = time.perf_counter()
  proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{mode} run failed ({proc.returncode}): {' '.join(argv)}\n{proc.stdout[-3000:]}"
                       f"\n{proc.stderr[-3000:]}")
  return time.perf_counter() - t0


def measure(c, mode: str, workdir: Path, warmup: int, devices: int = 2) -> dict[str, Any]:
  """A finished run's figures from its metrics.jsonl, and the simulator's prediction from its own calibration."""
  from jaxrl import config as config_lib
  from jaxrl.cost_profile import from_run
  from jaxrl.metrics import read_jsonl
  from jaxrl.sim import runlog

  records = read_jsonl(workdir / "metrics.jsonl")
  batch = c.rl.group_size * c.rl.groups_per_step
  rs = runlog.steady(records, warmup)[1:]
  out = dict(steps=len(records), measured_steps=len(rs), s_per_token=runlog.seconds_per_token(records, warmup, batch),
             step_s=runlog.step_time_s(records, warmup), **runlog.idle_fractions(records, warmup),
             staleness_mean=float(np.average([r["sample_staleness_mean"] for r in rs])),
             staleness_max=int(max(r["sample_staleness_max"] for r in rs)),
             completion_len_mean=float(np.mean([r["completion_len"] for r in rs])),
             samples_dropped=int(records[-1]["samples_dropped"]))
  if mode == AUTO:
    out.update(after_measuring(c, workdir, records, batch))
  if c.sampler.forced_lengths.median > 0 and mode != AUTO:
    cfg = config_lib.override(c.copy_and_resolve_references(), mode=mode)
    pred = from_run(cfg, workdir, devices=devices, warmup=warmup)
    out.update(predicted_step_s=pred["predicted_step_s"], prediction_error=pred["error"],
               calibration=pred["calibration"].to_json(), calibration_details=pred["details"])
  return out


def after_measuring(c, workdir: Path, records: list[dict], batch: int) -> dict[str, Any]:
  """An auto run's seconds per trained token over the segments after its first (measuring) one, each from the end
  of its warm-up step (c.auto.warmup_steps) to its last step: the restarts between segments left out."""
  import json

  segments = json.loads((workdir / "auto.json").read_text())
  seconds = tokens = 0.0
  for seg in segments[1:]:
    rs = [r for r in records if seg["start"] + c.auto.warmup_steps <= r["step"] <= seg["end"]]
    seconds += rs[-1]["time"] - rs[0]["time"]
    tokens += sum(r["completion_len"] * batch for r in rs[1:])
  return dict(s_per_token_after_measuring=seconds / tokens,
              choices=[(seg["start"], seg["end"], seg["choice"]) for seg in segments])


def ratios(runs: dict[str, dict]) -> dict[str, float]:
  """The pipeline's speedup over sync per trained token and per step; with an auto run, auto's trained tokens/s
  (after its measuring segment) over the better fixed mode's and over sync's, and over the better one's for its
  whole run."""
  sync, pipe = runs["sync"], runs["pipeline"]
  out = dict(speedup_per_token=sync["s_per_token"] / pipe["s_per_token"],
             speedup_per_step=sync["step_s"] / pipe["step_s"])
  if AUTO in runs:
    best, auto_s = min(sync["s_per_token"], pipe["s_per_token"]), runs[AUTO]["s_per_token_after_measuring"]
    out.update(auto_vs_best=best / auto_s, auto_vs_sync=sync["s_per_token"] / auto_s,
               auto_whole_run_vs_best=best / runs[AUTO]["s_per_token"])
  return out


def run_benchmark(workload: str, scratch: Path, rounds: int | None = None, with_auto: bool = False,
                  fill: bool = True) -> dict[str, Any]:
  config = f"{ROOT / 'configs' / 'bench_headline.py'}:{workload}"
  c = _load(workload)
  warmup, rounds = c.bench.warmup_steps, rounds or c.bench.rounds
  cache = scratch / "compilation_cache"
  out: dict[str, Any] = dict(workload=workload, config=config, rounds=[], load_before=os.getloadavg())
  modes = (*MODES, AUTO) if with_auto else MODES
  steps = {m: c.num_steps for m in MODES} | {AUTO: c.bench.get("auto_steps", c.num_steps)}
  for mode in modes if fill else ():  # fills the compilation cache (untimed)
    out[f"{mode}_cache_fill_s"] = run(mode, config, scratch / f"fill-{mode}", steps[mode], cache)
  for i in range(rounds):
    order = modes if i % 2 == 0 else modes[::-1]  # neither mode always runs first
    row: dict[str, Any] = dict(order=list(order))
    for mode in order:
      workdir = scratch / f"round{i}-{mode}"
      wall = run(mode, config, workdir, steps[mode], cache)
      row[mode] = dict(wall_s=wall, **measure(c, mode, workdir, warmup))
    row.update(ratios(row), load_average=os.getloadavg())
    out["rounds"].append(row)
    print(_round_line(i, row), flush=True)
  med = lambda f: float(np.median([f(r) for r in out["rounds"]]))
  out["median"] = dict(speedup_per_token=med(lambda r: r["speedup_per_token"]),
                       speedup_per_step=med(lambda r: r["speedup_per_step"]),
                       **{f"{m}_{k}": med(lambda r, m=m, k=k: r[m][k]) for m in modes
                          for k in ("s_per_token", "step_s", "sampler_idle", "learner_idle", "staleness_mean")})
  if with_auto:
    keys = ("auto_vs_best", "auto_vs_sync", "auto_whole_run_vs_best")
    out["median"].update({k: med(lambda r, k=k: r[k]) for k in keys})
  if "prediction_error" in out["rounds"][0]["sync"]:
    out["median"].update({f"{m}_prediction_error": med(lambda r, m=m: r[m]["prediction_error"]) for m in MODES})
  out.update(load_after=os.getloadavg(), host=platform.node(), cores=sorted(os.sched_getaffinity(0)),
             model=c.model.source, warmup_steps=warmup, num_steps=c.num_steps,
             batch=c.rl.group_size * c.rl.groups_per_step, forced_lengths=c.sampler.forced_lengths.to_dict())
  return out


def _load(workload: str):
  """configs/bench_headline.py's config for `workload`, as the runs load it."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("bench_headline_config", ROOT / "configs" / "bench_headline.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(workload)


def _round_line(i: int, row: dict) -> str:
  parts = []
  for m in row["order"]:
    r = row[m]
    pred = f", sim {r['prediction_error']:+.0%}" if "prediction_error" in r else ""
    parts.append(f"{m} {r['s_per_token'] * 1e3:.2f} ms/token {r['step_s']:.3f} s/step idle smp "
                 f"{r['sampler_idle']:.2f} lrn {r['learner_idle']:.2f} stale {r['staleness_mean']:.2f}{pred}")
  auto = ""
  if "auto_vs_best" in row:
    picks = ",".join(ch for _, _, ch in row[AUTO]["choices"])
    auto = f", auto ({picks}) {row['auto_vs_best']:.2f}x the better fixed mode after measuring"
  return (f"round {i}: " + "; ".join(parts) + f" -> {row['speedup_per_token']:.2f}x per token, "
          f"{row['speedup_per_step']:.2f}x per step{auto} (load {row['load_average'][0]:.1f})")


def report(out: dict) -> str:
  md = out["median"]
  lines = [f"{out['workload'] or 'forced long tail'}: {len(out['rounds'])} rounds, load average "
           f"{out['load_before'][0]:.1f} before, {out['load_after'][0]:.1f} after",
           f"median: pipeline vs colocated sync {md['speedup_per_token']:.2f}x per trained token, "
           f"{md['speedup_per_step']:.2f}x per step"]
  if "auto_vs_best" in md:
    lines.append(f"  auto after its measuring segment: {md['auto_vs_best']:.2f}x the better fixed mode, "
                 f"{md['auto_vs_sync']:.2f}x sync, per trained token (whole run with its sync measuring segment and "
                 f"restarts: {md['auto_whole_run_vs_best']:.2f}x the better fixed mode)")
  for m in [m for m in (*MODES, AUTO) if f"{m}_s_per_token" in md]:
    err = f"; simulator error {md[f'{m}_prediction_error']:+.1%}" if f"{m}_prediction_error" in md else ""
    lines.append(f"  {m}: {md[f'{m}_s_per_token'] * 1e3:.2f} ms per trained token, {md[f'{m}_step_s']:.3f} s per "
                 f"step, idle sampler {md[f'{m}_sampler_idle']:.2f} learner {md[f'{m}_learner_idle']:.2f}, staleness "
                 f"{md[f'{m}_staleness_mean']:.2f}{err}")
  return "\n".join(lines)


def main(argv=None):
  from absl import app, flags

  flags.DEFINE_string("workload", "", "configs/bench_headline.py argument: '' (forced long tail), 'test', 'smollm2'")
  flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "headline.json"), "JSON results path")
  flags.DEFINE_integer("rounds", 0, "rounds of both modes (0: the config's bench.rounds)")
  flags.DEFINE_bool("auto", False, "also run mode=auto each round (through the launcher: sync segments colocated, "
                    "pipeline segments as two processes)")
  flags.DEFINE_bool("fill", True, "run each mode once untimed first, to fill the compilation cache (--nofill: --keep's "
                    "folder holds a filled one)")
  flags.DEFINE_string("keep", "", "a folder for the runs' workdirs, kept afterwards (default: a temporary one)")

  def _main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    fl = flags.FLAGS
    if fl.keep:
      Path(fl.keep).mkdir(parents=True, exist_ok=True)
      out = run_benchmark(fl.workload, Path(fl.keep), fl.rounds or None, fl.auto, fl.fill)
    else:
      with tempfile.TemporaryDirectory(prefix="jaxrl-headline-") as scratch:
        out = run_benchmark(fl.workload, Path(scratch), fl.rounds or None, fl.auto, fl.fill)
    print(report(out))
    write_json(fl.out, out)

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
