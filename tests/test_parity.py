"""Logits parity with transformers' PyTorch reference on tiny random Llama / Qwen2 / Qwen3 checkpoints.

The golden logits were produced by tests/fixtures/make_golden.py in a separate torch environment.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import forward, forward_cached, hf, init_cache

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("case", ["pad", "full", "gaps"])
def test_logits_match_transformers(arch, case):
  cfg, graphdef, params = hf.load_params(FIXTURES / arch)
  golden = np.load(FIXTURES / arch / "golden.npz")
  mask = golden[f"{case}_attention_mask"]
  logits = jax.jit(forward, static_argnums=0)(graphdef, params, golden[f"{case}_input_ids"],
                                               golden[f"{case}_position_ids"], mask)
  real = mask.astype(bool)
  err = np.abs(np.asarray(logits)[real] - golden[f"{case}_logits"][real]).max()
  assert err < 1e-4, f"{arch}/{case}: max abs logits error {err:.2e}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_cached_decode_matches_transformers(arch):
  """Prefill half of the `full` case, then decode token by token against the golden logits."""
  cfg, graphdef, params = hf.load_params(FIXTURES / arch)
  golden = np.load(FIXTURES / arch / "golden.npz")
  tokens, positions = golden["full_input_ids"], golden["full_position_ids"]
  step = jax.jit(forward_cached, static_argnums=0)
  logits, cache = step(graphdef, params, tokens[:, :6], positions[:, :6], init_cache(cfg, 2, 16))
  outs = [logits]
  for t in range(6, tokens.shape[1]):
    logits, cache = step(graphdef, params, tokens[:, t : t + 1], positions[:, t : t + 1], cache)
    outs.append(logits)
  err = np.abs(np.asarray(jnp.concatenate(outs, 1)) - golden["full_logits"]).max()
  assert err < 1e-4, f"{arch}: cached decode max abs logits error {err:.2e}"
