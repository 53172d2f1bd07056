"""The kill campaign's independent-samplers topology (kill_campaign.py --topologies=indS): a jaxrl-learner and S
jaxrl-sampler programs; at random moments one sampler is SIGKILLed and a new one started in its place (it joins
mid-run), or the learner is SIGKILLed and started again with the same command (it resumes from its checkpoint while
the samplers keep running: they register again with the restarted learner). Each run must finish its steps, replay
its trace with no group lost or trained twice (faults_util.check_history, across the learner's resumes) and balance
generated = trained + dropped + discarded at resume + refused + in flight."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from faults_util import check_history, read_trace

STEPS = 40
FLAGS = {"num_steps": STEPS, "mesh.num_devices": 2, "mesh.sampler_devices": 1, "checkpoint.every_steps": 2,
         "checkpoint.max_to_keep": 2, "log.tensorboard": False, "log.progress": False, "log.trace": True}
LEASE_S = 8.0
RUN_TIMEOUT_S = 1200


def _commands(workdir: Path, port: int) -> tuple[list[str], list[str]]:
  config = ["--config=configs/tiny.py", *(f"--config.{k}={v}" for k, v in FLAGS.items())]
  learner = [sys.executable, "-m", "jaxrl.distributed.learner_main", *config, f"--workdir={workdir}", f"--port={port}",
             f"--lease_s={LEASE_S}"]
  sampler = [sys.executable, "-m", "jaxrl.distributed.sampler_main", *config, f"--learner=127.0.0.1:{port}",
             "--reconnect_s=600"]
  return learner, sampler


def _start(args: list[str], log: Path, env: dict, repo: Path) -> subprocess.Popen:
  with open(log, "ab") as f:
    return subprocess.Popen(args, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)


def _kill(proc: subprocess.Popen) -> None:
  proc.send_signal(signal.SIGKILL)
  proc.wait()


def _training(workdir: Path, attempt: int) -> bool:
  """The learner's attempt `attempt` (1, 2, ...) has started and trained a step (a kill before that would test its
  start-up only)."""
  path = workdir / "trace.jsonl"
  events = read_trace(path) if path.exists() else []
  starts = [i for i, e in enumerate(events) if e["event"] == "start"]
  return len(starts) == attempt and any(e["event"] == "train" for e in events[starts[-1]:])


def check_run(workdir: Path) -> dict:
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == STEPS, f"{workdir}: {summary['steps']} steps of {STEPS}"
  led = summary["ledger"]
  refused = sum(led["samples_refused"].values())
  unaccounted = (led["samples_generated"] - led["samples_trained"] - sum(led["dropped"].values())
                 - led["samples_discarded_at_resume"] - refused - summary["samples_in_flight"])
  counts = {"trained": led["samples_trained"], "dropped": sum(led["dropped"].values()), "refused": refused,
            "in_flight": summary["samples_in_flight"], "discarded_at_resume": led["samples_discarded_at_resume"],
            "generated_again": dict(led["groups_generated_again"]), "unaccounted": unaccounted}
  counts.update(check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=4))
  return counts


def campaign(samplers: int, sampler_kills: int, learner_kills: int, out: Path, env: dict, repo: Path, port: int,
             seed: int = 0, gap_s: tuple[float, float] = (4.0, 12.0), log=print) -> dict:
  """Kills until both counts are reached (a run that finishes first is followed by another); returns the tally."""
  rng = random.Random(f"ind{samplers}-{seed}")
  name = f"ind{samplers}"
  base = out / name
  shutil.rmtree(base, ignore_errors=True)
  base.mkdir(parents=True)
  deck = ["sampler"] * sampler_kills + ["learner"] * learner_kills
  rng.shuffle(deck)
  tally = {"topology": name, "kills": 0, "phases": {"sampler": 0, "learner": 0}, "resumes": 0, "runs": 0,
           "runs_checked": [], "unaccounted": 0, "failures": [], "samplers_started": 0}
  t0 = time.monotonic()
  while deck or tally["runs"] == 0:
    workdir, logs = base / f"run{tally['runs']}", base / f"run{tally['runs']}"
    learner_cmd, sampler_cmd = _commands(workdir, port)
    learner = _start(learner_cmd, Path(f"{logs}.learner.log"), env, repo)
    fleet = [_start(sampler_cmd, Path(f"{logs}.s{i}.log"), env, repo) for i in range(samplers)]
    tally["samplers_started"] += samplers
    try:
      started, attempt = time.monotonic(), 1
      next_at = started + rng.uniform(*gap_s)
      while learner.poll() is None and time.monotonic() - started < RUN_TIMEOUT_S:
        if deck and time.monotonic() >= next_at and _training(workdir, attempt):
          what = deck.pop()
          if what == "sampler":
            victim = rng.randrange(len(fleet))
            _kill(fleet[victim])
            fleet[victim] = _start(sampler_cmd, Path(f"{logs}.s{tally['samplers_started']}.log"), env, repo)
            tally["samplers_started"] += 1
          else:
            _kill(learner)
            learner = _start(learner_cmd, Path(f"{logs}.learner.log"), env, repo)
            tally["resumes"] += 1
            attempt += 1
          tally["kills"] += 1
          tally["phases"][what] += 1
          log(f"{name} run {tally['runs']}: SIGKILLed the {what} at {time.monotonic() - started:.0f}s")
          next_at = time.monotonic() + rng.uniform(*gap_s)
        time.sleep(0.1)
      code = learner.poll()
      for proc in fleet:
        try:
          proc.wait(60)
        except subprocess.TimeoutExpired:
          _kill(proc)
    finally:  # nothing of a run outlives it (an error here, a test's timeout)
      for proc in [learner, *fleet]:
        if proc.poll() is None:
          _kill(proc)
    if code != 0:  # None: past RUN_TIMEOUT_S (killed above)
      tally["failures"].append({"run": tally["runs"], "code": code})
      log(f"{name} run {tally['runs']}: the learner ended with {code}; see {logs}.learner.log")
      break
    try:
      counts = check_run(workdir)
    except AssertionError as e:
      tally["failures"].append({"run": tally["runs"], "check": str(e)[:2000]})
      log(f"{name} run {tally['runs']}: check failed: {e}")
      break
    tally["runs_checked"].append(counts)
    tally["unaccounted"] += counts["unaccounted"]
    tally["runs"] += 1
  tally["seconds"] = round(time.monotonic() - t0)
  tally["same_steps_as_uninterrupted"] = None  # which groups a step trains depends on which sampler delivered first
  return tally
