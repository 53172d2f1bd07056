"""Component failure: an exception in the sampler thread, the learner thread, the weight publisher or the reward
workers stops the run within a bounded time with the original traceback and a saved checkpoint (which resumes);
a reward fn that raises is isolated (NaN reward, group dropped as "reward_failed", counted) and the run goes on."""

import itertools
import subprocess
import threading
import time

import faults_rewards  # noqa: F401 - imported here first, so that breaking its import later hits only workers
import faults_util
import pytest
from faults_util import NUM_STEPS, TALLY, check_history, committed_steps, inject, read_trace, tiny_config

from jaxrl import train as train_lib
from jaxrl.config import ConfigError

BOUND_S = 30.0  # from the fault to train() raising, including the final checkpoint save


class Injected(Exception):
  """The fault the tests inject."""


def _fail_on_call(fn, n: int, fired: dict):
  """fn, except that its n-th call raises Injected (and records when)."""
  calls = itertools.count(1)

  def injected_fault(*args, **kwargs):
    if next(calls) == n:
      fired["at"] = time.monotonic()
      raise Injected(f"injected on call {n}")
    return fn(*args, **kwargs)

  return injected_fault


TARGETS = {  # component -> (attribute path on the controller, failing call)
    "sampler": ("sampler_loop.sampler.step", 6),
    "learner": ("learner_loop.train_step", 3),
    "publisher": ("learner_loop.weights.publish", 2),
}


@pytest.mark.parametrize("mode, component", [("pipeline", "sampler"), ("pipeline", "learner"),
                                             ("pipeline", "publisher"), ("sync", "sampler")])
def test_component_exception_stops_the_run_with_its_traceback_and_a_checkpoint(mode, component, tmp_path,
                                                                                monkeypatch):
  path, n = TARGETS[component]
  fired = {}

  def fail(run):
    owner_path, _, attr = f"controller.{path}".rpartition(".")
    owner = run
    for part in owner_path.split("."):
      owner = getattr(owner, part)
    setattr(owner, attr, _fail_on_call(getattr(owner, attr), n, fired))

  built = inject(monkeypatch, fail)
  with pytest.raises(Exception) as info:
    train_lib.train(tiny_config(mode), tmp_path)
  elapsed = time.monotonic() - fired["at"]
  TALLY["component exceptions injected"] += 1
  err = info.value
  original = err if isinstance(err, Injected) else err.__cause__
  assert isinstance(original, Injected), f"the original exception is lost: {err!r}"
  if mode == "pipeline":  # raised again in the main thread, naming the thread and carrying its traceback
    assert isinstance(err, RuntimeError) and "failed: Injected: injected on call" in str(err)
    assert "--- original traceback ---" in str(err) and "in injected_fault" in str(err)
  assert elapsed < BOUND_S, f"the run took {elapsed:.1f} s to stop"
  assert not [t.name for t in threading.enumerate() if t.name.startswith("jaxrl-")], "a loop thread outlived the run"
  ctl = built["run"].controller
  assert committed_steps(tmp_path)[-1] == ctl.version  # the last good state was saved
  monkeypatch.undo()
  summary = train_lib.train(tiny_config(mode), tmp_path)  # and it resumes to the end
  TALLY["runs resumed after a component failure"] += 1
  assert summary["resumed_from"] == ctl.version and summary["steps"] == NUM_STEPS
  check_history(read_trace(tmp_path / "trace.jsonl"), summary, group_size=4)


def test_a_raising_reward_fn_drops_its_group_and_the_run_goes_on(tmp_path, monkeypatch):
  built = inject(monkeypatch)
  summary = train_lib.train(tiny_config("pipeline", task__reward="faults_rewards:flaky"), tmp_path)
  score = built["run"].controller.sampler_loop.score
  runner = score.runners[score.reward_name]
  assert runner.isolation == "process"
  led = summary["ledger"]
  failed_groups = led["dropped"]["reward_failed"] // 4
  TALLY["reward fn exceptions injected"] += runner.stats.failures["error"]
  assert summary["steps"] == NUM_STEPS and led["samples_trained"] == NUM_STEPS * 16
  assert failed_groups >= 1 and runner.stats.failures["error"] >= failed_groups
  assert led["reward_failures"] >= failed_groups  # each dropped group had at least one failed sample
  check_history(read_trace(tmp_path / "trace.jsonl"), summary, group_size=4)


def test_a_reward_fn_that_always_raises_stops_the_jaxrl_train_within_its_failure_window_with_one_line(tmp_path):
  out = subprocess.run(faults_util.cli(tmp_path, task__reward="faults_rewards:always_raises", task__failure_window=16),
                       cwd=faults_util.REPO, env=faults_util.child_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last == ("jaxrl-train: reward 'faults_rewards:always_raises' failed 9 of the last 9 samples scored (over "
                  "task.max_failure_frac=0.5 of task.failure_window=16); most common error (9x): error: ValueError: "
                  "broken reward: injected failure")
  assert "Traceback" not in out.stderr
  assert "reward 'faults_rewards:always_raises' has no known cases to self-check" in out.stderr
  assert committed_steps(tmp_path) == [0]  # the checkpoint came first: the same command resumes


def test_without_its_failure_window_a_reward_that_always_raises_still_ends_the_run_for_lack_of_progress(tmp_path):
  c = tiny_config("pipeline", task__reward="faults_rewards:always_raises", rl__max_failures_in_a_row=8,
                  task__failure_window=100_000)
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=r"no progress: 8 failures in a row .*'reward_failed': 8"):
    train_lib.train(c, tmp_path)
  assert time.monotonic() - t0 < 120
  assert committed_steps(tmp_path) == [0]


def test_reward_workers_that_cannot_start_fail_the_build_before_any_work(tmp_path, monkeypatch):
  marker = tmp_path / "break-import"
  marker.touch()
  monkeypatch.setenv("JAXRL_FAULTS_BREAK_IMPORT", str(marker))
  with pytest.raises(ConfigError, match="cannot be loaded in a worker process: ImportError: faults_rewards"):
    train_lib.build(tiny_config("pipeline", task__reward="faults_rewards:flaky"), tmp_path / "run")
  assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_reward_worker_that_dies_and_cannot_restart_stops_the_run(tmp_path, monkeypatch):
  """The first call kills its worker; the replacement cannot import the fn. The other worker scores meanwhile, so
  the run may train a step or two before the replacement's failure reaches the sampler thread."""
  monkeypatch.setenv("JAXRL_FAULTS_BREAK_IMPORT", str(tmp_path / "break-import"))
  built = inject(monkeypatch)
  c = tiny_config("pipeline", task__reward="faults_rewards:dies_and_breaks_restarts")
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match="jaxrl sampler failed: RuntimeError: reward .* cannot be loaded in a worker"):
    train_lib.train(c, tmp_path / "run")
  TALLY["reward worker crashes injected"] += 1
  assert time.monotonic() - t0 < 120
  assert committed_steps(tmp_path / "run")[-1] == built["run"].controller.version
