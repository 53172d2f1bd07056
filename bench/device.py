r"""Engine decode tokens/s, dense vs paged KV cache at one KV memory budget, against the HBM roofline.

  bash bench/device.sh                      # on a machine with one GPU (installs the project, then runs this)
  python -m bench.device --dry_run          # tiny shapes on any backend (what the test runs on CPU)

Qwen2.5-1.5B shapes with random bfloat16 weights (no download). The decode state is built directly: every slot
live, at a lognormal live length (mean --mean_live, capped at max_len), so a generate call's cost is that of a
steady pipeline sampler; the dense engine has --dense_slots slots of --max_len positions, the paged one a pool of
the same bytes and as many slots as the pool holds at the workload's live lengths (capped at --paged_slots).
Reported per engine: live sequences, tokens/s (median of --calls generate calls of --steps_per_call steps) and
the roofline: live sequences / ((weight bytes + KV bytes the step must read) / measured HBM bandwidth), where
the KV bytes are the live tokens (what a ragged kernel reads). The paged engine runs twice: with its default
attention (on a GPU the Pallas paged-attention kernel, reading the pool in place) and with the XLA path. The HBM
bandwidth is measured in the same run (a large on-device copy). JSON to --out.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxrl.models import ModelConfig, init_params
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Engine, make_engine
from jaxrl.sampler.page_allocator import PageAllocator, pages_for
from jaxrl.sharding import make_mesh

_DRY = flags.DEFINE_bool("dry_run", False, "Tiny model and sizes (any backend, seconds): checks the script.")
_DENSE_SLOTS = flags.DEFINE_integer("dense_slots", 64, "Dense slots; the KV budget is dense_slots x max_len.")
_PAGED_SLOTS = flags.DEFINE_integer("paged_slots", 512, "Most paged slots.")
_MAX_LEN = flags.DEFINE_integer("max_len", 8192, "Positions per slot (dense) and per sample (both).")
_MEAN_LIVE = flags.DEFINE_integer("mean_live", 2048, "Mean live length of a sequence (lognormal, sigma 1).")
_PAGE = flags.DEFINE_integer("page_size", 64, "Positions per page.")
_STEPS = flags.DEFINE_integer("steps_per_call", 16, "Decode steps per generate call.")
_CALLS = flags.DEFINE_integer("calls", 5, "Timed generate calls per engine (after one warm-up call).")
_OUT = flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "device.json"), "JSON results path.")

QWEN2_5_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                    num_kv_heads=2, head_dim=128, tie_embeddings=True, attention_bias=True, rope_theta=1e6)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, tie_embeddings=True, attention_bias=True)


def _sizes():
  if _DRY.value:
    return dict(dense_slots=4, paged_slots=16, max_len=256, mean_live=24, page_size=16, steps=4, calls=2)
  return dict(dense_slots=_DENSE_SLOTS.value, paged_slots=_PAGED_SLOTS.value, max_len=_MAX_LEN.value,
              mean_live=_MEAN_LIVE.value, page_size=_PAGE.value, steps=_STEPS.value, calls=_CALLS.value)


def hbm_bandwidth(nbytes: int = 2**30) -> float:
  """Bytes/s of an on-device copy (read + write) of an nbytes array, best of 5."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a * 1.0000001)
  jax.block_until_ready(copy(x))
  best = np.inf
  for _ in range(5):
    t = time.perf_counter()
    jax.block_until_ready(copy(x))
    best = min(best, time.perf_counter() - t)
  return 2 * x.nbytes / best


def live_lengths(n: int, mean: int, max_len: int, seed: int) -> np.ndarray:
  """Lognormal live lengths (sigma 1: p99/median ~ 10) with the given mean, in [2, max_len - steps]."""
  rng = np.random.default_rng(seed)
  median = mean / np.exp(0.5)
  return np.clip(np.round(median * np.exp(rng.standard_normal(n))), 2, max_len).astype(np.int64)


def _state(engine: Engine, lengths: np.ndarray, steps: int):
  """A decode state with every slot live at the given lengths (random tokens; keys/values as initialised)."""
  s = engine.max_slots
  state = engine.init_decode_state()
  settings = engine.slot_settings(jax.random.key(0), SamplingParams(temperature=1.0), engine.max_len, ())
  stack = lambda x: np.broadcast_to(np.asarray(x), (s, *np.shape(x))).copy()
  keys = np.stack([np.asarray(jax.random.key_data(jax.random.key(i))) for i in range(s)])
  settings = jax.tree.map(stack, settings).replace(key=keys.astype(np.uint32))
  tokens = np.random.default_rng(1).integers(0, engine.cfg.vocab_size, (s, engine.max_len)).astype(np.int32)
  fields = dict(tokens_SxT=tokens, pos_S=(lengths - 1).astype(np.int32), active_S=np.ones(s, bool),
                num_generated_S=np.zeros(s, np.int32), settings=settings)
  if engine.kv == "paged":
    alloc = PageAllocator(engine.num_pages, engine.page_size, s, engine.pages_per_slot)
    for slot, n in enumerate(lengths):
      alloc.attach(slot, None, min(int(n) + steps, engine.max_len))
    fields["cache"] = state.cache.replace(table_SxM=alloc.table_SxM())
  shardings = engine._state_shardings
  return jax.device_put(state.replace(**fields), shardings)


def _measure(engine: Engine, params, lengths, steps: int, calls: int) -> dict:
  state = _state(engine, lengths, steps)
  state, _ = engine.generate(params, state)  # compile + warm-up
  jax.block_until_ready(state)
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    state, result = engine.generate(params, state)
    jax.block_until_ready(result)
    times.append(time.perf_counter() - t)
  seconds = float(np.median(times))
  live = len(lengths)
  return dict(slots=engine.max_slots, live=live, mean_live_tokens=float(lengths.mean() + steps / 2),
              seconds_per_call=round(seconds, 5), tokens_per_s=round(live * steps / seconds, 1))


def main(argv):
  del argv
  z = _sizes()
  if not _DRY.value and jax.default_backend() != "gpu":
    raise app.UsageError(f"bench.device needs a GPU (jax backend is {jax.default_backend()!r}); --dry_run runs tiny "
                         "shapes anywhere")
  dims = TINY if _DRY.value else QWEN2_5_1_5B
  cfg = ModelConfig.tiny(**dims, max_position_embeddings=z["max_len"], dtype="bfloat16", param_dtype="bfloat16")
  _, params = init_params(cfg)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  steps, max_len = z["steps"], z["max_len"]
  budget = z["dense_slots"] * max_len
  # Paged slots: as many sequences as the pool holds at these live lengths (pages reserved for a call's steps).
  pool = budget // z["page_size"]
  lengths = live_lengths(z["paged_slots"], z["mean_live"], max_len - steps, seed=0)
  used = np.cumsum([pages_for(min(int(n) + steps, max_len), z["page_size"]) for n in lengths])
  paged_slots = int(np.searchsorted(used, pool, side="right"))
  paged_slots -= paged_slots % 8 if paged_slots > 8 else 0  # whole groups of rows for the ragged XLA attention
  common = dict(max_len=max_len, steps_per_call=steps, dtype="bfloat16")
  engines = {"dense": make_engine(cfg, mesh, max_slots=z["dense_slots"], **common),
             # Every slot is live in these calls: one program of paged_slots rows (no smaller row buckets to compile).
             # The paged engine's attention: "auto" is the Pallas paged-attention kernel on a GPU, "xla" the ragged
             # XLA path (the CPU's) on the same pool.
             **{name: make_engine(cfg, mesh, max_slots=paged_slots, kv="paged", page_size=z["page_size"],
                                  num_pages=pool, row_buckets=(), attention=attention, **common)
                for name, attention in (("paged", "auto"), ("paged_xla", "xla"))}}
  bandwidth = hbm_bandwidth(2**24 if _DRY.value else 2**31)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
  report = dict(model="tiny" if _DRY.value else "Qwen2.5-1.5B shapes (random bf16)", sizes=z, paged_slots=paged_slots,
                weight_bytes=weight_bytes, kv_bytes_per_token=kv_per_token, kv_budget_bytes=budget * kv_per_token,
                hbm_bytes_per_s=round(bandwidth), device=str(jax.devices()[0].device_kind),
                backend=jax.default_backend(), host=platform.node(), load=os.getloadavg())
  for name, engine in engines.items():
    placed = engine.place(params, 0)
    n = engine.max_slots
    r = _measure(engine, placed, lengths[:n], steps, z["calls"])
    step_bytes = weight_bytes + kv_per_token * r["mean_live_tokens"] * r["live"]
    r["roofline_tokens_per_s"] = round(r["live"] * bandwidth / step_bytes, 1)
    r["of_roofline"] = round(r["tokens_per_s"] / r["roofline_tokens_per_s"], 3)
    r["attention"] = engine.attention
    report[name] = r
    print(f"{name:<9} slots {n:>4}  tokens/s {r['tokens_per_s']:>10,.0f}  roofline {r['roofline_tokens_per_s']:>10,.0f}"
          f"  ({r['of_roofline']:.0%})", flush=True)
    del placed
  report["paged_over_dense"] = round(report["paged"]["tokens_per_s"] / report["dense"]["tokens_per_s"], 2)
  report["kernel_over_xla"] = round(report["paged"]["tokens_per_s"] / report["paged_xla"]["tokens_per_s"], 2)
  print(f"HBM {bandwidth / 1e9:,.0f} GB/s measured; paged / dense tokens/s = {report['paged_over_dense']}x; paged "
        f"attention {report['paged']['attention']} / xla = {report['kernel_over_xla']}x")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
