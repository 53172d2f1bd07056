"""A jaxrl-learner over two processes (jax.distributed among themselves: one learner mesh of 4 CPU devices, 2 per
process) serving two independent samplers (issue 43): every step trained by both learner processes in lock step,
both publishing bitwise-equal weights of every version, a sampler pulling from the follower; and a lead learner
SIGKILLed mid-run: the follower stops within a bound, both learner processes are relaunched, resume from the
checkpoint and the samplers reconnect; then the follower's host preempted (SIGTERM): the lead stops both after the
same step with a checkpoint; relaunched again, the run completes with its history and ledger exact."""

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


def _trained(workdir, attempt: int) -> int:
  """Steps trained by attempt `attempt` (the train events after the trace's start event of that attempt; 0 until the
  attempt has written it)."""
  path = workdir / "trace.jsonl"
  events = read_trace(path) if path.exists() else []
  starts = [i for i, e in enumerate(events) if e["event"] == "start"]
  if len(starts) <= attempt:
    return 0
  return sum(e["event"] == "train" and e["applied"] for e in events[starts[attempt]:])


def _wait_trained(workdir, learners, attempt: int, steps: int, timeout_s: float = 400) -> None:
  end = time.monotonic() + timeout_s
  while _trained(workdir, attempt) < steps:
    assert all(p.poll() is None for p in learners), learners[0].log.read_text()[-3000:]
    assert time.monotonic() < end, f"attempt {attempt}: fewer than {steps} steps in {timeout_s}s"
    time.sleep(0.2)


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
  """Two learner processes and two samplers to the end of the run; `during(learners, launch)` returns the learner
  processes that end it (launch(attempt) starts a pair again). Returns the run's seconds."""
  (port,) = free_ports(1)
  procs = []

  def launch(attempt: int) -> list:
    learners = _learners(tmp_path, tmp_path / "run", steps, port, attempt)
    procs.extend(learners)
    return learners

  learners = launch(0)
  samplers = _samplers(tmp_path, steps, port)
  procs += samplers
  t0 = time.monotonic()
  try:
    if during is not None:
      learners = during(learners, launch)
    _finish(learners + samplers)
  finally:
    for p in procs:
      if p.poll() is None:
        kill(p)
  return time.monotonic() - t0


@pytest.mark.timeout(900)
def test_the_lead_learner_killed_then_the_follower_preempted_both_stop_and_resume_with_the_samplers(tmp_path):
  """The lead SIGKILLed after step 3: the follower stops on its own; both relaunched, they resume, and once they
  trained 2 steps the follower's host is preempted (SIGTERM): the lead stops them both after the same step, with a
  checkpoint; relaunched again, they finish. The samplers run on through all three attempts. Also the clean run's
  checks (a test of its own before): every step trained once in lock step, equal weights at every version, pulls
  served by the follower."""
  workdir = tmp_path / "run"
  stopped = {}

  def kill_then_preempt(learners, launch):
    _wait_trained(workdir, learners, 0, 3)  # past the checkpoint of step 2
    kill(learners[0])
    killed_at = time.monotonic()
    code = learners[1].wait(90)  # the follower stops on its own, within a bound
    print(f"follower stopped {time.monotonic() - killed_at:.1f}s after the lead was killed, exit {code}")
    assert code != 0
    learners = launch(1)
    _wait_trained(workdir, learners, 1, 2)
    learners[1].send_signal(signal.SIGTERM)  # the follower's host preempted: the lead stops them both
    assert learners[0].wait(120) == 143, learners[0].log.read_text()[-3000:]
    assert learners[1].wait(60) == 0, learners[1].log.read_text()[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    check_history(read_trace(workdir / "trace.jsonl"), summary, GROUP_SIZE)  # at the stop: nothing lost or twice
    stopped.update(summary=summary, committed=committed_steps(workdir), lead_log=learners[0].log.read_text())
    return launch(2)

  seconds = _run(tmp_path, 10, kill_then_preempt)
  at_stop = stopped["summary"]
  assert at_stop["stopped_by"] == "SIGTERM" and at_stop["resumed_from"] >= 2 and 4 <= at_stop["version"] < 10
  assert [p["version"] for p in at_stop["learner_processes"]] == [at_stop["version"]] * 2
  assert stopped["committed"][-1] == at_stop["version"]  # saved together, at the step both stopped after
  assert "learner process 1 got SIGTERM: stopping after the current step" in stopped["lead_log"]
  summary = _check_run(workdir, tmp_path, 10, attempts=3)
  print(f"two learner processes, two samplers, the lead killed after step 3, the follower preempted: 10 steps in "
        f"{seconds:.1f}s", json.dumps({k: summary["ledger"][k] for k in ("samples_generated", "samples_trained",
                                                                          "samples_refused")}))
  assert summary["resumed_from"] == at_stop["version"] and "stopped_by" not in summary
  for log in tmp_path.glob("sampler*.log"):  # each registered with every attempt's learners
    assert log.read_text().count("jaxrl-sampler: sampler ") >= 3, log.read_text()[-3000:]
