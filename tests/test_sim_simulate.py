"""Event simulator: closed-form step times, the reported long tail, pipeline invariants, bad input."""

import math

import numpy as np
import pytest

from jaxrl.sim import costs as C
from jaxrl.sim import lengths as L
from jaxrl.sim.hardware import preset
from jaxrl.sim.simulate import RunSpec, simulate_pipeline, simulate_sync

FAST = dict(train_tokens_per_s_per_device=1e30, weight_bytes=1.0, link_bandwidth=1e30)


def make_costs(curve, dpe=1, max_batch=1024, prefill=0.0, **kw):
  args = dict(FAST, **kw)
  return C.Costs(decode=curve, devices_per_engine=dpe, max_batch=max_batch, prefill_s_per_token=prefill, **args)


def llama2_13b():
  return C.ModelSpec.from_dims("llama-2-13b", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                               num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128)


@pytest.mark.parametrize("batch, book_ms", [(1, 4.98), (8, 12.13), (16, 20.30)])
def test_decode_bound_step_equals_roofline(batch, book_ms):
  # One decode step for `batch` sequences at 8192 tokens of context on 8 v5e chips (the scaling-book table).
  curve = C.roofline_decode(llama2_13b(), preset("tpu_v5e"), 8)
  spec = RunSpec(8, 8, batch, 1, 0, L.Empirical([1]), prompt_len=8192, steps=1, warmup_steps=0)
  r = simulate_sync(make_costs(curve, dpe=8), spec, colocated=False)
  want = curve.step_time(batch, batch * 8192)
  assert np.all(r.samples["finish_s"][r.trained] == pytest.approx(want, rel=1e-12))
  assert 1e3 * want == pytest.approx(book_ms, rel=0.02)
  assert r.step_time_s == pytest.approx(want, rel=1e-9)  # train and weight sync cost ~0 here


def test_shrinking_survivor_batch_matches_per_step_sum():
  curve = C.DecodeCurve(weights_s=0.01, kv_s_per_token=2e-6, compute_s_per_seq=1e-3, overhead_s=1e-3)
  spec = RunSpec(1, 1, 24, 4, 0, L.LogNormal(60.0, 0.8, 400), prompt_len=32, steps=1, warmup_steps=0, seed=3)
  r = simulate_sync(make_costs(curve), spec, colocated=False)
  n = r.samples["length"][r.trained]
  assert len(np.unique(n)) > 10  # really a spread of lengths
  t, done_at = 0.0, {}
  for i in range(n.max()):  # one decode step at a time: survivors are the samples longer than i
    live = n > i
    t += curve.step_time(live.sum(), live.sum() * (32 + i))
    done_at[i + 1] = t
  want = np.array([done_at[x] for x in n])
  np.testing.assert_allclose(r.samples["finish_s"][r.trained], want, rtol=1e-9)


def test_continuous_batching_refills_slots():
  curve = C.DecodeCurve(weights_s=0.01, kv_s_per_token=0.0, compute_s_per_seq=0.0)
  prefill = 1e-4
  spec = RunSpec(1, 1, 6, 1, 0, L.Empirical([50]), prompt_len=10, steps=1, warmup_steps=0)
  r = simulate_sync(make_costs(curve, max_batch=2, prefill=prefill), spec, colocated=False)
  fin = np.sort(r.samples["finish_s"][r.trained])
  # Three waves of two: each wave is two prefills then 50 steps of 10 ms.
  want = np.repeat([(k + 1) * (2 * 10 * prefill + 0.5) for k in range(3)], 2)
  np.testing.assert_allclose(fin, want, rtol=1e-12)


def reported_tail_costs():
  # A ~32B dense model (Qwen2.5-32B shapes) on 8 H200s as 4 tensor-parallel engines of 2, paged KV.
  m = C.ModelSpec.from_dims("qwen2.5-32b", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                            num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128)
  c = C.roofline_costs(m, preset("h200"), devices_per_engine=2, slot_tokens=2048, mem_eff=0.8, flop_eff=0.5,
                       overhead_s=0.005, kv_mem_fraction=0.9)
  return c.replace(**FAST)


# Matches the publicly reported sync step (Applied Compute, AI Engineer 2025: 40 prompts x 32 samples of a
# ~30B model, 99% of samples done by ~40 s, the step ends near 120 s): a lognormal body and a 0.5% runaway tail.
# (A 1% tail put the 99th percentile inside the tail on about half the seeds: 13 +- 3.6 runaways in 1,280.)
REPORTED_TAIL = L.Mixture([L.LogNormal(500.0, 0.47, 8192), L.LogNormal(6000.0, 0.3, 8192)], [0.995, 0.005])


def test_reported_long_tail_two_thirds_on_last_percent():
  shares = []
  for seed in range(40):  # holds on every seed, not on a picked one
    spec = RunSpec(8, 8, 1280, 32, 0, REPORTED_TAIL, prompt_len=256, steps=1, warmup_steps=0, seed=seed)
    r = simulate_sync(reported_tail_costs(), spec, colocated=False)
    fin = np.sort(r.samples["finish_s"][r.trained])
    assert fin.size == 1280
    t99, t_end = fin[math.ceil(0.99 * fin.size) - 1], fin[-1]
    assert 30 < t99 < 50 and 90 < t_end < 140, seed  # "99% by about 40 s, ends near 120 s"
    shares.append((t_end - t99) / t_end)
  assert min(shares) > 0.55 and max(shares) < 0.75
  assert 0.65 < np.median(shares) < 0.72  # about two thirds of the step on the last 1%


def test_pipeline_with_k0_is_the_sync_loop():
  curve = C.DecodeCurve(0.01, 1e-6, 1e-4, 1e-3)
  costs = make_costs(curve, max_batch=16, prefill=1e-5, train_tokens_per_s_per_device=2e4)
  spec = RunSpec(2, 2, 32, 4, 0, L.LogNormal(40.0, 0.7, 300), prompt_len=16, steps=5)
  p, s = simulate_pipeline(costs, spec), simulate_sync(costs, spec, colocated=False)
  np.testing.assert_allclose(p.step_end_s, s.step_end_s, rtol=1e-12)
  assert np.all(p.staleness == 0)


def pipeline_run(k=2, group_size=1, sigma=1.0, steps=10, lengths=None):
  curve = C.DecodeCurve(0.01, 1e-6, 2e-4, 1e-3)
  costs = make_costs(curve, max_batch=32, prefill=1e-5, train_tokens_per_s_per_device=3e4, weight_bytes=1e8,
                     link_bandwidth=1e10)
  spec = RunSpec(4, 2, 32, group_size, k, lengths or L.LogNormal(50.0, sigma, 1000), prompt_len=16, steps=steps)
  return spec, simulate_pipeline(costs, spec)


@pytest.mark.parametrize("k, group_size", [(1, 4), (2, 1), (3, 8)])
def test_pipeline_invariants(k, group_size):
  spec, r = pipeline_run(k=k, group_size=group_size)
  s = r.samples
  tr = r.trained
  assert r.staleness.max() <= k  # never trained beyond the bound (and nothing is dropped to get there)
  steps = s["step"][tr]
  assert np.array_equal(np.bincount(steps), np.full(spec.total_steps, spec.batch_size))  # full batches
  for g in np.unique(s["group"][tr]):  # complete-group rule: a group is trained whole, in one step
    m = s["group"] == g
    assert np.all(tr[m]) and len(set(s["step"][m])) == 1
  assert np.all(s["finish_s"][tr] <= s["trained_s"][tr])  # only finished samples are trained on
  assert np.all(s["start_version"][tr] <= s["end_version"][tr])
  assert np.any(s["end_version"][tr] > s["start_version"][tr])  # in-flight updates: versions mix in a sample
  assert np.all(s["staleness"][tr] == s["step"][tr] - s["start_version"][tr])
  assert 0 < r.sampler_idle_frac < 1 and 0 <= r.learner_idle_frac < 1


def test_staleness_grows_with_length():
  _, r = pipeline_run(k=3, group_size=1, sigma=1.2, steps=12)
  assert r.staleness_length_corr() > 0.15
  n, st = r.samples["length"][r.trained], r.staleness
  lo, hi = np.quantile(n, [0.1, 0.9])
  assert st[n >= hi].mean() > st[n <= lo].mean() + 0.3  # long samples span more updates


def test_growing_lengths_over_training():
  grow = L.Growing(L.LogNormal(30.0, 0.3, 1000), rate=0.5, max_len=1000)
  _, r = pipeline_run(k=1, group_size=1, steps=8, lengths=grow)
  s, tr = r.samples, r.trained
  means = [s["length"][tr & (s["step"] == i)].mean() for i in range(9)]
  assert means[-1] > 3 * means[0]
  assert np.all(np.diff(r.step_end_s[1:]) > 0)


def test_timeline_accounts_busy_time():
  _, r = pipeline_run(k=1, group_size=4)
  decode = sum(e - s for lane, kind, s, e in r.timeline if kind == "decode")
  assert decode == pytest.approx(r.decode_busy_s)
  assert {lane for lane, *_ in r.timeline} == {"engine 0", "engine 1", "engine 2", "engine 3", "learner"}
  assert r.decode_tokens >= r.samples["length"][r.trained].sum()


@pytest.mark.parametrize("kw, match", [
    (dict(sampler_devices=-1), "sampler_devices"),
    (dict(batch_size=0), "batch_size"),
    (dict(batch_size=30, group_size=4), "not a multiple of group_size"),
    (dict(max_staleness=-1), "max_staleness"),
    (dict(lengths=[10, 20]), "LengthDist"),
    (dict(pass_fraction=0.0), r"pass_fraction must be in \(0, 1\]"),
    (dict(pass_fraction=1.5), r"pass_fraction must be in \(0, 1\]"),
    (dict(pass_fraction=0.5, admission="budget"), "pass_fraction < 1 needs admission='deadline'"),
    (dict(filter_draws="lucky"), "filter_draws must be 'random' or 'even'"),
    (dict(stretch=(1.0, 0.5)), r"stretch must hold factors >= 1"),
])
def test_bad_runspec(kw, match):
  base = dict(sampler_devices=2, learner_devices=2, batch_size=8, group_size=4, max_staleness=1,
              lengths=L.LogNormal(10.0, 0.5, 50))
  base.update(kw)
  with pytest.raises(ValueError, match=match):
    RunSpec(**base)


def test_sampler_too_small_for_an_engine():
  costs = make_costs(C.DecodeCurve(0.01, 0.0, 0.0), dpe=4)
  spec = RunSpec(2, 2, 8, 4, 1, L.LogNormal(10.0, 0.5, 50))
  with pytest.raises(ValueError, match="hold no engine of 4 devices"):
    simulate_pipeline(costs, spec)


# ---- dynamic sampling, shared devices, weight pulls ---------------------------------------------------------------
def one_engine_run(**kw):
  """A sampler-bound run with a closed form: 1 engine of 4 slots, groups of 4 samples of 10 tokens at 10 ms a decode
  step (0.1 s a group), 2 groups a step (0.2 s), a learner that costs nothing."""
  costs = make_costs(C.DecodeCurve(weights_s=0.01, kv_s_per_token=0.0, compute_s_per_seq=0.0), max_batch=4)
  spec = RunSpec(1, 1, 8, 4, 1, L.Empirical([10]), prompt_len=1, steps=8, **kw)
  return simulate_pipeline(costs, spec)


def test_a_pass_fraction_of_one_half_doubles_the_generated_groups_and_the_step():
  r = one_engine_run(pass_fraction=0.5, filter_draws="even")
  trained_groups = r.trained.sum() // 4
  assert r.filtered_groups == trained_groups == 20 and r.surplus_groups == 0
  assert r.step_time_s == pytest.approx(0.4, rel=1e-9)  # twice the 0.2 s of the unfiltered run
  assert one_engine_run().step_time_s == pytest.approx(0.2, rel=1e-9)
  assert one_engine_run(pass_fraction=0.25, filter_draws="even").step_time_s == pytest.approx(0.8, rel=1e-9)


def test_no_filter_leaves_the_run_as_it_was():
  base = one_engine_run()
  for draws in ("random", "even"):
    r = one_engine_run(pass_fraction=1.0, filter_draws=draws)
    np.testing.assert_array_equal(r.step_end_s, base.step_end_s)
    assert r.filtered_groups == r.surplus_groups == 0


def test_random_filter_draws_keep_about_the_pass_fraction_and_depend_on_the_seed_alone():
  costs = make_costs(C.DecodeCurve(weights_s=0.01, kv_s_per_token=0.0, compute_s_per_seq=0.0), max_batch=8)
  spec = RunSpec(2, 1, 8, 4, 1, L.LogNormal(20.0, 0.5, 80), prompt_len=1, steps=200, pass_fraction=0.3, seed=5)
  a, b = simulate_pipeline(costs, spec), simulate_pipeline(costs, spec)
  np.testing.assert_array_equal(a.step_end_s, b.step_end_s)
  kept = a.trained.sum() // 4 + a.surplus_groups
  settled = kept + a.filtered_groups
  assert abs(kept / settled - 0.3) < 3 * math.sqrt(0.3 * 0.7 / settled)  # within 3 standard deviations
  # the lengths are drawn from their own stream: the filter does not change which lengths the groups get
  unfiltered = simulate_pipeline(costs, spec.replace(pass_fraction=1.0))
  np.testing.assert_array_equal(a.samples["length"][:32], unfiltered.samples["length"][:32])  # groups 0-7


def test_stretch_slows_its_own_process():
  assert one_engine_run(stretch=(1.0, 2.0)).step_time_s == pytest.approx(0.4, rel=1e-9)  # the engine at half rate
  assert one_engine_run(stretch=(3.0, 1.0)).step_time_s == pytest.approx(0.2, rel=1e-9)  # a free learner, 3x
  with pytest.raises(ValueError, match="stretch has 3 factors for the learner and 1 engines"):
    one_engine_run(stretch=(1.0, 1.0, 1.0))


def test_pulled_weights_stall_each_engine_for_its_take_and_the_learner_for_one_publish():
  curve = C.DecodeCurve(weights_s=0.01, kv_s_per_token=0.0, compute_s_per_seq=0.0)
  costs = C.Costs(decode=curve, devices_per_engine=1, max_batch=4, prefill_s_per_token=0.0,
                  train_tokens_per_s_per_device=1e30, weight_bytes=1e6, link_bandwidth=1e8, pull_bandwidth=2e7)
  r = simulate_pipeline(costs, RunSpec(2, 1, 8, 4, 1, L.Empirical([10]), prompt_len=1, steps=4))
  assert r.sync_s == pytest.approx(0.01)  # one staged copy at link_bandwidth, not one per engine
  takes = {round(e - s, 12) for lane, kind, s, e in r.timeline if kind == "sync" and lane != "learner"}
  assert takes == {0.05}  # each engine pulls 1 MB at 20 MB/s
