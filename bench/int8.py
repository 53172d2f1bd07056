r"""Int8 weight-only sampler against float32 on SmolLM2-135M-Instruct, side by side in one process (bench/decode.py's
helpers, hence flags of other names than its own).

  taskset -c 1 python -m bench.int8            # from the repo root; writes bench/results/int8.json
  taskset -c 1 python -m bench.int8 --batch_sizes=1 --tokens=32

Per batch (`batch` chat prompts "What is a+b?", one sample each, temperature 1.0, EOS ignored), for
sampler.weight_dtype "float" (float32 weights) then "int8" (jaxrl/models/quant.py), the same engine otherwise:
  decode      tokens/s of the fastest generate call (every slot active), the two engines' calls alternating;
  step bytes  "bytes accessed" of one compiled decode step (cost_analysis) and the placed weights' bytes;
  roofline    batch / max(FLOPs / matmul peak, (weights + live KV bytes) / read bandwidth), limits measured in this
              run (bench/decode.py's machine_limits), with each variant's own weight bytes;
  gap         mean and max |behaviour - float32 learner logprob| of the int8 sampler's tokens (a KL estimate of
              sampler || learner: what the learner's importance weights correct), from a short Sampler.run.
Ratios int8 / float are printed per batch; absolute tokens/s are context only (the box is shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from absl import app, flags

from bench.decode import _kl, _merge_best, _prompts, _requests, _step_cost, machine_limits
from jaxrl import assets
from jaxrl.models import forward_cached, hf, init_cache
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "32"], "Decode slots (= samples).")
_NEW = flags.DEFINE_integer("tokens", 64, "New tokens per sample.")
_STEPS = flags.DEFINE_integer("steps", 16, "Decode steps per generate call.")
_GAP_SAMPLES = flags.DEFINE_integer("gap_samples", 8, "Samples of the int8 sampler scored by the float learner.")
_OUT = flags.DEFINE_string("json_out", str(Path(__file__).parent / "results" / "int8.json"), "JSON results path.")
WEIGHT_DTYPES = ("float", "int8")


def step_bytes_accessed(engine, placed, batch: int, max_len: int) -> float:
  """XLA's "bytes accessed" of one compiled decode step (one token per slot) on these params."""
  cache = init_cache(engine.cfg, batch, max_len, engine.dtype)
  tokens, positions = jnp.zeros((batch, 1), jnp.int32), jnp.full((batch, 1), max_len // 2, jnp.int32)
  step = jax.jit(forward_cached, static_argnums=0).lower(engine.graphdef, placed.params, tokens, positions, cache)
  cost = step.compile().cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


def _filled(engine, placed, prompts, new):
  """A decode state with every slot holding one of the prompts, generating up to `new` tokens."""
  state = engine.init_decode_state()
  for slot, p in enumerate(prompts):
    settings = engine.slot_settings(jax.random.key(slot), SamplingParams(temperature=1.0), new + 1)
    state = engine.insert(engine.prefill(placed, p), state, slot, settings)
  return state


def decode_side_by_side(engines, params, prompts, new) -> dict[str, float]:
  """tokens/s of each engine's fastest generate call (every slot active), the engines' calls alternating so that
  both see the same load: on a shared machine the least disturbed call is the one to compare."""
  placed = {k: e.place(params, 0) for k, e in engines.items()}
  states = {k: _filled(e, placed[k], prompts, new) for k, e in engines.items()}
  best = dict.fromkeys(engines, float("inf"))
  for i in range(max(2, new // _STEPS.value) + 1):  # the first call compiles
    for k, e in engines.items():
      start = time.perf_counter()
      states[k], result = e.generate(placed[k], states[k])
      jax.block_until_ready((states[k], result))
      if i:
        best[k] = min(best[k], time.perf_counter() - start)
  return {k: len(prompts) * _STEPS.value / t for k, t in best.items()}


def main(argv):
  del argv
  path = assets.smollm2_path()
  cfg, graphdef, params = hf.load_params(path)
  tok = transformers.AutoTokenizer.from_pretrained(str(path))
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  load = os.getloadavg()
  limits = machine_limits()
  print(f"load {load[0]:.1f}; matmul peak f32 {limits[0]['float32'] / 1e9:.0f} GFLOP/s; read bandwidth "
        f"{limits[1] / 1e9:.1f} GB/s; cpus {len(os.sched_getaffinity(0))}", flush=True)
  new, rows = _NEW.value, []
  for batch in map(int, _BATCHES.value):
    prompts = _prompts(tok, batch)
    live = int(np.mean([len(p) for p in prompts])) + new // 2
    max_len = 64 * -(-(max(len(p) for p in prompts) + new + 1) // 64)
    engines = {w: make_engine(cfg, mesh, dtype="float32", weight_dtype=w, max_slots=batch, max_len=max_len,
                              steps_per_call=_STEPS.value) for w in WEIGHT_DTYPES}
    decode = decode_side_by_side(engines, params, prompts, new)
    limits = _merge_best(limits, machine_limits())  # right after the engines ran
    flops, float_bytes = _step_cost(cfg, params, batch, live, 4)
    for weight_dtype, engine in engines.items():
      placed = engine.place(params, 0)
      weight_bytes = float(sum(x.nbytes for x in jax.tree.leaves(placed.params)))
      nbytes = float_bytes - float(sum(x.nbytes for x in jax.tree.leaves(params))) + weight_bytes
      roof = batch / max(flops / limits[0]["float32"], nbytes / limits[1])
      row = dict(batch=batch, new_tokens=new, weight_dtype=weight_dtype,
                 decode_tokens_per_s=round(decode[weight_dtype], 2), roofline_tokens_per_s=round(roof, 1),
                 decode_of_roofline=round(decode[weight_dtype] / roof, 3), weight_bytes=weight_bytes,
                 step_bytes_model=nbytes, step_bytes_accessed=step_bytes_accessed(engine, placed, batch, max_len),
                 step_flops=flops, load=round(os.getloadavg()[0], 1))
      if weight_dtype == "int8":
        n = min(batch, _GAP_SAMPLES.value)
        rollouts = list(Sampler(engine, params, seed=0).run(_requests(prompts[:n], 32)))
        row["mean_delta_logprob"], row["max_abs_delta_logprob"] = _kl(graphdef, params, rollouts)
      rows.append(row)
      print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    f, q = rows[-2], rows[-1]
    q["decode_vs_float"] = round(q["decode_tokens_per_s"] / f["decode_tokens_per_s"], 2)
    q["bytes_accessed_vs_float"] = round(q["step_bytes_accessed"] / f["step_bytes_accessed"], 3)
    print(f"  batch {batch}: int8 decode x{q['decode_vs_float']} of float32, step bytes accessed "
          f"x{q['bytes_accessed_vs_float']}, weights {q['weight_bytes'] / 1e6:.0f} MB vs "
          f"{f['weight_bytes'] / 1e6:.0f} MB", flush=True)
  report = dict(rows=rows, matmul_peak_flops=limits[0], read_bandwidth_bytes_per_s=limits[1], load_at_start=load,
                cpus=len(os.sched_getaffinity(0)), uptime=subprocess.run(["uptime"], capture_output=True,
                                                                         text=True).stdout.strip(),
                device=f"{jax.devices()[0].platform} x{len(jax.devices())}", steps_per_call=_STEPS.value)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
