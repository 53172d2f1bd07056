"""Systems model of the paged KV cache: slots limited by pages of live tokens, KV reads per live token, and an
in-flight update's recompute proportional to live tokens (dense: every slot up to the longest)."""

import numpy as np
import pytest

from jaxrl.sim import costs as C
from jaxrl.sim.hardware import PRESETS
from jaxrl.sim.lengths import LogNormal
from jaxrl.sim.simulate import RunSpec, simulate_pipeline

QWEN_1_5B = C.ModelSpec.from_dims("qwen2.5-1.5b", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                  num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, tie_embeddings=True)


def test_pages_of_live_tokens_fit_more_sequences_than_max_len_slots():
  hw = PRESETS["h100"]
  dense = C.kv_limited_batch(QWEN_1_5B, hw, 1, slot_tokens=8192)
  paged = C.paged_kv_batch(QWEN_1_5B, hw, 1, live_tokens=2048, page_size=16)
  free = hw.hbm_bytes - QWEN_1_5B.weight_bytes
  assert dense == int(free // (QWEN_1_5B.kv_bytes_per_token * 8192))
  assert paged == int(free // (QWEN_1_5B.kv_bytes_per_token * (2048 + 8)))
  assert 3.9 < paged / dense < 4.0
  costs = C.roofline_costs(QWEN_1_5B, hw, devices_per_engine=1, slot_tokens=8192, kv="paged", live_tokens=2048,
                           max_batch_cap=10**6)
  assert costs.max_batch == paged and costs.rebuild_s_per_token == C.prefill_s_per_token(QWEN_1_5B, hw, 1)
  with pytest.raises(ValueError, match="needs live_tokens"):
    C.roofline_costs(QWEN_1_5B, hw, devices_per_engine=1, slot_tokens=8192, kv="paged")


def test_decode_reads_kv_per_live_token_and_rebuild_follows_the_layout():
  curve = C.DecodeCurve(weights_s=1e-3, kv_s_per_token=1e-8, compute_s_per_seq=1e-5)
  assert curve.step_time(8, 5000) - curve.step_time(8, 0) == pytest.approx(5e-5)
  base = C.Costs(decode=curve, devices_per_engine=1, max_batch=64, prefill_s_per_token=1e-6,
                 train_tokens_per_s_per_device=1e4, weight_bytes=1e9, link_bandwidth=1e10, rebuild_s_per_token=1e-6)
  assert base.rebuild_time(context_tokens=3000, longest=900) == pytest.approx(64 * 900 * 1e-6)
  assert base.replace(kv="paged").rebuild_time(context_tokens=3000, longest=900) == pytest.approx(3000 * 1e-6)
  with pytest.raises(ValueError, match="kv must be"):
    base.replace(kv="ragged")


def test_simulated_updates_cost_what_the_layout_recomputes():
  curve = C.DecodeCurve(weights_s=2e-3, kv_s_per_token=1e-8, compute_s_per_seq=2e-5)
  costs = C.Costs(decode=curve, devices_per_engine=1, max_batch=32, prefill_s_per_token=1e-5,
                  train_tokens_per_s_per_device=2e4, weight_bytes=1e9, link_bandwidth=1e11)
  spec = RunSpec(sampler_devices=1, learner_devices=1, batch_size=32, group_size=8, max_staleness=1,
                 lengths=LogNormal(200, 1.0, 2000), prompt_len=64, steps=12, warmup_steps=2, seed=0)

  def sync_busy(c):
    r = simulate_pipeline(c, spec)
    return sum(end - start for lane, kind, start, end in r.timeline if kind == "sync" and lane != "learner")

  free = sync_busy(costs)
  dense = sync_busy(costs.replace(rebuild_s_per_token=1e-5))
  paged = sync_busy(costs.replace(rebuild_s_per_token=1e-5, kv="paged"))
  assert free < paged < dense
  assert (dense - free) > 2 * (paged - free)
  assert np.isfinite([free, paged, dense]).all()
