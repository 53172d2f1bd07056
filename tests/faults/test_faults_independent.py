"""Independent sampler programs (jaxrl-sampler) that join and leave a running jaxrl-learner (issue 43): one sampler
SIGKILLed, one SIGSTOPped past its lease and woken (its registration is over; it registers again), a third joining
mid-run. The learner trains every step of one attempt, no group is trained twice and none is lost (the trace's
history and the ledger agree: trained, dropped, pending, generated again with its reason, refused samples counted),
and every trained token is within max_staleness. And the fenced path: a sampler that stops itself with finished
groups in hand (tests/faults/stop_before_deliver.py), is dropped, and wakes after another sampler generated and
trained those groups: all it delivers is refused as fenced, nothing twice trained, and it goes on."""

import collections
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from faults_util import BASE, check_history, kill, read_trace, start_child

from jaxrl.distributed.launch import free_ports

STEPS = 16
LEASE_S = 8.0  # well above the seconds a loaded, niced CPU box can starve a process for
GROUP_SIZE, GROUPS_PER_STEP = 4, 4  # configs/tiny.py
FLAGS = {**BASE, "num_steps": STEPS, "checkpoint.every_steps": 4}
STOP_BEFORE_DELIVER = Path(__file__).parent / "stop_before_deliver.py"


def _command(program: str, steps: int = STEPS, **flags) -> list[str]:
  """A module's command (or a script's: a path ending in .py) with the test's config and these flags."""
  run = [program] if program.endswith(".py") else ["-m", program]
  return [sys.executable, *run, "--config=configs/tiny.py",
          *(f"--config.{k}={v}" for k, v in {**FLAGS, "num_steps": steps}.items()),
          *(f"--{k}={v}" for k, v in flags.items())]


def _trains(workdir) -> list[dict]:
  path = workdir / "trace.jsonl"
  return [e for e in read_trace(path) if e["event"] == "train" and e["applied"]] if path.exists() else []


def _trained(workdir) -> int:
  return len(_trains(workdir))


def _wait_for(what: str, cond, learner, timeout_s: float = 300.0) -> None:
  end = time.monotonic() + timeout_s
  while not cond():
    assert learner.poll() is None, f"the learner ended while waiting for {what}: {learner.log.read_text()[-3000:]}"
    assert time.monotonic() < end, f"no {what} in {timeout_s:g}s: {learner.log.read_text()[-3000:]}"
    time.sleep(0.2)


def _exit_0(learner, samplers) -> None:
  """The learner, then every sampler, ends the run with exit status 0."""
  assert learner.wait(300) == 0, learner.log.read_text()[-3000:]
  for proc in samplers:
    assert proc.wait(60) == 0, proc.log.read_text()[-3000:]


def _end(*procs) -> None:
  """Kills what is still running (stopped ones too)."""
  for proc in procs:
    if proc.poll() is None:
      proc.send_signal(signal.SIGCONT)
      kill(proc)


@pytest.mark.timeout(900)
def test_samplers_killed_stopped_and_joining_while_the_learner_trains_every_step(tmp_path):
  workdir = tmp_path / "run"
  (port,) = free_ports(1)
  address = f"127.0.0.1:{port}"
  learner = start_child(_command("jaxrl.distributed.learner_main", workdir=workdir, port=port, lease_s=LEASE_S),
                        tmp_path / "learner.log")
  procs = {name: start_child(_command("jaxrl.distributed.sampler_main", learner=address), tmp_path / f"{name}.log")
           for name in ("a", "b")}
  try:
    _wait_for("third step", lambda: _trained(workdir) >= 3, learner)
    kill(procs["a"])
    killed_at = _trained(workdir)
    _wait_for("two steps by b alone", lambda: _trained(workdir) >= killed_at + 2, learner)
    procs["b"].send_signal(signal.SIGSTOP)  # no sampler runs now: the learner waits, it does not stop
    b = re.findall(r"jaxrl-sampler: sampler (\S+) of", procs["b"].log.read_text())[-1]  # b's registration now
    _wait_for(f"b ({b}) dropped", lambda: f"sampler {b} lost" in learner.log.read_text(), learner)
    procs["c"] = start_child(_command("jaxrl.distributed.sampler_main", learner=address), tmp_path / "c.log")
    _wait_for("c registered", lambda: "jaxrl-sampler: sampler " in procs["c"].log.read_text(), learner)
    procs["b"].send_signal(signal.SIGCONT)  # past its lease: its groups went back, its first call is refused
    _exit_0(learner, [procs["b"], procs["c"]])
  finally:
    _end(learner, *procs.values())
  summary, trains = _check_run(workdir, STEPS)
  assert sum(len(e["samples"]) for e in trains) == STEPS * GROUPS_PER_STEP * GROUP_SIZE
  # a, b, c and b again (a loaded box may starve one past its lease once more: it joins again); a killed and b
  # stopped were lost; b and c heard the run was over (their goodbyes after the final record are not counted)
  samplers = summary["samplers"]
  assert samplers["joined"] >= 4 and samplers["lost"] >= 2 and samplers["left"] == 0, samplers
  assert "lease expired" in (tmp_path / "b.log").read_text()
  led = summary["ledger"]
  # the groups the lost samplers held went back, each counted once (how many they held is the timing's: the hub
  # says it for each sampler it drops)
  held = [int(n) for n in re.findall(r"lost \(silent for more than [\d.]+s\): its (\d+) unfinished groups",
                                     learner.log.read_text())]
  assert len(held) == samplers["lost"] and led["groups_generated_again"].get("sampler_lost", 0) == sum(held)
  print("independent samplers:", json.dumps({k: led[k] for k in ("groups_admitted", "samples_generated",
                                                                  "samples_trained", "samples_refused",
                                                                  "groups_generated_again")}))


def _check_run(workdir, steps: int) -> tuple[dict, list[dict]]:
  """The summary and the train events of a run that trained every step of one attempt, no group twice, every group
  accounted for, every trained token within max_staleness=1."""
  summary = json.loads((workdir / "summary.json").read_text())
  events = read_trace(workdir / "trace.jsonl")
  assert [e["event"] for e in events].count("start") == 1  # one attempt: the learner never stopped
  trains = [e for e in events if e["event"] == "train"]
  assert [e["version"] for e in trains] == list(range(steps)) and all(e["applied"] for e in trains)
  check_history(events, summary, GROUP_SIZE)  # no sample trained twice, every group accounted for
  # every trained token within max_staleness=1 (a sample's oldest token: [group, index, min_version, max_version])
  assert max(e["version"] - s[2] for e in trains for s in e["samples"]) == summary["staleness_max"] <= 1
  return summary, trains


FENCE_STEPS = 24


@pytest.mark.timeout(600)
def test_a_sampler_that_wakes_with_groups_since_handed_to_another_is_fenced_and_nothing_is_trained_twice(tmp_path):
  """Sampler a stops itself right before its second delivery, finished groups in hand; past its lease the hub drops
  it and b generates and trains those groups; a wakes (SIGCONT): everything it delivers under its old registration
  is refused as fenced, counted sample for sample, and a registers again and delivers groups that are trained."""
  workdir, log = tmp_path / "run", tmp_path / "deliveries.jsonl"
  (port,) = free_ports(1)
  address = f"127.0.0.1:{port}"
  learner = start_child(_command("jaxrl.distributed.learner_main", FENCE_STEPS, workdir=workdir, port=port,
                                 lease_s=LEASE_S), tmp_path / "learner.log")
  procs = {"a": start_child(_command(str(STOP_BEFORE_DELIVER), FENCE_STEPS, learner=address), tmp_path / "a.log",
                            JAXRL_FAULTS_STOP_BEFORE_DELIVER="2", JAXRL_FAULTS_DELIVER_LOG=str(log)),
           "b": start_child(_command("jaxrl.distributed.sampler_main", FENCE_STEPS, learner=address),
                            tmp_path / "b.log")}
  try:
    _wait_for("a stopped before its second delivery", log.exists, learner)
    stop = json.loads(log.read_text().splitlines()[0])
    assert stop["event"] == "stop" and stop["groups"], stop
    _wait_for(f"a ({stop['sampler']}) dropped", lambda: f"sampler {stop['sampler']} lost" in learner.log.read_text(),
              learner)
    trained_by_b = lambda: set(stop["groups"]) <= {s[0] for e in _trains(workdir) for s in e["samples"]}  # noqa: E731
    _wait_for("a's groups generated and trained by b", trained_by_b, learner)
    assert _trained(workdir) <= FENCE_STEPS - 8, "too few steps left for a's next registration to deliver"
    procs["a"].send_signal(signal.SIGCONT)
    _exit_0(learner, procs.values())
  finally:
    _end(learner, *procs.values())
  summary, trains = _check_run(workdir, FENCE_STEPS)
  entries = [json.loads(line) for line in log.read_text().splitlines()[1:]]
  woken = [e for e in entries if e["sampler"] == stop["sampler"]]  # its old registration's deliveries
  assert woken[0]["groups"] == stop["groups"]  # the groups in hand at the stop go first
  assert all(e["reply"]["accepted"] == 0 and e["reply"]["refused"] == len(e["groups"]) for e in woken), woken
  led = summary["ledger"]
  assert led["samples_refused"]["fenced"] == sum(e["samples"] for e in woken)
  trained = collections.Counter(s[0] for e in trains for s in e["samples"])
  assert all(trained[g] == GROUP_SIZE for e in woken for g in e["groups"])  # trained once: b's samples
  again = [e for e in entries if e["sampler"] != stop["sampler"]]  # a's next registration goes on
  assert any(e["reply"]["accepted"] for e in again), entries
  assert summary["samplers"]["joined"] >= 3 and "lease expired" in procs["a"].log.read_text()
  print("fenced:", json.dumps({k: led[k] for k in ("samples_generated", "samples_trained", "samples_refused",
                                                   "groups_generated_again")}))
