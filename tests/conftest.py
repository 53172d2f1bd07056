"""Test setup: eight CPU devices (sampler/learner submeshes), float32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Many tests build the same small programs in fresh jit objects (and subprocesses): a persistent compilation
# cache halves the suite's time on 2 cores. It lives in the checkout, ignored by git.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)  # inherited by subprocesses of the tests
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

pytest_plugins = ["conftest_assets"]  # the session fixture smollm2_dir (real model, fetched once)
