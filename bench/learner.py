"""Train-step throughput: tokens/s and achieved FLOP/s as a fraction of this machine's matmul peak (same run).

    .venv/bin/python bench/learner.py            # default: a ~20M-parameter decoder, 8 x 256 tokens, float32
    .venv/bin/python bench/learner.py --layers=2 --hidden=256 --seq=128   # smaller, for a quick look
    .venv/bin/python bench/learner.py --workload=longtail   # packed vs padded on long-tailed lengths, and memory
                                                            # (bench/learner_longtail.py)

The peak is the best float32 GEMM rate of this process on a square matmul (jitted, best of 3), measured between
consecutive timed steps; each step is set against the better of its two neighbouring peaks (the machine may be
shared, and its load drifts), and the median over steps is reported. Step FLOPs are counted
analytically from the model's matmuls (forward x 3 for the backward pass, full LxL attention as the model
computes it; XLA's cost analysis counts a scanned layer once, so it is not used). Writes
bench/results/learner.json.
"""

from __future__ import annotations

import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step, make_optimizer
from jaxrl.models import Decoder, ModelConfig
from jaxrl.rollout import Rollout, make_batch


def best_time(fn, repeats: int) -> float:
  """Fastest of `repeats` runs of fn() (fn blocks until its result is ready)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def matmul_peak(n: int, repeats: int) -> float:
  """FLOP/s of an n x n x n float32 matmul, the machine's practical peak for this process."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  mm = jax.jit(jnp.matmul)
  mm(a, b).block_until_ready()
  return 2 * n**3 / best_time(lambda: mm(a, b).block_until_ready(), repeats)


def step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Matmul FLOPs of one forward + backward pass over batch x seq_len tokens (backward = 2 x forward)."""
  e, h, k, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  per_token_layer = 2 * (e * h * d + 2 * e * k * d + h * d * e + 3 * e * m) + 2 * 2 * seq_len * h * d
  per_token = cfg.num_layers * per_token_layer + 2 * e * cfg.vocab_size
  return 3.0 * per_token * batch * seq_len


def synthetic_batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int):
  """Full-length rows (prompt of seq_len / 4), random tokens, on-policy-looking logprobs, groups of 4."""
  rng = np.random.default_rng(seed)
  p = seq_len // 4
  rs = [Rollout(rng.integers(0, cfg.vocab_size, p).astype(np.int32),
                rng.integers(0, cfg.vocab_size, seq_len - p).astype(np.int32),
                rng.normal(-np.log(cfg.vocab_size), 0.1, seq_len - p).astype(np.float32),
                np.zeros(seq_len - p, np.int32), "length", group_id=i // 4, reward=float(rng.uniform()))
        for i in range(batch)]
  return make_batch(rs, batch, seq_len)


_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_HIDDEN = flags.DEFINE_integer("hidden", 512, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads (head_dim = hidden / heads).")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 4, "Key/value heads.")
_MLP = flags.DEFINE_integer("mlp", 1536, "MLP width.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Vocabulary size.")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows per train step.")
_SEQ = flags.DEFINE_integer("seq", 256, "Tokens per row.")
_MICRO = flags.DEFINE_integer("microbatches", 1, "Gradient-accumulation micro-batches per step.")
_STEPS = flags.DEFINE_integer("steps", 4, "Timed steps (after one warm-up step).")
_PEAK_N = flags.DEFINE_integer("peak_n", 2048, "Size of the square matmul that measures the peak.")
_WORKLOAD = flags.DEFINE_enum("workload", "full", ["full", "longtail"],
                              "full: full-length rows vs the matmul peak; longtail: bench/learner_longtail.py.")
_SAMPLES = flags.DEFINE_integer("samples", 32, "longtail: samples in the batch.")
_LONGEST = flags.DEFINE_integer("longest", 2048, "longtail: the longest sample and the packed row length.")
_TAIL = flags.DEFINE_float("tail", 10.0, "longtail: p99 / median of the lognormal lengths.")
_CHUNK = flags.DEFINE_integer("logprob_chunk", 512, "longtail: positions per log-prob chunk.")
_BUDGET = flags.DEFINE_float("budget_gib", 8.0, "longtail: memory budget (compiled temporaries) in GiB.")
_MEM_LIMIT = flags.DEFINE_integer("mem_limit", 65536, "longtail: longest row tried for the memory budget.")
_PADDED_MICRO = flags.DEFINE_integer("padded_micro", 8, "longtail: micro-batches of the padded batches.")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).parent / "results" / "learner.json"), "JSON path.")


def main(_):
  if _WORKLOAD.value == "longtail":
    import learner_longtail  # bench/ is the script's directory, on sys.path
    out = _OUT.value if _OUT.present else str(pathlib.Path(_OUT.value).with_name("learner_longtail.json"))
    return learner_longtail.main(_LAYERS.value, _HIDDEN.value, _HEADS.value, _KV_HEADS.value, _MLP.value,
                                 _VOCAB.value, _SAMPLES.value, _LONGEST.value, _TAIL.value, _STEPS.value,
                                 _CHUNK.value, _BUDGET.value, _MEM_LIMIT.value, _PADDED_MICRO.value, out)
  cfg = ModelConfig(vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value, intermediate_size=_MLP.value,
                    num_layers=_LAYERS.value, num_heads=_HEADS.value, num_kv_heads=_KV_HEADS.value,
                    head_dim=_HIDDEN.value // _HEADS.value, max_position_embeddings=_SEQ.value)
  graphdef, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  opt = make_optimizer(1e-4, warmup_steps=10, decay_steps=1000, weight_decay=0.1)
  loss_cfg = LossConfig(proximal="recompute", is_level="token", is_cap=2.0)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, loss=loss_cfg, batch_size=_BATCH.value,
                                   seq_len=_SEQ.value, num_microbatches=_MICRO.value))
  state = init_train_state(params, opt)
  batches = [synthetic_batch(cfg, _BATCH.value, _SEQ.value, s) for s in range(_STEPS.value)]
  key = jax.random.key(0)

  start = time.perf_counter()
  compiled = step.lower(state, batches[0], key).compile()
  compile_s = time.perf_counter() - start

  state, metrics = compiled(state, batches[0], key)  # warm-up
  jax.block_until_ready(metrics)
  # The machine may be shared: a peak measured next to each step, not once, tracks the load as it drifts.
  peaks, times = [matmul_peak(_PEAK_N.value, 3)], []
  for b in batches:
    t0 = time.perf_counter()
    state, metrics = compiled(state, b, key)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
    peaks.append(matmul_peak(_PEAK_N.value, 3))
  if int(state.version) != len(batches) + 1:
    raise RuntimeError(f"only {int(state.version)} of {len(batches) + 1} updates applied")
  flops = step_flops(cfg, _BATCH.value, _SEQ.value)
  # Each step against the better of the peaks measured just before and just after it.
  fractions = [flops / t / max(peaks[i], peaks[i + 1]) for i, t in enumerate(times)]
  step_s = float(np.median(times))
  tokens = _BATCH.value * _SEQ.value
  result = {
      "machine": f"{platform.machine()} {jax.devices()[0].device_kind}, {jax.device_count()} device(s)",
      "model": {"params": int(num_params), "layers": cfg.num_layers, "hidden": cfg.hidden_size,
                "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "mlp": cfg.intermediate_size,
                "vocab": cfg.vocab_size},
      "batch": _BATCH.value, "seq_len": _SEQ.value, "microbatches": _MICRO.value,
      "compile_s": compile_s,
      "step_s_median": step_s, "step_s_all": times,
      "tokens_per_s": tokens / step_s,
      "completion_tokens_per_s": float(metrics["num_tokens"]) / step_s,
      "model_flops_per_step": flops,
      "achieved_flops_per_s": flops / step_s,
      "matmul_peak_flops_per_s": max(peaks),
      "matmul_peak_runs": peaks,
      "fraction_of_matmul_peak_per_step": fractions,
      "fraction_of_matmul_peak": float(np.median(fractions)),
      "policy_version": int(state.version),  # every step applied its update: warm-up + timed steps
  }
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"model {num_params / 1e6:.1f}M params, {_BATCH.value}x{_SEQ.value} tokens, compile {compile_s:.1f}s")
  print(f"step {step_s * 1e3:.0f} ms  ->  {tokens / step_s:,.0f} tokens/s")
  print(f"achieved {flops / step_s / 1e9:.1f} GFLOP/s ({flops / 1e9:.1f} GFLOP of model matmuls per step)")
  print(f"matmul peak {max(peaks) / 1e9:.1f} GFLOP/s ({_PEAK_N.value}^3 f32; per step "
        f"{', '.join(f'{p / 1e9:.1f}' for p in peaks)})")
  print(f"fraction of matmul peak (median over steps, each against its neighbouring peaks): "
        f"{result['fraction_of_matmul_peak']:.2f}")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
