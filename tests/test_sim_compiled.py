"""The systems model on compiled costs: a jaxrl-compile report's programs become the simulator's Costs, and
jaxrl-plan plans from them (configs/plan_tpu.py)."""

import importlib.util
import json
from pathlib import Path

import pytest

from jaxrl.sim import compiled, plan
from jaxrl.sim.hardware import preset

REPO = Path(__file__).resolve().parents[1]
V5P = preset("tpu_v5p")


def report(**over) -> dict:
  """A report's fields the costs read, for a 4-chip v5p slice split 2 learner + 2 sampler (data 2)."""
  r = dict(
      target="v5p:2x2x1", chip="tpu_v5p", chips=4, fits=True,
      split=dict(learner=2, sampler=2, sampler_axes=dict(data=2, tensor=1), sampler_replicas=1),
      run=dict(batch_rows=16, seq_len=1024, max_slots=32, max_len=1024, kv="paged"),
      model=dict(preset="qwen2.5-0.5b", source="tiny", sampler_dtype="bfloat16", vocab_size=151936, hidden_size=896,
                 intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                 tie_embeddings=True),
      kv_capacity={"kv_bytes_per_token_chip": 12288.0, "tokens_per_chip": 1024 * 100.5},
      programs=[dict(name="train_step", flops=4.59e14, bytes_accessed=2.765e12),
                dict(name="prefill[512]", flops=512 * 1e9, bytes_accessed=1e9),
                dict(name="decode[32 rows]", flops=8 * 16 * 1e9, bytes_accessed=8 * 1.1e9, steps_per_call=8),
                dict(name="publish_receive", memory=dict(params=0.99e9))])
  r.update(over)
  return r


def test_costs_charge_what_the_programs_count():
  costs = compiled.compiled_costs(report(), mem_eff=0.5, flop_eff=0.5, mfu=0.5, slot_tokens=1024)
  assert costs.decode.weights_s == pytest.approx(1.1e9 / (0.5 * V5P.hbm_bandwidth))  # bytes of one decode step
  # 1e9 FLOPs per sequence per step (16 of the 32 slots on each data chip): a sequence on the engine's 2 chips
  assert costs.decode.compute_s_per_seq == pytest.approx(1e9 / 2 / (0.5 * V5P.peak_flops))
  assert costs.decode.kv_s_per_token == pytest.approx(12288 / 2 / (0.5 * V5P.hbm_bandwidth))
  assert costs.prefill_s_per_token == pytest.approx(1e9 / (0.5 * V5P.peak_flops))
  # The train step: 4.59e14 FLOPs per chip at MFU 0.5 is 2 s (its bytes 2 s at half bandwidth too), 16 x 1024 tokens
  assert costs.train_tokens_per_s_per_device == pytest.approx(16 * 1024 / (2.0 * 2), rel=1e-3)
  assert costs.max_batch == 100 and costs.devices_per_engine == 2 and costs.kv == "paged"
  assert costs.weight_bytes == 0.99e9 and costs.extra_forward_passes == 0  # the compiled FLOPs hold them


def test_a_report_that_does_not_fit_has_no_costs():
  with pytest.raises(ValueError, match="does not fit its chips"):
    compiled.compiled_costs(report(fits=False))


@pytest.mark.parametrize("variant", ["", ",roofline"])
def test_jaxrl_plan_plans_a_tpu_slice_from_the_report(tmp_path, variant):
  path = tmp_path / "report.json"
  path.write_text(json.dumps(report()))
  spec = importlib.util.spec_from_file_location("plan_tpu", REPO / "configs" / "plan_tpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(f"{path}{variant}")
  config.steps = 3
  b = plan.build(config)
  assert b["hardware"].name == "tpu_v5p" and b["pool"] == 4
  from_report = compiled.compiled_costs(
      report(), mem_eff=config.mem_eff, flop_eff=config.flop_eff, mfu=config.mfu, overhead_s=config.overhead_s,
      knee_sharpness=config.knee_sharpness, max_batch_cap=config.max_batch_cap, slot_tokens=config.slot_tokens,
      train_overhead_s=config.train_overhead_s, sync_overhead_s=config.sync_overhead_s)
  assert (b["costs"] == from_report) == (variant == "")  # ",roofline": the model shape's datasheet costs instead
  p = plan.run_plan(b)
  assert p.recommended.mode in ("sync", "pipeline") and p.sync
