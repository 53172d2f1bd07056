"""math-verify reward: symbolic equivalences, long completions, and where it runs (a sandboxed worker)."""

import sys

import pytest

from jaxrl.envs import RewardRunner, reward_spec

CASES = [  # (reference, completion, reward)
    ("1/2", r"So the probability is \boxed{\frac{1}{2}}.", 1.0),
    ("0.5", r"\boxed{\frac12}", 1.0),
    (r"\frac{3}{4}", "That is $0.75$.", 1.0),
    ("1234", "The answer is $1,234$.", 1.0),  # thousands separators
    ("1,234", r"\boxed{1234}", 1.0),
    ("72", "She sold 48 + 24 = 72 clips.\n#### 72", 1.0),
    ("x", r"\boxed{x}", 1.0),  # a bare symbolic reference
    ("3", "the answer is 4", 0.0),
    ("5", r"\boxed{4} or maybe \boxed{5}", 0.0),  # two boxed answers are a set {4, 5}: hedging earns nothing
    ("3", "thinking... " * 400 + r"so \boxed{3}", 1.0),  # a 5k-character completion
    ("3", "7 " * 2500, 0.0),
]


@pytest.fixture(scope="module")
def runner():
  with RewardRunner("math_verify", timeout_s=10, workers=1) as r:
    yield r


def test_equivalences_and_long_completions(runner):
  assert len(CASES[-2][1]) > 4800 and len(CASES[-1][1]) == 5000
  results = runner.score([("", completion, {"answer": ref}) for ref, completion, _ in CASES])
  assert [r.value for r in results] == [want for _, _, want in CASES], [r.error for r in results]


def test_runs_sandboxed_in_a_worker_main_thread_and_a_bad_reference_is_a_counted_failure(runner):
  spec = reward_spec("math_verify")
  assert spec.sandbox and not spec.inline  # signal.alarm needs a main thread: never the caller's thread
  assert runner.isolation == "process" and runner.sandbox is not None
  before = runner.stats.failures["error"]
  [result] = runner.score([("", r"\boxed{2}", {"answer": "???"})])
  assert not result.ok and "cannot parse the reference answer" in result.error
  assert runner.stats.failures["error"] == before + 1
  [result] = runner.score([("", r"\boxed{2}", {})])
  assert not result.ok and "needs meta['answer']" in result.error


def test_without_the_extra_the_reward_names_what_to_install(monkeypatch):
  from jaxrl.envs import rewards

  monkeypatch.delitem(rewards._REGISTRY, "math_verify")
  monkeypatch.delitem(sys.modules, "jaxrl.envs.math_verify_reward")
  monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed
  with pytest.raises(ValueError, match=r"reward 'math_verify' needs an optional package \(pip install "
                                       r"'jaxrl\[math\]'\)"):
    reward_spec("math_verify")
