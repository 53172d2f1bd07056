"""jaxrl.hlo: a compiled program's FLOPs, bytes and collectives with every loop counted as often as it runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import hlo, sharding

N, B, E = 6, 16, 256


def layers(w_NxExE, x_BxE):
  return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x_BxE, w_NxExE)[0]


def stacked_matmuls(w_NxExE, x_BxE):
  return jnp.sum(layers(w_NxExE, x_BxE))


def compiled_text(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


def test_a_scanned_layer_counts_once_per_layer():
  w, x = jnp.ones((N, E, E)), jnp.ones((B, E))
  text = compiled_text(stacked_matmuls, w, x)
  costs = hlo.costs(text)
  assert costs.flops == 2 * B * E * E * N  # XLA's cost_analysis counts the body once: N times less
  assert costs.unknown_loops == 0
  # Each layer reads its own slice of the stacked weights (on CPU: sliced, written, read by the dot), not all N of
  # them every iteration (which would be N * N slices)
  assert N * E * E * 4 <= costs.bytes < 4 * N * E * E * 4


def test_nested_loops_multiply():
  def thrice(w, x):
    return jnp.sum(jax.lax.fori_loop(0, 3, lambda i, x: layers(w, x), x))

  costs = hlo.costs(compiled_text(thrice, jnp.ones((N, E, E)), jnp.ones((B, E))))
  assert costs.flops == 3 * 2 * B * E * E * N


def test_collectives_of_an_fsdp_matmul_on_8_devices():
  mesh = sharding.make_mesh({"fsdp": -1})
  n = mesh.size
  w = jax.device_put(jnp.ones((N, E, E)), NamedSharding(mesh, P(None, "fsdp", None)))
  x = jax.device_put(jnp.ones((B * n, E)), NamedSharding(mesh, P("fsdp", None)))
  costs = hlo.costs(compiled_text(stacked_matmuls, w, x))
  # Per device: each layer's weights gathered whole (FSDP), the loss summed over devices
  assert costs.collective_bytes.get("all-gather", 0) == N * E * E * 4
  assert costs.flops == 2 * B * E * E * N
  assert any(name.startswith("all-gather") for name, _ in costs.top_collectives)


def test_a_matmul_written_as_a_padded_convolution():
  """XLA:TPU writes the decode step's q projection ([8, 896] x [896, 14, 64]) as a convolution sliding a window of
  14 over padding: only one tap per output position lands on the input."""
  text = """HloModule m
ENTRY %main (p0: bf16[8,896,1], p1: bf16[896,14,64]) -> bf16[8,14,64] {
  %p0 = bf16[8,896,1]{1,0,2} parameter(0)
  %p1 = bf16[896,14,64]{0,2,1} parameter(1)
  ROOT %convolution.40 = bf16[8,14,64]{2,0,1} convolution(%p0, %p1), window={size=14 pad=13_13 rhs_reversal=1}, \
dim_labels=bf0_i0o->b0f
}
"""
  costs = hlo.costs(text)
  assert costs.flops == 2 * 8 * 896 * 14 * 64
  assert costs.bytes == (8 * 896 + 896 * 14 * 64 + 8 * 14 * 64) * 2


@pytest.mark.parametrize("shape, size", [("bf16[8,128]{1,0:T(8,128)(2,1)}", 2048), ("(f32[2], s32[], pred[3])", 15),
                                         ("u32[]", 4)])
def test_shape_bytes(shape, size):
  assert hlo.shape_bytes(shape) == size


def test_no_entry_is_an_error():
  with pytest.raises(ValueError, match="no ENTRY"):
    hlo.costs("HloModule m\n")


def test_a_data_dependent_loop_is_counted_once_and_said():
  def until(x):
    return jax.lax.while_loop(lambda c: jnp.sum(c[0]) < 100.0, lambda c: (c[0] @ c[1], c[1]), (x, x))[0]

  costs = hlo.costs(compiled_text(until, jnp.asarray(np.eye(4, dtype=np.float32))))
  assert costs.unknown_loops == 1 and costs.flops == 2 * 4**3


def test_a_mosaic_kernel_is_counted_as_a_call_not_as_flops():
  """A Pallas TPU kernel is a custom call: the HLO shows its operands and result, not its work."""
  text = """HloModule m
%body (p: (s32[], f32[8,128])) -> (s32[], f32[8,128]) {
  %p = (s32[], f32[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,128] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %k = f32[8,128] custom-call(%x), custom_call_target="tpu_custom_call"
  ROOT %t = (s32[], f32[8,128]) tuple(%next, %k)
}
%cond (p: (s32[], f32[8,128])) -> pred[] {
  %p = (s32[], f32[8,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (x: f32[8,128]) -> (s32[], f32[8,128]) {
  %x = f32[8,128] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,128]) tuple(%zero, %x)
  ROOT %w = (s32[], f32[8,128]) while(%init), condition=%cond, body=%body
}
"""
  costs = hlo.costs(text)
  assert costs.kernel_calls == 3 and costs.flops == 0 and costs.unknown_loops == 0
  assert costs.bytes >= 3 * 2 * 8 * 128 * 4  # each call's operand and result


def test_the_ops_after_a_kernel_call_that_spans_lines_are_counted():
  """XLA:TPU prints a splash kernel's metadata with its newlines: the call spans lines, one of them starting with
  "}}". The layer's ops after it are still counted (they were dropped, and a splash train step's FLOPs with them)."""
  text = """HloModule m
%body (p: (s32[], f32[8,128], f32[128,128])) -> (s32[], f32[8,128], f32[128,128]) {
  %p = (s32[], f32[8,128], f32[128,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,128] get-tuple-element(%p), index=1
  %w = f32[128,128] get-tuple-element(%p), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %k = f32[8,128] custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{
"xprof_metadata":"{\\"block_q\\": 128,
}}, metadata={op_name="splash"}
  %y = f32[8,128] dot(%k, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,128], f32[128,128]) tuple(%next, %y, %w)
}
%cond (p: (s32[], f32[8,128], f32[128,128])) -> pred[] {
  %p = (s32[], f32[8,128], f32[128,128]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
ENTRY %main (x: f32[8,128], w: f32[128,128]) -> (s32[], f32[8,128], f32[128,128]) {
  %x = f32[8,128] parameter(0)
  %w = f32[128,128] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,128], f32[128,128]) tuple(%zero, %x, %w)
  ROOT %loop = (s32[], f32[8,128], f32[128,128]) while(%init), condition=%cond, body=%body
}
"""
  costs = hlo.costs(text)
  assert costs.kernel_calls == 3 and costs.unknown_loops == 0
  assert costs.flops == 3 * 2 * 8 * 128 * 128
