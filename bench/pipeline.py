r"""Sync vs pipeline on one config and a long-tailed length distribution, side by side in one run; and what the
simulator, calibrated by jaxrl.cost_profile on this machine in the same session, predicted for both.

  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.pipeline                     # configs/bench_pipeline.py, ~4 min
  JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m bench.pipeline --config=configs/bench_pipeline.py:test   # ~2 min

Completion lengths are lognormal per group (p99 = p99_ratio x median), forced with per-request max_tokens and EOS
ignored (a Sampler subclass reads the length of group g from a table: the Controller submits every group with
RunSpec.max_new_tokens). Both modes are built once by jaxrl.train.build (same engine, train step, prompts and
rewards, and the same controller loop: sync is max_staleness 0) and warmed up (every executable compiled, every
KV-rebuild bucket too).
Then `repeats` rounds each time a sync and a pipeline run from the same initial state on the same groups, with a
profile before every run and after the last; the sampler alone (continuous batching, no barrier) and the learner
alone are timed too. Reports wall time per trained token, steady-state step time (least-squares slope after the
warm-up steps, as the simulator measures it), sampler/learner idle fractions (Controller.busy), staleness, and the
simulator's prediction from the session's pooled profiles for the same lengths (replayed group by group). Writes
bench/results/pipeline.json; docs/BENCHMARKS.md, "Pipeline vs sync on 8 virtual devices, and the simulator",
explains the figures."""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":
  os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_json
from jaxrl.controller.local import LocalController
from jaxrl.controller.weights import WeightPublisher
from jaxrl.cost_profile import pooled, profile, summary
from jaxrl.sampler import Engine
from jaxrl.sampler.forced import Z99, ForcedLengths
from jaxrl.sim.calibrate import fit_calibration
from jaxrl.sim.lengths import Replay
from jaxrl.sim.planner import Prediction, RunDescription, predict


def group_lengths(n: int, median: float, p99_ratio: float, max_len: int, seed: int) -> np.ndarray:
  """Lognormal completion lengths of n groups, p99 / median = p99_ratio, clipped to [1, max_len]."""
  sigma = np.log(p99_ratio) / Z99
  raw = median * np.exp(sigma * np.random.default_rng(seed).standard_normal(n))
  return np.clip(np.rint(raw), 1, max_len).astype(np.int64)


@dataclasses.dataclass
class Bench:
  """A built run and what both modes share: the length table and the initial train state."""

  config: Any
  run: Any  # jaxrl.train.Run
  engine: Engine
  lengths: np.ndarray  # forced completion length of group g
  state0: Any  # initial TrainState (every controller starts from a copy: the train step donates its state)
  prompt_len: int

  def length_of(self, group_id: int) -> int:
    if group_id >= len(self.lengths):
      raise ValueError(f"group {group_id} has no forced length (the table holds {len(self.lengths)})")
    return int(self.lengths[group_id])

  def controller(self, mode: str, num_steps: int, on_step=None) -> LocalController:
    c, ctl, engine = self.config, self.run.controller, self.engine
    learner, sampling = ctl.learner_loop, ctl.sampler_loop
    k = c.rl.max_staleness if mode == "pipeline" else 0
    spec = dataclasses.replace(ctl.spec, num_steps=num_steps, max_staleness=k)
    state = jax.tree.map(jnp.copy, self.state0)
    sampler = ForcedLengths(self.length_of, engine, state.params, 0, seed=c.seed, on_update=c.sampler.on_update)
    return LocalController(spec, sampler=sampler, train_step=learner.train_step, state=state,
                    publisher=WeightPublisher(engine.param_shardings), prompts=sampling.prompts, score=sampling.score,
                    on_step=on_step)


def setup(c, workdir) -> Bench:
  from jaxrl.train import build

  run = build(c, workdir)
  engine = run.sampler_side.engine  # the run's own engine: same executables as jaxrl-train's sampler
  b = c.bench
  prompt_len = len(run.controller.sampler_loop.prompts(0)[0])
  lengths = group_lengths(b.max_groups, b.median, b.p99_ratio, c.sampler.max_len - prompt_len, c.seed)
  return Bench(c, run, engine, lengths, jax.tree.map(jnp.copy, run.controller.learner_loop.state), prompt_len)


def warm_up(bench: Bench) -> None:
  """Compiles everything both timed runs use: a short run of each mode, and a KV rebuild at every bucket."""
  for mode, steps in (("sync", 2), ("pipeline", bench.config.rl.max_staleness + 2)):
    bench.controller(mode, steps).run()
  engine = bench.engine
  params = engine.place(bench.state0.params, 0)
  state = engine.init_decode_state()
  for b in engine.buckets:
    state = engine.rebuild(params, state, b)
  jax.block_until_ready(state)  # the train step's packed row buckets were compiled at build (CompiledSteps)


def _slope(step_end: np.ndarray, warmup: int) -> float:
  """Seconds per step: least-squares slope of step end times from the last warm-up step on (the simulator's)."""
  y = step_end[warmup - 1:]
  return float(np.polyfit(np.arange(y.size), y, 1)[0])


def timed(bench: Bench, mode: str, measured_steps: int) -> dict[str, Any]:
  """One timed run of `mode`: warm-up steps (k + 1, as the simulator counts them) plus measured_steps."""
  k = bench.config.rl.max_staleness if mode == "pipeline" else 0
  warmup = k + 1
  ends, tokens = [], []

  def on_step(version, metrics):
    ends.append(time.perf_counter() - t0)
    tokens.append(metrics["completion_len"] * bench.config.rl.group_size * bench.config.rl.groups_per_step)

  ctl = bench.controller(mode, warmup + measured_steps, on_step)
  t0 = time.perf_counter()
  ctl.run()
  wall = time.perf_counter() - t0
  ends, tokens = np.asarray(ends), np.asarray(tokens)
  steady_tokens = tokens[warmup:].sum()
  staleness = np.asarray(ctl.learner_loop.trained_staleness)
  return dict(
      steps=len(ends), warmup_steps=warmup, wall_s=wall, trained_tokens=int(round(tokens.sum())),
      wall_s_per_token=wall / tokens.sum(), step_s=_slope(ends, warmup),
      steady_s_per_token=(ends[-1] - ends[warmup - 1]) / steady_tokens,
      sampler_idle=1 - ctl.busy["sampler"] / wall, learner_idle=1 - ctl.busy["learner"] / wall,
      sampler_busy_s_per_step=ctl.busy["sampler"] / len(ends), learner_busy_s_per_step=ctl.busy["learner"] / len(ends),
      staleness_mean=float(staleness.mean()), staleness_max=int(staleness.max()),
      dropped=dict(ctl.ledger.dropped), length_bias=ctl.ledger.length_bias(),
      groups_admitted=ctl.ledger.groups_admitted,
      decode_calls=ctl.sampler_loop.sampler.stats.decode_calls, kv_rebuilds=ctl.sampler_loop.sampler.stats.rebuilds,
      step_end_s=[round(float(e), 3) for e in ends])


def sampler_alone(bench: Bench, groups: int) -> float:
  """Seconds to generate the first `groups` groups with continuous batching and nothing else running."""
  c = bench.config
  engine = bench.engine
  sampler = ForcedLengths(bench.length_of, engine, bench.state0.params, 0, seed=c.seed)
  t0 = time.perf_counter()
  for g in range(groups):
    sampler.submit(bench.run.controller.sampler_loop.prompts(g)[0], g, c.rl.group_size,
                   sampling=bench.run.controller.spec.sampler.sampling)
  while sampler.num_active or sampler.num_waiting:
    sampler.step()
  return time.perf_counter() - t0


def prediction(bench: Bench, cal, measured_steps: int) -> Prediction:
  c = bench.config
  return predict(cal, RunDescription(
      sampler_devices=bench.engine.mesh.size, learner_devices=bench.run.learner_side.mesh.size,
      batch_size=c.rl.group_size * c.rl.groups_per_step, group_size=c.rl.group_size,
      lengths=Replay(bench.lengths, c.rl.group_size), max_staleness=c.rl.max_staleness, prompt_len=bench.prompt_len,
      steps=measured_steps, queue_groups=c.rl.queue_groups, seq_len=c.rl.seq_len,
      steps_per_call=c.sampler.steps_per_call, pack=c.rl.pack, max_segments=c.rl.max_segments))


def shared_step_s(sampler_s: float, learner_s: float, decode_c: float, train_c: float) -> float:
  """Ideal pipeline step when sampler and learner share the machine: both run at once (at 1 / contention of their
  speed) until one has done its step's work, then the other finishes alone. No staleness bound, no group rule."""
  both = min(sampler_s * decode_c, learner_s * train_c)
  return both + (sampler_s - both / decode_c) + (learner_s - both / train_c)


def _median(xs):
  return float(np.median(np.asarray(xs, np.float64)))


def run_benchmark(c, workdir) -> dict[str, Any]:
  """Warm-up, then `repeats` rounds of a sync and a pipeline run, with a profile before every run and after the last.

  The machine is shared and its load comes in bursts, so the simulator is calibrated on all the session's profiles
  pooled (medians) and compared with the median over rounds of each mode's measured step time. Each run also
  records how far its prediction moved between the profiles just before and just after it (the machine's drift).
  """
  phases: dict[str, float] = {}
  mark = time.perf_counter()

  def phase(name):
    nonlocal mark
    now = time.perf_counter()
    phases[name] = round(phases.get(name, 0.0) + now - mark, 2)
    mark = now

  bench = setup(c, workdir)
  phase("build")
  steps, gb, k = c.bench.measured_steps, c.rl.groups_per_step, c.rl.max_staleness

  def measure():
    train_step = bench.run.controller.learner_loop.train_step
    m, details, _ = profile(bench.engine, train_step, jax.tree.map(jnp.copy, bench.state0),
                            batch_size=c.rl.group_size * gb, seq_len=c.rl.seq_len, group_size=c.rl.group_size,
                            prompt_len=bench.prompt_len, learner_devices=bench.run.learner_side.mesh.size,
                            decode_calls=c.bench.profile_decode_calls, train_reps=c.bench.profile_train_reps)
    phase("profile")
    return m, details

  rounds = []
  try:
    warm_up(bench)
    phase("warm_up")
    alone_s = sampler_alone(bench, steps * gb) / steps
    phase("sampler_alone")
    profiles = [measure()]
    for i in range(c.bench.repeats):
      order = ("sync", "pipeline") if i % 2 == 0 else ("pipeline", "sync")  # neither always runs first
      runs = {}
      for mode in order:
        runs[mode] = timed(bench, mode, steps)
        phase(mode)
        profiles.append(measure())
        before, after = (getattr(prediction(bench, fit_calibration(m), steps), f"{mode}_step_s")
                         for m, _ in profiles[-2:])
        runs[mode]["prediction_drift"] = after / before - 1
      rounds.append(dict(order=list(order), **runs, load_average=os.getloadavg(),
                         speedup_wall_per_token=runs["sync"]["wall_s_per_token"] / runs["pipeline"]["wall_s_per_token"],
                         speedup_steady=runs["sync"]["step_s"] / runs["pipeline"]["step_s"]))
  finally:
    bench.run.controller.sampler_loop.score.close()
    bench.run.checkpointer.close()
    bench.run.metrics.close()
  cal = fit_calibration(pooled([m for m, _ in profiles]))
  details = {key: _median([d[key] for _, d in profiles]) for key in profiles[0][1]}
  pred = prediction(bench, cal, steps)
  validation = {}
  for mode in ("sync", "pipeline"):
    predicted = getattr(pred, f"{mode}_step_s")
    for r in rounds:
      r[mode].update(predicted_step_s=predicted, prediction_error=predicted / r[mode]["step_s"] - 1)
    measured = _median([r[mode]["step_s"] for r in rounds])
    validation[mode] = dict(measured_step_s=measured, predicted_step_s=predicted, error=predicted / measured - 1)
  med = lambda f: _median([f(r) for r in rounds])
  sim = pred.pipeline.summary()
  train_s = details["train_alone_s"]
  return dict(
      config=dict(model=c.model.tiny.to_dict(), sampler_devices=bench.engine.mesh.size,
                  learner_devices=bench.run.learner_side.mesh.size, max_slots=c.sampler.max_slots,
                  max_len=c.sampler.max_len, steps_per_call=c.sampler.steps_per_call, group_size=c.rl.group_size,
                  groups_per_step=gb, seq_len=c.rl.seq_len, max_staleness=k, queue_groups=c.rl.queue_groups,
                  on_update=c.sampler.on_update, prompt_len=bench.prompt_len,
                  measured_steps=steps,
                  repeats=c.bench.repeats, seed=c.seed),
      lengths=dict(median=c.bench.median, p99_ratio=c.bench.p99_ratio,
                   first_groups=bench.lengths[: (steps + 2 * k + 4) * gb].tolist(),
                   observed_median=float(np.median(bench.lengths)),
                   observed_p99=float(np.percentile(bench.lengths, 99)), max=int(bench.lengths.max())),
      validation=validation,
      median=dict(sync_s_per_token=med(lambda r: r["sync"]["wall_s_per_token"]),
                  pipeline_s_per_token=med(lambda r: r["pipeline"]["wall_s_per_token"]),
                  speedup_wall_per_token=med(lambda r: r["speedup_wall_per_token"]),
                  speedup_steady=med(lambda r: r["speedup_steady"])),
      alone=dict(sampler_s_per_step=alone_s, learner_s_per_step=train_s,
                 decode_call_alone_s=details["decode_alone_s"], decode_call_with_learner_s=details["decode_both_s"],
                 train_step_alone_s=train_s, train_step_with_sampler_s=details["train_both_s"],
                 decode_contention=cal.decode_contention, train_contention=cal.train_contention,
                 ideal_step_separate_s=max(alone_s, train_s),
                 ideal_step_shared_s=shared_step_s(alone_s, train_s, cal.decode_contention, cal.train_contention)),
      simulator=dict(sync_step_s=pred.sync_step_s, pipeline_step_s=pred.pipeline_step_s, speedup=pred.speedup,
                     decode_slowdown=pred.decode_slowdown, train_slowdown=pred.train_slowdown,
                     pipeline_staleness_mean=sim["staleness_mean"], pipeline_sampler_idle=sim["sampler_idle"],
                     pipeline_learner_idle=sim["learner_idle"], sync_sampler_idle=pred.sync.sampler_idle_frac,
                     sync_learner_idle=pred.sync.learner_idle_frac),
      calibration=cal.to_json(), calibration_summary=summary(cal, details), profiles=len(profiles),
      rounds=rounds, device=f"{jax.devices()[0].platform} x{len(jax.devices())}", cores=os.cpu_count(),
      host=platform.node(), phases_s=phases)


def table(report: dict) -> str:
  head = (f"{'round':<6}{'mode':<10}{'ms/token':>9}{'step s':>8}{'drift':>7}{'smp idle':>9}{'lrn idle':>9}"
          f"{'stale':>7}{'max':>5}{'dropped':>9}")
  lines = [head]
  for i, r in enumerate(report["rounds"]):
    for mode in r["order"]:
      m = r[mode]
      lines.append(f"{i:<6}{mode:<10}{m['wall_s_per_token'] * 1e3:>9.2f}{m['step_s']:>8.3f}"
                   f"{m['prediction_drift']:>+7.0%}{m['sampler_idle']:>9.2f}{m['learner_idle']:>9.2f}"
                   f"{m['staleness_mean']:>7.2f}{m['staleness_max']:>5}{sum(m['dropped'].values()):>9}")
  md, v, a, s = report["median"], report["validation"], report["alone"], report["simulator"]
  lines += [
      f"median over {len(report['rounds'])} rounds: pipeline vs sync {md['speedup_wall_per_token']:.2f}x per trained "
      f"token (whole runs), {md['speedup_steady']:.2f}x steady-state step",
      f"simulator (calibrated on {report['profiles']} profiles of this session): sync "
      f"{v['sync']['predicted_step_s']:.3f} s vs measured {v['sync']['measured_step_s']:.3f} s "
      f"({v['sync']['error']:+.1%}); pipeline "
      f"{v['pipeline']['predicted_step_s']:.3f} s vs {v['pipeline']['measured_step_s']:.3f} s "
      f"({v['pipeline']['error']:+.1%}); speedup {s['speedup']:.2f}x",
      f"alone: sampler {a['sampler_s_per_step']:.3f} s per step's groups (continuous batching, no barrier), learner "
      f"{a['learner_s_per_step']:.3f} s per step; at once: decode call {a['decode_call_alone_s'] * 1e3:.0f} -> "
      f"{a['decode_call_with_learner_s'] * 1e3:.0f} ms (x{a['decode_contention']:.1f}), train step "
      f"x{a['train_contention']:.2f}",
      f"ideal pipeline step: {a['ideal_step_separate_s']:.3f} s on separate hardware, {a['ideal_step_shared_s']:.3f} s "
      f"sharing these cores (sync measured {v['sync']['measured_step_s']:.3f} s)",
  ]
  for i, r in enumerate(report["rounds"]):  # deadline-based assembly: what is trained is what was generated
    for mode in r["order"]:
      bias = r[mode]["length_bias"]
      lines.append(f"round {i} {mode}: mean completion length generated {bias['generated_mean_len']:.1f}, trained "
                   f"{bias['trained_mean_len']:.1f}; dropped {sum(r[mode]['dropped'].values())}")
  return "\n".join(lines)


def main(argv=None):
  from absl import app, flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", str(Path(__file__).parents[1] / "configs" / "bench_pipeline.py"),
                                  "benchmark config (configs/bench_pipeline.py[:test])")
  flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "pipeline.json"), "JSON results path")

  def _main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    c = flags.FLAGS.config
    with tempfile.TemporaryDirectory() as workdir:
      report = run_benchmark(c, workdir)
    print(report["calibration_summary"])
    print(f"lengths per group: median {report['lengths']['observed_median']:.0f}, p99 "
          f"{report['lengths']['observed_p99']:.0f}, max {report['lengths']['max']}; "
          f"{report['config']['measured_steps']} measured steps per mode and round; load average "
          f"{report['rounds'][-1]['load_average']}")
    print(table(report))
    write_json(flags.FLAGS.out, report)

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
