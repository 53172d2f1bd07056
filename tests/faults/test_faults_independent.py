"""Independent sampler programs (jaxrl-sampler) that join and leave a running jaxrl-learner (issue 43): one sampler
SIGKILLed, one SIGSTOPped past its lease and woken (its registration is over; it registers again), a third joining
mid-run. The learner trains every step of one attempt, no group is trained twice and none is lost (the trace's
history and the ledger agree: trained, dropped, pending, generated again with its reason, refused samples counted),
and every trained token is within max_staleness."""

import json
import re
import signal
import sys
import time

import pytest
from faults_util import BASE, check_history, kill, read_trace, start_child

from jaxrl.distributed.launch import free_ports

STEPS = 16
LEASE_S = 8.0  # well above the seconds a loaded, niced CPU box can starve a process for
GROUP_SIZE, GROUPS_PER_STEP = 4, 4  # configs/tiny.py
FLAGS = {**BASE, "num_steps": STEPS, "checkpoint.every_steps": 4}


def _command(module: str, **flags) -> list[str]:
  return [sys.executable, "-m", module, "--config=configs/tiny.py", *(f"--config.{k}={v}" for k, v in FLAGS.items()),
          *(f"--{k}={v}" for k, v in flags.items())]


def _trained(workdir) -> int:
  path = workdir / "trace.jsonl"
  return sum(e["event"] == "train" and e["applied"] for e in read_trace(path)) if path.exists() else 0


def _wait_for(what: str, cond, learner, timeout_s: float = 300.0) -> None:
  end = time.monotonic() + timeout_s
  while not cond():
    assert learner.poll() is None, f"the learner ended while waiting for {what}: {learner.log.read_text()[-3000:]}"
    assert time.monotonic() < end, f"no {what} in {timeout_s:g}s: {learner.log.read_text()[-3000:]}"
    time.sleep(0.2)


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
    assert learner.wait(300) == 0, learner.log.read_text()[-3000:]
    for name in ("b", "c"):
      assert procs[name].wait(60) == 0, procs[name].log.read_text()[-3000:]
  finally:
    for proc in [learner, *procs.values()]:
      if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        kill(proc)
  summary = json.loads((workdir / "summary.json").read_text())
  events = read_trace(workdir / "trace.jsonl")
  assert [e["event"] for e in events].count("start") == 1  # one attempt: the learner never stopped
  trains = [e for e in events if e["event"] == "train"]
  assert [e["version"] for e in trains] == list(range(STEPS)) and all(e["applied"] for e in trains)
  check_history(events, summary, GROUP_SIZE)  # no sample trained twice, every group accounted for
  # every trained token within max_staleness=1 (a sample's oldest token: [group, index, min_version, max_version])
  assert max(e["version"] - s[2] for e in trains for s in e["samples"]) == summary["staleness_max"] <= 1
  assert sum(len(e["samples"]) for e in trains) == STEPS * GROUPS_PER_STEP * GROUP_SIZE
  # a, b, c and b again (a loaded box may starve one past its lease once more: it joins again); a killed and b
  # stopped were lost; b and c heard the run was over (their goodbyes after the final record are not counted)
  samplers = summary["samplers"]
  assert samplers["joined"] >= 4 and samplers["lost"] >= 2 and samplers["left"] == 0, samplers
  assert "lease expired" in (tmp_path / "b.log").read_text()
  led = summary["ledger"]
  assert led["groups_generated_again"].get("sampler_lost", 0) >= 1  # a or b held groups when it went
  print("independent samplers:", json.dumps({k: led[k] for k in ("groups_admitted", "samples_generated",
                                                                  "samples_trained", "samples_refused",
                                                                  "groups_generated_again")}))
