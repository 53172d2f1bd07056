"""Crash and resume: a SIGKILL in the middle of a checkpoint save leaves the previous checkpoint intact; SIGKILLs
at random points always resume; across kills and resumes no sample is trained twice and every group is trained,
dropped with a reason, or still in flight at the end (regenerated groups keep their group id)."""

import random
import sys
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
  kill,
  read_trace,
  start_child,
  tiny_config,
  wait_for,
)

from jaxrl.train import train

HERE = Path(__file__).resolve().parent
BATCH = 16  # tiny: group_size 4 x groups_per_step 4
EVENTS = 8  # an attempt from scratch writes about 11 trace events (start, 6 steps, 3 checkpoints, end)


def _kill_points(seed: int) -> list[tuple[str, float]]:
  """One or two kills: each after a random number of trace events (then a random fraction of a second), or at a
  random moment of start-up."""
  rng = random.Random(seed)
  return [("startup", rng.uniform(0.5, 6.0)) if rng.random() < 0.25 else ("events", rng.randint(1, EVENTS))
          for _ in range(rng.randint(1, 2))]


@pytest.fixture(scope="module", params=[0, 1, 2])
def killed_run(request, tmp_path_factory):
  """A pipeline run SIGKILLed twice at random points (each attempt resuming the last), then finished here."""
  seed = request.param
  rng = random.Random(1000 + seed)
  workdir = tmp_path_factory.mktemp(f"killed{seed}")
  trace = workdir / "trace.jsonl"
  kills = []
  for kind, at in _kill_points(seed):
    before = count_lines(trace)
    proc = start_child(cli(workdir), workdir / "child.log")
    if kind == "startup":
      time.sleep(at)
    else:
      target = before + int(at)
      wait_for(lambda t=target: count_lines(trace) >= t, proc, what=f"trace event {target}")
      time.sleep(rng.uniform(0.0, 0.2))
    assert proc.poll() is None, "the child finished before it could be killed"
    kill(proc)
    kills.append((kind, at, committed_steps(workdir)))
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
