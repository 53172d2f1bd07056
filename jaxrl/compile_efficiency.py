"""How close a run's compiled programs come to what the model needs (jaxrl-compile's "efficiency"), per chip:

  decode: bytes accessed per decode step against its weight shard plus every slot's KV at max_len, read once
    (target <= 1.2);
  train: FLOPs of a learner step against the model's count: 6N per trained token (8N with full remat,
    remat_policy "nothing_saveable"), 2N per token of each fixed-params pass (proximal, reference), N the matmul
    parameters (the head included, the embedding lookup not), plus attention's 4 x L x H x D per token and layer
    forward (the full L x L block: an XLA attention computes the masked half too), x3 for fwd+bwd (x4 with remat);
    target <= 1.1;
  collectives: bytes of a learner step's collectives against FSDP's two all-gathers and one reduce-scatter of the
    trained params per optimizer update (target <= 1.0 x that; 0 on a learner of one chip).

A ratio over its target names the ops that move or compute the most (from the compiled HLO's metadata).
"""

from __future__ import annotations

import math

import jax

TARGETS = dict(decode_bytes=1.2, train_flops=1.1, learner_collectives=1.0)


def _bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def model_train_flops(cfg, c, info) -> float:
  """FLOPs the model needs for one learner step over the whole batch (all chips; see the module doc)."""
  e, v = cfg.hidden_size, cfg.vocab_size
  layer = e * cfg.num_heads * cfg.head_dim * 2 + 2 * e * cfg.num_kv_heads * cfg.head_dim + 3 * e * cfg.intermediate_size
  n = cfg.num_layers * layer + e * v
  full_remat = cfg.remat and cfg.remat_policy == "nothing_saveable"
  tokens = info["spec"].batch_size * c.rl.seq_len
  attention = 4 * c.rl.seq_len * cfg.num_heads * cfg.head_dim * cfg.num_layers  # forward, per token
  train = ((8 if full_remat else 6) * n + (4 if full_remat else 3) * attention) * c.rl.num_epochs
  passes = info["passes"] * (2 * n + attention)
  return float(tokens * (train + passes))


def _verdict(ratio: float | None, target: float, top) -> dict:
  out = dict(ratio=ratio, target=target, ok=ratio is None or ratio <= target)
  if not out["ok"]:
    out["cause"] = [name for name, _ in top[:3]]
  return out


def _overhead(top):
  """The ops beyond the weight matmuls (which the ideal holds) that move the most bytes."""
  return [(name, b) for name, b in top if "dot_general" not in name]


def efficiency(report: dict, c, cfg, info, sampled, chip) -> dict:
  """The three ratios of a report whose programs all compiled (see the module doc)."""
  from jaxrl.compile import per_device_bytes

  programs = report["programs"]
  decode = next(p for p in programs if p["name"].startswith("decode"))
  ideal = per_device_bytes(sampled["params"]) + per_device_bytes(sampled["state"].cache)
  per_step = decode["bytes_accessed"] / decode["steps_per_call"]
  train = max((p for p in programs if p["name"].startswith("train_step")), key=lambda p: p["flops"])
  learner_chips = report["split"]["learner"]
  model_flops = model_train_flops(cfg, c, info) / learner_chips
  fsdp = 3 * _bytes(info["trained_params"]) * info["updates"] if learner_chips > 1 else 0.0
  coll = sum(train["collective_bytes"].values())
  return dict(
      decode_bytes=dict(_verdict(per_step / ideal, TARGETS["decode_bytes"], _overhead(decode["top_bytes"])),
                        per_step=per_step, ideal=ideal, seconds_per_step=decode["roofline"]["bound_s"] /
                        decode["steps_per_call"]),
      train_flops=dict(_verdict(train["flops"] / model_flops, TARGETS["train_flops"], train["top_flops"]),
                       compiled=train["flops"], model=model_flops),
      learner_collectives=dict(_verdict(coll / fsdp if fsdp else None, TARGETS["learner_collectives"],
                                        train["top_collectives"]), compiled=coll, fsdp=fsdp),
  )
