r"""A sampler joining a running job (issue 43): trained tokens/s of one jaxrl-learner run going from 1 to 2
independent jaxrl-sampler programs mid-run, beside the step time the planner predicts for 1 and for 2 samplers.

  PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.elastic_samplers > /tmp/elastic.log 2>&1  # sampler_bound, smollm2
  PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.elastic_samplers --workloads=sampler_bound  # ~2 min, quiet box
  PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.elastic_samplers --workloads=tiny_wide
  PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.elastic_samplers --predict_only \
      --workloads=sampler_bound,smollm2,tiny_wide  # ~3 min, no runs: the model's predictions again

One run per workload, each process pinned with taskset as a 2-core box allows: the learner on core 0, the first
sampler on core 1; after `join_after` applied steps (the learner's trace.jsonl) a second sampler starts on core 0,
beside the learner. Workloads:
  sampler_bound: configs/tiny.py's random decoder, long forced generations (median 96 tokens) through 4 slots one
                 token per call, a light learner: the learner's core idles before the join, so the joiner should help.
  tiny_wide:     a wider random decoder through 8 slots (learner-bound when the box is loaded).
  smollm2:       configs/default.py as it is (SmolLM2-135M-Instruct on arithmetic, its own lengths, dynamic sampling):
                 its learner's 16 s train step bounds it on this box, so the join should not help (the joiner also
                 takes CPU from the learner's core).
From the learner's metrics.jsonl and trace.jsonl, over the applied steps before the joiner started (after `warmup`)
and over those from `skip` steps after it registered (its start-up and compilation left out): trained completion
tokens/s, seconds per step (least-squares slope of the step log times), the learner's busy fraction (train seconds /
wall) and the samplers' (their summed loop busy seconds / wall / samplers running).
The prediction: the costs the run paid before the join, fitted as `jaxrl-profile --from-run` fits a run's logs
(jaxrl.sim.runlog.measurements: 1 sampler device, 1 learner device, no hand-off since groups reach the learner's
pool as they finish), the run's trained completion lengths as the length distribution, and
jaxrl.sim.planner.predict for 1 and 2 samplers (learner_devices = 1), the mean over SEEDS of STEPS simulated steps:
its pipeline step time and trained tokens/s, term by term (`model`; the last is `predicted`):
  own devices:     every engine and the learner on a device of its own, no filter, a weight copy pushed to each
                   engine (the planner before issue 43 (d));
  + filter's mean: rl.filter_groups keeps the pass fraction of the groups the pre-join window settled (the ledger's
                   counts, runlog.pass_fraction), spread evenly; + its variance: each group kept at random;
  + weight pulls:  the learner stages one copy a version and each sampler takes it (bench/weight_pull.py's float32
                   take rate, left out of the calibration's decode rows);
  + shared core:   the placement the run used (CORES: the joiner on the learner's core), time-shared
                   (jaxrl.sim.placement), with the learner process's CPU beside its train step and publish (its
                   /proc CPU seconds a step before the join, less both) as load on its core.
Every term models rl.cancel_surplus as the run had it (`inputs.cancel_surplus`; an entry without it ran before the
cancel existed: off). A filtered run that ran without the cancel also gets `model["cancel on"]`: the last term with
surplus groups cancelled, what the model predicts the cancel would change (not comparable with the measurement).
Without running: `--predict_only` recomputes the predictions of the JSON's entries from the pre-join records and
lengths each keeps in `inputs` (`--inputs_from=KEY=WORKDIR` reads them from a run's kept workdir, once).
JSON: bench/results/elastic_samplers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import write_json

REPO = Path(__file__).resolve().parents[1]
CORES = {"learner": "0", "sampler": "1", "joiner": "0"}
# num_steps: more than a run makes (it is stopped by SIGTERM); only the learning-rate schedule depends on it.
COMMON = {"num_steps": 1000, "log.trace": True, "log.tensorboard": False, "log.progress": False,
          "checkpoint.every_steps": 1000}
ROLES = {"mesh.num_devices": 2, "mesh.sampler_devices": 1}  # a learner device and a sampler device per program
WORKLOADS = {
    # the tiny model through 4 slots, one decode step per call, long forced generations: the sampler's per-token
    # dispatch bounds the step, the learner's 16 short rows cost little
    "sampler_bound": dict(config="configs/tiny.py", join_after=20, warmup=3, skip=8, after_steps=20, flags={
        "sampler.max_slots": 4, "sampler.max_len": 128, "sampler.max_new_tokens": 120, "sampler.steps_per_call": 1,
        "sampler.forced_lengths.median": 96.0, "sampler.forced_lengths.p99_ratio": 1.2, "rl.seq_len": 128,
        "rl.max_staleness": 2, "rl.pack": True, "rl.num_minibatches": 1, **ROLES}),
    # a wider decoder through 8 slots: meant sampler-bound, it was learner-bound on the loaded box (a 1.5 s train step)
    "tiny_wide": dict(config="configs/tiny.py", join_after=12, warmup=3, skip=2, after_steps=10, flags={
        "model.tiny.hidden_size": 128, "model.tiny.intermediate_size": 256, "model.tiny.num_layers": 4,
        "model.tiny.num_heads": 4, "model.tiny.num_kv_heads": 2, "model.tiny.head_dim": 32,
        "model.tiny.vocab_size": 256, "sampler.max_slots": 8, "sampler.max_len": 128, "sampler.max_new_tokens": 120,
        "sampler.steps_per_call": 8, "sampler.forced_lengths.median": 80.0, "sampler.forced_lengths.p99_ratio": 1.5,
        "rl.seq_len": 128, "rl.max_staleness": 2, "rl.pack": True, "rl.num_minibatches": 1, **ROLES}),
    "smollm2": dict(config="configs/default.py", join_after=6, warmup=2, skip=2, after_steps=4, flags={}),
}


def _flags(w: dict) -> list[str]:
  return [f"--config={w['config']}", *(f"--config.{k}={v}" for k, v in {**COMMON, **w["flags"]}.items())]


def _start(role: str, module: str, args: list[str], log: Path, cache: Path) -> subprocess.Popen:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "2", "PYTHONUNBUFFERED": "1",
         "TF_CPP_MIN_LOG_LEVEL": "3", "JAX_COMPILATION_CACHE_DIR": str(cache),  # the joiner compiles nothing new
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
         "JAXRL_RUN_SECRET": "e" * 64}  # the learner and its samplers share the run's secret
  with open(log, "w") as f:
    return subprocess.Popen(["taskset", "-c", CORES[role], sys.executable, "-m", module, *args], cwd=REPO, env=env,
                            stdout=f, stderr=subprocess.STDOUT)


def _trains(workdir: Path) -> list[dict]:
  from jaxrl.metrics import read_jsonl

  path = workdir / "trace.jsonl"
  return [e for e in read_jsonl(path) if e["event"] == "train" and e["applied"]] if path.exists() else []


def _cpu_s(proc: subprocess.Popen | None) -> float:
  """CPU seconds (user + system) the process has used; nan when it is not running."""
  try:
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
  except (AttributeError, OSError):
    return math.nan
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(cond, procs: dict[str, subprocess.Popen], log: Path, samples: list, end: float):
  """Polls cond until it is true (its value) or time.monotonic() passes end (None), noting (time, 1-minute load
  average, CPU seconds of each of CORES' processes) in samples every second. A learner that ends is an error."""
  while not (got := cond()) and time.monotonic() < end:
    if procs["learner"].poll() is not None:
      raise RuntimeError(f"elastic_samplers: the learner ended (exit {procs['learner'].poll()}): "
                         f"{log.read_text()[-2000:]}")
    if not samples or time.time() - samples[-1][0] >= 1.0:
      samples.append((time.time(), os.getloadavg()[0], *(_cpu_s(procs.get(role)) for role in CORES)))
    time.sleep(0.2)
  return got or None


def run(name: str, w: dict, tmp: Path, cache: Path, max_s: float) -> dict:
  """One run of workload w: learner + sampler, a second sampler after join_after steps, stopped (SIGTERM: after the
  current step) `skip + after_steps` steps after the joiner registered, or after max_s seconds with what it reached;
  the figures of its logs."""
  from jaxrl.distributed.launch import free_ports

  workdir, (port,) = tmp / name, free_ports(1)
  logs = {role: tmp / f"{name}-{role}.log" for role in CORES}
  t0 = time.monotonic()
  end = t0 + max_s
  procs = {"learner": _start("learner", "jaxrl.distributed.learner_main",
                             [*_flags(w), f"--workdir={workdir}", f"--port={port}", "--lease_s=60"],
                             logs["learner"], cache)}
  sampler_args = [*_flags(w), f"--learner=127.0.0.1:{port}", "--timeout_s=120", "--reconnect_s=1800"]
  procs["sampler"] = _start("sampler", "jaxrl.distributed.sampler_main", sampler_args, logs["sampler"], cache)
  learner, llog, samples = procs["learner"], logs["learner"], []
  applied = lambda n: lambda: len(_trains(workdir)) >= n  # noqa: E731
  started = joined = None
  try:
    if _wait(applied(w["join_after"]), procs, llog, samples, end):
      started = len(_trains(workdir))  # the joiner starts once this many steps are applied (versions 0..started-1)
      procs["joiner"] = _start("joiner", "jaxrl.distributed.sampler_main", sampler_args, logs["joiner"], cache)
      found = _wait(lambda: re.search(r"from version (\d+)", logs["joiner"].read_text()), procs, llog, samples, end)
      joined = int(found[1]) if found else None
      print(f"{name}: joiner started after {started} steps, registered at version {joined} "
            f"({time.monotonic() - t0:.0f}s)", file=sys.stderr, flush=True)
      if joined is not None:
        _wait(applied(joined + w["skip"] + w["after_steps"]), procs, llog, samples, end)
    learner.send_signal(signal.SIGTERM)  # stops after its current step, with a checkpoint: exit 143
    if learner.wait(600) not in (0, 143):
      raise RuntimeError(f"elastic_samplers: the learner failed: {llog.read_text()[-2000:]}")
    print(f"{name}: stopped after {len(_trains(workdir))} steps ({time.monotonic() - t0:.0f}s)", file=sys.stderr,
          flush=True)
  finally:
    for p in procs.values():  # the samplers wait for a learner that will not come back
      if p.poll() is None:
        p.kill()
  return figures(w, workdir, started, joined, np.array(samples))


def _window(records: dict[int, dict], trains: dict[int, dict], lo: int, hi: int, samplers: int,
            samples_TxM: np.ndarray) -> dict:
  """Figures of the steps training versions lo..hi-1 (the record of the step before lo starts the clock)."""
  if any(v not in records or v not in trains for v in range(lo - 1, hi)):
    raise ValueError(f"versions {lo - 1}..{hi - 1} are not all logged: {sorted(records)}")
  rs = [records[v] for v in range(lo - 1, hi)]
  wall = rs[-1]["time"] - rs[0]["time"]
  lengths = [n for v in range(lo, hi) for n in trains[v]["lengths"]]
  t = np.array([r["time"] for r in rs])
  inside = samples_TxM[(samples_TxM[:, 0] >= t[0]) & (samples_TxM[:, 0] <= t[-1])]
  # each process's CPU share over the window: what the 2 cores gave each role
  cpu = {role: float((inside[-1, 2 + i] - inside[0, 2 + i]) / (inside[-1, 0] - inside[0, 0])) if len(inside) > 1
         else math.nan for i, role in enumerate(CORES)}
  return dict(load_average=float(inside[:, 1].mean()) if len(inside) else math.nan, cpu=cpu,
              versions=[lo, hi - 1], steps=hi - lo, wall_s=wall, tokens_per_s=sum(lengths) / wall,
              step_s=float(np.polyfit(np.arange(t.size), t, 1)[0]),
              learner_busy=sum(r["train_s"] for r in rs[1:]) / wall,
              sampler_busy=(rs[-1]["sampler/busy_s"] - rs[0]["sampler/busy_s"]) / wall / samplers,
              completion_len=float(np.mean(lengths)))


def figures(w: dict, workdir: Path, started: int | None, joined: int | None, samples_TxM: np.ndarray) -> dict:
  """Measured windows before and after the join, and the planner's prediction for 1 and 2 samplers. A run stopped
  early has no `after` (fewer than 2 steps of it) and, not joined, its `before` runs to its last step."""
  from jaxrl.metrics import read_jsonl

  logged = read_jsonl(workdir / "metrics.jsonl")
  records = {r["version"] - 1: r for r in logged}  # a step's record has the version it made: the trained one + 1
  trains = {e["version"]: e for e in _trains(workdir)}
  stop = started if started is not None else max(trains) + 1
  before = _window(records, trains, w["warmup"], stop, 1, samples_TxM)
  after = None
  if joined is not None and (n := min(max(trains) + 1 - joined - w["skip"], w["after_steps"])) >= 2:
    after = _window(records, trains, joined + w["skip"], joined + w["skip"] + n, 2, samples_TxM)
  out = dict(join_after=w["join_after"], joiner_started_after=started, joiner_registered_at=joined, before=before,
             after=after, inputs=dict(_inputs_from(workdir, stop), cancel_surplus=_config(w).rl.cancel_surplus))
  return {**out, **compare(w, out)}


# Simulated steps per prediction, and the seeds a prediction is the mean over (a random filter's yield, the lengths)
STEPS, SEEDS = 256, (0, 1, 2)
# What the prediction reads of the pre-join steps' records (kept in the JSON: predictions are recomputed from it)
_RECORD_KEYS = ("step", "time", "version", "step_time_s", "train_s", "wait_s", "train_tokens", "publish_s",
                "completion_len", "samples_trained", "samples_dropped", "filtered_groups", "sampler/decode_calls",
                "sampler/live_rows", "sampler/context_tokens", "sampler/busy_s", "sampler/update_seconds")


def compare(w: dict, r: dict, shapes: tuple[int, float] | None = None) -> dict:
  """The planner's predictions from an entry's inputs, and their errors against its measured windows."""
  pred = predict(w, r["inputs"]["records"], r["inputs"]["lengths"], _learner_cpu_s(r["before"]), shapes,
                 r["inputs"].get("cancel_surplus", False))
  p1, p2 = pred["predicted"]["1"], pred["predicted"]["2"]
  out = dict(**pred, predicted_ratio=p2["tokens_per_s"] / p1["tokens_per_s"],
             step_error_1=r["before"]["step_s"] / p1["step_s"] - 1)
  if r["after"] is not None:
    a, b = r["after"], r["before"]
    out.update(measured_ratio=a["tokens_per_s"] / b["tokens_per_s"], measured_step_ratio=a["step_s"] / b["step_s"],
               step_error_2=a["step_s"] / p2["step_s"] - 1)
  return out


def _learner_cpu_s(before: dict) -> float | None:
  """CPU seconds per step the learner's process used before the join (/proc), None where they were not logged."""
  share = before.get("cpu", {}).get("learner", math.nan)
  return None if math.isnan(share) else share * before["wall_s"] / before["steps"]


def _pull_bandwidth() -> float:
  """Bytes/s of a sampler's take (pull + checksum) of a float32 version: bench/weight_pull.py's figure."""
  return json.loads((REPO / "bench/results/weight_pull.json").read_text())["float32"]["take_gb_s"] * 1e9


def _config(w: dict):
  """The validated RunConfig workload w runs with."""
  from jaxrl import config as config_lib

  spec = importlib.util.spec_from_file_location("elastic_config", REPO / w["config"])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.validate(config_lib.override(module.get_config(), **COMMON, **w["flags"]))


def _groups(sim) -> tuple[float, float]:
  """(groups generated per group trained, the share of the generated left out past their deadline) of a simulated
  run: trained, filtered, surplus and cancelled groups."""
  trained = sim.trained.sum() / sim.spec.group_size
  left_out = sim.surplus_groups + sim.cancelled_groups
  generated = trained + sim.filtered_groups + left_out
  return generated / trained, left_out / generated


def predict(w: dict, records: list[dict], lengths: list[int], learner_cpu_s: float | None,
            shapes: tuple[int, float] | None = None, cancel_surplus: bool = False) -> dict:
  """The planner's pipeline step time and tokens/s for 1 and 2 samplers from the pre-join costs, term by term: each
  engine on its own device (the model before issue 43 (d)), then with the filter's pass fraction, then with each
  sampler pulling every version (its take), then with the placement's shared core: the last is `predicted`; each
  with rl.cancel_surplus as the run had it (and, for a filtered run without it, the last term with it: "cancel on").
  shapes: (prompt tokens, weight bytes) where known (run_shapes loads the model's tokenizer)."""
  from jaxrl.controller import build as build_lib
  from jaxrl.sim import planner, runlog
  from jaxrl.sim.calibrate import fit_calibration
  from jaxrl.sim.lengths import Empirical
  from jaxrl.sim.placement import Placement

  c = _config(w)
  prompt_len, weight_bytes = shapes or build_lib.run_shapes(c)
  pull = _pull_bandwidth()

  def calibrate(take_s: float):
    # multi_process=False: a hub's samplers deliver each group as it finishes, into the learner process's pool, so
    # there is no per-step hand-off (runlog.handoff_s would take the least generation wait of a sampler-bound run)
    m, details = runlog.measurements(records, warmup=w["warmup"], steps_per_call=c.sampler.steps_per_call,
                                     max_batch=c.sampler.max_slots, learner_devices=1, sampler_devices=1,
                                     weight_bytes=weight_bytes, multi_process=False, take_s=take_s)
    return fit_calibration(m), details

  pushed, details = calibrate(0.0)
  pulled = dataclasses.replace(calibrate(weight_bytes / pull)[0], pull_bandwidth=pull)
  passed = runlog.run_pass_fraction(records, w["warmup"], c.rl)
  # the learner process's CPU beside its train step and publish (the hub serving the sampler); 0 where not logged
  host_s = 0.0 if learner_cpu_s is None else max(learner_cpu_s - details["train_step_s"] - details["transfer_s"], 0.0)
  cores = tuple(sorted(set(CORES.values())))
  terms = {"own devices": (pushed, 1.0, "even", False, cancel_surplus),
           "+ filter's mean": (pushed, passed, "even", False, cancel_surplus),
           "+ its variance": (pushed, passed, "random", False, cancel_surplus),
           "+ weight pulls": (pulled, passed, "random", False, cancel_surplus),
           "+ shared core": (pulled, passed, "random", True, cancel_surplus)}
  if passed < 1 and not cancel_surplus:
    terms["cancel on"] = (pulled, passed, "random", True, True)
  model = {}
  for term, (cal, pass_fraction, draws, shared, cancel) in terms.items():
    model[term] = {}
    for s in (1, 2):
      placement = Placement(cores, (CORES["learner"],), ((CORES["sampler"],), (CORES["joiner"],))[:s],
                            learner_host_s=host_s) if shared else None
      ps = [planner.predict(cal, planner.RunDescription(
          sampler_devices=s, learner_devices=1, batch_size=c.rl.group_size * c.rl.groups_per_step,
          group_size=c.rl.group_size, lengths=Empirical(lengths), max_staleness=c.rl.max_staleness,
          prompt_len=prompt_len, steps=STEPS, seed=seed, queue_groups=c.rl.queue_groups, seq_len=c.rl.seq_len,
          pack=c.rl.pack, max_segments=c.rl.max_segments, num_minibatches=c.rl.num_minibatches,
          steps_per_call=c.sampler.steps_per_call, overlap_calls=1, pass_fraction=pass_fraction,
          filter_draws=draws, cancel_surplus=cancel, placement=placement)) for seed in SEEDS]
      steps = [p.pipeline_step_s for p in ps]
      model[term][str(s)] = dict(
          step_s=float(np.mean(steps)), step_s_range=[min(steps), max(steps)],
          tokens_per_s=float(np.mean([p.pipeline.tokens_per_s for p in ps])),
          sampler_idle=float(np.mean([p.pipeline.sampler_idle_frac for p in ps])),
          learner_idle=float(np.mean([p.pipeline.learner_idle_frac for p in ps])),
          stretch=np.mean([p.stretch or (1.0,) for p in ps], axis=0).tolist(),
          groups_per_trained=float(np.mean([_groups(p.pipeline)[0] for p in ps])),
          left_out=float(np.mean([_groups(p.pipeline)[1] for p in ps])))
  d = pushed.decode
  fed = dict(prompt_len=prompt_len, weight_bytes=weight_bytes, lengths_median=float(np.median(lengths)),
             lengths_mean=float(np.mean(lengths)), decode_overhead_ms=d.overhead_s * 1e3,
             decode_weights_ms=d.weights_s * 1e3, decode_fit_rms=pushed.fit["rms_rel_error"],
             train_tokens_per_s=pushed.train_tokens_per_s_per_device, **details, pass_fraction=passed,
             take_s=weight_bytes / pull, learner_cpu_s=learner_cpu_s, learner_host_s=host_s)
  return dict(calibration=fed, model=model, predicted=model["+ shared core"])


def _shares(window: dict) -> str:
  return " ".join(f"{role} {share:.0%}" for role, share in window.get("cpu", {}).items()
                  if not math.isnan(share))


def _line(name: str, r: dict) -> str:
  b, a, p = r["before"], r["after"], r["predicted"]
  one = (f"{b['tokens_per_s']:.1f} tokens/s, step {b['step_s']:.2f} s, learner busy {b['learner_busy']:.0%}, sampler "
         f"busy {b['sampler_busy']:.0%}, load {b['load_average']:.1f}, CPU {_shares(b)}")
  two = "not reached" if a is None else (
      f"{a['tokens_per_s']:.1f} tokens/s (x{r['measured_ratio']:.2f}), step {a['step_s']:.2f} s, learner busy "
      f"{a['learner_busy']:.0%}, samplers busy {a['sampler_busy']:.0%}, load {a['load_average']:.1f}, CPU {_shares(a)}")
  err = "" if a is None else f", {r['step_error_2']:+.0%} with 2"
  terms = ", ".join(f"{t}: {m['1']['step_s']:.3g} -> {m['2']['step_s']:.3g} s "
                    f"(x{m['2']['tokens_per_s'] / m['1']['tokens_per_s']:.2f})" for t, m in r["model"].items())
  return (f"{name}: 1 sampler: {one}; 2 samplers: {two}; planner: step {p['1']['step_s']:.2f} s -> "
          f"{p['2']['step_s']:.2f} s, tokens/s x{r['predicted_ratio']:.2f} (measured step / predicted - 1: "
          f"{r['step_error_1']:+.0%} with 1{err}); by term: {terms}")


def _inputs_from(workdir: Path, started: int) -> dict:
  """The prediction's inputs, read from a run's kept workdir (what figures() keeps of it)."""
  from jaxrl.metrics import read_jsonl

  records = {r["version"] - 1: r for r in read_jsonl(workdir / "metrics.jsonl")}
  return dict(records=[{k: r[k] for k in _RECORD_KEYS if k in r} for v, r in sorted(records.items()) if v < started],
              lengths=[n for e in _trains(workdir) for n in e["lengths"]])


def predict_only(out: Path, names: list[str], inputs_from: dict[str, str]) -> None:
  """Recomputes the predictions of the JSON's entries for `names` (and their other_runs) without running: from
  each entry's `inputs`, or from the workdir inputs_from names for it (then kept in the entry)."""
  report = json.loads(out.read_text())
  others = [(r["workload"], f"other_runs.{i}", r) for i, r in enumerate(report.get("other_runs", []))]
  entries = [(n, n, report[n]) for n in names] + [e for e in others if e[0] in names]
  for name, key, r in entries:
    if key in inputs_from:
      r["inputs"] = _inputs_from(Path(inputs_from[key]), r["joiner_started_after"])
    if "inputs" not in r:
      print(f"{key}: no inputs kept and none given (--inputs_from={key}=WORKDIR): left as it was", file=sys.stderr)
      continue
    cal = r["calibration"]
    r.update(compare(WORKLOADS[name], r, (cal["prompt_len"], cal["weight_bytes"])))
    print(_line(key, r), flush=True)
  write_json(out, report)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", default="sampler_bound,smollm2", help=f"of {', '.join(WORKLOADS)}")
  parser.add_argument("--out", default=str(REPO / "bench/results/elastic_samplers.json"))
  parser.add_argument("--cache", default="/tmp/jaxrl-elastic-cache", help="persistent compilation cache")
  parser.add_argument("--max_minutes", type=float, default=40.0, help="a run is stopped after this long, with the "
                      "windows it reached")
  parser.add_argument("--predict_only", action="store_true", help="no runs: recompute the predictions of --out's "
                      "entries for --workloads (and their other_runs) from the inputs they keep")
  parser.add_argument("--inputs_from", default="", help="with --predict_only, KEY=WORKDIR,...: an entry without "
                      "inputs (KEY: a workload, or other_runs.N) reads them from its run's kept workdir")
  opts = parser.parse_args()
  from jaxrl import platforms

  platforms.skip_tpu_probe()  # this process only calibrates and simulates
  out = Path(opts.out)
  if opts.predict_only:
    predict_only(out, opts.workloads.split(","), dict(kv.split("=", 1) for kv in opts.inputs_from.split(",") if kv))
    return
  tmp = tempfile.mkdtemp(prefix="jaxrl-elastic-")  # kept: the runs' logs and workdirs
  print(f"elastic_samplers: runs in {tmp}", file=sys.stderr, flush=True)
  for name in opts.workloads.split(","):
    w = WORKLOADS[name]
    r = dict(config=w["config"], flags=w["flags"], load_before=os.getloadavg(),
             **run(name, w, Path(tmp), Path(opts.cache), opts.max_minutes * 60), load_after=os.getloadavg())
    print(_line(name, r), flush=True)
    # read again now: a workload run alone (or at the same time) replaces its own entry only
    report = json.loads(out.read_text()) if out.exists() else {}
    write_json(out, {**report, "cores": CORES, "host_cores": sorted(os.sched_getaffinity(0)), name: r})


if __name__ == "__main__":
  main()
