"""Logits parity with transformers' PyTorch reference on tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints.

The golden logits were produced by tests/fixtures/make_golden.py in a separate torch environment.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import forward, forward_cached, hf, init_cache

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("arch", ARCHS)
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


@pytest.mark.parametrize("arch", ARCHS)
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


@pytest.mark.parametrize("case", ["pad", "full", "gaps"])
def test_router_logits_and_aux_loss_match_transformers(case):
  """Qwen3-MoE (layers 0 and 2 sparse, 1 dense): every sparse layer's router logits and the load-balancing loss
  over the unpadded tokens, as Qwen3MoeForCausalLM(output_router_logits=True) gives them."""
  cfg, graphdef, params = hf.load_params(FIXTURES / "qwen3_moe")
  golden = np.load(FIXTURES / "qwen3_moe" / "golden.npz")
  mask = golden[f"{case}_attention_mask"]
  run = jax.jit(lambda p, t, x, s: nnx.merge(graphdef, p)(t, x, s, routing=True, router_logits=True))
  _, routing = run(params, golden[f"{case}_input_ids"], golden[f"{case}_position_ids"], mask)
  sparse = [i for i, s in enumerate(cfg.sparse_layers) if s]
  assert sparse == [0, 2]
  ours = np.moveaxis(np.asarray(routing.logits_BxTxNxX), 2, 0)[sparse]
  real = mask.astype(bool)
  err = np.abs(ours[:, real] - golden[f"{case}_router_logits"][:, real]).max()
  assert err < 1e-4, f"{case}: max abs router logits error {err:.2e}"
  assert np.all(np.asarray(routing.experts_BxTxNxK)[:, :, 1] == -1)  # the dense layer routes nothing
  assert abs(float(routing.aux_loss()) - float(golden[f"{case}_aux_loss"])) < 1e-5
