"""The same fault scenarios in every topology: single-host `jaxrl.train` and a job of 1 learner + 1 sampler process
(`jaxrl.distributed.launch`), on the tiny config with a trace.

Resume: the whole job SIGKILLed once its step-2 checkpoint is committed (groups admitted for the next steps are in
flight), then the same command: every step trains the groups of an uninterrupted run of the same seed, no group is
skipped or trained twice, and summary.json counts what the resume discarded and generated again."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from faults_util import (
  BASE,
  NUM_STEPS,
  REPO,
  TALLY,
  check_history,
  child_env,
  cli,
  committed_steps,
  groups_per_step,
  read_trace,
  tiny_config,
  wait_for,
)

from jaxrl.train import train

TOPOLOGIES = ("single", "mp1+1")
GROUP_SIZE = 4


def command(topology: str, workdir, **overrides) -> list[str]:
  """The command line of the tiny fault config in `topology`; overrides as in faults_util.cli."""
  if topology == "single":
    return cli(workdir, **overrides)
  flags = {**{k: v for k, v in BASE.items() if k != "mesh.num_devices"},
           **{k.replace("__", "."): v for k, v in overrides.items()}}
  return [sys.executable, "-m", "jaxrl.distributed.launch", "--num_processes=2", "--devices_per_process=1",
          "--grace_s=30", "--", "--config=configs/tiny.py", f"--workdir={workdir}", "--heartbeat_timeout_s=5",
          *(f"--config.{k}={v}" for k, v in flags.items())]


def start_job(args: list[str], log) -> subprocess.Popen:
  """The job with all its output (the launcher prints each process's pid on stdout) appended to `log`."""
  with open(log, "ab") as f:
    proc = subprocess.Popen(args, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT)
  proc.log = log
  return proc


def kill_job(proc, log) -> None:
  """SIGKILLs every process of the job (the launcher's children, then the launcher) or the single process."""
  for pid in map(int, re.findall(r"jaxrl.launch: process \d pid (\d+)", log.read_text())):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  TALLY["jobs SIGKILLed"] += 1


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The groups each step of an uninterrupted run trains (single-host; both topologies schedule the same)."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  train(tiny_config(), workdir)
  return groups_per_step(read_trace(workdir / "trace.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_a_job_killed_after_a_checkpoint_resumes_exactly(topology, uninterrupted, tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  args = command(topology, workdir)
  proc = start_job(args, log)
  wait_for(lambda: 2 in committed_steps(workdir), proc, timeout=300, what="the step-2 checkpoint")
  kill_job(proc, log)
  resumed_from = committed_steps(workdir)[-1]
  assert start_job(args, log).wait(timeout=300) == 0, log.read_text()[-3000:]

  summary = json.loads((workdir / "summary.json").read_text())
  events = read_trace(workdir / "trace.jsonl")
  assert summary["resumed_from"] == resumed_from and summary["steps"] == NUM_STEPS
  assert groups_per_step(events) == uninterrupted  # no group skipped, none trained twice, the same order
  check_history(events, summary, group_size=GROUP_SIZE)
  (start,) = [e for e in events if e["event"] == "start" and e["version"] == resumed_from]
  assert start["regenerate"], "nothing was in flight at the checkpoint: the kill tested nothing"
  # What the resume generated again is reported; check_history balanced every count without a reset.
  assert summary["ledger"]["samples_regenerated"] == len(start["regenerate"]) * GROUP_SIZE
