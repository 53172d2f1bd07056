"""How close a run's compiled programs come to what the model needs (jaxrl-compile's "efficiency"), per chip, from
the report alone:

  decode: bytes accessed per decode step against its weight shard plus every slot's KV at max_len, read once
    (target <= 1.2);
  train: FLOPs of a learner step against the model's count: 6N per trained token (8N with full remat,
    remat_policy "nothing_saveable"), 2N per token of each fixed-params pass (proximal, reference), N the matmul
    parameters (the head included, the embedding lookup not), plus attention's 4 x L x H x D per token and layer
    forward (the full L x L block: an XLA attention computes the masked half too), x3 for fwd+bwd (x4 with remat);
    target <= 1.1;
  collectives: bytes of a learner step's collectives against FSDP's: per gradient-accumulation chunk of every
    optimizer update two all-gathers of the trained params (forward, backward; three with full remat, which gathers
    again to recompute) and one reduce-scatter of their gradients, and one all-gather per chunk of each fixed-params
    pass; in the params' own dtype (target <= 1.1; none on a learner of one row shard).

A ratio over its target names the ops that cause it (from the compiled HLO's metadata): for decode the ops beyond the
weight matmuls, which the ideal holds.
"""

from __future__ import annotations

TARGETS = dict(decode_bytes=1.2, train_flops=1.1, learner_collectives=1.1)


def model_train_flops(report: dict) -> float:
  """FLOPs the model needs for one learner step over the whole batch (all chips; see the module doc)."""
  m, run = report["model"], report["run"]
  e, v = m["hidden_size"], m["vocab_size"]
  layer = 2 * e * m["num_heads"] * m["head_dim"] + 2 * e * m["num_kv_heads"] * m["head_dim"] + \
      3 * e * m["intermediate_size"]
  n = m["num_layers"] * layer + e * v
  full_remat = run["full_remat"]
  attention = 4 * run["seq_len"] * m["num_heads"] * m["head_dim"] * m["num_layers"]  # forward, per token
  train = ((8 if full_remat else 6) * n + (4 if full_remat else 3) * attention) * run["num_epochs"]
  passes = run["fixed_passes"] * (2 * n + attention)
  return float(run["batch_rows"] * run["seq_len"] * (train + passes))


def fsdp_collective_bytes(report: dict) -> float:
  """FSDP's collective bytes per chip for one learner step (see the module doc); 0 without row shards."""
  run = report["run"]
  if run["row_shards"] < 2:
    return 0.0
  gathers = 3 if run["full_remat"] else 2
  chunks = run["chunks"]
  return float((chunks * (gathers + 1) * run["updates"] + chunks * run["fixed_passes"]) * run["trained_param_bytes"])


def _verdict(ratio: float | None, target: float, top) -> dict:
  out = dict(ratio=ratio, target=target, ok=ratio is None or ratio <= target)
  if not out["ok"]:
    out["cause"] = [name for name, _ in top[:3]]
  return out


def decode_bytes(decode: dict, ideal: float) -> dict:
  """A decode program's bytes per step against `ideal` (its weight shard and KV per chip; see the module doc)."""
  per_step = decode["bytes_accessed"] / decode["steps_per_call"]
  overhead = [(name, b) for name, b in decode["top_bytes"] if "dot_general" not in name]
  return dict(_verdict(per_step / ideal, TARGETS["decode_bytes"], overhead), per_step=per_step, ideal=ideal,
              seconds_per_step=decode["roofline"]["bound_s"] / decode["steps_per_call"])


def efficiency(report: dict) -> dict:
  """The three ratios of a report whose programs all compiled (see the module doc)."""
  programs = report["programs"]
  decode = next(p for p in programs if p["name"].startswith("decode"))
  held = next(p for p in programs if p["name"] == "publish_receive")["memory"]
  train = max((p for p in programs if p["name"].startswith("train_step")), key=lambda p: p["flops"])
  model = model_train_flops(report) / report["split"]["learner"]
  fsdp = fsdp_collective_bytes(report)
  coll = sum(train["collective_bytes"].values())
  return dict(
      decode_bytes=decode_bytes(decode, held["params"] + held["kv"]),
      train_flops=dict(_verdict(train["flops"] / model, TARGETS["train_flops"], train["top_flops"]),
                       compiled=train["flops"], model=model),
      learner_collectives=dict(_verdict(coll / fsdp if fsdp else None, TARGETS["learner_collectives"],
                                        train["top_collectives"]), compiled=coll, fsdp=fsdp),
  )
