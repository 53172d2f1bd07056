"""Learner on RL's long-tailed lengths: packed vs padded throughput, and the longest row a memory budget trains.

    .venv/bin/python bench/learner.py --workload=longtail    # ~3-5 min on a 2-core CPU; writes
                                                             # bench/results/learner_longtail.json

Throughput: one batch of samples with lognormal lengths (p99 / median = 10, the longest set to --longest tokens),
trained (a) padded, one sample per row of --longest tokens, with the learner's previous kernels ([L, L] attention
scores, float32 [B, L, V] logits), (b) padded with the memory-efficient kernels, (c) packed (first-fit
decreasing into rows of --longest tokens, a row-count bucket) with the same kernels. The three run interleaved in
one process, float32, several steps each; the figure is the ratio of median real (non-padding) tokens per second.

Memory: the compiled train step's temporaries (`memory_analysis()`, XLA's buffer assignment for this backend)
for one row of L tokens of the SmolLM2-135M shape (abstract parameters: nothing is allocated), before (reference
attention, unchunked logits, no remat) and after (chunked attention and log-probs, remat), L doubling until the
budget is exceeded.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import numpy as np
from flax import nnx

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, make_optimizer
from jaxrl.learner.packing import pack_batch, row_buckets
from jaxrl.models import Decoder, ModelConfig
from jaxrl.rollout import Rollout, make_batch

_Z99 = 2.3263  # the standard normal's 99th percentile: p99 / median of a lognormal is exp(sigma * z99)


def longtail_lengths(n: int, longest: int, tail: float, seed: int) -> np.ndarray:
  """n lognormal lengths with p99 / median = tail, p99 at `longest`, clipped to [16, longest]; max = longest."""
  sigma = np.log(tail) / _Z99
  rng = np.random.default_rng(seed)
  lengths = np.exp(np.log(longest / tail) + sigma * rng.standard_normal(n))
  lengths = np.clip(np.round(lengths), 16, longest).astype(int)
  lengths[np.argmax(lengths)] = longest
  return lengths


def rollouts(lengths: np.ndarray, vocab: int, seed: int) -> list[Rollout]:
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):
    p = min(64, int(n) // 2)
    c = int(n) - p
    out.append(Rollout(rng.integers(0, vocab, p).astype(np.int32), rng.integers(0, vocab, c).astype(np.int32),
                       rng.normal(-np.log(vocab), 0.1, c).astype(np.float32), np.zeros(c, np.int32), "length",
                       group_id=i // 4, reward=float(rng.uniform())))
  return out


def throughput(cfg: ModelConfig, rs: list[Rollout], longest: int, steps: int, logprob_chunk: int,
               padded_micro: int) -> dict:
  """Median step time and real tokens/s of the three variants, run interleaved. The padded batches run as
  padded_micro accumulated micro-batches (the same update) so that the [L, L] scores fit in memory."""
  n = len(rs)
  opt = make_optimizer(1e-5, warmup_steps=1, decay_steps=1000)
  loss_cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0)
  buckets = row_buckets(n)
  packed = pack_batch(rs, longest, buckets, max_segments=64)
  variants = {
      "padded_before": (cfg.replace(train_attention="reference"), make_batch(rs, n, longest), (), 0, padded_micro),
      "padded_after": (cfg, make_batch(rs, n, longest), (), logprob_chunk, padded_micro),
      "packed": (cfg, packed, buckets, logprob_chunk, 1),
  }
  real = int(sum(r.num_tokens for r in rs))
  runs, times = {}, {name: [] for name in variants}
  for name, (c, batch, rows, chunk, micro) in variants.items():
    graphdef, params = nnx.split(Decoder(c, nnx.Rngs(0)))
    step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=loss_cfg, batch_size=n, seq_len=longest,
                                     row_buckets=rows, logprob_chunk=chunk, num_microbatches=micro))
    state = init_train_state(params, opt)
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch, key)  # warm-up
    jax.block_until_ready(metrics)
    runs[name] = {"compiled": compiled, "state": state, "batch": batch, "compile_s": compile_s,
                  "rows": int(batch.tokens_BxL.shape[0]), "real_tokens": int(metrics["num_input_tokens"])}
  for _ in range(steps):  # interleaved: a drift in the machine's load hits every variant alike
    for name, run in runs.items():
      t0 = time.perf_counter()
      run["state"], metrics = run["compiled"](run["state"], run["batch"], jax.random.key(1))
      jax.block_until_ready((run["state"], metrics))
      times[name].append(time.perf_counter() - t0)
  out = {}
  for name, run in runs.items():
    if run["real_tokens"] != real:
      raise RuntimeError(f"{name} trained {run['real_tokens']} real tokens, not {real}")
    step_s = float(np.median(times[name]))
    out[name] = {"rows": run["rows"], "microbatches": variants[name][4], "row_tokens": run["rows"] * longest,
                 "real_tokens": real,
                 "padding_frac": 1 - real / (run["rows"] * longest), "compile_s": run["compile_s"],
                 "step_s_median": step_s, "step_s_all": times[name], "real_tokens_per_s": real / step_s}
  return out


def temp_bytes(cfg: ModelConfig, seq_len: int, logprob_chunk: int) -> int:
  """Compiled temporaries of one train step on one row of seq_len tokens (abstract params: compile only)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))
  opt = make_optimizer(1e-5, warmup_steps=1, decay_steps=1000)
  state = jax.eval_shape(lambda p: init_train_state(p, opt), params)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=LossConfig(), batch_size=1, seq_len=seq_len,
                                   logprob_chunk=logprob_chunk))
  batch = jax.eval_shape(lambda: make_batch([], 1, seq_len))
  compiled = step.lower(state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def longest_within(cfg: ModelConfig, budget: int, start: int, limit: int, logprob_chunk: int) -> dict:
  """Temporaries at L = start, 2 start, ... until over budget (or limit); the longest L that fits."""
  sizes, fits, seq = {}, 0, start
  while seq <= limit:
    sizes[seq] = temp_bytes(cfg, seq, logprob_chunk)
    print(f"  L={seq}: {sizes[seq] / 2**30:.2f} GiB temporaries", flush=True)
    if sizes[seq] > budget:
      break
    fits, seq = seq, seq * 2
  return {"longest_fitting": fits, "temp_bytes": sizes}


def main(layers, hidden, heads, kv_heads, mlp, vocab, samples, longest, tail, steps, logprob_chunk, budget_gib,
         mem_limit, padded_micro, out_path):
  load = os.getloadavg()
  cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_layers=layers,
                    num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                    max_position_embeddings=longest)
  lengths = longtail_lengths(samples, longest, tail, seed=0)
  print(f"{samples} samples: median {np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, "
        f"max {lengths.max()} tokens (sum {lengths.sum()}); load average {load[0]:.1f}", flush=True)
  tp = throughput(cfg, rollouts(lengths, vocab, seed=1), longest, steps, logprob_chunk, padded_micro)
  for name, r in tp.items():
    print(f"{name:>14}: {r['rows']:>3} rows, {100 * r['padding_frac']:4.1f}% padding, step "
          f"{r['step_s_median']:.2f}s, {r['real_tokens_per_s']:,.0f} real tokens/s", flush=True)
  ratio = tp["packed"]["real_tokens_per_s"] / tp["padded_before"]["real_tokens_per_s"]
  ratio_kernels = tp["packed"]["real_tokens_per_s"] / tp["padded_after"]["real_tokens_per_s"]
  print(f"packed / padded (previous kernels): {ratio:.2f}x; packed / padded (same kernels): {ratio_kernels:.2f}x")

  result = {
      "machine": f"{jax.devices()[0].device_kind}, {os.cpu_count()} cpus, shared with other jobs",
      "load_average_1_5_15": list(load), "load_average_end": list(os.getloadavg()),
      "model": {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "mlp": mlp,
                "vocab": vocab},
      "lengths": {"samples": samples, "median": float(np.median(lengths)),
                  "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()), "sum": int(lengths.sum()),
                  "tail_p99_over_median": tail},
      "logprob_chunk": logprob_chunk, "throughput": tp,
      "packed_over_padded_before": ratio, "packed_over_padded_same_kernels": ratio_kernels,
  }
  out = pathlib.Path(out_path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")  # the throughput part, should the memory part not finish

  from jaxrl import assets
  from jaxrl.models.hf import load_config
  smol = load_config(assets.smollm2_path())
  budget = int(budget_gib * 2**30)
  print(f"SmolLM2-135M shape, one row, budget {budget_gib} GiB of compiled temporaries:")
  print(" before (reference attention, unchunked logits, no remat)")
  before = longest_within(smol.replace(train_attention="reference"), budget, 1024, mem_limit, 0)
  print(" after (chunked attention and log-probs, remat)")
  after = longest_within(smol.replace(train_attention="chunked", remat=True), budget, 1024, mem_limit,
                         logprob_chunk)
  print(f"longest row within {budget_gib} GiB: before {before['longest_fitting']}, after {after['longest_fitting']}"
        f"{' (the limit tried)' if after['longest_fitting'] >= mem_limit else ''}")
  result["memory"] = {"model": "SmolLM2-135M", "budget_gib": budget_gib, "before": before, "after": after}
  result["load_average_end"] = list(os.getloadavg())
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {out}")
