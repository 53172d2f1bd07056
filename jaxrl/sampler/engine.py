"""The decode engine (JetStream Engine API shape): prefill, insert, generate over a fixed pool of decode slots.

The decode state holds the keys/values of `max_slots` sequences of up to `max_len` tokens, sharded on the sampler
mesh (slots over "data", kv heads over "tensor"). Each slot keeps its whole sequence in `tokens_SxT` and `pos_S`,
the position of its last token, whose logits the next step computes. `generate` runs `steps_per_call` decode
steps in one jitted loop; a slot that finishes goes inactive inside the loop and is refilled by `insert` between
calls. Shapes never depend on the requests, so each program compiles once (prefill, insert and recompute once
per prompt-length bucket).

Two implementations, chosen once by `make_engine(kv=...)`: `DenseEngine` (sampler/dense_engine.py; max_len
positions per slot) and `PagedEngine` (sampler/paged_engine.py; a pool of pages shared by the slots, a call runs
only its live slots). `Engine` is what the Sampler and the other callers rely on from either.
"""

from __future__ import annotations

from typing import Protocol

from jaxrl.models import ModelConfig
from jaxrl.sampler.decode_state import DecodeState, Prefix, ResultTokens, SlotSettings
from jaxrl.sampler.dense_engine import DenseEngine
from jaxrl.sampler.paged_engine import PagedEngine
from jaxrl.sharding import Versioned

KV_LAYOUTS = ("dense", "paged")  # the KV cache: max_len per slot, or a page pool shared by the slots

__all__ = ["DecodeState", "DenseEngine", "Engine", "PagedEngine", "Prefix", "ResultTokens", "SlotSettings",
           "make_engine"]


class Engine(Protocol):
  """Prefill / insert / generate over `max_slots` decode slots of `max_len` tokens on the sampler mesh."""

  kv: str  # "dense" | "paged"
  cfg: ModelConfig
  max_slots: int
  max_len: int
  steps_per_call: int
  max_stop_ids: int
  buckets: tuple[int, ...]  # prompt lengths prefill compiles for
  row_buckets: tuple[int, ...]  # rows a generate call may run at
  publish_shardings: object  # of what place() takes: every param, or a LoRA model's adapters (hold_base)

  def bucket(self, length: int) -> int: ...
  def place(self, params, version: int) -> Versioned: ...
  def hold_base(self, base) -> None: ...  # LoRA: the frozen base, held once; place() then takes the adapters
  def init_decode_state(self) -> DecodeState: ...
  def prefill(self, params: Versioned, tokens, true_length: int | None = None) -> Prefix: ...
  def slot_settings(self, key, sampling, max_new: int, stop_ids=()) -> SlotSettings: ...
  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, settings: SlotSettings, *,
             num_generated: int = 0, table_row=None, first_private: int = 0) -> DecodeState: ...
  def row_bucket(self, live: int | None) -> int: ...
  def generate(self, params: Versioned, decode_state: DecodeState, live: int | None = None
               ) -> tuple[DecodeState, ResultTokens]: ...
  def release(self, decode_state: DecodeState, slot: int) -> DecodeState: ...
  def append(self, params: Versioned, decode_state: DecodeState, slot: int, tokens, start: int,
             max_new: int) -> DecodeState: ...
  def compile_count(self) -> int: ...


def make_engine(cfg: ModelConfig, mesh, *, kv: str = "dense", page_size: int = 16, num_pages: int | None = None,
                rebuild_rows: int = 8, interpret: bool = False, **common) -> DenseEngine | PagedEngine:
  """The engine of a KV layout: "dense" (max_len positions per slot) or "paged" (a pool of num_pages pages of
  page_size positions; see PagedEngine for these and rebuild_rows, interpret, which a dense cache does not use).
  common: max_slots, max_len, steps_per_call, min_bucket, max_stop_ids, rebuild_chunk, row_buckets, attention,
  rules, and dtype, of the sampler's weights, activations and KV cache: "float32" | "bfloat16" | "auto" (bfloat16
  on TPU/GPU, float32 on CPU, where XLA's float32 matmuls are exact and bfloat16 ones are not faster everywhere);
  None: cfg.dtype."""
  if kv not in KV_LAYOUTS:
    raise ValueError(f"Engine: kv must be one of {KV_LAYOUTS} (got {kv!r})")
  if kv == "paged":
    return PagedEngine(cfg, mesh, page_size=page_size, num_pages=num_pages, rebuild_rows=rebuild_rows,
                       interpret=interpret, **common)
  return DenseEngine(cfg, mesh, **common)
