"""Systems-model features for real clusters: MoE costs, learner scaling per device count and mode, extra
learner passes, admission budgets, draining vs partial rollouts, intervals over seeds, hardware presets."""

import math
import os
import re

import numpy as np
import pytest

from jaxrl.sim import costs as C
from jaxrl.sim import intervals
from jaxrl.sim import lengths as L
from jaxrl.sim.hardware import PRESETS, preset
from jaxrl.sim.simulate import RunSpec, simulate_pipeline, simulate_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qwen3_30b_a3b():
  # Qwen3-30B-A3B's config.json: 48 layers, hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, 8 routed,
  # no shared expert, untied embeddings of 151,936. Its model card: 30.5B parameters, 3.3B activated.
  return C.ModelSpec.from_dims("qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=0,
                               num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128,
                               experts_per_token=8, moe_intermediate_size=768)


def test_moe_counts_total_and_active_params_as_published():
  m = qwen3_30b_a3b()
  assert m.params == pytest.approx(30.5e9, rel=0.01)
  assert m.flop_params == pytest.approx(3.3e9, rel=0.02)
  assert m.expert_params == 48 * 128 * 3 * 2048 * 768
  dense = C.ModelSpec.from_dims("d", vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16)
  assert dense.flop_params == dense.params and dense.expert_fraction == 0.0


def test_moe_decode_reads_the_experts_its_tokens_route_to():
  m, hw = qwen3_30b_a3b(), preset("h100")
  curve = C.roofline_decode(m, hw, 1)
  f, routed = m.expert_fraction, 8 / 128
  assert curve.weights_read_s(1) == pytest.approx(curve.weights_s * (1 - f + f * routed), rel=1e-12)
  assert curve.weights_read_s(4) == pytest.approx(curve.weights_s * (1 - f + f * (1 - (1 - routed) ** 4)))
  assert curve.weights_read_s(4096) == pytest.approx(curve.weights_s, rel=1e-9)  # every expert is touched
  # FLOPs follow the active parameters, memory the total.
  assert curve.compute_s_per_seq == pytest.approx(2 * m.flop_params / hw.peak_flops)
  assert C.train_tokens_per_s_per_device(m, hw, 0.4) == pytest.approx(hw.peak_flops * 0.4 / (6 * m.flop_params))
  assert C.kv_limited_batch(m, hw, 1, 4096) == int((hw.hbm_bytes - m.weight_bytes) // (m.kv_bytes_per_token * 4096))
  # A simulated one-token step equals the curve at that batch (the engine uses the batch-dependent read).
  costs = C.Costs(decode=curve, devices_per_engine=1, max_batch=64, prefill_s_per_token=0.0,
                  train_tokens_per_s_per_device=1e30, weight_bytes=1.0, link_bandwidth=1e30)
  r = simulate_sync(costs, RunSpec(1, 1, 3, 1, 0, L.Empirical([1]), prompt_len=100, steps=1, warmup_steps=0),
                    colocated=False)
  assert np.all(r.samples["finish_s"][r.trained] == pytest.approx(curve.step_time(3, 300), rel=1e-12))


@pytest.mark.parametrize("bad, match", [
    (dict(num_experts=8, experts_per_token=9, moe_intermediate_size=16), "experts_per_token"),
    (dict(num_experts=8, experts_per_token=2, moe_intermediate_size=0), "moe_intermediate_size"),
])
def test_moe_bad_sizes(bad, match):
  with pytest.raises(ValueError, match=match):
    C.ModelSpec.from_dims("m", vocab_size=10, hidden_size=8, intermediate_size=0, num_layers=1, num_heads=1,
                          num_kv_heads=1, head_dim=8, **bad)


def costs_with(**kw):
  base = dict(decode=C.DecodeCurve(0.01, 1e-6, 1e-4, 1e-3), devices_per_engine=1, max_batch=64,
              prefill_s_per_token=0.0, train_tokens_per_s_per_device=1000.0, weight_bytes=1e6,
              link_bandwidth=1e10)
  return C.Costs(**dict(base, **kw))


def test_learner_throughput_per_device_count_and_mode():
  c = costs_with(train_scaling=((8, 1000.0), (32, 800.0)), sync_train_scaling=((32, 500.0),))
  assert c.train_tokens_per_s(8) == 1000.0 and c.train_tokens_per_s(32) == 800.0
  assert c.train_tokens_per_s(16) == pytest.approx(900.0)  # halfway in log(devices)
  assert c.train_tokens_per_s(2) == 1000.0 and c.train_tokens_per_s(64) == 800.0  # flat outside the points
  assert c.train_tokens_per_s(32, colocated=True) == 500.0
  assert costs_with().train_tokens_per_s(7) == 1000.0  # no table: the single figure
  assert c.train_time(16000, 16) == pytest.approx(16000 / (16 * 900.0))
  # Two extra forward passes (old log-probs and a reference model) cost (6 + 4) / 6 of the trained pass.
  assert costs_with(extra_forward_passes=2).train_time(6000, 1) == pytest.approx(10.0)


def test_colocated_sync_trains_at_its_own_rate():
  lengths = L.Empirical([20])
  spec = RunSpec(2, 2, 8, 2, 0, lengths, prompt_len=4, steps=3)
  fast = simulate_sync(costs_with(), spec, colocated=True)
  slow = simulate_sync(costs_with(sync_train_scaling=((4, 500.0),)), spec, colocated=True)
  train = [e - s for lane, k, s, e in fast.timeline if lane == "learner" and k == "train"]
  train_slow = [e - s for lane, k, s, e in slow.timeline if lane == "learner" and k == "train"]
  np.testing.assert_allclose(train_slow, 2 * np.asarray(train), rtol=1e-12)
  pipe = simulate_pipeline(costs_with(sync_train_scaling=((4, 500.0),)), spec.replace(max_staleness=1))
  assert pipe.step_time_s == pytest.approx(simulate_pipeline(costs_with(), spec.replace(max_staleness=1)).step_time_s)


@pytest.mark.parametrize("kw, match", [
    (dict(train_scaling=((0, 10.0),)), "train_scaling"),
    (dict(sync_train_scaling=((4, 10.0), (4, 12.0))), "twice"),
    (dict(extra_forward_passes=-1), "extra_forward_passes"),
])
def test_bad_learner_costs(kw, match):
  with pytest.raises(ValueError, match=match):
    costs_with(**kw)


def test_queue_smaller_than_a_step_is_a_config_error():
  with pytest.raises(ValueError, match="queue_groups=2 is smaller than the 4 groups"):
    RunSpec(2, 2, 16, 4, 1, L.Empirical([10]), queue_groups=2)
  RunSpec(2, 2, 16, 4, 1, L.Empirical([10]), queue_groups=4)  # a step's worth is enough


def tail_spec(**kw):
  lengths = L.Mixture([L.LogNormal(40.0, 0.5, 2000), L.LogNormal(600.0, 0.3, 2000)], [0.97, 0.03])
  args = dict(sampler_devices=2, learner_devices=2, batch_size=32, group_size=4, max_staleness=1, lengths=lengths,
              prompt_len=16, steps=12, seed=1)
  return RunSpec(**dict(args, **kw))


def test_admission_budget_trains_in_completion_order_with_unbounded_staleness():
  costs = costs_with(max_batch=256, train_tokens_per_s_per_device=1e5)
  dl = simulate_pipeline(costs, tail_spec())
  bud = simulate_pipeline(costs, tail_spec(admission="budget", admission_budget=1.0))
  assert dl.staleness.max() <= 1  # the deadline rule bounds staleness
  assert bud.staleness.max() > 1  # the same budget without deadlines lets long groups fall behind
  # The learner never waits for a late group: completion order decides, so it is no slower.
  assert bud.step_time_s <= dl.step_time_s * 1.001
  s, tr = bud.samples, bud.trained
  done = np.zeros(s["group"].max() + 1)
  np.maximum.at(done, s["group"][tr], s["finish_s"][tr])
  groups = np.unique(s["group"][tr])
  order = groups[np.argsort(done[groups], kind="stable")]
  step_of = {int(g): int(s["step"][s["group"] == g][0]) for g in groups}
  assert all(step_of[int(a)] <= step_of[int(b)] for a, b in zip(order, order[1:], strict=False))


@pytest.mark.parametrize("budget", [0.5, 1.25])
def test_fractional_budget_admits_part_of_a_step_ahead(budget):
  costs = costs_with(max_batch=1024)
  r = simulate_pipeline(costs, tail_spec(admission="budget", admission_budget=budget))
  s = r.samples
  started_at_v0 = np.unique(s["group"][(s["start_version"] == 0)]).size
  assert started_at_v0 == math.floor((1 + budget) * 32 // 4)  # groups of 4, 8 groups a step


def test_sync_ignores_the_admission_variant():
  costs = costs_with()
  a = simulate_sync(costs, tail_spec(), colocated=False)
  b = simulate_sync(costs, tail_spec(admission="budget", admission_budget=2.0), colocated=False)
  np.testing.assert_array_equal(a.step_end_s, b.step_end_s)


def test_draining_engines_never_mix_versions_in_a_sample():
  costs = costs_with(max_batch=16)
  partial = simulate_pipeline(costs, tail_spec(max_staleness=2))
  drain = simulate_pipeline(costs, tail_spec(max_staleness=2, partial_rollouts=False))
  s = partial.samples
  assert np.any(s["end_version"][partial.trained] > s["start_version"][partial.trained])
  s = drain.samples
  assert np.all(s["end_version"][drain.trained] == s["start_version"][drain.trained])
  assert drain.staleness.max() <= 2 and drain.step_time_s > partial.step_time_s


@pytest.mark.parametrize("kw, match", [
    (dict(admission="fifo"), "admission must be"),
    (dict(admission_budget=1.0), "needs admission='budget'"),
    (dict(admission="budget", admission_budget=-0.5), "admission_budget must be >= 0"),
])
def test_bad_admission(kw, match):
  with pytest.raises(ValueError, match=match):
    tail_spec(**kw)


def test_interval_over_seeds_and_windows():
  costs = costs_with()
  spec = tail_spec(max_staleness=1)
  iv = intervals.step_time_interval(lambda sp: simulate_pipeline(costs, sp), spec, seeds=6)
  runs = [simulate_pipeline(costs, spec.replace(seed=spec.seed + i)).step_time_s for i in range(6)]
  assert iv.per_seed == tuple(runs) and iv.median == pytest.approx(np.median(runs))
  assert iv.lo <= iv.median <= iv.hi and iv.window == 2 and iv.window_lo <= iv.window_hi
  assert iv.lo < iv.hi  # long tails: seeds differ
  # Evenly spaced steps: every window is the step time.
  even = simulate_sync(costs, RunSpec(1, 1, 8, 2, 0, L.Empirical([30]), prompt_len=4, steps=6), colocated=False)
  np.testing.assert_allclose(intervals.window_step_times(even, 3), even.step_time_s, rtol=1e-9)
  with pytest.raises(ValueError, match="seeds >= 1"):
    intervals.step_time_interval(lambda sp: simulate_pipeline(costs, sp), spec, seeds=0)


def test_presets_listed_in_the_plan_config_and_docs():
  text = open(os.path.join(ROOT, "jaxrl", "sim", "plan_config.py")).read()
  listed = re.search(r"preset: ([a-z0-9_, ]+)\n", text).group(1)
  assert sorted(n.strip() for n in listed.split(",")) == sorted(PRESETS)
  docs = open(os.path.join(ROOT, "docs", "SIMULATOR.md")).read()
  assert all(f"| `{name}` |" in docs for name in PRESETS)
  for hw in PRESETS.values():
    assert hw.link_bandwidth < hw.hbm_bandwidth
  h100, h800, h20 = preset("h100"), preset("h800"), preset("h20")
  assert (h800.peak_flops, h800.hbm_bandwidth) == (h100.peak_flops, h100.hbm_bandwidth)
  assert h800.link_bandwidth < h100.link_bandwidth and h20.peak_flops < 0.2 * h100.peak_flops
