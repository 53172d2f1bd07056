"""Rewards that cannot fail silently: a sandboxed worker imports lazily from an install its sandbox user cannot read,
the start-up self-check catches a reward broken only inside its sandbox (naming what its worker could not import),
an env task's scripted episodes check its env, and the failure window stops on systematic failure, not on noise."""

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from jaxrl import settings
from jaxrl.controller.data import make_scorer
from jaxrl.envs import Episodes, RewardRunner, guard, make_task
from jaxrl.envs.calculator import CalculatorEnv, CalculatorTask
from jaxrl.envs.env import Turn
from jaxrl.envs.rewards import Check, right_and_wrong
from jaxrl.envs.runner import RewardResult
from jaxrl.envs.sandbox import SandboxLimits, _reachable_by_others, run_code

sys.path.insert(0, str(Path(__file__).parent))
import sandbox_rewards  # noqa: E402

ROOT = os.getuid() == 0  # only root's sandbox changes user; elsewhere the layout below is readable anyway


def _private_site(tmp_path, packages) -> Path:
  """A copy of `packages` in a folder only root can reach (a venv under a mode-700 home): what `nobody`, the
  sandbox's user, cannot read."""
  home = tmp_path / "home"
  site = home / "venv" / "site-packages"
  site.mkdir(parents=True)
  home.chmod(0o700)
  installed = Path(sysconfig.get_paths()["purelib"])
  for name in packages:
    shutil.copytree(installed / name, site / name)
  assert not ROOT or not _reachable_by_others(str(site))
  return site


def test_math_verify_scores_in_its_sandbox_from_an_install_nobody_can_read(tmp_path, monkeypatch):
  # math-verify's LaTeX parser imports antlr4's analyser on first use, inside the sandbox (the bug this guards)
  site = _private_site(tmp_path, ["math_verify", "latex2sympy2_extended", "antlr4"])
  monkeypatch.syspath_prepend(str(site))  # the workers take this sys.path
  with RewardRunner("math_verify", workers=1) as runner:
    assert runner.sandbox is not None
    results = runner.score([("", r"so $\boxed{\frac{1}{2}}$", {"answer": "0.5"}), ("", "it is 3", {"answer": "0.5"}),
                            ("", r"$\boxed{1,234}$", {"answer": "1234"})])
  assert [(r.ok, r.value, r.import_errors) for r in results] == [(True, 1.0, ()), (True, 0.0, ()), (True, 1.0, ())]


def test_run_code_imports_from_an_install_nobody_can_read(tmp_path, monkeypatch):
  site = _private_site(tmp_path, [])
  (site / "lazy_pkg").mkdir()
  (site / "lazy_pkg" / "__init__.py").write_text("")
  (site / "lazy_pkg" / "sub.py").write_text("VALUE = 42\n")
  monkeypatch.syspath_prepend(str(site))
  result = run_code("import os, lazy_pkg.sub; print(os.getuid(), lazy_pkg.sub.VALUE)")
  assert result.ok and result.stdout == f"{65534 if ROOT else os.getuid()} 42\n", result


def test_reasoning_gym_scores_in_its_sandbox_from_an_install_nobody_can_read(tmp_path, monkeypatch):
  site = _private_site(tmp_path, ["reasoning_gym", "sympy"])  # sympy imports parts of itself on first use
  monkeypatch.syspath_prepend(str(site))
  task = make_task("reasoning_gym", dataset="polynomial_multiplication", size=40, eval_fraction=0.1)
  meta = task.eval_examples(1)[0].reward_meta
  with RewardRunner("reasoning_gym", workers=1, timeout_s=60) as runner:
    results = runner.score([("", f"<answer>{meta['answer']}</answer>", meta), ("", "<answer>z**2</answer>", meta)])
    guard.self_check("reasoning_gym", runner, task.reward_checks())  # the task's own known cases
  assert [(r.ok, r.value) for r in results] == [(True, 1.0), (True, 0.0)]


def test_the_self_check_catches_a_reward_broken_only_in_its_sandbox_and_names_what_it_could_not_import(
    tmp_path, monkeypatch):
  lazy = tmp_path / "private" / "lazy"  # reachable by root only (tmp_path's parents are mode 700 too)
  lazy.mkdir(parents=True)
  (tmp_path / "private").chmod(0o700)
  (lazy / "lazy_answer_reader.py").write_text("def tagged(text):\n  return text.split('<answer>')[-1].split('<')[0]\n")
  monkeypatch.setenv(sandbox_rewards.LAZY_DIR, str(lazy))
  spec_checks = right_and_wrong("<answer>7</answer>", "<answer>8</answer>", {"answer": "7"})
  with RewardRunner(sandbox_rewards.lazy_import_reward, workers=1, sandbox=None) as plain:  # unsandboxed: fine
    guard.self_check("test_lazy_import", plain, spec_checks)
  # Scoring each item in a process of its own (the default), the worker first scores the known cases before it is
  # confined: the lazy import is made once, there, and every item's process inherits it.
  with RewardRunner("test_lazy_import", workers=1) as per_item:
    assert per_item.sandbox.process_per_item
    guard.self_check("test_lazy_import", per_item, spec_checks)
  one_process = SandboxLimits(process_per_item=False)  # task.reward_process_per_item=False
  with RewardRunner("test_lazy_import", workers=1, sandbox=one_process) as sandboxed:
    if ROOT:  # as nobody, the folder it imports from on first use is out of reach: every answer scores 0
      with pytest.raises(guard.RewardsBroken) as info:
        guard.self_check("test_lazy_import", sandboxed, spec_checks)
      assert str(info.value) == (
          "reward 'test_lazy_import' failed its start-up self-check in its sandboxed worker: a known right answer "
          "'<answer>7</answer>' scored 0, expected 1; the worker could not import lazy_answer_reader "
          "(task.self_check=False skips the check)")
    else:
      guard.self_check("test_lazy_import", sandboxed, spec_checks)


def test_the_run_scorer_self_checks_its_rewards_before_it_scores(tmp_path, monkeypatch):
  task = make_task("arithmetic", seed=0)
  broken = settings.Task(name="arithmetic", reward="test_lazy_import")
  monkeypatch.setenv(sandbox_rewards.LAZY_DIR, str(tmp_path / "missing"))  # nowhere: broken in any sandbox
  with pytest.raises(guard.RewardsBroken, match="reward 'test_lazy_import' failed its start-up self-check .* "
                                                "could not import lazy_answer_reader"):
    make_scorer(broken, task, None)
  make_scorer(settings.Task(name="arithmetic", reward="test_lazy_import", self_check=False), task, None).close()
  make_scorer(settings.Task(name="arithmetic"), task, None).close()  # exact_answer: its cases pass


@pytest.mark.parametrize("check, result, why", [
    (Check("a", {}, True), RewardResult(1.0, True), None),
    (Check("a", {}, True), RewardResult(0.5, True), "a known right answer 'a' scored 0.5, expected 1"),
    (Check("a", {}, False), RewardResult(0.3, True), None),
    (Check("a", {}, False), RewardResult(1.0, True), "a known wrong answer 'a' scored 1, expected below 1"),
    (Check("a", {}, None), RewardResult(7.0, True), None),
    (Check("a", {}, None), RewardResult(float("nan"), False, "KeyError: 'x'", "error"), "error: KeyError: 'x'"),
])
def test_verdict(check, result, why):
  assert guard.verdict(check, result) == why


def _result(ok: bool, error: str = "ValueError: bad") -> RewardResult:
  return RewardResult(1.0, True) if ok else RewardResult(float("nan"), False, error, "error")


def test_the_failure_window_stops_on_the_first_failure_over_its_fraction():
  window = guard.FailureWindow(8, 0.5)
  for _ in range(4):
    window.add("r", _result(False))
  with pytest.raises(guard.RewardsBroken) as info:
    window.add("r", _result(False, "TimeoutError: slow"))
  assert str(info.value) == ("reward 'r' failed 5 of the last 5 samples scored (over task.max_failure_frac=0.5 of "
                             "task.failure_window=8); most common error (4x): error: ValueError: bad")
  assert window.failures == 5


def test_the_failure_window_forgets_old_failures_and_passes_scattered_ones():
  window = guard.FailureWindow(8, 0.5)
  for i in range(400):  # one in three fails: never more than 4 of any 8 in a row
    window.add("r", _result(i % 3 != 0))
  assert window.failures == 134
  for ok in [True] * 8 + [False] * 4:
    window.add("r", _result(ok))  # the window's last 8: 4 failures, not over
  window.add("r", _result(True))
  with pytest.raises(guard.RewardsBroken, match="failed 5 of the last 8"):
    window.add("r", _result(False))


class _ByteTokenizer:
  def encode(self, text, add_special_tokens=False):
    return list(text.encode())

  def decode(self, ids, skip_special_tokens=True):
    return bytes(ids).decode()


class _AlwaysWrong(CalculatorEnv):
  def step(self, text, ids):
    return Turn(done=True, reward=0.0)


class _AlwaysWrongTask(CalculatorTask):
  name, env_class = "calculator_always_wrong", _AlwaysWrong


def test_an_env_tasks_scripted_episodes_check_its_env():
  task = make_task("calculator", seed=0)
  episodes = Episodes(task, _ByteTokenizer(), vocab_size=256, chat_template=False)
  episodes.self_check()  # "Answer: <answer>" scores 1, the answer plus one below 1
  assert episodes.runner.steps == 0  # the check's steps stay out of the run's counts
  episodes.close()
  broken = Episodes(_AlwaysWrongTask(0), _ByteTokenizer(), vocab_size=256, chat_template=False)
  answer = _AlwaysWrongTask(0).prompt(0).answer
  with pytest.raises(guard.RewardsBroken) as info:
    broken.self_check()
  broken.close()
  assert str(info.value) == (f"env task 'calculator_always_wrong' failed its start-up self-check in the sampler's "
                             f"threads: a known right answer 'Answer: {answer}' scored 0, expected 1 "
                             "(task.self_check=False skips the check)")
