r"""Paged vs dense KV cache at the same KV memory budget, on a long-tailed GRPO workload, side by side in one run.

  .venv/bin/python -m bench.paged      # from the repo root; a small random model; writes bench/results/paged.json

Workload: groups of --group_size samples of one prompt (GRPO), completion lengths lognormal with p99 =
--p99_ratio x median, forced with per-group max_tokens and EOS off, max_len --max_len. The dense engine has
--dense_slots slots of max_len positions; the paged engine gets a pool of exactly as many positions
(dense_slots * max_len / page_size pages) and --paged_slots slots, so what limits its live sequences is the pool;
"paged_8" has the same pool and the dense engine's slot count (its updates recompute the same live samples).
Both run the same groups with the same seed. Reported: live sequences per decode step (mean, max), generated
tokens/s, and the cost of one in-flight update (on_update="recompute": dense recomputes every slot up to the
longest live position, paged only the live tokens), timed at the same points of each run after a warm-up that
compiled every program (the dense rebuild once per length bucket). The engines run in --runs rounds, one after
another in each; each reports its fastest run and each update point its fastest (the box is shared and loaded).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from bench.common import random_model
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Request, Sampler, make_engine
from jaxrl.sharding import make_mesh

_GROUPS = flags.DEFINE_integer("groups", 16, "GRPO groups per engine.")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "Samples per group (one prompt).")
_MEDIAN = flags.DEFINE_integer("median", 40, "Median completion length.")
_P99_RATIO = flags.DEFINE_float("p99_ratio", 12.0, "p99 / median of the completion length.")
_MAX_LEN = flags.DEFINE_integer("max_len", 2048, "Positions per sample (prompt + completion).")
_PROMPT = flags.DEFINE_integer("prompt_len", 40, "Prompt tokens (shared by a group).")
_DENSE_SLOTS = flags.DEFINE_integer("dense_slots", 8, "Dense slots; the KV budget is dense_slots x max_len.")
_PAGED_SLOTS = flags.DEFINE_integer("paged_slots", 64, "Paged slots (the page pool is the same budget).")
_PAGE = flags.DEFINE_integer("page_size", 16, "Positions per page.")
_CHUNK = flags.DEFINE_integer("rebuild_chunk", 32, "Paged rebuild: positions per row.")
_ROWS = flags.DEFINE_integer("rebuild_rows", 16, "Paged rebuild: rows per call.")
_ROW_BUCKETS = flags.DEFINE_list("row_buckets", ["1", "2", "4", "8", "16", "32"],
                                 "Paged: batch sizes a generate call may run its live rows at (max_slots is added). "
                                 "On the CPU a step costs about its rows, so buckets under 8 shorten the drain.")
_REPEATS = flags.DEFINE_integer("update_repeats", 3, "Times each update is run (the fastest is reported).")
_STEPS = flags.DEFINE_integer("steps_per_call", 8, "Decode steps per host round trip.")
_UPDATES = flags.DEFINE_integer("updates", 3, "In-flight updates timed per engine (spread over the run).")
_RUNS = flags.DEFINE_integer("runs", 2, "Rounds of runs over all engines; each engine reports its fastest run.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for lengths, prompts and sampling.")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "Model width (head_dim 32).")
_LAYERS = flags.DEFINE_integer("layers", 4, "Model layers (30 at --hidden 576: SmolLM2-135M's shape of blocks).")
_OUT = flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "paged.json"), "JSON results path.")


def _requests(groups, seed, vocab):
  rng = np.random.default_rng(seed)
  sigma = np.log(_P99_RATIO.value) / 2.3263  # z of the 99th percentile
  room = _MAX_LEN.value - _PROMPT.value
  # Lognormal quantiles in a random order: the sample has the distribution's median and p99 (a few hundred draws
  # would put the p99 anywhere in a factor of 2).
  n = groups * _GROUP_SIZE.value
  z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
  lengths = np.clip(np.round(_MEDIAN.value * np.exp(sigma * rng.permutation(z))), 1, room).astype(int)
  lengths = lengths.reshape(groups, _GROUP_SIZE.value)
  sp = SamplingParams(temperature=1.0)
  requests = [Request(rng.integers(0, vocab, _PROMPT.value).tolist(), group_id=g, n=_GROUP_SIZE.value, sampling=sp,
                      max_tokens=tuple(int(n) for n in lengths[g]), ignore_eos=True) for g in range(groups)]
  return requests, lengths


def _run(engine, params, requests, update_at=()):
  """Generates every request; times one in-flight update when the generated tokens first pass each of update_at.
  Returns (rollouts, stats)."""
  sampler = Sampler(engine, params, seed=_SEED.value, eos_token_ids=())
  for r in requests:
    sampler.submit_request(r)
  rollouts, live, updates, update_s, version, pending = [], [], [], 0.0, 0, list(update_at)
  start = time.perf_counter()
  steady = None  # (tokens, seconds) when the last sample got a slot: a pipeline's sampler never drains
  steady_live, pages_per_live = [], []
  while sampler.num_active or sampler.num_waiting:
    rollouts += sampler.step()
    live.append(sampler.num_active)
    if sampler.num_waiting:
      steady_live.append(sampler.num_active)
      if sampler.engine.kv == "paged" and sampler.num_active:
        pages_per_live.append(sampler.cache.pages.num_used / sampler.num_active)
    if steady is None and not sampler.num_waiting:
      steady = (sampler.stats.generated_tokens, time.perf_counter() - start - update_s)
    if pending and sampler.stats.generated_tokens >= pending[0] and sampler.num_active:
      pending.pop(0)
      jax.block_until_ready(sampler.cache.state)  # the decode call in flight is not the update's cost
      before, t0, times = sampler.stats.rebuilt_tokens, time.perf_counter(), []
      for _ in range(_REPEATS.value):  # the same recompute each time (same live samples): the fastest is its cost
        t = time.perf_counter()
        version += 1
        sampler.update_params(params, version)
        jax.block_until_ready(sampler.cache.state)
        times.append(time.perf_counter() - t)
      update_s += time.perf_counter() - t0
      updates.append(dict(tokens=sampler.stats.generated_tokens, live=sampler.num_active,
                          seconds=round(min(times), 4),
                          recomputed_positions=(sampler.stats.rebuilt_tokens - before) // _REPEATS.value))
  wall = time.perf_counter() - start - update_s
  tokens = sum(len(r.completion_tokens) for r in rollouts)
  s = sampler.stats
  # Sequences the KV budget holds at this workload: dense one per max_len slot; paged the pool over the pages a
  # live sequence held on average while the queue was non-empty (shared prompt pages counted once).
  fits = engine.max_slots if not pages_per_live else engine.num_pages / float(np.mean(pages_per_live))
  return rollouts, dict(steady_live_mean=round(float(np.mean(steady_live or [0])), 2),
                        sequences_that_fit=round(fits, 1),
                        tokens=tokens, seconds=round(wall, 3), tokens_per_s=round(tokens / wall, 1),
                        steady_tokens_per_s=round(steady[0] / steady[1], 1),
                        live_mean=round(float(np.mean(live)), 2), live_max=int(np.max(live)),
                        decode_calls=s.decode_calls, prefills=s.prefills, preemptions=s.preemptions,
                        rows_per_step=round(s.slot_steps / max(1, s.decode_calls * engine.steps_per_call), 2),
                        updates=updates)


def _same_tokens(a, b):
  return a.keys() == b.keys() and all(np.array_equal(a[k].completion_tokens, b[k].completion_tokens) for k in a)


def _logprob_difference(a, b):
  """Largest |logprob| difference between two runs of the same samples (0.0: identical bit for bit)."""
  return max(float(np.max(np.abs(a[k].logprobs - b[k].logprobs), initial=0.0)) for k in a)


def _programs(engine, params):
  """XLA's static estimate of each generate program (loops counted once): FLOPs and bytes accessed per row bucket
  (dense: its one program), and the temporaries it allocates (the cache is updated in place)."""
  placed, state = engine.place(params, 0), engine.init_decode_state()
  if engine.kv == "dense":
    programs = {engine.max_slots: engine._generate.lower(placed.params, np.int32(0), state).compile()}
  else:
    engine.generate(placed, state)  # compiles every bucket, if not done yet
    programs = engine._live_programs
  out = {}
  for rows, program in programs.items():
    cost = program.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out[rows] = dict(mflop=round(cost.get("flops", 0.0) / 1e6, 1),
                     mb_accessed=round(cost.get("bytes accessed", 0.0) / 1e6, 1),
                     temp_mb=round(program.memory_analysis().temp_size_in_bytes / 1e6, 2))
  return out


def _warm(engine, params, vocab):
  """Compiles every program a timed run uses (dense: the rebuild of every length bucket)."""
  requests, _ = _requests(2, _SEED.value + 1, vocab)
  _run(engine, params, requests, update_at=(1, 2 * engine.max_slots * engine.steps_per_call))
  if engine.kv == "dense":
    state = engine.init_decode_state()
    for b in engine.buckets:
      state = engine.rebuild(engine.place(params, 0), state, b)
    jax.block_until_ready(state)


def main(argv):
  del argv
  h = _HIDDEN.value
  cfg, params = random_model(h, _MAX_LEN.value, _LAYERS.value)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  common = dict(max_len=_MAX_LEN.value, steps_per_call=_STEPS.value)
  budget_positions = _DENSE_SLOTS.value * _MAX_LEN.value
  paged = dict(kv="paged", page_size=_PAGE.value, num_pages=budget_positions // _PAGE.value,
               rebuild_chunk=_CHUNK.value, rebuild_rows=_ROWS.value, **common)
  buckets = [int(b) for b in _ROW_BUCKETS.value]
  # "paged_8": the dense engine's slot count on pages, so its updates recompute the same live samples as dense.
  engines = {"dense": make_engine(cfg, mesh, max_slots=_DENSE_SLOTS.value, **common),
             "paged": make_engine(cfg, mesh, max_slots=_PAGED_SLOTS.value, **paged,
                                  row_buckets=[b for b in buckets if b <= _PAGED_SLOTS.value]),
             "paged_8": make_engine(cfg, mesh, max_slots=_DENSE_SLOTS.value, **paged,
                                    row_buckets=[b for b in buckets if b <= _DENSE_SLOTS.value])}
  kv_bytes = {}
  for name, engine in engines.items():
    _warm(engine, params, cfg.vocab_size)
    cache = engine.init_decode_state().cache
    kv_bytes[name] = sum(x.nbytes for x in jax.tree.leaves(cache) if x.ndim == 5)
  programs = {name: _programs(engine, params) for name, engine in engines.items() if name != "paged_8"}
  assert kv_bytes["dense"] == kv_bytes["paged"] == kv_bytes["paged_8"], kv_bytes

  requests, lengths = _requests(_GROUPS.value, _SEED.value, cfg.vocab_size)
  results, outputs = {}, {}
  # Updates at the same points of both runs: when 1/(u+1), 2/(u+1), ... of all tokens have been generated.
  update_at = [int(lengths.sum()) * (i + 1) // (_UPDATES.value + 1) for i in range(_UPDATES.value)]
  compiles = {name: engine.compile_count() for name, engine in engines.items()}
  for _ in range(_RUNS.value):  # rounds over all engines: a burst of load hits one round, not one engine
    for name, engine in engines.items():
      rollouts, result = _run(engine, params, requests, update_at)
      if name not in results:
        results[name], outputs[name] = result, {(r.group_id, r.sample_index): r for r in rollouts}
        continue
      best, other = sorted((results[name], result), key=lambda r: r["seconds"])
      for u, o in zip(best["updates"], other["updates"], strict=True):  # each update point: its fastest
        u["seconds"] = min(u["seconds"], o["seconds"])
      results[name] = best
  for name, engine in engines.items():
    results[name]["recompiles"] = engine.compile_count() - compiles[name]
  d, p = results["dense"], results["paged"]
  per_update = {k: np.mean([u["seconds"] for u in results[k]["updates"]]) for k in results}
  per_live = {k: np.mean([u["seconds"] / u["live"] for u in results[k]["updates"]]) for k in results}
  ratios = dict(sequences_that_fit=round(p["sequences_that_fit"] / d["sequences_that_fit"], 2),
                steady_live_sequences=round(p["steady_live_mean"] / d["steady_live_mean"], 2),
                live_sequences=round(p["live_mean"] / d["live_mean"], 2),
                tokens_per_s=round(p["tokens_per_s"] / d["tokens_per_s"], 2),
                steady_tokens_per_s=round(p["steady_tokens_per_s"] / d["steady_tokens_per_s"], 2),
                update_seconds=round(per_update["dense"] / per_update["paged"], 2),
                update_seconds_per_live_sequence=round(per_live["dense"] / per_live["paged"], 2),
                update_seconds_same_slots=round(per_update["dense"] / per_update["paged_8"], 2))
  report = dict(
      workload=dict(groups=_GROUPS.value, group_size=_GROUP_SIZE.value, prompt_len=_PROMPT.value,
                    max_len=_MAX_LEN.value, length_median=float(np.median(lengths)),
                    length_p99=float(np.percentile(lengths, 99)), length_max=int(lengths.max()),
                    p99_over_median=round(float(np.percentile(lengths, 99) / np.median(lengths)), 1),
                    steps_per_call=_STEPS.value),
      budget=dict(kv_bytes=kv_bytes["dense"], positions=budget_positions, dense_slots=_DENSE_SLOTS.value,
                  paged_slots=_PAGED_SLOTS.value, page_size=_PAGE.value, pages=budget_positions // _PAGE.value,
                  paged_row_buckets=list(engines["paged"].row_buckets),
                  paged_rebuild_chunk=_CHUNK.value, paged_rebuild_rows=_ROWS.value),
      model=dict(hidden=h, layers=cfg.num_layers, vocab=cfg.vocab_size),
      dense=d, paged=p, paged_8=results["paged_8"], paged_over_dense=ratios, generate_programs=programs,
      identical_samples=all(_same_tokens(outputs["dense"], outputs[k]) for k in ("paged", "paged_8")),
      max_logprob_difference={k: _logprob_difference(outputs["dense"], outputs[k]) for k in ("paged", "paged_8")},
      device=f"{jax.devices()[0].platform} x{len(jax.devices())}", host=platform.node(),
      load=os.getloadavg())
  w = report["workload"]
  print(f"lengths: median {w['length_median']:.0f}, p99 {w['length_p99']:.0f} ({w['p99_over_median']}x), max "
        f"{w['length_max']}; {_GROUPS.value} groups of {_GROUP_SIZE.value}; "
        f"KV budget {kv_bytes['dense'] / 2**20:.1f} MiB "
        f"= {_DENSE_SLOTS.value} x {_MAX_LEN.value} positions")
  print(f"{'kv':<8}{'live mean':>10}{'live max':>9}{'tokens/s':>10}{'steady':>9}{'update s':>10}{'update s/live':>14}"
        f"{'recomputed':>11}{'preempt':>8}")
  for name in engines:
    r = results[name]
    recomputed = np.mean([u["recomputed_positions"] for u in r["updates"]])
    print(f"{name:<8}{r['live_mean']:>10.1f}{r['live_max']:>9}{r['tokens_per_s']:>10,.0f}"
          f"{r['steady_tokens_per_s']:>9,.0f}{per_update[name]:>10.3f}"
          f"{per_live[name]:>14.4f}{recomputed:>11,.0f}{r['preemptions']:>8}")
  print(f"sequences the KV budget holds: dense {d['sequences_that_fit']}, paged {p['sequences_that_fit']} "
        f"({ratios['sequences_that_fit']}x); live while the queue is non-empty: dense {d['steady_live_mean']}, paged "
        f"{p['steady_live_mean']} (slots {_PAGED_SLOTS.value})")
  print(f"paged / dense: live sequences {ratios['live_sequences']}x, tokens/s {ratios['tokens_per_s']}x (steady "
        f"{ratios['steady_tokens_per_s']}x), update "
        f"{ratios['update_seconds']}x cheaper ({ratios['update_seconds_per_live_sequence']}x per live sequence, "
        f"{ratios['update_seconds_same_slots']}x with the dense engine's 8 slots); "
        f"identical samples: {report['identical_samples']} (largest logprob difference "
        f"{report['max_logprob_difference']}); load {report['load']}")
  print("generate programs (rows: MFLOP, MB accessed, temporaries MB):",
        {k: {r: tuple(v.values()) for r, v in x.items()} for k, x in programs.items()})
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
