"""The systems model against published runs of another RL framework (verl's fully async recipe on H20 GPUs).

    .venv/bin/python -m bench.sim_published            # ~5 min; writes bench/results/sim_published.json

The source states everything the model needs but the response lengths. They are taken as lognormal (median m,
spread sigma, capped at the max response length), and fitted on as little as possible:
- sigma (the tail: how much of a sync step waits for the longest samples) once, on the 128-GPU run's async step;
- each run's median on its own published sync `gen` phase (its lengths differ: they drift during training).
The learner's per-device rate per mode comes from the published phase times at that length (sync: old log-probs
+ update on the whole pool; async: update on the trainer GPUs). Then predicted, with nothing else fitted: the
sync and async steps of the 32- and 64-GPU runs, the 128-GPU staleness ablation (threshold 0 / 0.1 / 0.3 with
each row's own update time) and the 30B-A3B MoE run, over 5 seeds each.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import numpy as np

from jaxrl.sim import intervals, plan
from jaxrl.sim import lengths as lengths_lib
from jaxrl.sim.simulate import RunSpec, simulate_pipeline, simulate_sync

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEDS = 5
# The 128-GPU staleness ablation of the same README: threshold -> (async step, async update_actor), seconds.
ABLATION_128 = {0.0: (231.34, 98.77), 0.1: (171.30, 109.12), 0.3: (146.11, 103.22), 0.5: (150.63, 113.16)}


def load(name: str, arg=None):
  spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


def lengths_of(c, median: float):
  return lengths_lib.LogNormal(median, c.lengths.sigma, c.lengths.max_len)


def bisect_log(f, target: float, lo: float, hi: float, rounds: int) -> tuple[float, bool]:
  """x in [lo, hi] with f(x) = target for an increasing f, by bisection in log x; (x, False) if out of range."""
  if f(hi) < target or f(lo) > target:
    return (hi if f(hi) < target else lo), False
  for _ in range(rounds):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
  return math.sqrt(lo * hi), True


def tokens_per_s(c, median: float, seconds: float, devices: int) -> float:
  """Per-device rate at which `devices` devices train one step's tokens (prompt + mean response) in `seconds`."""
  return c.batch_sizes[0] * (c.prompt_len + lengths_of(c, median).mean()) / (seconds * devices)


def costs_for(c, median: float):
  """The plan config's roofline costs; the learner's rate per mode from the published phase times at this median."""
  b = plan.build(c)
  pub = c.published
  learners = c.pool - pub.sampler_devices
  costs = b["costs"].replace(train_scaling=((learners, tokens_per_s(c, median, pub.pipeline_train_s, learners)),),
                             sync_train_scaling=((c.pool, tokens_per_s(c, median, pub.sync_train_s, c.pool)),))
  mfu = lambda tps: tps * 6 * b["model"].flop_params / b["hardware"].peak_flops  # noqa: E731
  return costs, mfu(costs.sync_train_scaling[0][1]), mfu(costs.train_scaling[0][1])


def spec_for(c, median: float, seed: int = 0) -> RunSpec:
  """The plan config's workload at the published split, with lengths of this median."""
  return plan.build(c)["workload"].replace(
      sampler_devices=c.published.sampler_devices, learner_devices=c.pool - c.published.sampler_devices,
      lengths=lengths_of(c, median), seed=seed)


def sync_gen_s(c, median: float) -> float:
  """Mean generation phase of the simulated colocated sync steps (from a publish to the next train start)."""
  costs, _, _ = costs_for(c, median)
  r = simulate_sync(costs, spec_for(c, median), colocated=True)
  ends = np.concatenate([[0.0], r.step_end_s[:-1]])
  return float(np.mean(r.step_start_s - ends))


def fit_median(c) -> tuple[float, bool]:
  """The median whose simulated sync generation phase is the published one (it grows with the lengths)."""
  return bisect_log(lambda m: sync_gen_s(c, m), c.published.sync_gen_s, 20.0, float(c.lengths.max_len), 16)


def fit_sigma(c) -> float:
  """The spread at which the run's async step (median refitted to its sync gen) is the published one.

  A longer tail (larger sigma, smaller median for the same sync gen) makes the sync step wait more for its
  slowest samples, so the same sync gen leaves fewer tokens to generate: the async step falls with sigma.
  """
  def async_step(sigma):
    c.lengths.sigma = sigma
    median, _ = fit_median(c)
    costs, _, _ = costs_for(c, median)
    return -simulate_pipeline(costs, spec_for(c, median)).step_time_s
  sigma, ok = bisect_log(async_step, -c.published.pipeline_step_s, 0.4, 2.0, 8)
  if not ok:
    raise RuntimeError(f"no spread in [0.4, 2] reproduces the published async step of {c.published.source}")
  return sigma


def predict(c, median: float, fitted: bool) -> dict:
  costs, sync_mfu, async_mfu = costs_for(c, median)
  spec = spec_for(c, median)
  pipe = intervals.step_time_interval(lambda s: simulate_pipeline(costs, s), spec, SEEDS)
  sync = intervals.step_time_interval(lambda s: simulate_sync(costs, s, colocated=True), spec, SEEDS)
  pub = c.published
  last = simulate_pipeline(costs, spec).summary()
  return dict(
      source=pub.source, pool=c.pool, sampler_devices=pub.sampler_devices, sigma=c.lengths.sigma,
      fitted_median=median, median_fits=fitted,
      mean_response=lengths_of(c, median).mean(), sync_mfu=sync_mfu, async_mfu=async_mfu,
      sync_published_s=pub.sync_step_s, sync_predicted_s=sync.median, sync_interval_s=(sync.lo, sync.hi),
      sync_error=sync.median / pub.sync_step_s - 1, pipeline_published_s=pub.pipeline_step_s,
      pipeline_predicted_s=pipe.median, pipeline_interval_s=(pipe.lo, pipe.hi),
      pipeline_error=pipe.median / pub.pipeline_step_s - 1, speedup_published=pub.sync_step_s / pub.pipeline_step_s,
      speedup_predicted=sync.median / pipe.median, staleness_mean=last["staleness_mean"],
      staleness_max=last["staleness_max"])


def main():
  sigma = fit_sigma(load("plan_verl_fully_async_7b", "128"))
  print(f"lengths' spread fitted on the 128-GPU async step: sigma {sigma:.3f}")
  runs = [("plan_verl_fully_async_7b", str(p)) for p in (128, 64, 32)] + [("plan_verl_fully_async_30b_a3b", None)]
  rows = []
  for name, arg in runs:
    c = load(name, arg)
    c.lengths.sigma = sigma
    median, fits = fit_median(c)
    row = predict(c, median, fits)
    rows.append(row)
    note = "" if fits else " (AT THE BOUND: no median reproduces the published sync gen)"
    impossible = " (> 1: impossible)" if row["async_mfu"] > 1 else ""
    print(f"{row['source']}: fitted median {median:.0f}{note} (mean {row['mean_response']:.0f}) tokens, implied MFU "
          f"sync {row['sync_mfu']:.3f} async {row['async_mfu']:.3f}{impossible}\n"
          f"  sync     published {row['sync_published_s']:7.1f} s  predicted {row['sync_predicted_s']:7.1f} s "
          f"({row['sync_error']:+.1%})\n"
          f"  pipeline published {row['pipeline_published_s']:7.1f} s  predicted {row['pipeline_predicted_s']:7.1f} s "
          f"({row['pipeline_error']:+.1%}; seeds {row['pipeline_interval_s'][0]:.1f}-"
          f"{row['pipeline_interval_s'][1]:.1f})"
          f"\n  speedup  published {row['speedup_published']:.2f}x predicted {row['speedup_predicted']:.2f}x; "
          f"staleness mean {row['staleness_mean']:.2f} max {row['staleness_max']}")
  c128 = load("plan_verl_fully_async_7b", "128")
  c128.lengths.sigma = sigma
  median = rows[0]["fitted_median"]
  ablation = []
  for threshold, (step, update) in ABLATION_128.items():
    c = c128.copy_and_resolve_references()
    c.published.pipeline_train_s = update
    c.admission_budget = threshold
    costs, _, _ = costs_for(c, median)
    pipe = intervals.step_time_interval(lambda s, costs=costs: simulate_pipeline(costs, s), spec_for(c, median), SEEDS)
    ablation.append(dict(threshold=threshold, published_s=step, predicted_s=pipe.median, error=pipe.median / step - 1))
    print(f"128 GPUs, staleness_threshold {threshold}: published {step:.1f} s, predicted {pipe.median:.1f} s "
          f"({pipe.median / step - 1:+.1%})")
  out = ROOT / "bench" / "results" / "sim_published.json"
  out.write_text(json.dumps(dict(sigma=sigma, runs=rows, ablation_128=ablation, seeds=SEEDS), indent=1))
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
