"""Roofline telemetry: the analytic FLOP/byte counts against a hand count and XLA's cost analysis, the sampler's
counters, the peak table and overrides, and a tiny run that logs MFU/MBU to every sink and the progress line."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl import telemetry
from jaxrl.config import ConfigError, override, validate
from jaxrl.metrics import read_jsonl
from jaxrl.models import ModelConfig, init_params
from jaxrl.models.decoder import forward
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh
from jaxrl.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402

CFG = ModelConfig.tiny()  # V 64, E 32, F 64, 2 layers, 4 heads of 8, 2 kv heads, untied embeddings
# Per layer: q 32x32 + k 32x16 + v 32x16 + o 32x32 + SwiGLU 3 x 32x64 = 9216; 2 layers + the 64x32 head.
MATMUL_PARAMS = 2 * (32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64) + 64 * 32  # 20480
FLOPS_PER_KEY = 2 * (2 * 4 * 8) * 2  # q.k and p.v, 2 H D each, 2 layers: 256
# Every weight: the matmuls above, 2 RMSNorm scales of 32 per layer, the final norm, the input embedding 64x32.
PARAMS = MATMUL_PARAMS + 2 * 2 * 32 + 32 + 64 * 32  # 22688


def test_the_model_counts_are_the_hand_counts():
  assert telemetry.matmul_params(CFG) == MATMUL_PARAMS == 20480
  assert telemetry.flops_per_key(CFG) == FLOPS_PER_KEY == 256
  _, params = init_params(CFG, 0)
  assert sum(x.size for x in jax.tree.leaves(params)) == PARAMS  # the byte counts' parameter count is the model's
  assert telemetry.causal_keys(4, 16) == 4 * (16 * 17 // 2) == 544


def test_learner_step_counts_equal_a_hand_count():
  # 4 rows of 16 tokens, 1 epoch of 2 mini-batches, decoupled PPO's prox pass: forward + backward + 1 forward.
  forward_flops = 2 * 20480 * 64 + 256 * 544  # 2,621,440 + 139,264
  assert telemetry.learner_step_flops(CFG, 4, 16, epochs=1, fixed_passes=1) == 4 * forward_flops == 11_042_816
  assert telemetry.learner_step_flops(CFG, 4, 16, epochs=2, fixed_passes=2) == 8 * forward_flops
  # Per update (float32 params): fwd + bwd weight reads 2 x 4, gradient 4, AdamW 7 x 4 = 40 B per param; the
  # prox pass reads the weights once more: 2 x 40 + 4 = 84 B per param.
  assert telemetry.learner_step_bytes(CFG, updates=2, fixed_passes=1, param_bytes=4) == 22688 * 84 == 1_905_792


def test_sampler_counts_equal_a_hand_count():
  # 15 generated tokens that attended 120 keys; prompts of 5 and 9 tokens prefilled (15 + 45 keys).
  flops = telemetry.sampler_flops(CFG, generated=15, attended=120, prefilled=14, prefill_keys=60)
  assert flops == 2 * 20480 * (15 + 14) + 256 * (120 + 60) == 1_233_920
  # 10 decode steps and 2 prefills read the float32 weights (22688 x 4 B); keys and values of 2 layers x 2 kv
  # heads x 8 x 4 B = 256 B per position, read for each attended key, written for each new token.
  moved = telemetry.sampler_bytes(CFG, decode_steps=10, prefills=2, generated=15, attended=120, prefilled=14,
                                  bytes_per_value=4)
  assert moved == 12 * 22688 * 4 + (120 + 15 + 14) * 256 == 1_127_168
  # An int8 sampler reads its weights at one byte a parameter; its keys and values stay float32
  moved = telemetry.sampler_bytes(CFG, decode_steps=10, prefills=2, generated=15, attended=120, prefilled=14,
                                  bytes_per_value=4, weight_bytes_per_value=1)
  assert moved == 12 * 22688 + (120 + 15 + 14) * 256 == 310_400


def _cost(fn, *args):
  return fn.lower(*args).compile().cost_analysis()["flops"]


def test_xla_cost_analysis_agrees_with_the_hand_count():
  """XLA counts more than the model FLOPs: the whole L x L score and p.v matmuls (the causal mask is applied, the
  upper triangle still computed) and the elementwise work (RMSNorm, RoPE, SwiGLU, softmax), 5-6% of this tiny
  model's forward; the count with the full square is within 10% below XLA's. Layers unrolled: XLA's cost analysis
  counts a loop's body once."""
  cfg = ModelConfig.tiny(scan_unroll=2)
  graphdef, params = init_params(cfg, 0)
  rows, length = 4, 16
  tokens = jnp.zeros((rows, length), jnp.int32)
  positions, segments = jnp.broadcast_to(jnp.arange(length), (rows, length)), jnp.ones((rows, length), jnp.int32)
  logits = lambda p: forward(graphdef, p, tokens, positions, segments)  # noqa: E731
  model = telemetry.forward_flops(cfg, rows * length, telemetry.causal_keys(rows, length))
  square = telemetry.forward_flops(cfg, rows * length, rows * length * length)
  xla = _cost(jax.jit(logits), params)
  assert model < square <= xla <= 1.1 * square
  xla_grad = _cost(jax.jit(jax.value_and_grad(lambda p: logits(p).sum())), params)
  assert 3 * model < 3 * square <= xla_grad <= 1.1 * 3 * square  # forward + backward: 3 forwards


def test_sampler_counts_its_attended_keys_and_prefills():
  engine = make_engine(CFG, make_mesh({"data": 1}, jax.devices()[:1]), max_slots=4, max_len=32, steps_per_call=4,
                       min_bucket=8)
  _, params = init_params(CFG, 0)
  sampler = Sampler(engine, params, eos_token_ids=())
  greedy = SamplingParams(greedy=True)
  sampler.submit(np.arange(2, 7), group_id=0, n=2, max_tokens=6, sampling=greedy)  # one prefill for both samples
  sampler.submit(np.arange(2, 11), group_id=1, max_tokens=3, sampling=greedy)
  while sampler.num_active or sampler.num_waiting:
    sampler.step()
  s = sampler.stats
  assert s.generated_tokens == 2 * 6 + 3
  # Token j of a completion is drawn at position prompt + j - 1, attending prompt + j keys.
  assert s.attended_keys == 2 * sum(5 + j for j in range(6)) + sum(9 + j for j in range(3)) == 120
  assert (s.prefills, s.prefill_tokens, s.prefill_keys) == (2, 5 + 9, 15 + 45)


def test_the_device_table_and_the_overrides():
  h100 = telemetry.table_peak("NVIDIA H100 80GB HBM3")
  assert (h100.flops, h100.bandwidth) == (989e12, 3.35e12)
  assert telemetry.table_peak("NVIDIA H200").bandwidth == 4.8e12  # not the H20's 4.0e12
  assert telemetry.table_peak("NVIDIA A100-SXM4-80GB").flops == 312e12
  assert telemetry.table_peak("TPU v4").flops == 275e12
  assert telemetry.table_peak("TPU v5 lite").flops == 197e12
  assert telemetry.table_peak("TPU v5").flops == 459e12
  assert telemetry.table_peak("TPU v5p").flops == 459e12
  assert telemetry.table_peak("TPU v6 lite").flops == 918e12
  assert telemetry.table_peak("cpu") is None
  on_h100 = telemetry.device_peak("NVIDIA H100 80GB HBM3", "bfloat16")
  assert on_h100.flops == 989e12 and on_h100.source.startswith("table h100")
  set_both = telemetry.device_peak("NVIDIA H100 80GB HBM3", "bfloat16", flops=5e14, bandwidth=2e12)
  assert (set_both.flops, set_both.bandwidth) == (5e14, 2e12)
  assert telemetry.device_peak("NVIDIA H100 80GB HBM3", "bfloat16", bandwidth=2e12).flops == 989e12
  measured = telemetry.device_peak("cpu", "float32")
  assert measured.source.startswith("measured") and measured.flops > 0 and measured.bandwidth > 0
  assert telemetry.device_peak("NVIDIA H100 80GB HBM3", "float32", mode="measure") == measured
  with pytest.raises(ValueError, match="peak mode 'table'"):
    telemetry.device_peak("cpu", "float32", mode="table")
  assert telemetry.side_peak(h100, 4, "gpu").flops == 4 * 989e12
  assert telemetry.side_peak(measured, 4, "cpu") == measured  # CPU devices share the host
  c = tiny.get_config()
  c.log.peak_flops = -1.0
  with pytest.raises(ConfigError, match="log.peak_flops must be a number >= 0"):
    validate(c)


def test_telemetry_rates_over_each_sides_busy_time():
  work = telemetry.Work(CFG, seq_len=16, epochs=1, updates=2, fixed_passes=1, param_bytes=4,
                        sampler_bytes_per_value=4, steps_per_call=5)
  peak = telemetry.Peak(1e9, 1e8, "test")
  t = telemetry.Telemetry(work, learner=peak, sampler=peak.times(2))
  counters = dict(seconds=2.0, generated_tokens=15, attended_keys=120, prefill_tokens=14, prefill_keys=60,
                  decode_calls=2, prefills=2)
  got = t({"train_s": 0.5, "train_tokens": 64.0, **{f"sampler/{k}": v for k, v in counters.items()}})
  assert got["learner_flops_per_s"] == 11_042_816 / 0.5 and got["learner_mfu"] == 11_042_816 / 0.5 / 1e9
  assert got["learner_bytes_per_s"] == 1_905_792 / 0.5 and got["learner_mbu"] == 1_905_792 / 0.5 / 1e8
  assert got["sampler_flops_per_s"] == 1_233_920 / 2.0 and got["sampler_mfu"] == 1_233_920 / 2.0 / 2e9
  assert got["sampler_mbu"] == 1_127_168 / 2.0 / 2e8
  # Only what the samplers did since the last step counts; nothing new: no sampler numbers this step.
  twice = {f"sampler/{k}": 2 * v for k, v in counters.items()}
  again = t({"train_s": 0.5, "train_tokens": 64.0, **twice})
  assert again["sampler_flops_per_s"] == got["sampler_flops_per_s"]
  idle = t({"train_s": 0.5, "train_tokens": 64.0, **twice})
  assert set(idle) == {"learner_flops_per_s", "learner_bytes_per_s", "learner_mfu", "learner_mbu"}


def test_a_tiny_run_logs_mfu_and_mbu_everywhere(tmp_path, capsys):
  c = override(tiny.get_config(), num_steps=3, **{"log.backends": ("jsonl", "tensorboard")})
  train(c, tmp_path)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert len(records) == 3
  for r in records:
    for side in ("learner", "sampler")[: 2 if "sampler_mfu" in r else 1]:
      assert r[f"{side}_flops_per_s"] > 0 and r[f"{side}_bytes_per_s"] > 0
      assert 0 < r[f"{side}_mfu"] <= 1 and 0 < r[f"{side}_mbu"] <= 1
  assert "sampler_mfu" in records[0]  # the first step's share was generated before it
  events = b"".join(p.read_bytes() for p in (tmp_path / "tb").glob("events.out.tfevents.*"))
  assert all(key.encode() in events for key in telemetry.KEYS)
  err = capsys.readouterr().err
  assert "[step 3/3" in err and " mfu/l " in err and " mbu/l " in err and " mfu/s " in err and " mbu/s " in err
