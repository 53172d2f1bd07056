"""A jaxrl-learner over two processes (jax.distributed among themselves: one learner mesh of 4 CPU devices, 2 per
process) serving two independent samplers (issue 43): every step trained by both learner processes in lock step,
both publishing bitwise-equal weights of every version, a sampler pulling from the follower; and a lead learner
SIGKILLed mid-run: the follower stops within a bound, both learner processes are relaunched, resume from the
checkpoint, the samplers reconnect and the run completes with its history and ledger exact."""

import json
import re
import signal
import sys
import time

import pytest
from faults_util import BASE, check_history, committed_steps, kill, read_trace, replay, start_child

from jaxrl.distributed.launch import free_ports

GROUP_SIZE, GROUPS_PER_STEP = 4, 4  # configs/tiny.py
LEARNERS = 2


def _command(module: str, steps: int, **flags) -> list[str]:
  config = {**BASE, "num_steps": steps, "checkpoint.every_steps": 2}
  return [sys.executable, "-m", module, "--config=configs/tiny.py", *(f"--config.{k}={v}" for k, v in config.items()),
          *(f"--{k}={v}" for k, v in flags.items())]


def _learners(tmp_path, workdir, steps: int, port: int, attempt: int) -> list:
  (coordinator,) = free_ports(1)
  return [start_child(_command("jaxrl.distributed.learner_main", steps, workdir=workdir, port=port if p == 0 else 0,
                               num_processes=LEARNERS, process_id=p, coordinator_address=f"127.0.0.1:{coordinator}",
                               lease_s=8.0, follow_timeout_s=10.0),
                      tmp_path / f"learner{p}-{attempt}.log", JAX_NUM_CPU_DEVICES="2") for p in range(LEARNERS)]


def _samplers(tmp_path, steps: int, port: int) -> list:
  # the learners compile every batch shape before they serve: minutes on a loaded box
  return [start_child(_command("jaxrl.distributed.sampler_main", steps, learner=f"127.0.0.1:{port}", reconnect_s=600),
                      tmp_path / f"sampler{i}.log") for i in range(2)]


def _trained(workdir) -> int:
  path = workdir / "trace.jsonl"
  return sum(e["event"] == "train" and e["applied"] for e in read_trace(path)) if path.exists() else 0


def _finish(procs, timeout_s: float = 300.0) -> None:
  for p in procs:
    assert p.wait(timeout_s) == 0, p.log.read_text()[-3000:]


def _check_run(workdir, tmp_path, steps: int, attempts: int) -> dict:
  """The checks both runs share: every step trained once in the run's history, every group accounted for, the
  staleness bound, and the learner processes' weights equal, version by version."""
  summary = json.loads((workdir / "summary.json").read_text())
  events = read_trace(workdir / "trace.jsonl")
  assert [e["event"] for e in events].count("start") == attempts
  kept, _ = replay(events)
  trains = [e for e in kept if e["event"] == "train"]
  assert [e["version"] for e in trains] == list(range(steps)) and all(e["applied"] for e in trains)
  check_history(events, summary, GROUP_SIZE)  # no sample trained twice, every group accounted for
  assert max(e["version"] - s[2] for e in trains for s in e["samples"]) <= 1  # max_staleness=1, every token
  assert sum(len(e["samples"]) for e in trains) == steps * GROUPS_PER_STEP * GROUP_SIZE
  lead, follower = summary["learner_processes"]
  assert lead["process"] == 0 and follower["process"] == 1 and lead["version"] == follower["version"] == steps
  # Each process's own copy of every version it published: the checksums of the same bytes (f32 on CPU: the params
  # themselves), so the learner processes hold bitwise-equal params at every version
  assert follower["published"] == lead["published"] and str(steps) in lead["published"]
  # a sampler pulled from the follower's own transfer server (it checked each pull against the follower's
  # checksums, which equal the lead's)
  assert follower["pulls_served"] > 0, summary["learner_processes"]
  weights_from = set(re.findall(r"weights from (\S+)", "".join(p.read_text() for p in tmp_path.glob("sampler*.log"))))
  assert len(weights_from) >= 2, weights_from
  return summary


def _run(tmp_path, steps: int, during=None) -> float:
  """Two learner processes and two samplers to the end of the run; `during(learners)` returns the learner
  processes that end it (e.g. relaunched ones). Returns the run's seconds."""
  (port,) = free_ports(1)
  learners = _learners(tmp_path, tmp_path / "run", steps, port, 0)
  samplers = _samplers(tmp_path, steps, port)
  procs = learners + samplers
  t0 = time.monotonic()
  try:
    if during is not None:
      learners = during(learners, lambda: _learners(tmp_path, tmp_path / "run", steps, port, 1))
      procs += learners
    _finish(learners + samplers)
  finally:
    for p in procs:
      if p.poll() is None:
        kill(p)
  return time.monotonic() - t0


@pytest.mark.timeout(900)
def test_the_lead_learner_killed_the_follower_stops_and_both_resume_with_the_samplers(tmp_path):
  """Also the clean run's checks (a test of its own before; this one makes every one of them, across a resume): every
  step trained once in lock step, equal weights at every version, pulls served by the follower."""
  def kill_the_lead(learners, relaunch):
    end = time.monotonic() + 400
    while _trained(tmp_path / "run") < 3:  # past the checkpoint of step 2
      assert all(p.poll() is None for p in learners), learners[0].log.read_text()[-3000:]
      assert time.monotonic() < end, "no third step in 400s"
      time.sleep(0.2)
    kill(learners[0])
    killed_at = time.monotonic()
    code = learners[1].wait(90)  # the follower stops on its own, within a bound
    print(f"follower stopped {time.monotonic() - killed_at:.1f}s after the lead was killed, exit {code}")
    assert code != 0
    return relaunch()

  seconds = _run(tmp_path, 6, kill_the_lead)
  summary = _check_run(tmp_path / "run", tmp_path, 6, attempts=2)
  print(f"two learner processes, two samplers, the lead killed after step 3: 6 steps in {seconds:.1f}s",
        json.dumps({k: summary["ledger"][k] for k in ("samples_generated", "samples_trained", "samples_refused")}))
  assert summary["resumed_from"] is not None and summary["resumed_from"] >= 2
  for log in tmp_path.glob("sampler*.log"):  # each registered with the first learner and again with the relaunch
    assert log.read_text().count("jaxrl-sampler: sampler ") >= 2, log.read_text()[-3000:]


@pytest.mark.timeout(600)
def test_a_follower_learner_preempted_stops_every_learner_process_after_the_same_step(tmp_path):
  workdir = tmp_path / "run"
  (port,) = free_ports(1)
  learners = _learners(tmp_path, workdir, 8, port, 0)
  samplers = _samplers(tmp_path, 8, port)
  try:
    end = time.monotonic() + 400
    while _trained(workdir) < 2:
      assert all(p.poll() is None for p in learners), learners[0].log.read_text()[-3000:]
      assert time.monotonic() < end, "no second step in 400s"
      time.sleep(0.2)
    learners[1].send_signal(signal.SIGTERM)  # the follower's host preempted: the lead stops them both
    assert learners[0].wait(120) == 143, learners[0].log.read_text()[-3000:]
    assert learners[1].wait(60) == 0, learners[1].log.read_text()[-3000:]
  finally:
    for p in learners + samplers:
      if p.poll() is None:
        kill(p)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["stopped_by"] == "SIGTERM" and 2 <= summary["version"] < 8
  assert [p["version"] for p in summary["learner_processes"]] == [summary["version"]] * 2
  assert committed_steps(workdir)[-1] == summary["version"]  # saved together, at the step both stopped after
  check_history(read_trace(workdir / "trace.jsonl"), summary, GROUP_SIZE)
  assert "learner process 1 got SIGTERM: stopping after the current step" in learners[0].log.read_text()
