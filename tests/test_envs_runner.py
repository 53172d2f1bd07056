"""RewardRunner: a reward fn that raises, hangs, crashes or returns junk is a counted failure, never a dead run."""

import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxrl.envs import RewardRunner

TIMEOUT_S = 0.5


def behave(prompt, completion, meta):
  """A user fn (module level, so a worker process can import it) whose behaviour the completion picks."""
  if completion == "raise":
    raise RuntimeError(f"boom on {prompt}")
  if completion == "hang":
    time.sleep(600)
  if completion == "die":
    os._exit(3)
  if completion == "exit":
    sys.exit(4)
  if completion == "nan":
    return float("nan")
  if completion == "text":
    return "1.0"
  return float(len(completion)) + meta.get("bonus", 0)


@pytest.fixture(scope="module")
def runner():
  r = RewardRunner(behave, timeout_s=TIMEOUT_S, workers=2)
  yield r
  r.close()


def _delta(runner, before):
  return {k: v - before[k] for k, v in runner.stats.failures.items() if v - before[k]}


def test_process_isolation_is_the_default_for_user_fns(runner):
  assert runner.isolation == "process" and len(runner._workers) == 2
  out = runner.score([("p", "abc", {}), ("p", "xy", {"bonus": 10})])
  assert [(r.value, r.ok, r.error) for r in out] == [(3.0, True, None), (12.0, True, None)]


def test_raising_fn_is_counted(runner):
  before = dict(runner.stats.failures)
  out = runner.score([("q1", "a", {}), ("q2", "raise", {}), ("q3", "exit", {}), ("q4", "bb", {})])
  assert [r.ok for r in out] == [True, False, False, True] and out[3].value == 2.0
  assert math.isnan(out[1].value) and out[1].reason == "error" and out[1].error == "RuntimeError: boom on q2"
  assert out[2].error == "SystemExit: 4"
  assert _delta(runner, before) == {"error": 2}


def test_hanging_fn_is_killed_in_bounded_time(runner):
  before, starts = dict(runner.stats.failures), runner.stats.worker_starts
  items = [("p", "a", {}), ("p", "hang", {}), ("p", "bb", {}), ("p", "hang", {}), ("p", "ccc", {})]
  t0 = time.perf_counter()
  out = runner.score(items)
  elapsed = time.perf_counter() - t0
  assert [r.value for r in out if r.ok] == [1.0, 2.0, 3.0]
  assert [r.reason for r in out] == ["", "timeout", "", "timeout", ""]
  assert out[1].error == f"reward fn took longer than {TIMEOUT_S}s; worker killed"
  # Two hangs on two workers overlap: about one timeout, not two; nothing waits for the 600 s sleep.
  assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 8.0  # slack: a replacement worker starts for the last item
  assert _delta(runner, before) == {"timeout": 2} and runner.stats.worker_starts == starts + 2
  # The replaced workers serve the next batch.
  assert [r.value for r in runner.score([("p", "dddd", {})] * 4)] == [4.0] * 4


def test_crashing_worker_and_bad_values(runner):
  before = dict(runner.stats.failures)
  out = runner.score([("p", "die", {}), ("p", "nan", {}), ("p", "text", {}), ("p", "ok", {}),
                      ("p", "ok", {"lock": threading.Lock()})])
  assert [r.reason for r in out] == ["crash", "bad_value", "bad_value", "", "unsendable"]
  assert out[0].error == "reward worker died (exit code 3)"
  assert out[1].error == "returned nan" and out[2].error == "returned str, not a number"
  assert out[4].error.startswith("item cannot be sent to a worker: TypeError")
  assert _delta(runner, before) == {"crash": 1, "bad_value": 2, "unsendable": 1}
  assert runner.stats.calls >= 5 and runner.stats.failed >= 4
  assert runner.stats.to_json()["failures"]["crash"] >= 1


def test_many_items_reuse_the_same_workers(runner):
  """What keeps process isolation cheap: a batch of 400 items goes through the running workers, none restarted
  (no timing asserted: the speed of this machine is not the behaviour under test)."""
  items = [("prompt", "x" * 50, {"completion_ids": list(range(64))})] * 400
  runner.score(items[:8])  # warm
  starts, calls = runner.stats.worker_starts, runner.stats.calls
  out = runner.score(items)
  assert all(r.value == 50.0 for r in out)
  assert runner.stats.worker_starts == starts and runner.stats.calls == calls + len(items)


def test_builtin_rewards_run_inline_and_still_catch_errors():
  r = RewardRunner("exact_answer")
  assert r.isolation == "inline" and r._workers == []
  out = r.score([("p", "Answer: 7", {"answer": "7"}), ("p", "Answer: 7", {})])
  assert out[0].value == 1.0 and out[1].reason == "error" and "needs meta['answer']" in out[1].error
  assert r.stats.failures["error"] == 1 and r.stats.calls == 2


def test_unpicklable_or_unimportable_fns_fail_at_construction(tmp_path):
  with pytest.raises(ValueError, match="cannot be sent to a worker process"):
    RewardRunner(lambda p, c, m: 1.0, isolation="process")
  # A module the parent imported from a path the worker cannot see.
  (tmp_path / "hidden_reward_mod.py").write_text("def fn(p, c, m):\n  return 1.0\n")
  sys.path.insert(0, str(tmp_path))
  try:
    import hidden_reward_mod
  finally:
    sys.path.remove(str(tmp_path))
  with pytest.raises(RuntimeError, match="cannot be loaded in a worker process: ModuleNotFoundError"):
    RewardRunner(hidden_reward_mod.fn, workers=1)
  with pytest.raises(ValueError, match="isolation must be"):
    RewardRunner("exact_answer", isolation="thread")


def test_close_stops_workers():
  r = RewardRunner(behave, workers=1)
  proc = r._workers[0].proc
  assert r.score([("p", "ab", {})])[0].value == 2.0
  r.close()
  assert proc.poll() == 0
  with pytest.raises(RuntimeError, match="is closed"):
    r.score([("p", "ab", {})])


@pytest.mark.slow
def test_hung_worker_exits_when_its_parent_is_killed():
  here = os.path.dirname(__file__)
  script = textwrap.dedent(f"""
      import sys, threading
      sys.path[:0] = [{here!r}, {os.getcwd()!r}]
      from test_envs_runner import behave
      from jaxrl.envs import RewardRunner
      r = RewardRunner(behave, timeout_s=600, workers=1)
      print(r._workers[0].proc.pid, flush=True)
      r.score([("p", "hang", {{}})])
  """)
  parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  worker = int(parent.stdout.readline())
  time.sleep(0.3)  # the worker is now inside the hanging fn
  parent.kill()
  parent.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      os.kill(worker, 0)
    except ProcessLookupError:
      break
    time.sleep(0.1)
  else:
    os.kill(worker, 9)
    pytest.fail("the worker outlived its killed parent")
