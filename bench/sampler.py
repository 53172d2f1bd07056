r"""Continuous vs static batching on a long-tailed length distribution, side by side in one run.

  .venv/bin/python -m bench.sampler      # from the repo root; a small random model; writes bench/results/sampler.json

Completion lengths are lognormal (p99 = --p99_ratio x median), forced with per-request max_tokens and EOS
disabled. Both modes run the same requests with the same seed on the same Engine (so the same samples come out,
token for token); "static" admits a new batch only when every slot is free (a batch padded to its longest
sample), "continuous" refills each slot as soon as it frees. Prints tokens/s of each and the ratio, the
fraction of slot-steps that produced a token, and the compile count after warm-up and at the end.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags

from bench.common import random_model
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Request, Sampler, make_engine
from jaxrl.sharding import make_mesh

_REQUESTS = flags.DEFINE_integer("requests", 192, "Samples to generate per mode.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Decode slots.")
_STEPS = flags.DEFINE_integer("steps_per_call", 8, "Decode steps per host round trip.")
_MEDIAN = flags.DEFINE_integer("median", 24, "Median completion length.")
_P99_RATIO = flags.DEFINE_float("p99_ratio", 10.0, "p99 / median of the completion length.")
_MAX_LEN = flags.DEFINE_integer("max_len", 512, "KV cache length per slot.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for lengths, prompts and sampling.")
_HIDDEN = flags.DEFINE_integer("hidden", 128, "Model width (layers 4, head_dim 32).")
_OUT = flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "sampler.json"), "JSON results path.")


def _requests(n, seed, vocab, max_len):
  rng = np.random.default_rng(seed)
  sigma = np.log(_P99_RATIO.value) / 2.3263  # z of the 99th percentile
  prompt_lens = rng.integers(4, 32, n)
  lengths = np.clip(np.round(_MEDIAN.value * np.exp(sigma * rng.standard_normal(n))), 1, max_len - prompt_lens)
  requests = [Request(rng.integers(0, vocab, p).tolist(), group_id=i, sampling=SamplingParams(temperature=1.0),
                      max_tokens=int(m), ignore_eos=True)
              for i, (p, m) in enumerate(zip(prompt_lens, lengths, strict=True))]
  return requests, lengths


def _run(engine, params, requests, admission):
  sampler = Sampler(engine, params, seed=_SEED.value, admission=admission)
  start = time.perf_counter()
  rollouts = list(sampler.run(requests))
  wall = time.perf_counter() - start
  tokens = sum(len(r.completion_tokens) for r in rollouts)
  stats = sampler.stats
  return rollouts, dict(tokens=tokens, seconds=round(wall, 3), tokens_per_s=round(tokens / wall, 1),
                        useful_slot_fraction=round(stats.useful_fraction, 4), decode_calls=stats.decode_calls,
                        slot_steps=stats.slot_steps)


def main(argv):
  del argv
  h = _HIDDEN.value
  cfg, params = random_model(h, _MAX_LEN.value)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  engine = make_engine(cfg, mesh, max_slots=_SLOTS.value, max_len=_MAX_LEN.value, steps_per_call=_STEPS.value)

  warmup, _ = _requests(2 * _SLOTS.value, _SEED.value + 1, cfg.vocab_size, _MAX_LEN.value)
  for admission in ("continuous", "static"):
    _run(engine, params, warmup, admission)
  compiles_after_warmup = engine.compile_count()

  requests, lengths = _requests(_REQUESTS.value, _SEED.value, cfg.vocab_size, _MAX_LEN.value)
  results = {}
  outputs = {}
  for admission in ("static", "continuous"):
    rollouts, results[admission] = _run(engine, params, requests, admission)
    outputs[admission] = {r.group_id: r.completion_tokens.tolist() for r in rollouts}
  same_samples = outputs["static"] == outputs["continuous"]
  ratio = results["continuous"]["tokens_per_s"] / results["static"]["tokens_per_s"]
  report = dict(
      workload=dict(requests=len(requests), slots=_SLOTS.value, steps_per_call=_STEPS.value, max_len=_MAX_LEN.value,
                    length_median=float(np.median(lengths)), length_p99=float(np.percentile(lengths, 99)),
                    length_max=int(lengths.max()), length_mean=round(float(lengths.mean()), 1)),
      model=dict(hidden=h, layers=cfg.num_layers, vocab=cfg.vocab_size),
      static=results["static"], continuous=results["continuous"], speedup=round(ratio, 2),
      identical_samples=same_samples, compiles_after_warmup=compiles_after_warmup,
      compiles_at_end=engine.compile_count(),
      device=f"{jax.devices()[0].platform} x{len(jax.devices())}", host=platform.node(),
  )
  print(f"lengths: median {report['workload']['length_median']:.0f}, p99 {report['workload']['length_p99']:.0f}, "
        f"max {report['workload']['length_max']} ({len(requests)} requests, {_SLOTS.value} slots, "
        f"{_STEPS.value} steps/call)")
  print(f"{'mode':<12}{'tokens/s':>12}{'useful slot-steps':>20}{'decode calls':>14}{'seconds':>10}")
  for mode in ("static", "continuous"):
    r = results[mode]
    print(f"{mode:<12}{r['tokens_per_s']:>12,.0f}{r['useful_slot_fraction']:>20.1%}{r['decode_calls']:>14}"
          f"{r['seconds']:>10.2f}")
  print(f"continuous / static = {ratio:.2f}x; identical samples: {same_samples}; compiles after warm-up "
        f"{compiles_after_warmup}, at end {report['compiles_at_end']}")
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  Path(_OUT.value).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
  app.run(main)
