"""Test setup: eight CPU devices (sampler/learner submeshes), float32 matmuls at full precision."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

pytest_plugins = ["conftest_assets"]  # the session fixture smollm2_dir (real model, fetched once)
