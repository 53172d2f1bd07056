"""Multi-process runs on CPU loopback (jaxrl.distributed.launch, gloo collectives, socket cross-host transfers).

1. Two learner processes + two sampler processes, pipeline mode: reward rises, every version's params arrive at
   both samplers bit for bit, the staleness bound holds; then learner 1 is SIGKILLed and every other process stops
   on its own within seconds, each naming learner 1; the same command (with one sampler process) resumes from the
   learners' last checkpoint, bit for bit, and trains on until a SIGTERM to one process (a preempted host) stops
   every process after the same learner step, with a checkpoint and exit status 143; the same command resumes the
   job again and logs every step once.
2. Sync mode, two learner processes + one sampler process running multi-turn episodes, against the single-host run
   of the same config and seed (one process, 3 devices): the same params, bit for bit, the same held-out eval before
   and after training (the sampler process's), and every sample and episode is accounted for.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.distributed.transfer import load_shards
from jaxrl.integrity import MARKER
from jaxrl.metrics import read_jsonl
from jaxrl.models.quant import CONTRACTED

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "configs"), str(REPO / "tests" / "faults")]
import tiny  # noqa: E402
from faults_util import check_history, read_trace  # noqa: E402

HEARTBEAT_S = 5


def _launch(num_processes: int, args: list[str], log: Path) -> subprocess.Popen:
  cmd = [sys.executable, "-m", "jaxrl.distributed.launch", f"--num_processes={num_processes}",
         "--devices_per_process=1", "--grace_s=60", "--timeout_s=600", "--", *args, "--config.log.tensorboard=False",
         "--config.log.progress=False", "--config.log.trace=True", f"--heartbeat_timeout_s={HEARTBEAT_S}",
         "--dump_weights"]
  # The matmul precision the test suite uses (conftest), here and in the single-host reference.
  env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
  return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _assert_weights_arrived_bitwise(weights: Path, versions, learners, samplers):
  for v in versions:
    sent = load_shards([weights / f"v{v}_process{p}.npz" for p in learners])
    for p in samplers:
      got = load_shards([weights / f"v{v}_process{p}.npz"])
      assert sent.keys() == got.keys()
      for name in sent:
        assert sent[name].dtype == got[name].dtype and sent[name].tobytes() == got[name].tobytes(), (v, p, name)


def _signal_after_steps(proc: subprocess.Popen, workdir: Path, log: Path, steps: int, timeout_s: float,
                        process: int, sig: signal.Signals) -> tuple[int, float]:
  """Waits until this job has logged step `steps` (a record written after it started: a resumed workdir holds the
  records of the runs before it, which the resumed run truncates to its checkpoint), sends `sig` to one of its
  processes, and waits for the launcher: (its exit status, seconds from the signal to the job's end). The job is
  killed if anything goes wrong."""
  started = time.time()

  def reached() -> bool:
    records = read_jsonl(workdir / "metrics.jsonl") if (workdir / "metrics.jsonl").exists() else []
    return any(r["step"] >= steps and r["time"] >= started for r in records)

  try:
    deadline = time.monotonic() + timeout_s
    while not reached():
      assert proc.poll() is None, f"the job ended early:\n{log.read_text()[-5000:]}"
      assert time.monotonic() < deadline, f"fewer than {steps} steps in {timeout_s} s:\n{log.read_text()[-5000:]}"
      time.sleep(0.2)
    pids = {int(i): int(p) for i, p in re.findall(r"jaxrl.launch: process (\d) pid (\d+)", log.read_text())}
    os.kill(pids[process], sig)
    sent_at = time.monotonic()
    code = proc.wait(timeout=120)
    return code, time.monotonic() - sent_at
  finally:
    if proc.poll() is None:
      proc.kill()


@pytest.mark.slow
def test_two_learner_processes_learn_die_together_and_stop_together_on_a_sigterm(tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "launch.log"
  steps = 12
  proc = _launch(4, ["--config=configs/tiny.py", f"--workdir={workdir}", "--config.num_steps=1000",
                     "--config.mesh.sampler_devices=2"], log)
  # Learner 1: learner 0 is left inside a collective with a dead peer.
  code, stopped_after = _signal_after_steps(proc, workdir, log, steps, 420, process=1, sig=signal.SIGKILL)
  out = log.read_text()

  records = read_jsonl(workdir / "metrics.jsonl")[:steps]
  rewards = [r["reward_mean"] for r in records]
  first, last = np.mean(rewards[:2]), np.mean(rewards[-3:])
  assert last > first + 0.3, f"reward went from {first:.3f} to {last:.3f}"
  # Per trained token, measured inside the learner's step, and per sample on the host.
  assert all(r["staleness_max"] <= 1 for r in records), [r["staleness_max"] for r in records]
  assert any(r["staleness_mean"] > 0 for r in records)  # sampling and training really overlapped
  _assert_weights_arrived_bitwise(workdir / "weights", range(steps + 1), learners=(0, 1), samplers=(2, 3))

  assert code == 137, out[-3000:]  # the launcher reports the first failure: learner 1's SIGKILL
  assert "process 0: exit status 3, process 1: killed by SIGKILL, process 2: exit status 3, " \
         "process 3: exit status 3" in out
  assert "killing process" not in out  # they stopped on their own, the launcher had nothing to kill
  assert stopped_after < 3 * HEARTBEAT_S + 15, stopped_after
  for p, name in ((0, "learner 0"), (2, "sampler 0"), (3, "sampler 1")):
    assert re.search(rf"\[p{p} +[\d.]+s\] jaxrl: process {p} \({name}\) stopping: process 1 \(learner 1\) sent no "
                     rf"heartbeat for \d+s: it died or hangs", out), out[-3000:]

  # The same command resumes from the last checkpoint the learners saved together, here on another split (one
  # sampler process instead of two): the params it starts from are the saved ones, bit for bit.
  # Only checkpoints with their commit marker count: a save the SIGKILL interrupted is set aside on resume.
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if (p / MARKER).exists())
  assert saved and saved[-1] >= steps - 8, saved  # tiny.py saves every 4 steps; the newest may have been cut
  resumed_at = saved[-1]
  (workdir / "weights").rename(tmp_path / "weights-first")
  # SIGTERM to the sampler's host (a preempted host; the learners hear of it through the store) once the resumed
  # job trained 2 steps: every process stops after the same learner step, with a checkpoint and exit status 143.
  log = tmp_path / "resume.log"
  args = ["--config=configs/tiny.py", f"--workdir={workdir}", "--config.mesh.sampler_devices=1"]
  proc = _launch(3, [*args, "--config.num_steps=1000"], log)  # learners: processes 0, 1; sampler: process 2
  code, stopped_after = _signal_after_steps(proc, workdir, log, resumed_at + 2, 300, process=2, sig=signal.SIGTERM)
  out = log.read_text()
  assert code == 143, out[-3000:]
  assert "process 0: exit status 143, process 1: exit status 143, process 2: exit status 143" in out, out[-3000:]
  assert "killing process" not in out and "heartbeat" not in out  # a clean stop, not a failure
  assert stopped_after < 30, stopped_after
  summary = json.loads((workdir / "summary.json").read_text())
  stopped_at = summary["steps"]
  assert summary["resumed_from"] == resumed_at and summary["stopped_by"] == "SIGTERM"
  assert resumed_at + 2 <= stopped_at < 1000 and summary["sampler_processes"] == [2]
  for p in range(3):
    assert re.search(rf"\[p{p} +[\d.]+s\] jaxrl: process {p}: stopped by SIGTERM", out), out[-3000:]
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved[-1] == stopped_at, saved  # the last step trained, saved by both learners together
  first, again = (load_shards([d / f"v{resumed_at}_process{p}.npz" for p in (0, 1)])
                  for d in (tmp_path / "weights-first", workdir / "weights"))
  assert first.keys() == again.keys()
  for name in first:
    assert first[name].tobytes() == again[name].tobytes(), name
  _assert_weights_arrived_bitwise(workdir / "weights", range(resumed_at, stopped_at + 1), learners=(0, 1),
                                  samplers=(2,))

  # The same command again resumes from the SIGTERM's checkpoint and trains to the end.
  target = stopped_at + 2
  code = _launch(3, [*args, f"--config.num_steps={target}"], tmp_path / "end.log").wait(timeout=300)
  out = (tmp_path / "end.log").read_text()
  assert code == 0, out[-5000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["resumed_from"] == stopped_at and summary["steps"] == target and "stopped_by" not in summary
  assert summary["staleness_max"] <= 1
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=4)  # no group lost or trained twice
  led = summary["ledger"]
  assert led["samples_trained"] == target * 16  # the steps before each stop and after, none twice
  assert led["samples_generated"] == led["samples_trained"] + sum(led["dropped"].values()) + \
      led["samples_discarded_at_resume"] + summary["samples_in_flight"]
  steps_logged = [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")]
  assert steps_logged == list(range(1, target + 1))  # the steps after each checkpoint, logged once


def _normalized(tree) -> dict[str, np.ndarray]:
  """Leaves by path, spelled the same for an nnx.State and for its Orbax-restored dict."""
  return {re.sub(r"\W+", "/", name).strip("/"): x for name, x in tree.items()}


def _resume_to(workdir: Path, log: Path, num_processes: int, sampler_devices: int, target: int) -> dict:
  """The same command on another split, to `target` steps; its summary."""
  code = _launch(num_processes, ["--config=configs/tiny.py", f"--workdir={workdir}", f"--config.num_steps={target}",
                                 f"--config.mesh.sampler_devices={sampler_devices}"], log).wait(timeout=300)
  assert code == 0, log.read_text()[-5000:]
  return json.loads((workdir / "summary.json").read_text())


@pytest.mark.timeout(600)  # the slowest tests: 111-183 s on the 2-core box under load (docs/RELIABILITY.md)
@pytest.mark.slow
def test_one_learner_process_checkpoints_with_one_and_two_samplers_and_resumes_after_sigkill(tmp_path):
  """1 learner + 1 sampler process (which used to crash at its first checkpoint: Orbax refuses a learner state that
  one process holds whole), SIGKILLed; resumed as 1 learner + 2 samplers, SIGKILLed again; resumed as 1 + 1 to
  the end. Every resume starts from the last checkpoint, no sample is trained twice and no group is lost."""
  workdir = tmp_path / "run"
  # (processes, sampler devices = sampler processes, steps logged before the kill: past a checkpoint of this run)
  topologies = [(2, 1, 5), (3, 2, 9)]
  for i, (n, sampler_devices, steps) in enumerate(topologies):
    log = tmp_path / f"launch{i}.log"
    proc = _launch(n, ["--config=configs/tiny.py", f"--workdir={workdir}", "--config.num_steps=1000",
                       f"--config.mesh.sampler_devices={sampler_devices}"], log)
    # The sampler (the last process) is killed: the learner stops on its own, after its checkpoint at step 4 or 8.
    code, _ = _signal_after_steps(proc, workdir, log, steps, 300, process=n - 1, sig=signal.SIGKILL)
    out = log.read_text()
    assert code == 137, out[-3000:]
    assert "Cannot serialize" not in out
    assert re.search(rf"process 0 \(learner 0\) stopping: process {n - 1} \(sampler {n - 2}\) sent no heartbeat",
                     out), out[-3000:]
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if (p / MARKER).exists())
  assert saved[-1] >= 8, saved  # tiny.py saves every 4 steps; the second run resumed from the first's
  target = saved[-1] + 2
  summary = _resume_to(workdir, tmp_path / "resume.log", 2, 1, target)
  assert summary["resumed_from"] == saved[-1] and summary["steps"] == target
  assert summary["learner_processes"] == [0] and summary["sampler_processes"] == [1]
  led = summary["ledger"]
  assert led["samples_trained"] == target * 16 and led["dropped"] == {}
  assert summary["staleness_max"] <= 1
  assert [r["step"] for r in read_jsonl(workdir / "metrics.jsonl")] == list(range(1, target + 1))  # each once
  # Across the kills and the changes of split (1, 2, then 1 sampler process): no group lost or trained twice.
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=4)


EPISODE_FLAGS = ["--config.task.name=token_turns", "--config.sampler.max_len=64", "--config.rl.seq_len=64",
                 "--config.sampler.max_new_tokens=8", "--config.eval.num_examples=0"]


@pytest.mark.timeout(600)  # the slowest tests: 111-183 s on the 2-core box under load (docs/RELIABILITY.md)
@pytest.mark.slow
@pytest.mark.parametrize("mode, processes, samplers", [("sync", 3, 1), ("pipeline", 3, 2)])
def test_multi_turn_episodes_across_processes(tmp_path, mode, processes, samplers):
  """Multi-turn episodes (token_turns: three model turns, two observations) with the sampler in its own process(es):
  observation tokens cross to the learners with loss mask 0 (their version -1). Sync: `jaxrl.distributed.job` on 3
  processes of 1 device (learner 2, sampler 1) against `jaxrl.train` on one process with 3 CPU devices, by the same
  CLI flags and seed: the same params, bit for bit, the same ledger and episodes, the same held-out eval before and
  after training (the sampler process's), every version's params at the sampler as sent. Pipeline: two sampler
  processes' episodes are all accounted for."""
  import jax
  import orbax.checkpoint as ocp

  steps = 4 if mode == "sync" else 6
  flags = [f"--config=configs/tiny.py:{mode}", f"--config.num_steps={steps}",
           f"--config.mesh.sampler_devices={samplers}", *EPISODE_FLAGS]
  if mode == "sync":  # the sync run is also compared with the single-host run's held-out evals
    flags.append("--config.eval.num_examples=6")
  workdir, log = tmp_path / "mp", tmp_path / "launch.log"
  proc = _launch(processes, [*flags, f"--workdir={workdir}"], log)
  try:
    code = proc.wait(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert code == 0, log.read_text()[-5000:]
  summary = json.loads((workdir / "summary.json").read_text())
  c = tiny.get_config(mode)
  episodes = steps * c.rl.group_size * c.rl.groups_per_step
  led = summary["ledger"]
  assert summary["steps"] == steps and led["samples_trained"] == episodes and not led["dropped"]
  assert led["samples_generated"] == led["samples_trained"] + summary["samples_in_flight"]
  stats = summary["episodes"]  # summed over the sampler processes
  assert stats["episodes"] >= episodes and stats["ends"] == {"done": stats["episodes"]}
  assert stats["env_steps"] == 3 * stats["episodes"] and not stats["env_failures"]
  assert summary["staleness_max"] == (0 if mode == "sync" else 1)
  assert summary["sampler_processes"] == list(range(processes - samplers, processes))
  if mode == "pipeline":
    return
  assert summary["sampler_versions"] == [steps]
  _assert_weights_arrived_bitwise(workdir / "weights", range(steps + 1), learners=(0, 1), samplers=(2,))

  # Same device count in the reference process: XLA:CPU numerics can depend on it (with 8 devices, one matrix of
  # the tiny model differs by ~2e-5 after a step, in any run).
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "3", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
  ref = subprocess.run([sys.executable, "-m", "jaxrl.train", *flags, f"--workdir={tmp_path / 'single'}",
                        "--config.log.tensorboard=False", "--config.log.progress=False"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert ref.returncode == 0, ref.stderr[-3000:]
  reference = json.loads((tmp_path / "single" / "summary.json").read_text())
  counts = lambda stats: {k: v for k, v in stats.items() if k != "env_seconds"}  # env_seconds: a timing
  assert summary["ledger"] == reference["ledger"] and counts(summary["episodes"]) == counts(reference["episodes"])
  for when, version in (("eval_before", 0), ("eval_after", steps)):
    assert summary[when] == reference[when] and summary[when]["version"] == version, (when, summary[when])
  assert summary["eval_after"]["reward_mean"] != summary["eval_before"]["reward_mean"]  # another policy
  restored = ocp.StandardCheckpointer().restore(tmp_path / "single" / "checkpoints" / str(steps) / "state")["params"]
  single = _normalized({jax.tree_util.keystr(k): np.asarray(v)
                        for k, v in jax.tree_util.tree_leaves_with_path(restored)})
  multi = _normalized(load_shards([workdir / "weights" / f"v{steps}_process{p}.npz" for p in (0, 1)]))
  assert single.keys() == multi.keys() and len(single) == 12
  for name in single:
    assert single[name].dtype == multi[name].dtype and single[name].tobytes() == multi[name].tobytes(), name
  first = _normalized(load_shards([workdir / "weights" / f"v0_process{p}.npz" for p in (0, 1)]))
  assert any(first[name].tobytes() != multi[name].tobytes() for name in first)  # it trained


def test_an_int8_sampler_process_receives_each_version_quantized_by_the_learner(tmp_path):
  """sampler.weight_dtype="int8" in a 1 learner + 1 sampler job: the learner quantizes each version before it is
  sent, so the sampler process receives int8 values with per-channel scales (a quarter of the float bytes), and
  they are that version's weights: within half a quantization step of the learner's float params."""
  workdir, log = tmp_path / "run", tmp_path / "launch.log"
  code = _launch(2, ["--config=configs/tiny.py", f"--workdir={workdir}", "--config.num_steps=3",
                     "--config.mesh.sampler_devices=1", "--config.sampler.weight_dtype=int8"], log).wait(timeout=300)
  assert code == 0, log.read_text()[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == 3 and summary["ledger"]["samples_trained"] == 3 * 16
  for v in range(4):
    sent = load_shards([workdir / "weights" / f"v{v}_process0.npz"])
    got = load_shards([workdir / "weights" / f"v{v}_process1.npz"])
    quantized = set()
    for name, w in sent.items():
      if f"{name}.values" not in got:  # norms: float, as sent
        assert got[name].dtype == w.dtype and got[name].tobytes() == w.tobytes(), (v, name)
        continue
      values, scale = got[f"{name}.values"], got[f"{name}.scale"]
      contracted = CONTRACTED[_param_name(name)]
      assert values.dtype == np.int8 and values.shape == w.shape
      np.testing.assert_allclose(scale, np.abs(w).max(axis=contracted) / 127, rtol=1e-6)
      full_scale = np.expand_dims(scale, tuple(a % w.ndim for a in contracted))
      assert np.all(np.abs(values * full_scale - w) <= full_scale / 2 * (1 + 1e-5)), (v, name)
      quantized.add(name)
    # every matmul weight (q/k/v/o, gate/up/down, embedding, head) arrived quantized, nothing else
    assert quantized == {n for n in sent if _param_name(n) in CONTRACTED} and len(quantized) == 9


def _param_name(path: str) -> str:
  return re.search(r"\['(\w+)'\]\.value$", path).group(1)


MOE = dict(architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
           router_aux_loss_coef=0.01)


@pytest.mark.slow
def test_a_mixture_of_experts_policy_trains_across_processes_on_its_recorded_routing(tmp_path):
  """A Qwen3-MoE policy in a job of a learner and a sampler process: its rollouts cross in packets with their routing,
  so every trained model token is routed by the learner as the sampler routed it (routing replay), on every step."""
  config = tmp_path / "tiny_moe.py"
  config.write_text(f"import sys\nsys.path.insert(0, {str(REPO / 'configs')!r})\nimport tiny\n\n\n"
                    f"def get_config(arg=None):\n  c = tiny.get_config(arg)\n"
                    f"  c.model.tiny = dict(c.model.tiny) | {MOE!r}\n  return c\n")
  workdir, log = tmp_path / "run", tmp_path / "launch.log"
  steps = 3
  code = _launch(2, [f"--config={config}", f"--workdir={workdir}", f"--config.num_steps={steps}",
                     "--config.mesh.sampler_devices=1", "--config.eval.num_examples=0"], log).wait(timeout=300)
  assert code == 0, log.read_text()[-5000:]
  records = read_jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert [r["routing_recorded"] for r in records] == [1.0] * steps  # not one token routed afresh
  assert all(r["loss/router_aux"] > 0 for r in records)
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["ledger"]["samples_trained"] == steps * 16
