"""Test setup: eight CPU devices (sampler/learner submeshes), float32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# libtpu (the test extra) takes a lock file per process when it loads: parallel workers, and a deviceless TPU compile
# (tests/test_kernels_mosaic.py) beside another engineer's run, would otherwise fail to load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# The suite is dominated by XLA compiling many small programs, not by running them: LLVM's backend optimisations
# make a tiny model's init program take 9.7 s to compile here instead of 1.1 s. Tests (and the subprocesses they
# start, which inherit this) compile without them; results agree within every test's tolerance, and timing tests
# compare runs made under the same flags. Production runs keep XLA's defaults.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# XLA CPU's concurrency-optimised scheduler lets the devices of one SPMD program reach two independent collectives
# in different orders (device 0 waits in an all-gather, devices 1-3 in an all-reduce of the same run): on a loaded
# 2-core box the MoE pipeline test then deadlocked until XLA's rendezvous timeout aborted the worker (8 of 14 runs
# of two concurrent copies; 0 of 12 with the scheduler off). docs/RELIABILITY.md, "Bugs found and fixed".
if "xla_cpu_enable_concurrency_optimized_scheduler" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false"

from jaxrl import platforms  # noqa: E402

platforms.skip_tpu_probe()  # libtpu is installed (the test extra): no TPU probe, here nor in subprocesses

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Many tests build the same small programs in fresh jit objects (and subprocesses): a persistent compilation
# cache halves the suite's time on 2 cores. It lives in the checkout, ignored by git.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
# Every program is cached, however quick its compile: a tiny run's many small programs are most of its compile
# time. The environment carries these to the runs the tests start (a warm tiny run: 7.8 -> 4.6 s of CPU).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
_min_s, _min_bytes = (os.environ[f"JAX_PERSISTENT_CACHE_MIN_{k}"] for k in ("COMPILE_TIME_SECS", "ENTRY_SIZE_BYTES"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", float(_min_s))
jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(_min_bytes))

# conftest_assets: the session fixture smollm2_dir (real model, fetched once); conftest_timeouts: no test hangs
pytest_plugins = ["conftest_assets", "conftest_timeouts"]
