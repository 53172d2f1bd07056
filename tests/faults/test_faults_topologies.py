"""The same fault scenarios in every topology: single-host `jaxrl.train` and a job of 1 learner + 1 sampler process
(`jaxrl.distributed.launch`), on the tiny config with a trace.

Resume: the whole job SIGKILLed once its step-2 checkpoint is committed (groups admitted for the next steps are in
flight), then the same command: every step trains the groups of an uninterrupted run of the same seed, no group is
skipped or trained twice, and summary.json counts what the resume discarded and generated again.
Bad input: one line naming the key, exit status 2, before any process starts.
Skipped prompts: traced with their reason, and counted.
Auto staleness: the admission bound the learner chooses reaches every sampler."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from faults_util import (
  BASE,
  GOOD,
  LONG,
  NUM_STEPS,
  REPO,
  TALLY,
  check_history,
  child_env,
  cli,
  committed_steps,
  groups_per_step,
  hf_folder,
  read_trace,
  tiny_config,
  tiny_variant,
  wait_for,
)

from jaxrl.metrics import read_jsonl
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


def with_config(args: list[str], config) -> list[str]:
  """The command line `args` of the tiny config with the config file `config` instead."""
  return [re.sub(r"^--config=configs/tiny.py", f"--config={config}", a) for a in args]


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


def pending_at(workdir, step: int) -> list[int]:
  """The groups in flight (admitted, not settled) that the committed checkpoint of `step` records."""
  record = json.loads((workdir / "checkpoints" / str(step) / "record" / "metadata").read_text())
  return record["pending_group_ids"]


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
  # A checkpoint that holds groups in flight (pending in its record), step 2 or later: one taken while the sampler
  # lagged (a loaded box) holds none, and a kill after it would test nothing
  wait_for(lambda: any(pending_at(workdir, s) for s in committed_steps(workdir) if s >= 2), proc, timeout=300,
           what="a checkpoint with groups in flight")
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


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_bad_input_is_one_line_naming_the_key_and_exit_2(topology, tmp_path):
  (tmp_path / "a-file").write_text("")
  cases = {"rl.nosuchkey=1": "unknown config key 'nosuchkey'", "sampler.top_p=abc": "sampler.top_p",
           "rl.max_staleness=abc": "rl.max_staleness", "sampler.top_p=2": "sampler.top_p must be a number in (0, 1]"}
  runs = [(command(topology, tmp_path / "w") + [f"--config.{flag}"], message) for flag, message in cases.items()]
  runs.append((command(topology, tmp_path / "a-file" / "w"), "is not writable"))
  # A missing data file: a model folder, so that the dataset task's text prompts pass (nothing reads it: the data is
  # checked first).
  missing = tmp_path / "no-such.jsonl"
  config = tiny_variant(tmp_path / "dataset_config.py", model__source=str(tmp_path), task__name="dataset",
                        task__kwargs__train_files=str(missing))
  runs.append((with_config(command(topology, tmp_path / "w"), config),
               f"task.kwargs.train_files: no such file {missing}"))
  prog = "jaxrl-train" if topology == "single" else "jaxrl.launch"
  for args, message in runs:
    out = subprocess.run(args, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
    # One line in all: the launcher started no process (it prints "jaxrl.launch: process <i> pid <pid>" for each).
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, (args[-1], out.stdout[-2000:], out.stderr[-2000:])
    assert lines[0].startswith(f"{prog}: ") and message in lines[0], lines
    TALLY["CLI bad inputs"] += 1
  assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_skipped_prompts_are_in_the_trace_with_their_reason(topology, tmp_path):
  """A prompt longer than the sampler's context is skipped, counted and traced with its reason in every topology
  (a job's samplers post their skips; its lead learner traces them before the record that counts them), and the
  trace still accounts for every data position."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in [*GOOD[:5], LONG, *GOOD[5:]]) + "\n")
  (data / "eval.jsonl").write_text(json.dumps(GOOD[0]) + "\n")  # every train.jsonl record trains
  config = tiny_variant(tmp_path / "text_config.py", model__source=str(hf_folder(data / "model", True)),
                        task__name="gsm8k", task__kwargs__path=str(data / "train.jsonl"),
                        task__kwargs__eval_path=str(data / "eval.jsonl"), task__kwargs__instruction="")
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  assert start_job(with_config(command(topology, workdir), config), log).wait(timeout=300) == 0, log.read_text()[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  events = read_trace(workdir / "trace.jsonl")
  skips = [e for e in events if e["event"] == "skip_prompt"]
  assert skips and all("leaves no room to generate in sampler.max_len=32" in e["reason"] for e in skips), skips
  assert summary["ledger"]["skipped_prompts"] == len(skips)
  check_history(events, summary, group_size=GROUP_SIZE)  # skipped is one of each data position's outcomes
  TALLY["skipped prompts traced"] += len(skips)


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_auto_staleness_moves_the_admission_bound_and_the_samplers_keep_it(topology, tmp_path):
  """rl.max_staleness="auto" from k_min = 0: the learner moves k from the drift it measures; every sampler admits
  under the bound it last heard of, so a step trains nothing staler than a bound chosen before it. (A sampler
  process that ignored the bound, admitting under k_max, failed this test: k never left 0.)"""
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  auto = {"rl__max_staleness": "auto", "rl__auto_staleness__k_max": 2, "rl__auto_staleness__window": 2}
  assert start_job(command(topology, workdir, **auto), log).wait(timeout=300) == 0, log.read_text()[-3000:]
  records = read_jsonl(workdir / "metrics.jsonl")
  ks = [r["admit_staleness"] for r in records]
  assert len(records) == NUM_STEPS and all(0 <= k <= 2 for k in ks) and max(ks) >= 1, ks  # it moved up from 0
  for i, r in enumerate(records):
    assert r["staleness_max"] <= max([0, *ks[:i]]), (i, ks, [r["staleness_max"] for r in records])


@pytest.mark.timeout(600)  # the slowest tests: 111-183 s on the 2-core box under load (docs/RELIABILITY.md)
@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_mode_auto_switches_between_segments_without_losing_or_repeating_a_sample(topology, tmp_path):
  """mode="auto": a sync segment of 5 steps measures, the simulator predicts, the next segment (4 steps) runs the
  choice (jaxrl-train's segments in one process; the launcher's, one launch each: a sync segment as one colocated
  process, a pipeline segment as the job's processes, each resuming the other's checkpoint). Every group is trained
  exactly once across the switch (the trace's history), every step is logged once, the decision is in summary.json."""
  from jaxrl.controller import auto

  workdir, log = tmp_path / "run", tmp_path / "job.log"
  flags = {"mode": "auto", "num_steps": 9, "auto__measure_steps": 5, "auto__recheck_steps": 4}
  assert start_job(command(topology, workdir, **flags), log).wait(timeout=400) == 0, log.read_text()[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  segments = summary["auto"]
  assert summary["mode"] == "auto" and [(s["start"], s["end"]) for s in segments] == [(0, 5), (5, 9)]
  assert segments[0]["choice"] == "sync" and set(segments[1]["predicted"]) == {"sync", "pipeline_k1", "pipeline_k2"}
  assert segments[1]["choice"] == auto.choose(segments[1]["predicted"], {"sync": segments[0]["measured_tokens_per_s"]})
  assert all(s["measured_tokens_per_s"] > 0 and s["measured_step_s"] > 0 for s in segments)
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=GROUP_SIZE)  # none lost or trained twice
  led = summary["ledger"]
  assert summary["steps"] == 9 and led["samples_trained"] == 9 * 4 * GROUP_SIZE  # 4 groups a step
  assert [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")] == list(range(1, 10))
  if topology != "single":  # the launcher runs a sync segment colocated: one process holding both devices
    announced = re.findall(r"mode=auto: steps to (\d+) as (\w+), .* on (one process|the job's processes)",
                           log.read_text())
    assert [(int(e), m, w) for e, m, w in announced] == [
        (s["end"], "sync" if s["choice"] == "sync" else "pipeline",
         "one process" if s["choice"] == "sync" else "the job's processes") for s in segments]


@pytest.mark.slow
def test_a_run_moves_between_topologies_at_its_checkpoints(tmp_path):
  """What mode=auto's launcher does: single-host sync to step 2, the 1 learner + 1 sampler process pipeline to step
  4, single-host sync again to step 6, each resuming the last one's checkpoint. Every group is trained exactly once
  (the trace's history), every step is logged once, and the ledger counts every sample."""
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  for topology, mode, end in (("single", "sync", 2), ("mp1+1", "pipeline", 4), ("single", "sync", NUM_STEPS)):
    args = command(topology, workdir, mode=mode, num_steps=end, optimizer__decay_steps=NUM_STEPS)
    assert start_job(args, log).wait(timeout=300) == 0, log.read_text()[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=GROUP_SIZE)
  assert summary["steps"] == NUM_STEPS and summary["ledger"]["samples_trained"] == NUM_STEPS * 4 * GROUP_SIZE
  assert [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")] == list(range(1, NUM_STEPS + 1))
