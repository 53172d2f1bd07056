r"""SmolLM2-135M-Instruct decode speed against the machine's roofline and the pre-issue-14 engine, in one run.

  python -m bench.decode                       # from the repo root; writes bench/results/decode.json
  python -m bench.decode --batches=32 --new_tokens=64 --dtypes=float32

Per (batch, new tokens): `batch` chat prompts "What is a+b?" (~35 tokens), one sample each, temperature 1.0, EOS
ignored. For each engine (the frozen baseline of bench/decode_baseline.py, then today's engine in each dtype):
  decode  tokens/s of the generate calls alone (all slots active, dispatched back to back, read at the end);
  e2e     tokens/s of Sampler.run over the requests (prefill, insert, host loop included), after a warm-up run.
The roofline comes from this run's own measurements: matmul peak (2048^3, per dtype) and read bandwidth (a 512 MB
sum). A decode step needs max(FLOPs / peak, bytes / bandwidth), with FLOPs = 2 x rows x (block + head params) +
attention, and bytes = the weights once + the live KV cache. `mm ceiling` times the step's own matmuls alone (same
shapes, real weights, same run): what XLA:CPU's matmuls allow at that batch. KL: bfloat16 samples scored by the
float32 learner (mean of behaviour - learner logprob, an estimate of KL(sampler || learner)) and max |delta|.
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

from bench.decode_baseline import baseline_engine
from jaxrl import assets, telemetry
from jaxrl.models import forward, hf
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Request, Sampler, make_engine, sampling_logprobs
from jaxrl.sharding import make_mesh

_BATCHES = flags.DEFINE_list("batches", ["1", "8", "32", "64"], "Decode slots (= samples).")
_NEW = flags.DEFINE_list("new_tokens", ["64", "512"], "New tokens per sample.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Dtypes of today's engine.")
_BASELINE_MAX_NEW = flags.DEFINE_integer("baseline_max_new", 64, "Run the baseline only up to this many tokens.")
_STEPS = flags.DEFINE_integer("steps_per_call", 16, "Decode steps per generate call.")
_OUT = flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "decode.json"), "JSON results path.")


def _best(f, reps=3):
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f())
    times.append(time.perf_counter() - t)
  return min(times)


def machine_limits():
  """Matmul peak per dtype (FLOP/s) and read bandwidth (bytes/s), measured now."""
  peak = {name: telemetry.matmul_flops(name, 2048, 5) for name in ("float32", "bfloat16")}
  x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  return peak, x.nbytes / _best(lambda: total(x), 5)


def _merge_best(a, b):
  return {k: max(a[0][k], b[0][k]) for k in a[0]}, max(a[1], b[1])


def _prompts(tok, n):
  return [tok.apply_chat_template([{"role": "user", "content": f"What is {3 + i}+{7 + 2 * i}?"}],
                                  add_generation_prompt=True, return_dict=False) for i in range(n)]


def _step_cost(cfg, params, rows, live, kv_bytes):
  """(FLOPs, bytes) of one decode step of `rows` slots whose caches hold `live` positions."""
  sizes = {k: int(np.prod(v.shape)) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
           for k in [jax.tree_util.keystr(k)]}
  weight_params = sum(sizes.values())  # the tied embedding is read once, as the output head
  matmul_params = weight_params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)
  attn = 4 * rows * live * cfg.num_heads * cfg.head_dim * cfg.num_layers
  kv = 2 * cfg.num_layers * rows * live * cfg.num_kv_heads * cfg.head_dim * kv_bytes
  return 2 * rows * matmul_params + attn, weight_params * kv_bytes + kv


def matmul_ceiling(cfg, params, rows, dtype):
  """Seconds of one decode step's matmuls alone: every projection of every layer and the output head."""
  p = jax.tree.map(lambda x: x.astype(dtype), params)
  blocks = p["blocks"]
  e = cfg.hidden_size
  ws = [blocks["attn"][n][...].reshape(cfg.num_layers, e, -1) for n in ("q_proj", "k_proj", "v_proj")]
  ws += [blocks["attn"]["o_proj"][...].reshape(cfg.num_layers, -1, e)]
  ws += [blocks["mlp"][n][...] for n in ("gate_proj", "up_proj", "down_proj")]
  head = p["embed"][...]

  @jax.jit
  def mm(x, ws, head):
    def layer(x, w):
      q, k, v, o, g, u, d = w
      kv = (x @ k).sum(-1, keepdims=True) + (x @ v).sum(-1, keepdims=True)  # consumed, so not removed
      x = x + (x @ q) @ o + kv
      return x + (jax.nn.silu(x @ g) * (x @ u)) @ d, None
    x, _ = jax.lax.scan(layer, x, ws)
    return x @ head.T

  x = jnp.ones((rows, e), dtype)
  mm(x, ws, head).block_until_ready()
  return _best(lambda: mm(x, ws, head), 5)


def _requests(prompts, new):
  return [Request(p, group_id=i, sampling=SamplingParams(temperature=1.0), max_tokens=new, ignore_eos=True)
          for i, p in enumerate(prompts)]


def _e2e(engine, params, prompts, new, overlap):
  list(Sampler(engine, params, seed=1).run(_requests(prompts, engine.steps_per_call)))  # every shape compiles
  sampler = Sampler(engine, params, seed=0, overlap=overlap)
  start = time.perf_counter()
  rollouts = list(sampler.run(_requests(prompts, new)))
  return sum(len(r.completion_tokens) for r in rollouts) / (time.perf_counter() - start), rollouts


def _decode(engine, params, prompts, new):
  """tokens/s of the fastest of the generate calls (every slot active): on a shared machine the least disturbed
  call is the one to compare with the limits, themselves the best of several measurements."""
  placed = engine.place(params, 0)
  state = engine.init_decode_state()
  for slot, p in enumerate(prompts):
    settings = engine.slot_settings(jax.random.key(slot), SamplingParams(temperature=1.0), new + 1)
    state = engine.insert(engine.prefill(placed, p), state, slot, settings)
  best = float("inf")
  for _ in range(max(2, new // engine.steps_per_call)):  # the first call compiles
    start = time.perf_counter()
    state, result = engine.generate(placed, state)
    jax.block_until_ready((state, result))
    best = min(best, time.perf_counter() - start)
  return len(prompts) * engine.steps_per_call / best


def _kl(graphdef, params, rollouts):
  """(mean behaviour - learner logprob, max |delta|) with the learner's float32 forward."""
  deltas = []
  for r in rollouts:
    seq = np.concatenate([r.prompt_tokens, r.completion_tokens])[None]
    logits = forward(graphdef, params, seq, np.arange(seq.shape[1])[None], np.ones_like(seq))
    p = len(r.prompt_tokens)
    lp = sampling_logprobs(logits[:, p - 1 : -1], seq[:, p:], r.sampling)[0]
    deltas.append(r.logprobs - np.asarray(lp))
  d = np.concatenate(deltas)
  return float(d.mean()), float(np.abs(d).max())


def main(argv):
  del argv
  path = assets.smollm2_path()
  cfg, graphdef, params = hf.load_params(path)
  tok = transformers.AutoTokenizer.from_pretrained(str(path))
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  load = os.getloadavg()
  peak, bandwidth = machine_limits()
  print(f"load {load[0]:.1f}; matmul peak f32 {peak['float32'] / 1e9:.0f} GFLOP/s, bf16 "
        f"{peak['bfloat16'] / 1e9:.0f} GFLOP/s; read bandwidth {bandwidth / 1e9:.1f} GB/s")
  rows = []
  for new in map(int, _NEW.value):
    for batch in map(int, _BATCHES.value):
      prompts = _prompts(tok, batch)
      live = int(np.mean([len(p) for p in prompts])) + new // 2
      max_len = 64 * -(-(max(len(p) for p in prompts) + new + 1) // 64)
      kw = dict(max_slots=batch, max_len=max_len, steps_per_call=_STEPS.value)
      variants = [("baseline", "float32")] if new <= _BASELINE_MAX_NEW.value else []
      variants += [("engine", d) for d in _DTYPES.value]
      for name, dtype in variants:
        engine = baseline_engine(cfg, mesh, **kw) if name == "baseline" else make_engine(cfg, mesh, dtype=dtype, **kw)
        kv_bytes = jnp.dtype(dtype).itemsize
        flops, nbytes = _step_cost(cfg, params, batch, live, kv_bytes)
        decode = _decode(engine, params, prompts, new)
        peak, bandwidth = _merge_best((peak, bandwidth), machine_limits())  # limits right after the engine ran
        roof = batch / max(flops / peak[dtype], nbytes / bandwidth)
        ceiling = batch / matmul_ceiling(cfg, params, batch, dtype)
        e2e, rollouts = _e2e(engine, params, prompts, new, overlap=name != "baseline")
        row = dict(batch=batch, new_tokens=new, engine=name, dtype=dtype, decode_tokens_per_s=round(decode, 1),
                   e2e_tokens_per_s=round(e2e, 1), roofline_tokens_per_s=round(roof, 1),
                   matmul_ceiling_tokens_per_s=round(ceiling, 1), decode_of_roofline=round(decode / roof, 3),
                   decode_of_matmul_ceiling=round(decode / ceiling, 3), load=round(os.getloadavg()[0], 1),
                   step_flops=flops, step_bytes=nbytes)
        if name == "engine" and batch <= 8 and new <= 64:
          row["kl_sampler_learner"], row["max_abs_delta_logprob"] = _kl(graphdef, params, rollouts)
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
      base = next((r for r in rows[-len(variants):] if r["engine"] == "baseline"), None)
      if base:
        for r in rows[-len(variants):]:
          r["decode_vs_baseline"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 2)
          r["e2e_vs_baseline"] = round(r["e2e_tokens_per_s"] / base["e2e_tokens_per_s"], 2)
          print(f"  {r['engine']} {r['dtype']}: decode x{r['decode_vs_baseline']}, e2e x{r['e2e_vs_baseline']} "
                f"vs baseline", flush=True)
  for r in rows:  # against the best limits of the whole run
    r["roofline_tokens_per_s"] = round(r["batch"] / max(r["step_flops"] / peak[r["dtype"]],
                                                        r["step_bytes"] / bandwidth), 1)
    r["decode_of_roofline"] = round(r["decode_tokens_per_s"] / r["roofline_tokens_per_s"], 3)
  report = dict(rows=rows, matmul_peak_flops=peak, read_bandwidth_bytes_per_s=bandwidth, load_at_start=load,
                uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                device=f"{jax.devices()[0].platform} x{len(jax.devices())}", steps_per_call=_STEPS.value)
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
