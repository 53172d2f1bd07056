"""Costs from a jaxrl-compile report: the simulator charges what the compiled programs count, not the model shape's
roofline (jaxrl/sim/costs.py), on the same chip's datasheet peaks and the same efficiency factors.

From the report, per chip: the decode step's bytes and FLOPs (per step of steps_per_call, at the run's slots), the
prefill's FLOPs per prompt token, the train step's FLOPs and bytes for its tokens (its remat, its extra forward
passes, its attention and optimizer included), the sampler's weight bytes, and the HBM left for KV beside
everything else (kv_capacity). A decode step of B sequences with C context tokens then costs

    t(B, C) = overhead + C x KV bytes per token / (data chips x BW x mem_eff)
              + smoothmax(compiled bytes per step / (BW x mem_eff), B x compiled FLOPs per sequence / (F x flop_eff))

and a learner step max(FLOPs / (F x mfu), bytes / (BW x mem_eff)) per chip. The compiled decode bytes hold the
weights plus what the program moves besides them (sampling, cache bookkeeping): the compiled counterpart of the
roofline's weights_s. KV reads keep the per-token rate (the compiled decode loop over the cache has a data-dependent
trip count, counted once: jaxrl/hlo.py).
"""

from __future__ import annotations

import math

from jaxrl.sim.costs import Costs, DecodeCurve, ModelSpec
from jaxrl.sim.hardware import preset


def model_spec(report: dict) -> ModelSpec:
  """The report's model as the cost model counts it (its shape is in the report; sampler dtype's bytes)."""
  m = report["model"]
  dims = {k: m[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                            "num_kv_heads", "head_dim", "tie_embeddings")}
  size = 2.0 if m["sampler_dtype"] == "bfloat16" else 4.0
  return ModelSpec.from_dims(m["preset"] or m["source"], **dims, bytes_per_param=size, kv_bytes_per_value=size)


def compiled_costs(report: dict, *, mem_eff: float = 1.0, flop_eff: float = 1.0, mfu: float = 0.4,
                   overhead_s: float = 0.0, knee_sharpness: float = math.inf, max_batch_cap: int = 1024,
                   slot_tokens: int = 4096, train_overhead_s: float = 0.0, sync_overhead_s: float = 0.0) -> Costs:
  """The simulator's Costs of the run a jaxrl-compile report compiled (a report whose programs all fit)."""
  if not report.get("fits"):
    raise ValueError(f"the report of {report.get('target')} does not fit its chips: no costs to plan with")
  chip = preset(report["chip"])
  programs = {p["name"]: p for p in report["programs"]}
  pick = lambda prefix: next(p for name, p in programs.items() if name.startswith(prefix))  # noqa: E731
  decode, prefill = pick("decode"), pick("prefill")
  train = max((p for n, p in programs.items() if n.startswith("train_step")), key=lambda p: p["flops"])
  split, run = report["split"], report["run"]
  data, tensor = split["sampler_axes"].get("data", 1), split["sampler_axes"].get("tensor", 1)
  bw, peak = chip.hbm_bandwidth * mem_eff, chip.peak_flops
  steps = decode["steps_per_call"]
  seqs_per_chip = run["max_slots"] / data
  capacity = report["kv_capacity"]
  per_token = capacity["kv_bytes_per_token_chip"]
  fits = int(capacity["tokens_per_chip"] // slot_tokens) * (1 if run["kv"] == "paged" else data)
  curve = DecodeCurve(weights_s=decode["bytes_accessed"] / steps / bw, kv_s_per_token=per_token / (data * bw),
                      compute_s_per_seq=decode["flops"] / steps / seqs_per_chip / data / (peak * flop_eff),
                      overhead_s=overhead_s, knee_sharpness=knee_sharpness)
  tokens = run["batch_rows"] * run["seq_len"]
  step_s = max(train["flops"] / (peak * mfu), train["bytes_accessed"] / bw)
  prefill_s = prefill["flops"] / int(prefill["name"].split("[")[1].rstrip("]")) / (peak * flop_eff)
  return Costs(decode=curve, devices_per_engine=split["sampler"], max_batch=max(1, min(max_batch_cap, fits)),
               prefill_s_per_token=prefill_s, train_tokens_per_s_per_device=tokens / (step_s * split["learner"]),
               weight_bytes=programs["publish_receive"]["memory"]["params"] * tensor,
               link_bandwidth=chip.link_bandwidth, train_overhead_s=train_overhead_s, sync_overhead_s=sync_overhead_s,
               kv=run["kv"], rebuild_s_per_token=prefill_s)
