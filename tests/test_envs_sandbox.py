"""Sandbox: code a model wrote runs in a separate process with CPU, memory, process and file limits, no network and
a scratch directory as its only writable place; each hostile sample (infinite loop, fork bomb, huge allocation,
writes outside the scratch directory, sockets) is contained and counted, and the next sample is scored."""

import os
import sys
from pathlib import Path

import pytest

from jaxrl.envs import RewardRunner
from jaxrl.envs.sandbox import SandboxLimits, run_code

sys.path.insert(0, str(Path(__file__).parent))
import sandbox_rewards  # noqa: E402

LIMITS = SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1)
HOSTILE = {  # sample -> the reasons it may end with (a loop hits the CPU limit or, on a loaded machine, the timeout)
    "while True: pass": {"cpu_limit", "timeout"},
    "import os\nwhile True: os.fork()": {"blocked"},
    "import subprocess; subprocess.run(['sh', '-c', ':(){ :|:& };:'])": {"blocked"},
    "x = bytearray(10 ** 10)": {"memory"},
    "open('OUTSIDE', 'w').write('pwned')": {"blocked"},
    "open('/tmp/jaxrl-sandbox-escape', 'w').write('pwned')": {"blocked"},
    "import os; os.remove('VICTIM')": {"blocked"},
    "import socket; socket.create_connection(('127.0.0.1', 22))": {"blocked"},
    "import ctypes; ctypes.CDLL(None).fork()": {"blocked"},
    "open('big', 'wb').write(b'x' * (2 << 20))": {"error"},  # past file_mb: EFBIG
}


@pytest.fixture
def targets(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("intact")
  return {"outside": str(tmp_path / "pwned.txt"), "victim": str(victim)}


def _fill(code: str, targets) -> str:
  return code.replace("OUTSIDE", targets["outside"]).replace("VICTIM", targets["victim"])


def _check_untouched(targets):
  assert not Path(targets["outside"]).exists() and not Path("/tmp/jaxrl-sandbox-escape").exists()
  assert Path(targets["victim"]).read_text() == "intact"


def test_hostile_code_is_contained_and_the_next_sample_runs(targets):
  runner = RewardRunner(sandbox_rewards.run_completion, timeout_s=4.0, workers=2, sandbox=LIMITS)
  try:
    samples = [_fill(code, targets) for code in HOSTILE] + ["y = sum(range(10))"]
    results = runner.score([("p", code, {}) for code in samples])
  finally:
    runner.close()
  for (code, allowed), r in zip(HOSTILE.items(), results, strict=False):
    assert not r.ok and r.reason in allowed, (code, r)
  assert results[-1].ok and results[-1].value == 1.0  # the run goes on
  assert runner.stats.failed == len(HOSTILE) and runner.stats.calls == len(samples)
  _check_untouched(targets)


def test_scratch_directory_is_writable_and_the_kernel_limits_are_set():
  # /proc is outside the Landlock domain: the limits are read through getrlimit
  probe = ("import os, resource as r, socket\nopen('note.txt', 'w').write('ok')\n"
           "print(open('note.txt').read(), os.getcwd().split('/')[-1][:13])\n"
           "print(r.getrlimit(r.RLIMIT_NPROC)[0], r.getrlimit(r.RLIMIT_FSIZE)[0], *r.getrlimit(r.RLIMIT_CPU))\n"
           "print(os.getuid(), [name for _, name in socket.if_nameindex()])")
  r = run_code(probe, LIMITS, timeout_s=10)
  assert r.ok, r
  lines = r.stdout.splitlines()
  assert lines[0] == "ok jaxrl-sandbox"
  nproc, fsize, cpu_soft, cpu_hard = map(int, lines[1].split())
  assert (nproc, fsize) == (0, 1 << 20) and cpu_soft <= 3 and cpu_hard == cpu_soft + 1
  uid, interfaces = lines[2].split(" ", 1)
  if os.getuid() == 0:  # root's sandbox runs as nobody, in its own network namespace (loopback only, down)
    assert uid == "65534" and interfaces == "['lo']"


def test_cpu_limit_kills_a_busy_loop_before_a_long_timeout():
  r = run_code("while True: pass", LIMITS, timeout_s=30)
  assert (r.ok, r.reason) == (False, "cpu_limit")


@pytest.mark.parametrize("code", [c for c in HOSTILE if c != "while True: pass"])  # the loop: the test above
def test_run_code_contains_each_hostile_sample(code, targets):
  r = run_code(_fill(code, targets), LIMITS, timeout_s=4.0)
  assert not r.ok and r.reason in HOSTILE[code], r
  _check_untouched(targets)


def test_countdown_expression_reward_runs_sandboxed_and_scores():
  runner = RewardRunner("countdown", timeout_s=5.0, workers=1)
  try:
    assert runner.isolation == "process" and runner.sandbox == SandboxLimits()
    meta = {"numbers": [3, 4, 5], "target": 17}
    out = runner.score([("p", "<answer>3 * 4 + 5</answer>", meta), ("p", "<answer>3 + 4</answer>", meta),
                        ("p", "<answer>" + "(" * 200 + "</answer>", meta)])
  finally:
    runner.close()
  assert [r.value for r in out] == [1.0, 0.0, 0.0]
