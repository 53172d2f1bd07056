"""What every decode engine does the same way, whatever its cache: sizes, dtype, shardings, prompt buckets,
prefill, per-request settings, stopping a slot and appending an observation's tokens.

`DenseEngine` and `PagedEngine` (sampler/dense_engine.py, sampler/paged_engine.py) extend it with the cache:
each provides `empty_cache()` and `cache_shardings(rows)`, and its own insert, generate and recompute programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxrl.models import KVCache, ModelConfig, lora, quant
from jaxrl.models.config import DTYPES
from jaxrl.models.hf import abstract_params
from jaxrl.sampler import continuation, decode
from jaxrl.sampler.decode_state import DecodeState, Prefix, ResultTokens, SlotSettings
from jaxrl.sharding import SAMPLER_RULES, Versioned, logical_to_spec, param_shardings, transfer, under_mesh


def check_positive_ints(**sizes) -> None:
  for name, value in sizes.items():
    if not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"Engine: {name} must be a positive int (got {value!r})")


def prompt_buckets(min_bucket: int, max_len: int) -> tuple[int, ...]:
  """Prompt lengths prefill compiles for: min_bucket, doubling, then max_len."""
  buckets, b = [], min_bucket
  while b < max_len:
    buckets.append(b)
    b *= 2
  return (*buckets, max_len)


def compute_dtype_name(dtype: str | None, cfg: ModelConfig, mesh) -> str:
  dtype = cfg.dtype if dtype is None else dtype
  if dtype == "auto":
    dtype = "float32" if mesh.devices.flat[0].platform == "cpu" else "bfloat16"
  if dtype not in DTYPES:
    raise ValueError(f"Engine: dtype must be one of {DTYPES} or 'auto' (got {dtype!r})")
  return dtype


class SlotEngine:
  """Prefill / insert / generate over `max_slots` decode slots of `max_len` tokens on the sampler mesh."""

  kv: str  # "dense" | "paged", set by each engine

  def __init__(self, cfg: ModelConfig, mesh, *, max_slots: int, max_len: int, steps_per_call: int = 8,
               min_bucket: int = 16, max_stop_ids: int = 8, rebuild_chunk: int = 128, dtype: str | None = None,
               weight_dtype: str = "float", rules=SAMPLER_RULES):
    """dtype: of the sampler's weights, activations and KV cache: "float32" | "bfloat16" | "auto" (bfloat16 on
    TPU/GPU, float32 on CPU, where XLA's float32 matmuls are exact and bfloat16 ones are not faster everywhere);
    None: cfg.dtype. weight_dtype: "float" (the weights in dtype) or "int8" (the large matmul weights quantized
    per output channel when placed, jaxrl.models.quant). Prompts prefill in buckets of min_bucket, doubling, up to
    max_len; a recompute runs chunks of rebuild_chunk positions."""
    check_positive_ints(max_slots=max_slots, max_len=max_len, steps_per_call=steps_per_call, min_bucket=min_bucket,
                        max_stop_ids=max_stop_ids, rebuild_chunk=rebuild_chunk)
    if max_len < 2:
      raise ValueError(f"Engine: max_len must be >= 2 to hold a prompt token and a generated one (got {max_len})")
    dtype = compute_dtype_name(dtype, cfg, mesh)
    if weight_dtype not in quant.WEIGHT_DTYPES:
      raise ValueError(f"Engine: weight_dtype must be one of {quant.WEIGHT_DTYPES} (got {weight_dtype!r})")
    # Params are cast once when placed (not per step inside the decode program).
    cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.dtype, self.weight_dtype = cfg.compute_dtype, weight_dtype
    self.cfg, self.mesh, self.rules = cfg, mesh, rules
    self.max_slots, self.max_len, self.steps_per_call = max_slots, max_len, steps_per_call
    self.max_stop_ids, self.rebuild_chunk = max_stop_ids, rebuild_chunk
    self.buckets = prompt_buckets(min_bucket, max_len)
    self.graphdef, abstract = abstract_params(cfg)
    self.param_shardings = param_shardings(abstract, mesh, rules)
    if weight_dtype == "int8":
      self.param_shardings = quant.quantized_shardings(self.param_shardings, abstract)
    self.base = None  # a LoRA model's frozen base, held once (hold_base): placed params are then its adapters
    self.publish_shardings = self.param_shardings  # of what place() takes: every param, or the adapters alone
    self._state_shardings = self.decode_state_shardings()
    self._result_shardings = ResultTokens(*(self._named("batch", None),) * 3, self._named("batch"), self._named(),
                                          self._named("batch", None, None, None) if cfg.is_moe else None)
    prefix_shardings = Prefix(self.kv_shardings(batch_axis=None), self._named(None), self._named(),
                              experts_PxNxK=self._named(None, None, None) if cfg.is_moe else None)
    # Each engine jits its own function objects: jit keeps one cache per function, so compile_count() counts this
    # engine's programs only (not those of other engines over the same module-level function).
    # Under the mesh: a MoE model's experts run in shard_map over its expert axis (jaxrl/models/moe.py)
    self._prefill = jax.jit(under_mesh(functools.partial(decode.prefill, self.graphdef, cfg), mesh),
                            out_shardings=prefix_shardings)
    self._release = jax.jit(functools.partial(decode.release), donate_argnums=0, out_shardings=self._state_shardings)
    self._zeros = None
    self._write_observation = None

  def _named(self, *axes, rows=None) -> NamedSharding:
    """Sharding of an array whose dimensions carry these logical axes (sizes are only checked for divisibility)."""
    sizes = {"batch": rows or self.max_slots, "kv_heads": self.cfg.num_kv_heads, "head_dim": self.cfg.head_dim,
             "layers": self.cfg.num_layers}
    dims = [sizes.get(a, 1) for a in axes]
    return NamedSharding(self.mesh, logical_to_spec(axes, dims, self.mesh, self.rules))

  def kv_shardings(self, batch_axis="batch") -> KVCache:
    """Of a dense [N, S, T, K, D] cache (a prefix's, batch_axis None): slots over "data", kv heads over "tensor"."""
    sh = self._named("layers", batch_axis, None, "kv_heads", "head_dim")
    return KVCache(sh, sh)

  def decode_state_shardings(self, rows=None) -> DecodeState:
    """Shardings of the decode state; rows: of a compacted batch of that many rows (default max_slots)."""
    vec = self._named("batch", rows=rows)
    mat = self._named("batch", None, rows=rows)
    return DecodeState(self.cache_shardings(rows), mat, vec, vec, vec, SlotSettings(mat, vec, vec, vec, vec, vec, mat))

  def bucket(self, length: int) -> int:
    """The smallest prompt-length bucket that holds `length` tokens."""
    for b in self.buckets:
      if b >= length:
        return b
    raise ValueError(f"a prompt of {length} tokens does not fit the cache (max_len={self.max_len})")

  def place(self, params, version: int) -> Versioned:
    """Puts params onto the sampler shardings in the engine's dtype, quantized for weight_dtype "int8" (a no-op for
    arrays already there). Holding a LoRA base (hold_base), params are the adapters alone: only they move, and the
    result runs them on the base."""
    moved = transfer(params, version, self.publish_shardings, self.dtype, self.weight_dtype)
    return moved if self.base is None else Versioned(lora.merge(self.base, moved.params), moved.version)

  def hold_base(self, base) -> None:
    """Keeps a LoRA model's frozen base params on the sampler (placed and cast once), so that an update moves only
    the adapters (`publish_shardings`, what a publisher sends to)."""
    adapters, frozen = lora.split(abstract_params(self.cfg)[1])
    self.base = transfer(base, 0, param_shardings(frozen, self.mesh, self.rules), self.dtype).params
    self.publish_shardings = param_shardings(adapters, self.mesh, self.rules)

  def init_decode_state(self) -> DecodeState:
    s, t = self.max_slots, self.max_len
    key_shape = jax.random.key_data(jax.random.key(0)).shape

    def zeros():
      settings = SlotSettings(jnp.zeros((s, *key_shape), jnp.uint32), jnp.ones((s,), jnp.float32),
                              jnp.zeros((s,), jnp.int32), jnp.ones((s,), jnp.float32), jnp.zeros((s,), bool),
                              jnp.zeros((s,), jnp.int32), jnp.full((s, self.max_stop_ids), -1, jnp.int32))
      return DecodeState(self.empty_cache(), jnp.zeros((s, t), jnp.int32), jnp.zeros((s,), jnp.int32),
                         jnp.zeros((s,), bool), jnp.zeros((s,), jnp.int32), settings)

    if self._zeros is None:  # one compile per engine, however many Samplers it serves
      self._zeros = jax.jit(zeros, out_shardings=self._state_shardings)
    return self._zeros()

  def prefill(self, params: Versioned, tokens, true_length: int | None = None) -> Prefix:
    """Keys/values of the prompt tokens[:true_length], padded to its length bucket."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    true_length = len(tokens) if true_length is None else int(true_length)
    if not 0 < true_length <= len(tokens):
      raise ValueError(f"true_length must be in [1, {len(tokens)}] (got {true_length}); prompts cannot be empty")
    if true_length > self.max_len - 1:
      raise ValueError(f"a prompt of {true_length} tokens does not fit the cache: max_len={self.max_len} leaves "
                       f"room for prompts of at most {self.max_len - 1} tokens")
    padded = np.zeros(self.bucket(true_length), np.int32)
    padded[:true_length] = tokens[:true_length]
    prefix = self._prefill(params.params, padded, np.int32(true_length))
    if prefix.experts_PxNxK is not None:  # read back when the sample ends: started now, off the decode's path
      prefix.experts_PxNxK.copy_to_host_async()
    return prefix.replace(version=params.version)

  def slot_settings(self, key, sampling, max_new: int, stop_ids=()) -> SlotSettings:
    """One request's settings as host scalars; stop_ids must already be checked against the vocabulary. key: a
    typed jax key or its raw uint32 data (jax.random.key_data; a host array costs no device round trip)."""
    if len(stop_ids) > self.max_stop_ids:
      raise ValueError(f"{len(stop_ids)} stop token ids given, the engine holds at most {self.max_stop_ids}")
    stops = np.full((self.max_stop_ids,), -1, np.int32)
    stops[: len(stop_ids)] = stop_ids
    temperature = 1.0 if sampling.greedy else sampling.temperature
    data = key if isinstance(key, np.ndarray) else jax.random.key_data(key)
    return SlotSettings(np.asarray(data, np.uint32), np.float32(temperature),
                        np.int32(sampling.top_k), np.float32(sampling.top_p), np.bool_(sampling.greedy),
                        np.int32(max_new), stops)

  def check_slot(self, slot: int) -> None:
    if not 0 <= slot < self.max_slots:
      raise ValueError(f"slot {slot} is outside [0, {self.max_slots})")

  def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Stops a slot (the host ended its sample, e.g. on a stop string)."""
    return self._release(decode_state, np.int32(slot))

  def write_observation(self, decode_state: DecodeState, slot: int, tokens, start: int, max_new: int
                        ) -> tuple[DecodeState, int]:
    """The first half of `append` (both caches): the observation's tokens after position `start`, the slot
    active again with max_new; returns the state and the end of the observation's positions."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    self.check_slot(slot)
    if tokens.size == 0:
      raise ValueError("append: no observation tokens (a turn continues with at least one)")
    end = int(start) + len(tokens)
    if not 0 <= start or end > self.max_len - 2:
      raise ValueError(f"append: {len(tokens)} tokens after position {start} leave no room to generate in "
                       f"max_len={self.max_len}")
    if self._write_observation is None:  # compiled on first use: engines that never continue a slot skip it
      self._write_observation = jax.jit(continuation.write_observation, donate_argnums=0,
                                        out_shardings=self._state_shardings)
    padded = np.zeros(self.bucket(len(tokens)), np.int32)
    padded[: len(tokens)] = tokens
    decode_state = self._write_observation(decode_state, np.int32(slot), np.int32(start), padded,
                                           np.int32(len(tokens)), np.int32(max_new))
    return decode_state, end

  def own_programs(self) -> tuple:
    """The jitted functions whose compilations compile_count() counts (each engine adds its own)."""
    return self._prefill, self._release
