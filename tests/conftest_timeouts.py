"""No test can hang the suite: a test past its time limit fails with the stack of every thread, and the rest runs.

pytest-timeout (pyproject.toml: `timeout`, `timeout_method = "signal"`) fails a test past its limit, fixtures
included, and prints every thread's stack. SIGALRM raises in the test's main thread, so a pytest-xdist worker lives
on and runs the rest of its files. (pytest-timeout's thread method ends the process instead: under xdist the stacks
are lost with the worker's captured output, and `--dist loadfile` hands the file, hanging test first, to the worker
started in its place, up to xdist's restart limit.) A longer test says so with @pytest.mark.timeout(seconds).

A signal cannot end a wait inside native code that never returns to Python (a deadlocked XLA collective, a native
lock): there, `timeout_backstop` seconds after the limit, faulthandler writes every thread's stack to the real
stderr and ends the process. A test that ended its process is then failed at once by the worker xdist starts in its
place instead of hanging it again: each test leaves a mark while it runs, removed when it ends.
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

_FD, _MARKS, _ENDED = pytest.StashKey[int](), pytest.StashKey[str](), pytest.StashKey[bool]()
_MARKS_ENV = "JAXRL_TEST_RUNNING_MARKS"  # the folder of the marks, made by the run's main process for its workers


def pytest_addoption(parser):
  parser.addini("timeout_backstop", "seconds past a test's timeout after which a hang in native code ends the "
                "process with every thread's stack", default="60")


def pytest_configure(config):
  # Output capture is suspended while plugins configure: this is the process's real stderr (an xdist worker's too).
  config.stash[_FD] = os.dup(sys.stderr.fileno())
  if not hasattr(config, "workerinput"):  # the main process; its xdist workers inherit the environment
    config.stash[_MARKS] = os.environ[_MARKS_ENV] = tempfile.mkdtemp(prefix="jaxrl-running-")


def pytest_unconfigure(config):
  os.close(config.stash[_FD])
  if _MARKS in config.stash:
    shutil.rmtree(config.stash[_MARKS], ignore_errors=True)


def _limit(item) -> float:
  """The test's timeout (pytest-timeout's: its mark, then --timeout, then the ini value); 0: none."""
  marker = item.get_closest_marker("timeout")
  if marker is not None and (marker.args or "timeout" in marker.kwargs):
    return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
  value = item.config.getoption("timeout", None)
  return float(item.config.getini("timeout") if value is None else value)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  limit = _limit(item)
  if limit <= 0:
    return (yield)
  mark = pathlib.Path(os.environ[_MARKS_ENV], hashlib.sha1(item.nodeid.encode()).hexdigest())
  item.stash[_ENDED] = mark.exists()
  mark.touch()
  faulthandler.dump_traceback_later(limit + float(item.config.getini("timeout_backstop")), exit=True,
                                    file=item.config.stash[_FD])
  try:
    return (yield)
  finally:
    faulthandler.cancel_dump_traceback_later()
    mark.unlink(missing_ok=True)


def pytest_runtest_setup(item):
  if item.stash.get(_ENDED, False):
    pytest.fail("this test ended the process that ran it (a hang in native code past its timeout, whose stacks "
                "the log shows above, or a crash); it is not run again", pytrace=False)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
  """pytest-xdist's main process, a worker having died: `--dist loadfile` puts every file of the dead worker back in
  the queue, those it had finished too, and the worker started in its place waits forever on a finished file (no
  test left to run, none to report). Finished files are taken out of the queue again."""
  queue = getattr(sched, "workqueue", None)  # LoadScopeScheduling's (loadfile, loadscope)
  for scope, unit in list(queue.items() if queue is not None else ()):
    if all(unit.values()):
      del queue[scope]

