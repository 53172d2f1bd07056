"""jaxrl.integrity's array checksums: block by block, the value of the whole-array formula, with small temporaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import integrity


def _whole_array(x):
  """The checksum's definition taken over the whole array at once (what checkpoints saved before blocking hold)."""
  bits = integrity._bits_u32(x).ravel()
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


@pytest.mark.parametrize("shape, dtype", [((3, 64), jnp.float32), ((2 * 64 + 17,), jnp.bfloat16), ((5,), jnp.int32),
                                          ((7, 3), jnp.bool_), ((64 * 4 + 3,), jnp.uint8)])
def test_blocked_checksum_equals_the_whole_array_formula(shape, dtype, monkeypatch):
  monkeypatch.setattr(integrity, "BLOCK", 64)  # several blocks and a tail at test sizes
  rng = np.random.default_rng(0)
  values = rng.standard_normal(shape) * 100
  x = jnp.asarray(values > 0 if dtype == jnp.bool_ else values, dtype)
  got = np.asarray(jax.jit(integrity._checksum)(x))
  np.testing.assert_array_equal(got, np.asarray(jax.jit(_whole_array)(x)))
  flipped = x.ravel().at[-1].set(jnp.logical_not(x.ravel()[-1]) if dtype == jnp.bool_ else x.ravel()[-1] + 1)
  assert (np.asarray(jax.jit(integrity._checksum)(flipped.reshape(shape))) != got).any()


def test_checksums_of_a_state_need_temporaries_of_a_block_not_of_the_arrays():
  # The main job's largest leaves (SmolLM2-135M's embedding and MLP weights, 430 MB): compiled, never allocated.
  tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(49152, 576)] + [(30, 576, 1536)] * 3]
  memory = integrity._checksums.lower(tree).compile().memory_analysis()
  # Before blocking, XLA:CPU held the uint32 bits and the weighted product of each leaf: 2x the arguments.
  assert memory.temp_size_in_bytes < 0.05 * memory.argument_size_in_bytes
