"""Training attention: every implementation equals the reference on packed rows (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernels.train_attention import attention, chunked_attention, cudnn_attention, splash_attention
from jaxrl.sharding import make_mesh

B, T, H, KV, D = 2, 200, 4, 2, 16


def inputs():
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, T, H, D))
  k, v = (jax.random.normal(key, (B, T, KV, D)) for key in ks[1:])
  seg = np.zeros((B, T), np.int32)
  seg[0, :70], seg[0, 70:150], seg[0, 150:190] = 1, 2, 3  # three samples, then padding
  seg[1, :199] = 1
  return q, k, v, jnp.asarray(seg)


IMPLS = {
    "chunked": lambda q, k, v, s: chunked_attention(q, k, v, s, block=64),
    "cudnn_mask": lambda q, k, v, s: cudnn_attention(q, k, v, s, implementation="xla"),  # cuDNN's mask, on CPU
    "splash_interpret": lambda q, k, v, s: splash_attention(q, k, v, s, interpret=True),
}


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_equals_reference_on_real_tokens(name):
  q, k, v, seg = inputs()
  real = np.asarray(seg > 0)[..., None, None]
  fn = IMPLS[name]
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.where(real, f(q, k, v, seg), 0.0) ** 2)
  ref_fn = lambda q, k, v, s: attention(q, k, v, s, "reference")
  np.testing.assert_allclose(np.where(real, fn(q, k, v, seg), 0), np.where(real, ref_fn(q, k, v, seg), 0),
                             atol=2e-6)
  if name == "splash_interpret":
    return  # the interpreted backward kernels take minutes on CPU; the forward pins the kernel's masking
  grads = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
  ref = jax.grad(loss(ref_fn), argnums=(0, 1, 2))(q, k, v)
  for g, r in zip(grads, ref, strict=True):
    np.testing.assert_allclose(g, r, atol=2e-5 * float(jnp.abs(r).max()))


def test_chunked_padding_output_is_finite_and_skips_no_real_key():
  q, k, v, seg = inputs()
  out = chunked_attention(q, k, v, seg, block=64)
  assert np.isfinite(np.asarray(out)).all()
  # The last real query of row 1 sees keys in every block, the skipped ones included if causality allowed them.
  np.testing.assert_allclose(out[1, 198], attention(q, k, v, seg, "reference")[1, 198], atol=2e-6)


def test_chunked_memory_is_linear_in_length():
  """Compiled temporaries of forward + backward: the reference holds [B, K, G, T, T] float32, chunked O(T)."""

  def temp_bytes(impl, t):
    args = (jax.ShapeDtypeStruct((1, t, H, D), jnp.float32), jax.ShapeDtypeStruct((1, t, KV, D), jnp.float32),
            jax.ShapeDtypeStruct((1, t, KV, D), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32))
    f = lambda q, k, v, s: jnp.sum(attention(q, k, v, s, impl, block=256) ** 2)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*args).compile().memory_analysis().temp_size_in_bytes

  scores = H * 4096 * 4096 * 4
  assert temp_bytes("reference", 4096) >= scores
  chunked = temp_bytes("chunked", 4096)
  assert chunked < scores / 4
  assert temp_bytes("chunked", 8192) < 2.2 * chunked  # twice the length, about twice the memory


def test_unknown_implementation():
  q, k, v, seg = inputs()
  with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
    attention(q, k, v, seg, "flash")


def test_splash_lowers_for_tpu():
  """The TPU path lowers to Mosaic kernels from this CPU host: forward one, backward two more (dq, dkv)."""
  shapes = [(2, 256, 4, 128), (2, 256, 2, 128), (2, 256, 2, 128)]
  args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] + [jax.ShapeDtypeStruct((2, 256), jnp.int32)]
  loss = lambda q, k, v, s: jnp.sum(splash_attention(q, k, v, s).astype(jnp.float32) ** 2)
  for fn, kernels in ((splash_attention, 1), (jax.grad(loss, argnums=(0, 1, 2)), 3)):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == kernels


def test_splash_under_a_mesh_runs_per_device_and_equals_the_reference():
  """Under a mesh (the learner's step traces under its own) splash runs in shard_map, rows over fsdp and heads over
  tensor: the reference's numbers on the real tokens."""
  q, k, v, seg = inputs()
  real = np.asarray(seg > 0)[..., None, None]
  with jax.set_mesh(make_mesh({"fsdp": 2, "tensor": 2}, jax.devices()[:4])):
    fn = lambda *a: splash_attention(*a, interpret=True)
    assert "shard_map" in str(jax.make_jaxpr(fn)(q, k, v, seg))
    out = jax.jit(fn)(q, k, v, seg)
  np.testing.assert_allclose(np.where(real, out, 0), np.where(real, attention(q, k, v, seg, "reference"), 0),
                             atol=2e-6)
