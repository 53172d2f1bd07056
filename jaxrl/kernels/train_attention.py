"""Causal self-attention over packed rows for the learner's full-sequence path, one function per backend.

A query attends to keys at or before it with the same non-zero segment id (jaxrl/learner/packing.py). Padding
queries (segment 0) see no key; their output is finite and unused. Implementations:
  reference: the [B, K, G, T, T] float32 score tensor; exact, for short rows and as the tests' yardstick.
  chunked:   XLA, query blocks (each rematerialised in the backward pass) x key blocks with an online softmax;
             key blocks wholly after the query block are skipped. Memory O(T * block) per head, not O(T^2).
  cudnn:     jax.nn.dot_product_attention(implementation="cudnn") on GPU (bf16 / fp16), segments as a boolean
             [B, 1, T, T] mask (one byte per pair, no per-head float tensor).
  splash:    the Pallas splash-attention kernel on TPU (causal mask, segment ids); `interpret` runs it on CPU. Under
             a mesh it runs in shard_map, each device on its rows and heads (docs/KERNELS.md).
"auto" (implementation None) picks by the platform of the mesh in scope, which is the target's also when a TPU
program is compiled deviceless on a CPU host.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl.axes import LEARNER_RULES, logical_to_spec
from jaxrl.kernels.mosaic import mosaic_precision, per_device

IMPLEMENTATIONS = ("reference", "chunked", "cudnn", "splash")  # the run config's model.train_attention choices

_NEG_INF = -1e30


def target_platform() -> str:
  """The platform the program is built for: that of the mesh in scope (in a deviceless TPU compile the host's
  jax.default_backend() is "cpu"), else the default backend's."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  return jax.default_backend() if device is None else device.platform


def default_implementation(seq_len: int, dtype, block: int) -> str:
  """The target's memory-efficient kernel; the reference for rows of one block or less (no gain there)."""
  backend = target_platform()
  if backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  if backend == "tpu":
    return "splash"
  return "chunked" if seq_len > block else "reference"


def _allowed(q_idx, k_idx, seg_q_BxT, seg_k_BxS):
  causal = q_idx[:, None] >= k_idx[None, :]
  same = seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :]
  return causal[None] & same & (seg_k_BxS[:, None, :] != 0)


def reference_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT):
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxTxKxD.shape[2]
  q = q_BxTxHxD.reshape(b, t, kv, h // kv, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k_BxTxKxD, preferred_element_type=jnp.float32) / math.sqrt(d)
  mask_BxTxS = _allowed(jnp.arange(t), jnp.arange(t), segment_ids_BxT, segment_ids_BxT)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v_BxTxKxD).reshape(b, t, h, d)


def chunked_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, block: int = 512):
  b, t, h, d = q_BxTxHxD.shape
  kv, dt = k_BxTxKxD.shape[2], q_BxTxHxD.dtype
  n = -(-t // block)
  pad = n * block - t
  padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q = padded(q_BxTxHxD).reshape(b, n, block, kv, h // kv, d) / jnp.asarray(math.sqrt(d), dt)
  k_NxBxCxKxD = jnp.moveaxis(padded(k_BxTxKxD).reshape(b, n, block, kv, d), 1, 0)
  v_NxBxCxKxD = jnp.moveaxis(padded(v_BxTxKxD).reshape(b, n, block, kv, d), 1, 0)
  seg = padded(segment_ids_BxT).reshape(b, n, block)
  seg_NxBxC = jnp.moveaxis(seg, 1, 0)
  offsets = jnp.arange(block)

  # Remat per query block: the backward pass keeps only the block's inputs, never a [block, T] score slab.
  @jax.checkpoint
  def query_block(args):
    q_BxCxKxGxD, seg_q_BxC, i = args

    def key_block(carry, xs):
      k_blk, v_blk, seg_k, j = xs

      def update(carry):
        m, l, acc = carry
        s = jnp.einsum("bqkgd,bskd->bkgqs", q_BxCxKxGxD, k_blk, preferred_element_type=jnp.float32)
        ok = _allowed(i * block + offsets, j * block + offsets, seg_q_BxC, seg_k)[:, None, None]
        s = jnp.where(ok, s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        scale = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(dt), v_blk, preferred_element_type=jnp.float32)
        return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv

      # A key block wholly after the query block is all masked: skip its work (causality).
      return jax.lax.cond(j <= i, update, lambda c: c, carry), None

    g = h // kv
    init = (jnp.full((b, kv, g, block), _NEG_INF, jnp.float32), jnp.zeros((b, kv, g, block), jnp.float32),
            jnp.zeros((b, kv, g, block, d), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(key_block, init, (k_NxBxCxKxD, v_NxBxCxKxD, seg_NxBxC, jnp.arange(n)))
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return jnp.moveaxis(out, 3, 1).astype(dt)  # BxCxKxGxD

  out = jax.lax.map(query_block, (jnp.moveaxis(q, 1, 0), seg_NxBxC, jnp.arange(n)))
  return jnp.moveaxis(out, 0, 1).reshape(b, n * block, h, d)[:, :t]


def cudnn_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, implementation: str = "cudnn"):
  t = q_BxTxHxD.shape[1]
  mask = _allowed(jnp.arange(t), jnp.arange(t), segment_ids_BxT, segment_ids_BxT)
  # A padding query sees nothing: let it see itself, so no softmax row is empty (its output is unused).
  mask = mask | jnp.eye(t, dtype=bool)[None]
  return jax.nn.dot_product_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask=mask[:, None],
                                      implementation=implementation)


def _splash_block(t: int) -> int:
  """The kernel's block (queries and keys, forward and backward): the largest of 512, 256, 128 dividing the padded
  row (Mosaic tiles a block by 128 lanes; these compile for v5e and v5p at head dim 64 and 128 in float32 and
  bfloat16, rows of 1k to 32k tokens: tests/test_kernels_mosaic.py, bench/kernels_mosaic.py)."""
  return next(b for b in (512, 256, 128) if t % b == 0)


def _splash_kernel(t: int, groups: int, interpret: bool):
  """Made in each trace that calls it: its mask tables become that trace's arrays (a kernel kept across traces
  leaked the first trace's tracers into later programs); the costly mask processing is cached by jax by mask."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  block = _splash_block(t)
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(groups)])
  return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret), splash.SegmentIds


def _splash_local(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, interpret: bool):
  """The kernel over this device's rows and heads: one call per (row, kv head), each its G query heads (MQA)."""
  b, t, h, d = q_BxTxHxD.shape
  kv = k_BxTxKxD.shape[2]
  tile = 128  # the kernel's blocks tile the row: pad to a multiple (padding is segment 0, never a real key)
  tp = -(-t // tile) * tile
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  kernel, segment_ids = _splash_kernel(tp, h // kv, interpret)
  q = pad(q_BxTxHxD / jnp.asarray(math.sqrt(d), q_BxTxHxD.dtype)).reshape(b, tp, kv, h // kv, d)
  q_BxKxGxTxD = jnp.transpose(q, (0, 2, 3, 1, 4))
  k_BxKxTxD, v_BxKxTxD = (jnp.swapaxes(pad(x), 1, 2) for x in (k_BxTxKxD, v_BxTxKxD))
  seg = pad(segment_ids_BxT)
  # Padding tokens share segment 0 with each other only: every query row has a visible key (itself).
  per_head = lambda q, k, v, s: kernel(q, k, v, segment_ids=segment_ids(q=s, kv=s))
  per_row = jax.vmap(per_head, in_axes=(0, 0, 0, None))
  out = jax.vmap(per_row)(q_BxKxGxTxD, k_BxKxTxD, v_BxKxTxD, seg)  # BxKxGxTxD
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, tp, h, d)[:, :t]


def _splash_specs(mesh, shape_BxTxKxD):
  """shard_map specs of (q, k, v, segment ids) and of the output: rows over the learner's batch axes, heads over
  its tensor axis where that axis divides the kv heads (query head h uses kv head h // G, so q splits the same
  way); an axis that does not divide is left out (the kernel runs replicated along it)."""
  batch, _, heads, _ = logical_to_spec(("batch", None, "kv_heads", None), shape_BxTxKxD, mesh, LEARNER_RULES)
  x = P(batch, None, heads, None)
  return (x, x, x, P(batch, None)), x


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _splash_pinned(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, interpret):
  """_splash_local with its forward and backward kernels traced at Mosaic's precision (the backward is traced when
  the step is differentiated, outside the forward's context: hence the custom_vjp)."""
  with mosaic_precision():
    return _splash_local(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, interpret)


def _splash_pinned_fwd(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, interpret):
  with mosaic_precision():
    local = lambda q, k, v: _splash_local(q, k, v, segment_ids_BxT, interpret)
    return jax.vjp(local, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)


def _splash_pinned_bwd(interpret, vjp, d_out):
  with mosaic_precision():
    return (*vjp(d_out), None)


_splash_pinned.defvjp(_splash_pinned_fwd, _splash_pinned_bwd)


def splash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, interpret: bool = False):
  """The splash kernel on each device's rows and heads (kernels.mosaic.per_device: shard_map under the mesh in
  scope, which the learner's step traces under)."""
  local = lambda q, k, v, s: _splash_pinned(q, k, v, s, interpret)
  return per_device(local, lambda mesh: _splash_specs(mesh, k_BxTxKxD.shape), q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                    segment_ids_BxT)


def attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, implementation: str | None = None,
              block: int = 512):
  """Causal segment-masked attention, [B, T, H, D] out; implementation None picks the backend's default."""
  impl = implementation or default_implementation(q_BxTxHxD.shape[1], q_BxTxHxD.dtype, block)
  if impl == "reference":
    return reference_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT)
  if impl == "chunked":
    return chunked_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT, block)
  if impl == "cudnn":
    return cudnn_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT)
  if impl == "splash":
    return splash_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, segment_ids_BxT)
  raise ValueError(f"unknown attention implementation {impl!r}; allowed: {IMPLEMENTATIONS}")
