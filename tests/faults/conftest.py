"""Fault tests: the suite's persistent XLA compilation cache (tests/conftest.py) for this folder's many short runs,
in-process and in child processes, and a tally of what was injected, resumed and fuzzed, printed at the end of the
session (docs/RELIABILITY.md quotes it)."""

import os
from pathlib import Path

import faults_util
import pytest


@pytest.fixture(scope="session")
def xla_cache_dir():
  """The suite's one cache (child processes inherit JAX_COMPILATION_CACHE_DIR): a cache of this folder's own, made
  per xdist worker, compiled each of its programs once per worker, and again what other files had compiled."""
  return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])


def pytest_terminal_summary(terminalreporter):
  if faults_util.TALLY:
    items = ", ".join(f"{k}: {v}" for k, v in sorted(faults_util.TALLY.items()))
    terminalreporter.write_line(f"faults tally: {items}")
