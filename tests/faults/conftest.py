"""Fault tests: a persistent XLA compilation cache shared by this folder's many short runs (in-process and in
child processes, so each program compiles once per session), and a tally of what was injected, resumed and
fuzzed, printed at the end of the session (docs/RELIABILITY.md quotes it)."""

import faults_util
import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(xla_cache_dir):
  """On for this folder's modules only; other test files keep jax's defaults."""
  saved = {k: getattr(jax.config, k) for k in _CACHE_OPTIONS}
  jax.config.update("jax_compilation_cache_dir", str(xla_cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  compilation_cache.reset_cache()
  faults_util.CHILD_ENV["JAX_COMPILATION_CACHE_DIR"] = str(xla_cache_dir)
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def pytest_terminal_summary(terminalreporter):
  if faults_util.TALLY:
    items = ", ".join(f"{k}: {v}" for k, v in sorted(faults_util.TALLY.items()))
    terminalreporter.write_line(f"faults tally: {items}")
