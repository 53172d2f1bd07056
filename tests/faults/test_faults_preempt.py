"""Preemption: SIGTERM (what a preempted TPU VM or a Slurm time limit sends) stops `jaxrl-train` after the current
step with a checkpoint of the last trained state, a one-line message and exit code 143; the same command resumes
it to the end, logging every step exactly once."""

import json
import signal
import time

import pytest
from faults_util import (
  NUM_STEPS,
  TALLY,
  check_history,
  cli,
  committed_steps,
  inject,
  read_trace,
  start_child,
  tiny_config,
  wait_for,
)

from jaxrl import train as train_lib
from jaxrl.metrics import read_jsonl

STOP_BOUND_S = 30.0  # from SIGTERM to the process exiting, the checkpoint saved


@pytest.mark.slow
def test_sigterm_saves_the_last_step_and_the_same_command_resumes(tmp_path):
  args = cli(tmp_path / "run", "pipeline", checkpoint__every_steps=100)  # no periodic checkpoint
  proc = start_child(args, tmp_path / "stderr.log")
  metrics = tmp_path / "run" / "metrics.jsonl"
  wait_for(lambda: metrics.exists() and len(read_jsonl(metrics)) >= 2, proc, what="two trained steps")
  t0 = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  code = proc.wait(timeout=120)
  elapsed = time.monotonic() - t0
  TALLY["processes SIGTERMed"] += 1
  err = (tmp_path / "stderr.log").read_text()
  assert code == 128 + signal.SIGTERM, err[-3000:]
  assert elapsed < STOP_BOUND_S, f"took {elapsed:.1f} s to stop"
  assert "jaxrl: SIGTERM: stopping after the current step and saving a checkpoint" in err
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  stopped_at = summary["steps"]
  assert summary["stopped_by"] == "SIGTERM" and 2 <= stopped_at < NUM_STEPS
  assert f"jaxrl-train: stopped by SIGTERM at step {stopped_at} of {NUM_STEPS}; checkpoint saved" in err
  assert committed_steps(tmp_path / "run") == [stopped_at]  # the state it stopped at (no periodic save before)
  led = summary["ledger"]
  assert led["samples_generated"] == led["samples_trained"] + sum(led["dropped"].values()) + \
      summary["samples_in_flight"]

  resume = start_child(args, tmp_path / "stderr.log")
  assert resume.wait(timeout=300) == 0, (tmp_path / "stderr.log").read_text()[-3000:]
  summary = json.loads((tmp_path / "run" / "summary.json").read_text())
  assert summary["resumed_from"] == stopped_at and summary["steps"] == NUM_STEPS and "stopped_by" not in summary
  assert [r["step"] for r in read_jsonl(metrics)] == list(range(1, NUM_STEPS + 1))
  check_history(read_trace(tmp_path / "run" / "trace.jsonl"), summary, group_size=4)


def test_a_stop_request_mid_batch_in_sync_mode_saves_and_resumes(tmp_path, monkeypatch):
  """The sync loop stops between decode calls, inside a batch: that batch is not trained, its groups stay pending
  and are generated again on resume."""
  calls = {"n": 0}

  def stop_mid_batch(run):
    ctl = run.controller
    real_step = ctl.sampler_loop.sampler.step

    def step():
      calls["n"] += 1
      if ctl.version == 3 and calls.setdefault("at", calls["n"]) == calls["n"]:
        ctl.request_stop("test")  # the first decode call of step 3's batch
      return real_step()

    ctl.sampler_loop.sampler.step = step

  inject(monkeypatch, stop_mid_batch)
  summary = train_lib.train(tiny_config("sync", checkpoint__every_steps=100), tmp_path)
  assert summary["stopped_by"] == "test" and summary["steps"] == 3
  assert committed_steps(tmp_path) == [3]
  saves = [e for e in read_trace(tmp_path / "trace.jsonl") if e["event"] == "checkpoint"]
  assert saves[-1]["version"] == 3 and len(saves[-1]["pending"]) == 4  # step 3's groups, to generate again
  monkeypatch.undo()
  summary = train_lib.train(tiny_config("sync", checkpoint__every_steps=100), tmp_path)
  assert summary["resumed_from"] == 3 and summary["steps"] == NUM_STEPS and "stopped_by" not in summary
  check_history(read_trace(tmp_path / "trace.jsonl"), summary, group_size=4)
