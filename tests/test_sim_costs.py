"""Cost model: the scaling-book LLaMA-2-13B decode table, memory limits, train and transfer time, bad input."""

import math

import numpy as np
import pytest

from jaxrl.models.config import ModelConfig
from jaxrl.sim import costs
from jaxrl.sim.hardware import PRESETS, GiB, preset

# "All About Transformer Inference" (jax-ml scaling book, part 7), "Modeling throughput and latency for
# LLaMA 2-13B": 8 TPU v5e, bf16, a KV cache of 8192 tokens per sequence (6.7 GB each), step time =
# (batch * KV bytes + param bytes) / total HBM bandwidth. The book's "6.5 TiB/s" is 8 x 8.2e11 B/s.
BOOK_STEP_MS = {1: 4.98, 8: 12.13, 16: 20.30, 32: 36.65, 64: 69.33, 240: 249.09}
BOOK_CONTEXT = 8192


def llama2_13b():
  return costs.ModelSpec.from_dims("llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                                   num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128)


def test_llama2_13b_size():
  m = llama2_13b()
  assert m.params == 13_015_864_320  # the published 13.0B
  assert m.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2  # K and V, 40 layers, 40 heads of 128, bf16
  assert m.kv_bytes_per_token * BOOK_CONTEXT / 1e9 == pytest.approx(6.7, abs=0.05)  # the book's "6.7" per seq


@pytest.mark.parametrize("batch", sorted(BOOK_STEP_MS))
def test_scaling_book_decode_step_times(batch):
  curve = costs.roofline_decode(llama2_13b(), preset("tpu_v5e"), devices=8)
  ms = 1e3 * curve.step_time(batch, batch * BOOK_CONTEXT)
  assert ms == pytest.approx(BOOK_STEP_MS[batch], rel=0.02)


def test_scaling_book_gqa_variant():
  # Same 13B params, KV cache 5x smaller (8 KV heads): 4.17 ms at batch 1, 17.04 ms at 64, 52.99 ms at 240.
  base = llama2_13b()
  m = costs.ModelSpec("13b-gqa", base.params, base.kv_bytes_per_token / 5)
  curve = costs.roofline_decode(m, preset("tpu_v5e"), devices=8)
  for b, want in ((1, 4.17), (64, 17.04), (240, 52.99)):
    assert 1e3 * curve.step_time(b, b * BOOK_CONTEXT) == pytest.approx(want, rel=0.02)


def test_scaling_book_oom_beyond_16():
  # 8 x 16 GiB of HBM holds the weights and 16 sequences of 8192 tokens ("We OOM beyond batch size 16").
  assert costs.kv_limited_batch(llama2_13b(), preset("tpu_v5e"), 8, BOOK_CONTEXT) == 16


def test_roofline_terms_are_the_formula():
  m, hw = llama2_13b(), preset("h100")
  c = costs.roofline_decode(m, hw, 2, mem_eff=0.5, flop_eff=0.25, overhead_s=1e-3)
  bw, flops = 2 * hw.hbm_bandwidth * 0.5, 2 * hw.peak_flops * 0.25
  for b, ctx in ((1, 100), (50, 4000), (5000, 10)):
    want = 1e-3 + b * ctx * m.kv_bytes_per_token / bw + max(m.weight_bytes / bw, 2 * m.params * b / flops)
    assert c.step_time(b, b * ctx) == pytest.approx(want, rel=1e-12)
  assert c.knee_batch == pytest.approx((m.weight_bytes / bw) / (2 * m.params / flops))


def test_smooth_knee_bounds():
  hard = costs.DecodeCurve(0.01, 1e-8, 1e-4)
  soft = costs.DecodeCurve(0.01, 1e-8, 1e-4, knee_sharpness=4.0)
  b = np.array([1, 10, 100, 1000, 10000])
  t_hard, t_soft = hard.step_time(b, b * 100), soft.step_time(b, b * 100)
  assert np.all(t_soft >= t_hard)
  assert np.all(t_soft - t_hard <= (2 ** 0.25 - 1) * 0.01 * (b / 100).clip(min=1) + 1e-15)
  assert t_soft[2] - t_hard[2] == pytest.approx((2 ** 0.25 - 1) * 0.01)  # largest at the knee (batch 100)
  assert t_soft[0] == pytest.approx(t_hard[0], rel=1e-6)  # far from the knee they agree


def test_train_and_transfer_time():
  m, hw = llama2_13b(), preset("tpu_v5p")
  tps = costs.train_tokens_per_s_per_device(m, hw, mfu=0.5)
  assert tps == pytest.approx(459e12 * 0.5 / (6 * m.params))
  # 16 B/param of training state on 95 GiB chips.
  assert costs.learner_min_devices(m, hw) == math.ceil(m.params * 16 / (95 * GiB))
  # 4 engines x 26 GB from 8 learner devices to 8 sampler devices at 600 GB/s: 13 GB per device.
  assert costs.transfer_time(m.weight_bytes, 600e9, 8, 8, copies=4) == pytest.approx(m.weight_bytes * 4 / 8 / 600e9)
  assert costs.transfer_time(1e9, 1e9, 1, 4, copies=4) == pytest.approx(4.0)  # one sender is the bottleneck


def test_from_model_config_matches_dims():
  cfg = ModelConfig.tiny()
  m = costs.ModelSpec.from_model_config(cfg, name="tiny")
  d, v, f, n_l, hd = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
  q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
  assert m.params == n_l * (2 * d * q + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d
  assert m.kv_bytes_per_token == 2 * n_l * kv * 2


def test_presets_have_sources():
  for name, hw in PRESETS.items():
    assert hw.name == name and hw.source
  with pytest.raises(ValueError, match="unknown hardware preset 'tpu_v9'"):
    preset("tpu_v9")


@pytest.mark.parametrize("bad", [
    lambda: costs.ModelSpec("m", -1.0, 10.0),
    lambda: costs.ModelSpec.from_dims("m", vocab_size=10, hidden_size=-8, intermediate_size=8, num_layers=1,
                                      num_heads=1, num_kv_heads=1, head_dim=8),
    lambda: costs.roofline_decode(llama2_13b(), preset("h100"), devices=0),
    lambda: costs.DecodeCurve(-0.1, 0.0, 0.0),
    lambda: costs.DecodeCurve(0.1, 0.0, 0.0).step_time(0, 10),
    lambda: costs.DecodeCurve(0.1, 0.0, 0.0).step_time(4, -1),
    lambda: costs.kv_limited_batch(llama2_13b(), preset("h100"), 1, slot_tokens=-5),
    lambda: costs.train_tokens_per_s_per_device(llama2_13b(), preset("h100"), mfu=1.5),
    lambda: preset("h100").replace(hbm_bandwidth=0),
    lambda: costs.roofline_costs(llama2_13b(), preset("tpu_v5e"), devices_per_engine=1, slot_tokens=8192),
])
def test_bad_input_raises(bad):
  with pytest.raises(ValueError):
    bad()


def test_pulled_weights_are_staged_once_and_taken_by_each_engine():
  c = costs.Costs(decode=costs.DecodeCurve(0.01, 0.0, 0.0), devices_per_engine=1, max_batch=4, prefill_s_per_token=0.0,
                  train_tokens_per_s_per_device=1.0, weight_bytes=1e9, link_bandwidth=1e9, sync_overhead_s=0.5)
  assert c.update_times(1, 4) == (4.5, 4.5)  # pushed: a copy per engine (4 GB at 1 GB/s), each engine waits for it
  pulled = c.replace(pull_bandwidth=2.5e8)
  assert pulled.update_times(1, 4) == (1.5, 4.0)  # one staged copy; each engine's take is bytes / pull_bandwidth
  with pytest.raises(ValueError, match=r"pull_bandwidth must be >= 0 \(got -1.0\)"):
    c.replace(pull_bandwidth=-1.0)


def test_slowed_stretches_the_sampler_and_the_learner_apart():
  c = costs.Costs(decode=costs.DecodeCurve(0.01, 1e-6, 1e-4, overhead_s=0.002), devices_per_engine=1, max_batch=4,
                  prefill_s_per_token=1e-3, train_tokens_per_s_per_device=100.0, weight_bytes=1.0, link_bandwidth=1.0,
                  train_overhead_s=0.5, rebuild_s_per_token=1e-3, train_scaling=((1, 100.0), (4, 50.0)))
  assert c.slowed() == c
  s = c.slowed(decode_x=2.0, train_x=3.0)
  assert s.decode.step_time(3, 30) == pytest.approx(2 * c.decode.step_time(3, 30), rel=1e-12)
  assert (s.prefill_s_per_token, s.rebuild_s_per_token) == (2e-3, 2e-3)
  for devices in (1, 2, 4):
    assert s.train_time(1000, devices) == pytest.approx(3 * c.train_time(1000, devices), rel=1e-12)
