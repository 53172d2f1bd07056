"""Roofline telemetry: the learner's and the sampler's achieved FLOP/s and bytes/s over their busy time, and their
fractions of the devices' peak (MFU: FLOP/s over peak FLOP/s; MBU: bytes/s over peak memory bandwidth).

The work is counted from the model config, not read from XLA: model FLOPs (every projection, the output head and
causal attention; no rematerialisation, elementwise ops or masked-out attention; a learner batch's padding counts,
the step computes it) and the fewest bytes the work must move (weights, KV cache and optimizer state; no
activations). The peaks come from the systems model's table (jaxrl.sim.hardware) by `device_kind`; on a device
not in it (a CPU) or on request they are measured once at start: a matmul and a matrix-vector product.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp

from jaxrl.learner.step import fixed_param_pass_count  # the learner's own rule for its extra passes
from jaxrl.sim.costs import ModelSpec
from jaxrl.sim.hardware import PRESETS

PEAK_MODES = ("auto", "measure")  # the roofline's peak: the device table's (else measured), or measured

# jax.devices()[0].device_kind -> the jaxrl.sim.hardware preset whose datasheet numbers it has, the first substring
# that matches (so "H200" before "H20", "TPU v5 lite" before "TPU v5"). TPU v5e and v6e report "lite".
DEVICE_KINDS = (("H200", "h200"), ("H100", "h100"), ("H800", "h800"), ("H20", "h20"), ("A100", "a100"),
                ("B200", "b200"), ("MI300X", "mi300x"), ("TPU v6 lite", "tpu_v6e"), ("TPU v6e", "tpu_v6e"),
                ("TPU v5 lite", "tpu_v5e"), ("TPU v5e", "tpu_v5e"), ("TPU v5p", "tpu_v5p"), ("TPU v5", "tpu_v5p"),
                ("TPU v4", "tpu_v4"))
KEYS = tuple(f"{side}_{name}" for side in ("learner", "sampler")
             for name in ("flops_per_s", "bytes_per_s", "mfu", "mbu"))
_F32 = 4  # bytes of a float32 gradient accumulator


def matmul_params(cfg) -> int:
  """Weights a token multiplies by: every layer's q, k, v, o and SwiGLU projections and the output head (the input
  embedding is a lookup)."""
  e, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return cfg.num_layers * (e * q + 2 * e * kv + q * e + 3 * e * cfg.intermediate_size) + cfg.vocab_size * e


def flops_per_key(cfg) -> int:
  """Attention FLOPs of one query over one key, all layers: q.k and p.v, each 2 H D."""
  return 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers


def causal_keys(rows: int, length: int) -> int:
  """Keys `rows` causal rows of `length` tokens attend in all: token i attends i + 1."""
  return rows * length * (length + 1) // 2


def forward_flops(cfg, tokens: int, keys: int) -> int:
  """Model FLOPs of a forward pass over `tokens` tokens whose queries attend `keys` keys in all."""
  return 2 * matmul_params(cfg) * tokens + flops_per_key(cfg) * keys


def learner_step_flops(cfg, rows: int, seq_len: int, *, epochs: int, fixed_passes: int) -> int:
  """One train step over rows x seq_len tokens: forward + backward (3 forwards) per epoch over the batch, and the
  forward passes at fixed params (jaxrl.learner.step.fixed_param_pass_count)."""
  return (3 * epochs + fixed_passes) * forward_flops(cfg, rows * seq_len, causal_keys(rows, seq_len))


def learner_step_bytes(cfg, *, updates: int, fixed_passes: int, param_bytes: int) -> int:
  """The fewest bytes a train step moves: per update the weights read by the forward and the backward pass, the
  float32 gradient written, AdamW's read of params, gradient and two moments and write of params and moments (all
  at the params' dtype); each fixed-param pass reads the weights once. Activations are not counted."""
  params = int(ModelSpec.from_model_config(cfg).params)
  return params * (updates * (9 * param_bytes + _F32) + fixed_passes * param_bytes)


def sampler_flops(cfg, *, generated: int, attended: int, prefilled: int, prefill_keys: int) -> int:
  """Model FLOPs of decoding `generated` tokens whose steps attended `attended` keys in all, and of prefilling
  `prefilled` prompt tokens (`prefill_keys` keys)."""
  return forward_flops(cfg, generated + prefilled, attended + prefill_keys)


def sampler_bytes(cfg, *, decode_steps: int, prefills: int, generated: int, attended: int, prefilled: int,
                  bytes_per_value: int, weight_bytes_per_value: int | None = None) -> int:
  """The fewest bytes the sampler moves: every decode step and prefill reads the weights once (at
  weight_bytes_per_value, default bytes_per_value: 1 for an int8 sampler, its per-channel scales left out), every
  attended key reads its keys and values, every generated or prefilled token writes its own (at the sampler's
  dtype)."""
  spec = ModelSpec.from_model_config(cfg, bytes_per_param=bytes_per_value)
  weights = ModelSpec.from_model_config(cfg, bytes_per_param=weight_bytes_per_value or bytes_per_value)
  return int((decode_steps + prefills) * weights.weight_bytes + (attended + generated + prefilled)
             * spec.kv_bytes_per_token)


@dataclasses.dataclass(frozen=True)
class Peak:
  """Peak FLOP/s and memory bandwidth (bytes/s) of a device or a side's devices, and where they come from."""

  flops: float
  bandwidth: float
  source: str

  def times(self, devices: int) -> Peak:
    return Peak(self.flops * devices, self.bandwidth * devices, f"{devices} x {self.source}")


def table_peak(device_kind: str) -> Peak | None:
  """The datasheet peak (dense bf16) of a device kind in jaxrl.sim.hardware, or None if the table lacks it."""
  name = next((preset for kind, preset in DEVICE_KINDS if kind.lower() in device_kind.lower()), None)
  if name is None:
    return None
  hw = PRESETS[name]
  return Peak(hw.peak_flops, hw.hbm_bandwidth, f"table {name}: {hw.source}")


def _best_s(fn, reps: int) -> float:
  jax.block_until_ready(fn())  # compiled and warm
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def matmul_flops(dtype: str, n: int, reps: int) -> float:
  """FLOP/s of an n x n by n x n matmul in `dtype` on the default device, best of `reps` (after a warm-up)."""
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda a: a @ a)
  return 2 * n**3 / _best_s(lambda: matmul(a), reps)


def read_bandwidth(nbytes: int, reps: int) -> float:
  """Bytes/s of reading a float32 matrix of about `nbytes` once, as a decode step reads its weights: a
  matrix-vector product, best of `reps` (after a warm-up). Not a sum: XLA:CPU runs one on a single thread, below
  what the memory allows (docs/TELEMETRY.md)."""
  n = math.isqrt(nbytes // 4)
  m, v = jnp.ones((n, n), jnp.float32), jnp.ones((n,), jnp.float32)
  matvec = jax.jit(lambda m, v: m @ v)
  return m.nbytes / _best_s(lambda: matvec(m, v), reps)


@functools.cache
def measured_peak(dtype: str, n: int = 1024, read_bytes: int = 64 * 2**20, reps: int = 3) -> Peak:
  """One device's matmul FLOP/s and read bandwidth, measured once per process."""
  return Peak(matmul_flops(dtype, n, reps), read_bandwidth(read_bytes, reps),
              f"measured on {jax.devices()[0].device_kind} ({dtype} matmul {n}^3, {read_bytes >> 20} MiB matvec)")


def device_peak(device_kind: str, dtype: str, mode: str = "auto", flops: float = 0.0, bandwidth: float = 0.0) -> Peak:
  """One device's peak: the table's (mode "auto", where it knows the device), else measured now (in the compute
  dtype); flops / bandwidth > 0 replace either number."""
  if mode not in PEAK_MODES:
    raise ValueError(f"peak mode {mode!r}; allowed: {PEAK_MODES}")
  peak = (table_peak(device_kind) if mode == "auto" else None) or measured_peak(dtype)
  if flops > 0 or bandwidth > 0:
    peak = Peak(flops or peak.flops, bandwidth or peak.bandwidth, f"set in the config (else {peak.source})")
  return peak


def side_peak(device: Peak, devices: int, platform: str) -> Peak:
  """A side's peak: one device's times its devices, except on a CPU, whose devices share the host's cores and
  memory (the measured peak is already the host's)."""
  return device if platform == "cpu" else device.times(devices)


@dataclasses.dataclass(frozen=True)
class Work:
  """What the counts need to know about a run: the model, the learner step's shape and the sampler's dtype."""

  cfg: object  # jaxrl.models.ModelConfig
  seq_len: int
  epochs: int
  updates: int  # optimizer updates per step (mini-batches x epochs)
  fixed_passes: int
  param_bytes: int
  sampler_bytes_per_value: int
  steps_per_call: int
  sampler_weight_bytes_per_value: int | None = None  # 1 for an int8 sampler (sampler.weight_dtype="int8")


class Telemetry:
  """Per learner step, from its metrics: the learner's rates over the step's train time (train_s, over
  train_tokens) and the samplers' over their time inside Sampler.step() (sampler/seconds) since the last step,
  from their cumulative counters (sampler/<name>, summed over replicas). A step after which no sampler reported new
  work logs the learner's numbers only."""

  def __init__(self, work: Work, learner: Peak, sampler: Peak):
    self.work, self.learner, self.sampler = work, learner, sampler
    self._last: dict[str, float] = {}

  def __call__(self, metrics: dict) -> dict[str, float]:
    w, out = self.work, {}
    if metrics.get("train_s", 0) > 0:
      rows = int(metrics["train_tokens"]) // w.seq_len
      flops = learner_step_flops(w.cfg, rows, w.seq_len, epochs=w.epochs, fixed_passes=w.fixed_passes)
      moved = learner_step_bytes(w.cfg, updates=w.updates, fixed_passes=w.fixed_passes, param_bytes=w.param_bytes)
      out |= _rates("learner", flops, moved, metrics["train_s"], self.learner)
    now = {k[len("sampler/"):]: float(v) for k, v in metrics.items() if k.startswith("sampler/")}
    d = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
    if d.get("seconds", 0) > 0:
      count = lambda name: int(d[name])  # noqa: E731
      flops = sampler_flops(w.cfg, generated=count("generated_tokens"), attended=count("attended_keys"),
                            prefilled=count("prefill_tokens"), prefill_keys=count("prefill_keys"))
      moved = sampler_bytes(w.cfg, decode_steps=count("decode_calls") * w.steps_per_call, prefills=count("prefills"),
                            generated=count("generated_tokens"), attended=count("attended_keys"),
                            prefilled=count("prefill_tokens"), bytes_per_value=w.sampler_bytes_per_value,
                            weight_bytes_per_value=w.sampler_weight_bytes_per_value)
      out |= _rates("sampler", flops, moved, d["seconds"], self.sampler)
      self._last = now
    return out


def _rates(side: str, flops: int, moved: int, seconds: float, peak: Peak) -> dict[str, float]:
  return {f"{side}_flops_per_s": flops / seconds, f"{side}_bytes_per_s": moved / seconds,
          f"{side}_mfu": flops / seconds / peak.flops, f"{side}_mbu": moved / seconds / peak.bandwidth}


def for_run(cfg, rl, loss, sampler, log, *, learner_devices: int, sampler_devices: int, sampler_dtype) -> Telemetry:
  """The Telemetry of a run's model config and its rl, loss, sampler and log sections on this backend;
  sampler_devices: one sampler replica's."""
  updates = rl.num_minibatches * rl.num_epochs
  work = Work(cfg, seq_len=rl.seq_len, epochs=rl.num_epochs, updates=updates,
              fixed_passes=fixed_param_pass_count(loss, updates), param_bytes=jnp.dtype(cfg.param_dtype).itemsize,
              sampler_bytes_per_value=jnp.dtype(sampler_dtype).itemsize,
              sampler_weight_bytes_per_value=1 if sampler.weight_dtype == "int8" else None,
              steps_per_call=sampler.steps_per_call)
  device = jax.devices()[0]
  peak = device_peak(device.device_kind, cfg.dtype, log.peak, log.peak_flops, log.peak_bandwidth)
  return Telemetry(work, side_peak(peak, learner_devices, device.platform),
                   side_peak(peak, sampler_devices, device.platform))
