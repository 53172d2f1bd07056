"""No test can hang the suite (tests/conftest_timeouts.py, pyproject's pytest-timeout settings): run as CI runs it
(pytest-xdist, --dist loadfile), a deadlocked test fails within its limit with the stack of every thread, a hang in
native code ends its worker with every stack after the backstop and is not run again, and the tests after them run."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

DEADLOCK = '''
import threading

def test_deadlock():
  a, b = threading.Lock(), threading.Lock()
  both = threading.Barrier(2)

  def take(first, second):
    with first:
      both.wait()
      with second:  # each thread holds the lock the other waits for
        pass

  for pair in ((a, b), (b, a)):
    threading.Thread(target=take, args=pair, daemon=True).start()
  threading.Event().wait()

def test_after_the_deadlock():
  pass
'''

NATIVE = '''
import ctypes

def test_stuck_in_native_code():
  libc = ctypes.CDLL(None)
  mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER is all zero bytes in glibc
  libc.pthread_mutex_lock(mutex)
  libc.pthread_mutex_lock(mutex)  # a default mutex locked again by its owner: no signal ends this wait

def test_after_the_native_hang():
  pass
'''


def _pytest(tmp_path, files: dict[str, str]) -> tuple[str, float]:
  """(output, seconds) of the repository's pytest settings (timeout 2 s, backstop 3 s) over `files`, on one xdist
  worker as CI runs them."""
  for name, code in files.items():
    (tmp_path / name).write_text(textwrap.dedent(code))
  env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
  t0 = time.perf_counter()
  out = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "--dist", "loadfile", "-p", "conftest_timeouts",
                        "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
                        "-o", "timeout=2", "-o", "timeout_backstop=3", "-v", *files], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
  return out.stdout + out.stderr, time.perf_counter() - t0


def test_the_settings_give_every_test_a_limit():
  text = (REPO / "pyproject.toml").read_text()
  assert "pytest-timeout" in text and '\ntimeout = 300\n' in text and '\ntimeout_method = "signal"\n' in text


def test_a_deadlocked_test_fails_within_its_limit_with_every_threads_stack(tmp_path):
  out, seconds = _pytest(tmp_path, {"test_deadlock.py": DEADLOCK})
  assert "FAILED test_deadlock.py::test_deadlock" in out and "Failed: Timeout (>2.0s) from pytest-timeout." in out
  # Both lock holders' stacks, each stopped at the lock the other holds.
  assert out.count("Stack of Thread-") == 2 and out.count("line 11, in take\n    with second:") == 2
  assert "PASSED test_deadlock.py::test_after_the_deadlock" in out and "1 failed, 1 passed" in out
  assert seconds < 60


@pytest.mark.timeout(120)
def test_a_hang_in_native_code_ends_its_worker_with_every_stack_and_is_not_run_again(tmp_path):
  # The worker ran a file to its end first: xdist must not hand that finished file to the worker that replaces it.
  out, seconds = _pytest(tmp_path, {"test_deadlock.py": DEADLOCK, "test_native.py": NATIVE})
  assert "Timeout (0:00:05)!" in out and 'test_native.py", line 8 in test_stuck_in_native_code' in out
  assert "worker 'gw0' crashed while running 'test_native.py::test_stuck_in_native_code'" in out
  assert "this test ended the process that ran it" in out  # the replacement worker fails it at once
  assert "PASSED test_native.py::test_after_the_native_hang" in out and "2 failed, 2 passed, 1 error" in out
  assert seconds < 90
