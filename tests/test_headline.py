"""The headline benchmark's pieces (issue 17): forced long-tailed lengths as a config hook, the per-step costs a run
logs, the calibration jaxrl-profile --from-run fits from them, the simulator's step time from that calibration
within 15% of a recorded run's (sync; 20% pipeline), and a small real run of each mode logging what that needs.
Nothing here depends on this machine's speed: bench/headline.py checks the simulator against live runs."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl import config as config_lib
from jaxrl.metrics import read_jsonl
from jaxrl.sampler.forced import LognormalLengths
from jaxrl.sim import runlog

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "configs"))
import bench_headline  # noqa: E402

TOLERANCE = 0.15
# The pipeline's learner waits for its share every step on this CPU loopback (the sampler sends a share's groups
# one cross-process copy each once the learner asks for it). --from-run charges the window's least wait as a per-step
# hand-off (runlog.handoff_s), which brought the simulator's error on these runs within this tolerance; the rest of
# the wait varies step to step (bench/handoff.py; docs/BENCHMARKS_HISTORY.md, "The headline: colocated sync vs
# pipeline").
PIPELINE_TOLERANCE = 0.20


def test_forced_lengths_depend_on_seed_and_group_alone_and_have_the_asked_tail():
  lengths = LognormalLengths(median=12, p99_ratio=10, max_len=100_000, seed=3)
  many = lengths.of(range(20_000))
  assert lengths(17) == many[17] == LognormalLengths(12, 10, 100_000, 3)(17)  # no state: any process, any order
  assert np.median(many) == pytest.approx(12, rel=0.05)
  assert np.percentile(many, 99) / np.median(many) == pytest.approx(10, rel=0.1)
  assert not np.array_equal(many[:50], LognormalLengths(12, 10, 100_000, 4).of(range(50)))
  clipped = LognormalLengths(12, 10, 30).of(range(2000))
  assert clipped.min() >= 1 and clipped.max() == 30


@pytest.mark.parametrize("kw,message", [(dict(median=0.0), "median > 0"), (dict(p99_ratio=0.5), "p99_ratio >= 1"),
                                        (dict(max_len=0), "max_len >= 1")])
def test_bad_forced_lengths_are_rejected(kw, message):
  with pytest.raises(ValueError, match=message):
    LognormalLengths(**(dict(median=12.0, p99_ratio=10.0, max_len=100) | kw))


@pytest.mark.parametrize("field,value,message", [
    ("median", -1.0, "sampler.forced_lengths.median must be a number >= 0"),
    ("p99_ratio", 0.5, "sampler.forced_lengths.p99_ratio must be a number >= 1")])
def test_bad_forced_lengths_config_is_a_config_error(field, value, message):
  c = bench_headline.get_config("test")
  c.sampler.forced_lengths[field] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(c)


def _record(step, t, calls, rows, context, busy, update, train_s=0.1, tokens=1000.0):
  return {"step": step, "time": t, "step_time_s": 0.5, "train_s": train_s, "wait_s": 0.3, "train_tokens": tokens,
          "publish_s": 0.004,
          "completion_len": 10.0, "sampler/decode_calls": calls, "sampler/live_rows": rows,
          "sampler/context_tokens": context, "sampler/busy_s": busy, "sampler/update_seconds": update}


def test_run_log_gives_decode_rows_step_time_idle_fractions_and_costs_from_deltas():
  records = [_record(1, 10.0, 1, 8, 80, 5.0, 0.0, train_s=4.0),  # compilation: before the window
             _record(2, 11.0, 3, 24, 320, 5.2, 0.01),
             _record(3, 11.5, 5, 40, 560, 5.4, 0.02),
             _record(4, 12.0, 9, 56, 1120, 5.6, 0.03),
             _record(5, 12.5, 12, 68, 1400, 5.8, 0.04)]
  rows = runlog.decode_rows(records, warmup=2, steps_per_call=4)  # busy seconds less updates, per decode step
  np.testing.assert_allclose(rows, [(8.0, 15.0, 0.19 / 8), (4.0, 35.0, 0.19 / 16), (4.0, 280 / 12, 0.19 / 12)])
  assert runlog.step_time_s(records, warmup=2) == pytest.approx(0.5)
  idle = runlog.idle_fractions(records, warmup=2)
  assert idle["sampler_idle"] == pytest.approx(1 - 0.6 / 1.5)
  assert idle["learner_idle"] == pytest.approx(1 - 0.3 / 1.5)
  assert runlog.seconds_per_token(records, warmup=2, batch_size=4) == pytest.approx(1.5 / 120)
  m, details = runlog.measurements(records, warmup=2, steps_per_call=4, max_batch=8, learner_devices=2,
                                   sampler_devices=1, weight_bytes=1e6)
  assert m.train_tokens_per_s_per_device == pytest.approx(1000 / (0.1 * 2))
  assert m.train_overhead_s == pytest.approx(0.5 - 0.1 - 0.3 - 0.004)  # step less train, wait, publish
  assert m.update_s == pytest.approx(0.01) and m.link_bandwidth == pytest.approx(1e6 / 0.004)
  assert (m.prefill_s_per_token, m.decode_contention, details["steps"]) == (0.0, 1.0, 3)
  with pytest.raises(ValueError, match="only 2 steps after warm-up saw decode calls: need 3"):
    runlog.measurements(records[:4] + [records[3]], warmup=2, steps_per_call=4, max_batch=8, learner_devices=1,
                        sampler_devices=1, weight_bytes=1e6)


def test_multi_process_run_charges_its_least_wait_as_per_step_hand_off():
  records = [_record(i, 10.0 + 0.5 * i, 3 * i, 24 * i, 300 * i, 0.2 * i, 0.01 * i) for i in range(1, 7)]
  for r, wait in zip(records, (0.01, 0.9, 0.05, 0.04, 0.3, 0.06), strict=True):
    r["wait_s"] = wait
  kw = dict(warmup=2, steps_per_call=4, max_batch=8, learner_devices=1, sampler_devices=1, weight_bytes=1e6)
  one, _ = runlog.measurements(records, **kw)
  two, details = runlog.measurements(records, **kw, multi_process=True)
  # The window's steps are 3..6 (step 2 ends warm-up: its wait, and step 1's, are not in it).
  assert runlog.handoff_s(records, warmup=2) == details["handoff_s"] == 0.04
  assert two.train_overhead_s == pytest.approx(one.train_overhead_s + 0.04)
  assert dataclasses.replace(two, train_overhead_s=one.train_overhead_s) == one


def test_run_log_without_cost_records_or_steps_is_rejected():
  records = [_record(i, float(i), i, i, i, 0.1 * i, 0.0) for i in range(1, 7)]
  with pytest.raises(ValueError, match="warmup must be >= 1"):
    runlog.steady(records, 0)
  with pytest.raises(ValueError, match="the run logged 6 steps: need warmup=4"):
    runlog.steady(records, 4)
  del records[-1]["train_s"]
  with pytest.raises(ValueError, match=r"lacks \['train_s'\]"):
    runlog.steady(records, 2)


# ---- a small real run of each mode, predicted from its own logs ----------------------------------------------------


def _run(mode: str, workdir: Path, steps: int) -> None:
  """One run of configs/bench_headline.py:test as bench/headline.py runs it (sync: one process on both cores;
  pipeline: a learner process and a sampler process on a core each)."""
  from bench.headline import command

  argv, env = command(mode, f"{REPO / 'configs' / 'bench_headline.py'}:test", workdir, steps)
  env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
  proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


# Logs of one run of each mode as _run makes them (configs/bench_headline.py:test, 7 steps), recorded 2026-12-06 on
# the shared 2-core box: metrics.jsonl and summary.json, all that --from-run reads.
RECORDED = REPO / "tests" / "data" / "headline_runs"


def _config(mode: str):
  return config_lib.override(bench_headline.get_config("test"), mode=mode)


@pytest.mark.parametrize("mode,tolerance", [("sync", TOLERANCE), ("pipeline", PIPELINE_TOLERANCE)])
def test_from_run_calibration_predicts_a_recorded_runs_step_time(mode, tolerance):
  """The simulator, given only the costs a run logged, predicts that run's steady step time."""
  from jaxrl.cost_profile import from_run

  c = _config(mode)
  records = read_jsonl(RECORDED / mode / "metrics.jsonl")
  r = from_run(c, RECORDED / mode, devices=2, warmup=c.bench.warmup_steps)
  assert r["measured_step_s"] == pytest.approx(runlog.step_time_s(records, c.bench.warmup_steps))
  assert abs(r["error"]) <= tolerance, f"{mode}: simulator error {r['error']:+.1%}"


@pytest.mark.parametrize("mode", ["sync", "pipeline"])
def test_a_small_real_run_logs_what_from_run_needs(mode, tmp_path):
  """A real run of each mode trains every step within its staleness bound and logs the costs --from-run fits."""
  from jaxrl.cost_profile import from_run

  # Two steps more than the recorded runs: the fit needs 3 steps after warm-up that saw decode calls, and a pipeline
  # sampler on a busy box can finish the last steps' groups early (7 steps once left 2).
  c = config_lib.override(_config(mode), num_steps=9)
  _run(mode, tmp_path, c.num_steps)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert len(records) == c.num_steps and records[-1]["samples_dropped"] == 0
  assert max(r["staleness_max"] for r in records) == (0 if mode == "sync" else c.rl.max_staleness)
  r = from_run(c, tmp_path, devices=2, warmup=c.bench.warmup_steps)
  assert r["measured_step_s"] == pytest.approx(runlog.step_time_s(records, c.bench.warmup_steps))
  assert math.isfinite(r["predicted_step_s"]) and r["predicted_step_s"] > 0
