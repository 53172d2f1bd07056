"""Crash and resume: a SIGKILL in the middle of a checkpoint save leaves the previous checkpoint intact; SIGKILLs
at random points always resume; across kills and resumes no sample is trained twice and every group is trained,
dropped with a reason, or still in flight at the end (regenerated groups keep their group id)."""

import random
import sys
import threading
import time
from pathlib import Path

import pytest
from faults_util import (
  NUM_STEPS,
  TALLY,
  check_history,
  cli,
  committed_steps,
  count_lines,
  inject,
  kill,
  read_trace,
  start_child,
  tiny_config,
  wait_for,
)

from jaxrl.train import train

HERE = Path(__file__).resolve().parent
BATCH = 16  # tiny: group_size 4 x groups_per_step 4


def _kill_points(seed: int) -> list[tuple[str, float]]:
  """One or two kills, each at a random moment of start-up (seconds after the child starts) or at a random point
  of training (a fraction of the steps the attempt has left, counted in trace events, plus up to 0.2 s)."""
  rng = random.Random(seed)
  return [("startup", rng.uniform(0.5, 6.0)) if rng.random() < 0.25 else ("training", rng.random())
          for _ in range(rng.randint(1, 2))]


def _run_until(proc, cond, timeout: float = 180) -> bool:
  """Waits for cond(); False if the child finished cleanly first (a failed child fails the test)."""
  deadline = time.monotonic() + timeout
  while not cond():
    if proc.poll() is not None:
      assert proc.returncode == 0, f"child failed ({proc.returncode}): {proc.log.read_text()[-3000:]}"
      return False
    assert time.monotonic() < deadline, f"the child made no progress in {timeout} s"
    time.sleep(0.01)
  return True


@pytest.fixture(scope="module", params=[0, 1, 2])
def killed_run(request, tmp_path_factory):
  """A pipeline run SIGKILLed once or twice at random points (each attempt resuming the last), finished here."""
  seed = request.param
  rng = random.Random(1000 + seed)
  workdir = tmp_path_factory.mktemp(f"killed{seed}")
  trace = workdir / "trace.jsonl"
  kills = []
  for kind, at in _kill_points(seed):
    before = count_lines(trace)
    left = NUM_STEPS - (committed_steps(workdir) or [0])[-1]  # each step writes at least its "train" event
    proc = start_child(cli(workdir), workdir / "child.log")
    if kind == "startup":
      deadline = time.monotonic() + at
      alive = _run_until(proc, lambda d=deadline: time.monotonic() > d)
    else:
      target = before + 1 + int(at * left)  # the start event, then some of the steps
      alive = _run_until(proc, lambda t=target: count_lines(trace) >= t)
      time.sleep(rng.uniform(0.0, 0.2))
    if alive and proc.poll() is None:
      kill(proc)
    kills.append((kind, round(at, 2), "killed" if alive else "finished first", committed_steps(workdir)))
  latest = committed_steps(workdir)
  summary = train(tiny_config(), workdir)
  TALLY["runs resumed after SIGKILL"] += 1
  return {"seed": seed, "workdir": workdir, "kills": kills, "latest": latest[-1] if latest else None,
          "summary": summary, "events": read_trace(trace)}


def test_every_killed_run_resumes_and_finishes(killed_run):
  s = killed_run["summary"]
  assert s["resumed_from"] == killed_run["latest"]  # the newest committed checkpoint (None: killed before one)
  assert s["steps"] == NUM_STEPS
  assert s["ledger"]["samples_trained"] == NUM_STEPS * BATCH


def test_no_sample_trained_twice_and_every_group_accounted_for(killed_run):
  counts = check_history(killed_run["events"], killed_run["summary"], group_size=4)
  assert counts["trained"] == NUM_STEPS * BATCH
  assert any(k[2] == "killed" for k in killed_run["kills"])
  print(f"seed {killed_run['seed']}: kills {killed_run['kills']}, {counts}")


def test_sigkill_during_a_checkpoint_save_keeps_the_previous_checkpoint(tmp_path):
  """The child holds the commit of the step-4 save (its files written, the folder not yet renamed); killed there,
  the step-2 checkpoint is intact and the run resumes from it."""
  workdir = tmp_path / "run"
  args = [sys.executable, str(HERE / "slow_commit.py"), *cli(workdir)[3:]]
  proc = start_child(args, tmp_path / "child.log", JAXRL_FAULTS_HOLD_STEP="4")
  wait_for(lambda: (workdir / "saving-4").exists(), proc, what="the step-4 save")
  kill(proc)
  unfinished = [p.name for p in (workdir / "checkpoints").iterdir() if p.name.startswith("4.")]
  assert unfinished, "the killed save left no temporary folder: it was not under way"
  assert committed_steps(workdir) == [2]
  summary = train(tiny_config(), workdir)
  TALLY["runs resumed after SIGKILL"] += 1
  assert summary["resumed_from"] == 2 and summary["steps"] == NUM_STEPS
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=4)
  assert committed_steps(workdir)[-1] == NUM_STEPS


class Stop(Exception):
  """Stops a run on purpose."""


def test_a_run_stopped_with_a_full_admission_window_resumes(tmp_path, monkeypatch):
  """Stopped (here by a learner exception) once the sampler has admitted all that the staleness bound allows, the
  run saves (max_staleness + 1) * groups_per_step groups to regenerate. Counting them as admitted a second time
  when they are generated again made the admission policy refuse every group after such a resume: a hang."""
  def stop_once_the_window_is_full(run):
    ctl = run.controller.learner_loop
    real_step, calls = ctl.train_step, []

    def train_step(state, batch, key):
      calls.append(1)
      if len(calls) == 3:  # version 2: the sampler may admit groups up to (2 + 1 + 1) * 4 = 16
        wait_for(lambda: run.controller.record.next_group_id >= 16, timeout=60, what="a full admission window")
        raise Stop("window full")
      return real_step(state, batch, key)

    ctl.train_step = train_step

  c = tiny_config(checkpoint__every_steps=4)  # the checkpoint at version 2 is the one saved when the run stops
  inject(monkeypatch, stop_once_the_window_is_full)
  with pytest.raises(RuntimeError, match="Stop: window full"):
    train(c, tmp_path)
  monkeypatch.undo()
  (saved,) = [e for e in read_trace(tmp_path / "trace.jsonl") if e["event"] == "checkpoint"]
  assert saved["version"] == 2 and len(saved["pending"]) == 8 and committed_steps(tmp_path) == [2]
  result = {}
  resume = threading.Thread(target=lambda: result.update(summary=train(c, tmp_path)), daemon=True)
  resume.start()
  resume.join(120)
  assert "summary" in result, "the resumed run made no progress in 120 s"
  TALLY["runs resumed after a component failure"] += 1
  summary = result["summary"]
  assert summary["resumed_from"] == 2 and summary["steps"] == NUM_STEPS
  check_history(read_trace(tmp_path / "trace.jsonl"), summary, group_size=4)
