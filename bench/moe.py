r"""A small mixture of experts against a dense decoder of the same active parameters, side by side in one process.

  nice -n 19 python -m bench.moe            # from the repo root; writes bench/results/moe.json

Dense: width 256, 4 layers, 8 heads of 32, MLP 512, vocab 512. MoE: the same attention and embedding, 8 experts of
256 per layer, 2 per token: the same active MLP parameters per token (2 x 256 = 512), 4x the MLP parameters held.
Per model, the two models' calls alternating so that both see the same load (the box is shared: ratios, not
absolute times, are the result):
  decode  tokens/s of the fastest generate call (16 slots, all active, 16 steps a call);
  train   seconds of the fastest train step (16 rows of 128 tokens, routing replayed for the MoE);
  FLOPs   XLA's cost_analysis of one compiled decode step (16 slots) and of the train step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from bench.common import write_json
from jaxrl.learner import StepConfig, init_train_state, jit_train_step
from jaxrl.models import ModelConfig, forward_cached, init_cache, init_params
from jaxrl.rollout import Rollout, SamplingParams, make_batch
from jaxrl.sampler import make_engine
from jaxrl.sharding import make_mesh

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per model (after one that compiles).")
_OUT = flags.DEFINE_string("json_out", str(Path(__file__).parent / "results" / "moe.json"), "JSON results path.")
SLOTS, STEPS, MAX_LEN, ROWS, SEQ = 16, 16, 256, 16, 128
DENSE = ModelConfig.tiny(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=32, max_position_embeddings=MAX_LEN)
MOE = DENSE.replace(architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=256, router_aux_loss_coef=0.001)
DENSE = DENSE.replace(architecture="qwen3", qk_norm=True)


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def _decoder(cfg):
  """(engine, placed params, filled decode state, FLOPs of one decode step)."""
  graphdef, params = init_params(cfg)
  engine = make_engine(cfg, make_mesh({"data": 1}, jax.devices()[:1]), max_slots=SLOTS, max_len=MAX_LEN,
                       steps_per_call=STEPS)
  placed = engine.place(params, 0)
  state = engine.init_decode_state()
  rng = np.random.default_rng(0)
  for slot in range(SLOTS):
    settings = engine.slot_settings(jax.random.key(slot), SamplingParams(), MAX_LEN)
    state = engine.insert(engine.prefill(placed, rng.integers(2, cfg.vocab_size, 16)), state, slot, settings)
  tokens, positions = jnp.zeros((SLOTS, 1), jnp.int32), jnp.full((SLOTS, 1), MAX_LEN // 2, jnp.int32)
  step = jax.jit(forward_cached, static_argnums=0).lower(graphdef, params, tokens, positions,
                                                         init_cache(cfg, SLOTS, MAX_LEN))
  return engine, placed, state, _flops(step.compile())


def _learner(cfg):
  """(train step, state, batch, FLOPs of the step): random rollouts of 32 prompt + 96 completion tokens."""
  graphdef, params = init_params(cfg)
  rng = np.random.default_rng(1)
  rollouts = []
  for i in range(ROWS):
    routing = None
    if cfg.is_moe:
      routing = np.argsort(rng.random((96, cfg.num_layers, cfg.num_experts)), -1)[..., :2].astype(np.int16)
    rollouts.append(Rollout(rng.integers(2, 512, 32).astype(np.int32), rng.integers(2, 512, 96).astype(np.int32),
                            np.full(96, -6.0, np.float32), np.zeros(96, np.int32), "length", group_id=i // 4,
                            reward=float(i % 3), experts=routing))
  batch = make_batch(rollouts, ROWS, SEQ)
  opt = optax.adam(1e-4)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, batch_size=ROWS, seq_len=SEQ))
  state = init_train_state(params, opt)
  flops = _flops(step.lower(state, batch, jax.random.key(0)).compile())
  return step, state, batch, flops


def main(argv):
  del argv
  models = {"dense": DENSE, "moe": MOE}
  rows = {name: {"params": sum(x.size for x in jax.tree.leaves(init_params(cfg)[1]))} for name, cfg in models.items()}
  decoders = {name: _decoder(cfg) for name, cfg in models.items()}
  learners = {name: _learner(cfg) for name, cfg in models.items()}
  best = {name: {"decode": float("inf"), "train": float("inf")} for name in models}
  for i in range(_REPEATS.value + 1):  # call 0 compiles
    for name in models:
      engine, placed, state, _ = decoders[name]
      start = time.perf_counter()
      state, result = engine.generate(placed, state)
      jax.block_until_ready((state, result))
      decoders[name] = (engine, placed, state, decoders[name][3])
      if i:
        best[name]["decode"] = min(best[name]["decode"], time.perf_counter() - start)
      step, train_state, batch, flops = learners[name]
      start = time.perf_counter()
      train_state, metrics = step(train_state, batch, jax.random.key(i))
      jax.block_until_ready((train_state, metrics))
      learners[name] = (step, train_state, batch, flops)
      if i:
        best[name]["train"] = min(best[name]["train"], time.perf_counter() - start)
  for name in models:
    rows[name].update(decode_tokens_per_s=round(SLOTS * STEPS / best[name]["decode"], 1),
                      train_step_s=round(best[name]["train"], 4), decode_step_flops=decoders[name][3],
                      train_step_flops=learners[name][3])
  ratios = {key: round(rows["moe"][key] / rows["dense"][key], 3) for key in rows["dense"]}
  report = dict(rows=rows, moe_over_dense=ratios, load=round(os.getloadavg()[0], 1),
                shapes=dict(slots=SLOTS, steps_per_call=STEPS, max_len=MAX_LEN, train_rows=ROWS, seq_len=SEQ))
  for name, row in rows.items():
    print(name, " ".join(f"{k}={v}" for k, v in row.items()))
  print("moe / dense", ratios, "load", report["load"])
  write_json(_OUT.value, report)


if __name__ == "__main__":
  app.run(main)
