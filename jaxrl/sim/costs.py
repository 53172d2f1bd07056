"""Cost model: decode step time (roofline), KV-limited batch, prefill, train and weight-transfer time.

Decode step of one engine (a replica of the sampler on `devices` devices), for a batch of B live sequences
whose contexts add up to C tokens (the scaling-book "general" step time, plus a fixed overhead):

    t(B, C) = overhead + kv_s_per_token * C + smoothmax(weights_s, compute_s_per_seq * B)

with weights_s = W / (n * BW * mem_eff), kv_s_per_token = kv_bytes / (n * BW * mem_eff) and
compute_s_per_seq = 2 N_active / (n * F * flop_eff). Attention reads are always bandwidth-bound; the linear layers
are bound by the weight read until B reaches the knee weights_s / compute_s_per_seq. B counts live sequences only:
what the paged engine computes (it runs a step on its live rows, rounded up to a row bucket: paged_engine.py) and
what vLLM-style engines compute; jaxrl's dense engine runs all of its slots at every step, idle ones included.

Mixture-of-experts models: FLOPs follow the active parameters (N_active), memory the total; a decode step of B
sequences reads the shared weights and the experts its B tokens route to: a fraction 1 - (1 - k/E)^B of the
expert weights per layer, with E experts and k routed per token (uniform routing).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxrl.sim.hardware import Hardware


def _check_positive(owner: str, **values):
  for name, v in values.items():
    if not v > 0:
      raise ValueError(f"{owner}: {name} must be > 0 (got {v})")


def _check_nonnegative(owner: str, **values):
  for name, v in values.items():
    if not v >= 0:
      raise ValueError(f"{owner}: {name} must be >= 0 (got {v})")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the cost model needs to know about a decoder: parameter count and KV-cache bytes per token."""

  name: str
  params: float  # total parameters (what memory and the weight transfer hold)
  kv_bytes_per_token: float
  bytes_per_param: float = 2.0  # bf16 weights for sampling and for the transfer
  active_params: float = 0.0  # parameters one token computes with (MoE); 0: all of them (dense)
  expert_params: float = 0.0  # parameters in routed experts (MoE), part of `params`
  num_experts: int = 0  # routed experts per layer (MoE); 0: dense
  experts_per_token: int = 0  # experts each token is routed to (MoE)

  def __post_init__(self):
    _check_positive(f"ModelSpec {self.name!r}", params=self.params, kv_bytes_per_token=self.kv_bytes_per_token,
                    bytes_per_param=self.bytes_per_param)
    _check_nonnegative(f"ModelSpec {self.name!r}", active_params=self.active_params,
                       expert_params=self.expert_params, num_experts=self.num_experts,
                       experts_per_token=self.experts_per_token)
    if self.active_params > self.params or self.expert_params > self.params:
      raise ValueError(f"ModelSpec {self.name!r}: active_params ({self.active_params:.4g}) and expert_params "
                       f"({self.expert_params:.4g}) cannot exceed params ({self.params:.4g})")
    if self.experts_per_token > self.num_experts:
      raise ValueError(f"ModelSpec {self.name!r}: experts_per_token={self.experts_per_token} > "
                       f"num_experts={self.num_experts}")

  @property
  def weight_bytes(self) -> float:
    return self.params * self.bytes_per_param

  @property
  def flop_params(self) -> float:
    """Parameters a token's forward pass multiplies by: 2 x this many FLOPs per token."""
    return self.active_params or self.params

  @property
  def expert_fraction(self) -> float:
    """Share of the weight bytes in routed experts (0 for a dense model)."""
    return self.expert_params / self.params

  @classmethod
  def from_dims(cls, name: str, *, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                num_heads: int, num_kv_heads: int, head_dim: int, tie_embeddings: bool = False,
                bytes_per_param: float = 2.0, kv_bytes_per_value: float = 2.0, num_experts: int = 0,
                experts_per_token: int = 0, moe_intermediate_size: int = 0) -> ModelSpec:
    """Llama/Qwen-style decoder (SwiGLU MLP, GQA attention, RMSNorm) counted from its sizes.

    MoE (num_experts > 0): every layer has `num_experts` SwiGLU experts of `moe_intermediate_size`, a router,
    and a shared SwiGLU MLP of `intermediate_size` (0 for none); each token uses `experts_per_token` experts.
    """
    dims = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim)
    _check_positive(f"ModelSpec {name!r}", **dims)
    _check_nonnegative(f"ModelSpec {name!r}", intermediate_size=intermediate_size, num_experts=num_experts)
    if num_experts and not (0 < experts_per_token <= num_experts and moe_intermediate_size > 0):
      raise ValueError(f"ModelSpec {name!r}: an MoE needs 0 < experts_per_token <= num_experts and "
                       f"moe_intermediate_size > 0 (got {experts_per_token}, {num_experts}, {moe_intermediate_size})")
    if not num_experts and not intermediate_size > 0:
      raise ValueError(f"ModelSpec {name!r}: intermediate_size must be > 0 (got {intermediate_size})")
    d, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    shared = d * q + 2 * d * kv + q * d + 3 * d * intermediate_size + 2 * d + d * num_experts  # + router
    expert = 3 * d * moe_intermediate_size
    embed = vocab_size * d * (1 if tie_embeddings else 2)
    params = num_layers * (shared + num_experts * expert) + embed + d
    active = num_layers * (shared + experts_per_token * expert) + embed + d
    kv_bytes = 2 * num_layers * kv * kv_bytes_per_value
    return cls(name, float(params), float(kv_bytes), bytes_per_param,
               active_params=float(active) if num_experts else 0.0,
               expert_params=float(num_layers * num_experts * expert), num_experts=num_experts,
               experts_per_token=experts_per_token)

  @classmethod
  def from_model_config(cls, cfg, name: str = "model", bytes_per_param: float = 2.0) -> ModelSpec:
    """From a `jaxrl.models.ModelConfig` (read by attribute, so this module does not import the model)."""
    return cls.from_dims(name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_layers=cfg.num_layers,
                         num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         tie_embeddings=cfg.tie_embeddings, bytes_per_param=bytes_per_param,
                         kv_bytes_per_value=bytes_per_param)


def smoothmax(a, b, sharpness: float):
  """(a^p + b^p)^(1/p): the max for p = inf, at most 2^(1/p) above it at the knee a = b."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if math.isinf(sharpness):
    return np.maximum(a, b)
  hi, lo = np.maximum(a, b), np.minimum(a, b)
  ratio = np.divide(lo, hi, out=np.zeros_like(hi), where=hi > 0)
  return hi * (1.0 + ratio**sharpness) ** (1.0 / sharpness)


@dataclasses.dataclass(frozen=True)
class DecodeCurve:
  """Decode step time of one engine vs live batch and total context (see the module docstring)."""

  weights_s: float  # reading every weight once
  kv_s_per_token: float
  compute_s_per_seq: float
  overhead_s: float = 0.0
  knee_sharpness: float = math.inf  # p of the smooth max; inf is the hard roofline
  expert_fraction: float = 0.0  # MoE: share of weights_s in routed experts (read only where tokens route)
  experts_routed: float = 0.0  # MoE: experts_per_token / num_experts

  def __post_init__(self):
    _check_nonnegative("DecodeCurve", weights_s=self.weights_s, kv_s_per_token=self.kv_s_per_token,
                       compute_s_per_seq=self.compute_s_per_seq, overhead_s=self.overhead_s)
    _check_positive("DecodeCurve", knee_sharpness=self.knee_sharpness)
    if not (0 <= self.expert_fraction <= 1 and 0 <= self.experts_routed <= 1):
      raise ValueError(f"DecodeCurve: expert_fraction and experts_routed must lie in [0, 1] (got "
                       f"{self.expert_fraction}, {self.experts_routed})")

  def weights_read_s(self, batch):
    """Seconds to read the weights a step of `batch` sequences touches (all of them for a dense model)."""
    if not self.expert_fraction:
      return self.weights_s
    touched = 1.0 - (1.0 - self.experts_routed) ** np.asarray(batch, np.float64)
    w = self.weights_s * (1.0 - self.expert_fraction + self.expert_fraction * touched)
    return float(w) if w.ndim == 0 else w

  @property
  def knee_batch(self) -> float:
    """Batch where the linear layers turn from weight-read-bound to compute-bound."""
    return self.weights_s / self.compute_s_per_seq if self.compute_s_per_seq > 0 else math.inf

  def step_time(self, batch, context_tokens):
    """Seconds for one decode step of `batch` sequences whose contexts total `context_tokens`."""
    batch, context_tokens = np.asarray(batch, np.float64), np.asarray(context_tokens, np.float64)
    if np.any(batch < 1) or np.any(context_tokens < 0):
      raise ValueError(f"decode step needs batch >= 1 and context >= 0 (got {batch}, {context_tokens})")
    t = self.overhead_s + self.kv_s_per_token * context_tokens + smoothmax(
        self.weights_read_s(batch), self.compute_s_per_seq * batch, self.knee_sharpness)
    return float(t) if t.ndim == 0 else t


def roofline_decode(model: ModelSpec, hw: Hardware, devices: int, *, mem_eff: float = 1.0, flop_eff: float = 1.0,
                    overhead_s: float = 0.0, knee_sharpness: float = math.inf) -> DecodeCurve:
  """The decode curve of an engine spread over `devices` devices of `hw`."""
  _check_positive("roofline_decode", devices=devices, mem_eff=mem_eff, flop_eff=flop_eff)
  bw = devices * hw.hbm_bandwidth * mem_eff
  return DecodeCurve(weights_s=model.weight_bytes / bw, kv_s_per_token=model.kv_bytes_per_token / bw,
                     compute_s_per_seq=2 * model.flop_params / (devices * hw.peak_flops * flop_eff),
                     overhead_s=overhead_s, knee_sharpness=knee_sharpness, expert_fraction=model.expert_fraction,
                     experts_routed=model.experts_per_token / model.num_experts if model.num_experts else 0.0)


def kv_limited_batch(model: ModelSpec, hw: Hardware, devices: int, slot_tokens: int,
                     mem_fraction: float = 1.0) -> int:
  """Decode slots that fit next to the weights when every slot reserves `slot_tokens` of KV cache."""
  _check_positive("kv_limited_batch", devices=devices, slot_tokens=slot_tokens, mem_fraction=mem_fraction)
  free = devices * hw.hbm_bytes * mem_fraction - model.weight_bytes
  return max(0, int(free // (model.kv_bytes_per_token * slot_tokens)))


def paged_kv_batch(model: ModelSpec, hw: Hardware, devices: int, live_tokens: float, page_size: int = 16,
                   mem_fraction: float = 1.0) -> int:
  """Live sequences a page pool holds next to the weights when sequences hold `live_tokens` positions on average
  (rounded up to pages: half a page each): the paged cache's slots are limited by live tokens, not max_len."""
  _check_positive("paged_kv_batch", devices=devices, live_tokens=live_tokens, page_size=page_size,
                  mem_fraction=mem_fraction)
  free = devices * hw.hbm_bytes * mem_fraction - model.weight_bytes
  return max(0, int(free // (model.kv_bytes_per_token * (live_tokens + page_size / 2))))


def prefill_s_per_token(model: ModelSpec, hw: Hardware, devices: int, flop_eff: float = 1.0) -> float:
  """Prefill is compute-bound for prompts longer than the knee: 2 N FLOPs per prompt token."""
  _check_positive("prefill_s_per_token", devices=devices, flop_eff=flop_eff)
  return 2 * model.flop_params / (devices * hw.peak_flops * flop_eff)


def train_tokens_per_s_per_device(model: ModelSpec, hw: Hardware, mfu: float) -> float:
  """Learner throughput at a stated MFU: 6 N FLOPs per trained token (forward + backward)."""
  if not 0 < mfu <= 1:
    raise ValueError(f"mfu must be in (0, 1] (got {mfu})")
  return hw.peak_flops * mfu / (6 * model.flop_params)


def learner_min_devices(model: ModelSpec, hw: Hardware, bytes_per_param: float = 16.0,
                        mem_fraction: float = 1.0) -> int:
  """Devices whose memory holds the training state (bf16 params and grads, fp32 master + Adam: 16 B/param)."""
  _check_positive("learner_min_devices", bytes_per_param=bytes_per_param, mem_fraction=mem_fraction)
  return math.ceil(model.params * bytes_per_param / (hw.hbm_bytes * mem_fraction))


def transfer_time(weight_bytes: float, link_bandwidth: float, senders: int, receivers: int,
                  copies: int = 1) -> float:
  """Seconds to send `copies` replicas of the weights from `senders` to `receivers` devices.

  Each receiver takes weight_bytes * copies / receivers bytes and each sender gives the same total split over
  the senders; the slower side at `link_bandwidth` per device sets the time.
  """
  _check_positive("transfer_time", weight_bytes=weight_bytes, link_bandwidth=link_bandwidth, senders=senders,
                  receivers=receivers, copies=copies)
  total = weight_bytes * copies
  return max(total / senders, total / receivers) / link_bandwidth


@dataclasses.dataclass(frozen=True)
class Costs:
  """Everything the simulator charges time for, for one model on one kind of device."""

  decode: DecodeCurve  # per engine
  devices_per_engine: int
  max_batch: int  # live sequences per engine (KV-cache limit)
  prefill_s_per_token: float  # per engine, per prompt token
  train_tokens_per_s_per_device: float
  weight_bytes: float
  link_bandwidth: float  # bytes/s per device during a weight transfer
  train_overhead_s: float = 0.0  # fixed per learner step (optimizer update, host work)
  sync_overhead_s: float = 0.0  # fixed per weight transfer (latency, re-layout)
  # Learner throughput measured at several device counts, ((devices, tokens/s per device), ...): it replaces
  # the single figure above, interpolated linearly in log(devices) and held flat outside the measured range
  # (per-device throughput falls as a learner grows: collectives, smaller per-device batches).
  train_scaling: tuple[tuple[int, float], ...] = ()
  # The same for the colocated synchronous baseline's learner, which trains on the whole pool next to the
  # sampler's memory (often lower: smaller micro-batches, offloading); empty: as the pipeline's learner.
  sync_train_scaling: tuple[tuple[int, float], ...] = ()
  # Forward passes over the batch besides the trained one (old-policy log-probs of decoupled PPO, a reference
  # model for KL): each adds 2 N FLOPs per token to the 6 N of forward + backward.
  extra_forward_passes: int = 0
  kv: str = "dense"  # KV cache layout: what an in-flight update recomputes (see rebuild_time)
  rebuild_s_per_token: float = 0.0  # in-flight update: recompute per KV position (a chunked prefill); 0: free
  # Weight service (independent sampler programs, issue 43): the learner stages each version once and every engine
  # pulls it, taking weight_bytes / pull_bandwidth seconds (the pull and its checksum: the weight_pull bench's
  # take); 0: the learner pushes a copy to every engine (one job), at link_bandwidth.
  pull_bandwidth: float = 0.0

  def __post_init__(self):
    _check_positive("Costs", devices_per_engine=self.devices_per_engine, max_batch=self.max_batch,
                    train_tokens_per_s_per_device=self.train_tokens_per_s_per_device,
                    weight_bytes=self.weight_bytes, link_bandwidth=self.link_bandwidth)
    _check_nonnegative("Costs", prefill_s_per_token=self.prefill_s_per_token,
                       train_overhead_s=self.train_overhead_s, sync_overhead_s=self.sync_overhead_s,
                       extra_forward_passes=self.extra_forward_passes, rebuild_s_per_token=self.rebuild_s_per_token,
                       pull_bandwidth=self.pull_bandwidth)
    for field in ("train_scaling", "sync_train_scaling"):
      points = getattr(self, field)
      if any(len(p) != 2 or not p[0] >= 1 or not p[1] > 0 for p in points):
        raise ValueError(f"Costs.{field} must be (devices >= 1, tokens/s per device > 0) pairs (got {points})")
      if len({p[0] for p in points}) != len(points):
        raise ValueError(f"Costs.{field} names a device count twice (got {points})")
    if self.kv not in ("dense", "paged"):
      raise ValueError(f"Costs: kv must be 'dense' or 'paged' (got {self.kv!r})")

  def replace(self, **kw) -> Costs:
    return dataclasses.replace(self, **kw)

  def train_tokens_per_s(self, devices: int, colocated: bool = False) -> float:
    """Per-device learner throughput at `devices` devices; `colocated`: the synchronous baseline's learner."""
    points = (self.sync_train_scaling if colocated else ()) or self.train_scaling
    if not points:
      return self.train_tokens_per_s_per_device
    n, tps = np.asarray(sorted(points), np.float64).T
    return float(np.interp(math.log(devices), np.log(n), tps))

  def train_time(self, tokens: float, devices: int, colocated: bool = False) -> float:
    _check_positive("train_time", devices=devices)
    flops_factor = 1.0 + self.extra_forward_passes / 3.0  # (6 + 2 extra) N over the 6 N the rate is for
    return self.train_overhead_s + tokens * flops_factor / (devices * self.train_tokens_per_s(devices, colocated))

  def rebuild_time(self, context_tokens: float, longest: float) -> float:
    """An in-flight update's KV recompute for live contexts totalling `context_tokens`, the longest `longest`:
    paged recomputes the live tokens, dense every slot up to the longest live position (idle slots included)."""
    positions = context_tokens if self.kv == "paged" else self.max_batch * longest
    return self.rebuild_s_per_token * positions

  def sync_time(self, sender_devices: int, receiver_devices: int) -> float:
    """One weight publish: every engine of the receivers gets a full copy (one staged copy where they pull it)."""
    engines = 1 if self.pull_bandwidth else receiver_devices // self.devices_per_engine
    return self.sync_overhead_s + transfer_time(self.weight_bytes, self.link_bandwidth, sender_devices,
                                                receiver_devices, copies=max(engines, 1))

  def update_times(self, sender_devices: int, receiver_devices: int) -> tuple[float, float]:
    """(the learner's seconds per publish, an engine's pause for it): pushed, both are the publish; pulled, the
    learner stages one copy and each engine pays its own take."""
    publish_s = self.sync_time(sender_devices, receiver_devices)
    return publish_s, self.weight_bytes / self.pull_bandwidth if self.pull_bandwidth else publish_s

  def slowed(self, decode_x: float = 1.0, train_x: float = 1.0) -> Costs:
    """These costs with the engines' decode, prefill and KV recompute stretched by decode_x and the learner's train
    steps by train_x (contention, shared devices)."""
    d = self.decode
    decode = dataclasses.replace(d, weights_s=d.weights_s * decode_x, kv_s_per_token=d.kv_s_per_token * decode_x,
                                 compute_s_per_seq=d.compute_s_per_seq * decode_x, overhead_s=d.overhead_s * decode_x)
    return self.replace(decode=decode, prefill_s_per_token=self.prefill_s_per_token * decode_x,
                        train_tokens_per_s_per_device=self.train_tokens_per_s_per_device / train_x,
                        train_overhead_s=self.train_overhead_s * train_x,
                        train_scaling=tuple((n, tps / train_x) for n, tps in self.train_scaling),
                        sync_train_scaling=tuple((n, tps / train_x) for n, tps in self.sync_train_scaling),
                        rebuild_s_per_token=self.rebuild_s_per_token * decode_x)


def roofline_costs(model: ModelSpec, hw: Hardware, *, devices_per_engine: int, slot_tokens: int,
                   mem_eff: float = 1.0, flop_eff: float = 1.0, mfu: float = 0.4, overhead_s: float = 0.0,
                   knee_sharpness: float = math.inf, kv_mem_fraction: float = 1.0, max_batch_cap: int = 1024,
                   train_overhead_s: float = 0.0, sync_overhead_s: float = 0.0, mfu_by_devices=None,
                   sync_mfu_by_devices=None, extra_forward_passes: int = 0, kv: str | None = None,
                   live_tokens: float | None = None, page_size: int = 16) -> Costs:
  """Costs from datasheet numbers and efficiency factors; `slot_tokens` is the KV reserved per sequence.

  mfu_by_devices / sync_mfu_by_devices: {devices: MFU} measured at several learner sizes (pipeline learner /
  colocated sync learner); they set Costs.train_scaling / sync_train_scaling.
  kv: None leaves in-flight updates free of recompute (as before paging); "dense" or "paged" charges their
  recompute at the prefill rate (Costs.rebuild_time), and "paged" sizes the batch by the pages that sequences
  of `live_tokens` positions on average take instead of slot_tokens each."""
  if kv == "paged":
    if live_tokens is None:
      raise ValueError("roofline_costs: kv='paged' needs live_tokens (the mean positions a live sequence holds)")
    fits = paged_kv_batch(model, hw, devices_per_engine, live_tokens, page_size, kv_mem_fraction)
  else:
    fits = kv_limited_batch(model, hw, devices_per_engine, slot_tokens, kv_mem_fraction)
  max_batch = min(max_batch_cap, fits)
  if max_batch < 1:
    raise ValueError(f"{model.name} does not fit an engine of {devices_per_engine} {hw.name} devices with one "
                     f"slot of {slot_tokens} tokens; use more devices per engine")
  return Costs(
      decode=roofline_decode(model, hw, devices_per_engine, mem_eff=mem_eff, flop_eff=flop_eff,
                             overhead_s=overhead_s, knee_sharpness=knee_sharpness),
      devices_per_engine=devices_per_engine, max_batch=max_batch,
      prefill_s_per_token=prefill_s_per_token(model, hw, devices_per_engine, flop_eff),
      train_tokens_per_s_per_device=train_tokens_per_s_per_device(model, hw, mfu),
      weight_bytes=model.weight_bytes, link_bandwidth=hw.link_bandwidth,
      train_overhead_s=train_overhead_s, sync_overhead_s=sync_overhead_s,
      train_scaling=_scaling(model, hw, mfu_by_devices), sync_train_scaling=_scaling(model, hw, sync_mfu_by_devices),
      extra_forward_passes=extra_forward_passes, kv=kv or "dense",
      rebuild_s_per_token=0.0 if kv is None else prefill_s_per_token(model, hw, devices_per_engine, flop_eff))


def _scaling(model: ModelSpec, hw: Hardware, mfu_by_devices) -> tuple[tuple[int, float], ...]:
  return tuple((int(n), train_tokens_per_s_per_device(model, hw, float(m)))
               for n, m in sorted((mfu_by_devices or {}).items(), key=lambda kv: int(kv[0])))
