"""jaxrl-plan: find the best sampler/learner split of a device pool and predict its speedup over sync; recommends
sync when no split trains more tokens per second.

  jaxrl-plan --config=configs/plan_mission.py [--outdir=/tmp/plan]

Prints the sweep table and writes timeline.png, speedup_vs_split.png, staleness_vs_split.png and
speedup_vs_length.png to the output directory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from jaxrl.sim import compiled, intervals, planner, plots
from jaxrl.sim import costs as costs_lib
from jaxrl.sim import lengths as lengths_lib
from jaxrl.sim.calibrate import Calibration
from jaxrl.sim.hardware import preset
from jaxrl.sim.simulate import RunSpec, simulate_pipeline, simulate_sync


def build(config) -> dict:
  """Costs, workload and planner arguments from a plan config (importable for notebooks and tests)."""
  model = costs_lib.ModelSpec.from_dims(**config.model)
  hw = preset(config.hardware).replace(**dict(config.hardware_overrides))
  if config.compiled:
    with open(config.compiled) as f:
      report = json.load(f)
    model, hw = compiled.model_spec(report), preset(report["chip"]).replace(**dict(config.hardware_overrides))
    costs = compiled.compiled_costs(
        report, mem_eff=config.mem_eff, flop_eff=config.flop_eff, mfu=config.mfu, overhead_s=config.overhead_s,
        knee_sharpness=config.knee_sharpness, max_batch_cap=config.max_batch_cap, slot_tokens=config.slot_tokens,
        train_overhead_s=config.train_overhead_s, sync_overhead_s=config.sync_overhead_s)
  elif config.calibration:
    costs = Calibration.load(config.calibration).costs()
  else:
    costs = costs_lib.roofline_costs(
        model, hw, devices_per_engine=config.devices_per_engine, slot_tokens=config.slot_tokens,
        mem_eff=config.mem_eff, flop_eff=config.flop_eff, mfu=config.mfu, overhead_s=config.overhead_s,
        knee_sharpness=config.knee_sharpness, kv_mem_fraction=config.kv_mem_fraction,
        max_batch_cap=config.max_batch_cap, train_overhead_s=config.train_overhead_s,
        sync_overhead_s=config.sync_overhead_s, mfu_by_devices=dict(config.mfu_by_devices),
        sync_mfu_by_devices=dict(config.sync_mfu_by_devices), extra_forward_passes=config.extra_forward_passes)
  if config.train_tps_by_devices or config.sync_train_tps_by_devices:
    costs = costs.replace(train_scaling=tuple(map(tuple, config.train_tps_by_devices)),
                          sync_train_scaling=tuple(map(tuple, config.sync_train_tps_by_devices)))
  lengths = lengths_lib.from_config(config.lengths.to_dict())
  workload = RunSpec(sampler_devices=1, learner_devices=1, batch_size=config.batch_sizes[0],
                     group_size=config.group_size, max_staleness=config.ks[0], lengths=lengths,
                     prompt_len=config.prompt_len, steps=config.steps, seed=config.seed,
                     queue_groups=config.queue_groups, admission=config.admission,
                     admission_budget=config.admission_budget, partial_rollouts=config.partial_rollouts,
                     pass_fraction=config.pass_fraction)
  return dict(model=model, hardware=hw, costs=costs, workload=workload, pool=config.pool,
              staleness_bound=config.staleness_bound, batch_sizes=tuple(config.batch_sizes), ks=tuple(config.ks),
              splits=tuple(config.splits),
              learner_min_devices=costs_lib.learner_min_devices(model, hw, config.learner_bytes_per_param))


def run_plan(b: dict) -> planner.Plan:
  return planner.plan(b["costs"], b["workload"], b["pool"], staleness_bound=b["staleness_bound"],
                      batch_sizes=b["batch_sizes"], ks=b["ks"], splits=b["splits"],
                      learner_min_devices=b["learner_min_devices"])


def length_sweep(b: dict, best: planner.PlanRow, factors) -> tuple[list[float], list[float]]:
  """Best speedup (trained tokens per second over sync's) over the splits at the best (batch, k), with every length
  scaled by each factor."""
  means, speedups = [], []
  base = b["workload"].lengths
  for f in factors:
    dist = lengths_lib.Scaled(base, f, max(1, int(round(base.max_len * f))))
    wl = b["workload"].replace(lengths=dist)
    p = planner.plan(b["costs"], wl, b["pool"], staleness_bound=b["staleness_bound"],
                     batch_sizes=(best.batch_size,), ks=(best.max_staleness,), splits=b["splits"],
                     learner_min_devices=b["learner_min_devices"])
    means.append(dist.mean())
    speedups.append(p.best.token_speedup if p.best else math.nan)
  return means, speedups


def _main(argv):
  del argv
  config = flags.FLAGS.config
  outdir = flags.FLAGS.outdir or config.outdir
  os.makedirs(outdir, exist_ok=True)
  t0 = time.perf_counter()
  b = build(config)
  c = b["costs"]
  print(f"model {b['model'].name}: {b['model'].params / 1e9:.3g}B params on {b['pool']} x {b['hardware'].name}; "
        f"engine = {c.devices_per_engine} devices, {c.max_batch} slots, knee at batch {c.decode.knee_batch:.0f}; "
        f"learner needs >= {b['learner_min_devices']} devices; mean response {b['workload'].lengths.mean():.0f} "
        "tokens")
  p = run_plan(b)
  print(p.table())
  best, rec = p.best, p.recommended
  sync = p.sync[rec.batch_size]
  took = f"(sweep took {time.perf_counter() - t0:.1f} s)"
  if rec.mode == "sync":
    vs = (f"the best pipeline ({best.sampler_devices} sampler + {best.learner_devices} learner devices, batch "
          f"{best.batch_size}, k={best.max_staleness}) trains {rec.ratio:.3f}x sync's tokens per second"
          if best is not None else "no pipeline configuration is feasible")
    print(f"\nrecommended: sync on all {b['pool']} devices, batch {rec.batch_size}: {sync.step_time_s:.2f} s/step, "
          f"{sync.tokens_per_s:.4g} trained tokens/s; {vs} {took}")
  else:
    print(f"\nrecommended: pipeline, {best.sampler_devices} sampler + {best.learner_devices} learner devices, "
          f"batch {best.batch_size}, k={best.max_staleness}: {best.step_time_s:.2f} s/step, speedup "
          f"{rec.ratio:.3f}x over sync on all {b['pool']} devices per trained token ({best.speedup:.3f}x per step "
          f"at batch {best.batch_size}) {took}")
  if best is None:
    return 0
  pub = config.published
  if pub.sync_step_s:
    row = next((r for r in p.rows if r.feasible and r.sampler_devices == pub.sampler_devices
                and r.batch_size == best.batch_size), None)
    if row is not None:
      print(f"published ({pub.source}): sync {pub.sync_step_s:.4g} s/step, pipeline on {pub.sampler_devices} sampler "
            f"devices {pub.pipeline_step_s:.4g} s/step ({pub.sync_step_s / pub.pipeline_step_s:.3f}x); predicted "
            f"{row.sync_step_time_s:.4g} ({row.sync_step_time_s / pub.sync_step_s - 1:+.1%}) and {row.step_time_s:.4g} "
            f"({row.step_time_s / pub.pipeline_step_s - 1:+.1%}), {row.speedup:.3f}x")
  if config.seeds > 1:
    spec = b["workload"].replace(sampler_devices=best.sampler_devices, learner_devices=best.learner_devices,
                                 batch_size=best.batch_size, max_staleness=best.max_staleness)
    pipe = intervals.step_time_interval(functools.partial(simulate_pipeline, c), spec, config.seeds)
    sync_spec = spec.replace(sampler_devices=b["pool"] - 1, learner_devices=1)
    sync_i = intervals.step_time_interval(lambda s: simulate_sync(c, s, colocated=True), sync_spec, config.seeds)
    ratio = np.asarray(sync_i.per_seed) / np.asarray(pipe.per_seed)  # the same lengths drawn per seed
    print(f"over {config.seeds} seeds (10-90%): pipeline {pipe}; sync {sync_i}; speedup "
          f"{np.quantile(ratio, 0.1):.3f}-{np.quantile(ratio, 0.9):.3f}x (median {np.median(ratio):.3f}x)")
  plots.timeline(p.best_result(), os.path.join(outdir, "timeline.png"))
  plots.timeline(sync, os.path.join(outdir, "timeline_sync.png"))
  plots.vs_split(p, "speedup", "pipeline speedup over sync", os.path.join(outdir, "speedup_vs_split.png"))
  plots.vs_split(p, "staleness_mean", "mean staleness (learner steps)",
                 os.path.join(outdir, "staleness_vs_split.png"))
  if config.length_factors:
    means, speedups = length_sweep(b, best, config.length_factors)
    for m, s in zip(means, speedups, strict=True):
      print(f"mean length {m:8.0f} tokens: best speedup {s:.3f}x")
    plots.speedup_vs_length(means, speedups, os.path.join(outdir, "speedup_vs_length.png"),
                            label=f"batch {best.batch_size}, k={best.max_staleness}")
  print(f"plots in {outdir} ({time.perf_counter() - t0:.1f} s in all)")
  return 0


def main():
  """Console-script entry point (jaxrl-plan = "jaxrl.sim.plan:main")."""
  # Defined here, not at import, so that importing this module next to other CLIs defines no clashing flags.
  config_flags.DEFINE_config_file("config", None, "configs/plan_<name>.py", lock_config=True)
  flags.DEFINE_string("outdir", None, "where the PNGs go (default: config.outdir)")
  app.run(_main)


if __name__ == "__main__":
  main()
