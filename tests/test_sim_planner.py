"""Planner: the mission configuration's optimum split and speedup, predict(), dropped configs, CLI."""

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxrl.sim import calibrate, planner
from jaxrl.sim import lengths as L
from jaxrl.sim.costs import Costs, DecodeCurve
from jaxrl.sim.plan import build, run_plan
from jaxrl.sim.simulate import RunSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(name, arg=None):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config(arg)


@pytest.fixture(scope="module")
def mission():
  b = build(load_config("plan_mission"))
  return b, run_plan(b)


@pytest.mark.slow
def test_mission_interior_optimum_and_speedup(mission):
  b, p = mission
  best = p.best
  splits = sorted({r.sampler_devices for r in p.feasible})
  assert splits[0] < best.sampler_devices < splits[-1]  # interior optimum
  assert best.max_staleness == 1 and best.staleness_max <= 1
  assert 1.4 < best.speedup < 1.9  # the mission reports ~1.6x
  k1 = {r.sampler_devices: r for r in p.feasible if r.max_staleness == 1}
  assert k1[splits[0]].speedup < best.speedup and k1[splits[-1]].speedup < best.speedup
  k0 = [r for r in p.feasible if r.max_staleness == 0]
  assert all(r.speedup < 1.0 for r in k0)  # without staleness a split only loses to sync on the whole pool


@pytest.mark.slow
def test_mission_doubling_samplers_wastes_devices(mission):
  b, p = mission
  best = p.best
  doubled = 2 * best.sampler_devices
  assert doubled < b["pool"]
  # Timing only: the doubled split may leave the learner short of memory, which the planner drops anyway.
  r2 = planner.plan(b["costs"], b["workload"], b["pool"], staleness_bound=1, ks=(1,), splits=(doubled,))
  twice = r2.rows[0]
  assert twice.step_time_s > 1.1 * best.step_time_s
  assert twice.sampler_idle > best.sampler_idle + 0.2  # the extra sampler devices mostly wait
  assert twice.staleness_mean >= best.staleness_mean - 0.01  # staleness stays pinned at the bound
  # In this model the learner is not what idles more: with fewer devices it becomes the bottleneck.
  assert twice.learner_idle < best.learner_idle


def small_costs(**kw):
  args = dict(decode=DecodeCurve(0.01, 1e-6, 2e-4, 1e-3), devices_per_engine=1, max_batch=32,
              prefill_s_per_token=1e-5, train_tokens_per_s_per_device=2e4, weight_bytes=1e8, link_bandwidth=1e10)
  args.update(kw)
  return Costs(**args)


def workload(**kw):
  args = dict(sampler_devices=1, learner_devices=1, batch_size=32, group_size=4, max_staleness=1,
              lengths=L.LogNormal(40.0, 0.8, 400), prompt_len=16, steps=4)
  args.update(kw)
  return RunSpec(**args)


def test_plan_drops_with_reasons():
  p = planner.plan(small_costs(devices_per_engine=2), workload(), 8, staleness_bound=1, ks=(1, 2),
                   splits=(1, 2, 6, 7), learner_min_devices=2)
  reasons = {(r.sampler_devices, r.max_staleness): r.reason for r in p.rows if not r.feasible}
  assert "engine needs 2 devices" in reasons[(1, 1)]
  assert "learner memory needs >= 2" in reasons[(7, 1)]
  assert "exceeds the staleness bound 1" in reasons[(2, 2)]
  assert {(r.sampler_devices, r.max_staleness) for r in p.feasible} == {(2, 1), (6, 1)}
  assert p.best in p.feasible and "dropped" in p.table()


@pytest.mark.parametrize("kw, match", [
    (dict(splits=(9,)), "does not fit a pool of 8"),
    (dict(splits=(8,)), "does not fit a pool of 8"),
    (dict(staleness_bound=-1), "staleness_bound"),
    (dict(learner_min_devices=9), "the pool has 8"),
])
def test_plan_bad_input(kw, match):
  args = dict(staleness_bound=1)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    planner.plan(small_costs(), workload(), 8, **args)


def test_predict_from_calibration():
  curve = DecodeCurve(0.01, 1e-6, 2e-4, 1e-3)
  rows = [(b, s, float(curve.step_time(b, b * s))) for b in (1, 8, 32, 128) for s in (16, 256)]
  cal = calibrate.fit_calibration(calibrate.Measurements(
      decode=rows, train_tokens_per_s_per_device=2e4, max_batch=32, weight_bytes=1e8, link_bandwidth=1e10,
      prefill_s_per_token=1e-5))
  logged = np.random.default_rng(0).lognormal(np.log(40), 0.8, 500).astype(int) + 1
  run = planner.RunDescription(sampler_devices=2, learner_devices=2, batch_size=32, group_size=4,
                               lengths=logged, max_staleness=2, prompt_len=16, steps=6)
  pred = planner.predict(cal, run)
  same = planner.predict(small_costs(), run)  # the calibration reproduces the curve it was fitted to
  assert pred.sync_step_s == pytest.approx(same.sync_step_s, rel=1e-6)
  assert pred.pipeline_step_s == pytest.approx(same.pipeline_step_s, rel=1e-6)
  assert pred.speedup == pytest.approx(pred.sync_step_s / pred.pipeline_step_s)
  assert pred.pipeline_step_s < pred.sync_step_s
  assert pred.pipeline.staleness.max() <= 2 and pred.sync.staleness.max() == 0


def test_plan_cli_writes_table_and_plots(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "jaxrl.sim.plan", f"--config={ROOT}/configs/plan_tiny.py", f"--outdir={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "<- best" in out.stdout and "speedup" in out.stdout and "dropped: k=2 exceeds" in out.stdout
  for name in ("timeline.png", "timeline_sync.png", "speedup_vs_split.png", "staleness_vs_split.png",
               "speedup_vs_length.png"):
    data = (tmp_path / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_predict_prices_packed_rows():
  """Packed: a step costs its packed rows x seq_len, between the real tokens and the padded batch; each mini-batch
  is packed into rows of its own, as the learner packs it."""
  from jaxrl.learner.packing import packed_rows, row_buckets
  costs = small_costs().replace(train_overhead_s=0.0)
  logged = np.random.default_rng(1).lognormal(np.log(40), 0.9, 400).astype(int) + 1
  kw = dict(sampler_devices=2, learner_devices=2, batch_size=32, group_size=4, lengths=logged, max_staleness=0,
            prompt_len=16, steps=4)
  real, padded, packed = (planner.predict(costs, planner.RunDescription(**kw, **extra)).sync
                          for extra in ({}, dict(seq_len=512), dict(seq_len=512, pack=True)))
  train_s = lambda sim: sum(end - start for lane, kind, start, end in sim.timeline if kind == "train")
  assert train_s(real) < train_s(packed) < 0.5 * train_s(padded)
  # The charge is exactly the packed rows of each step's samples (prompt + completion), mini-batch by mini-batch:
  # never fewer rows than packing the whole batch at once, and here more.
  order = np.random.default_rng(0).permutation(32)
  step, length = packed.samples["step"], packed.samples["length"]
  per_step = [(length[step == s] + 16)[order].tolist() for s in np.unique(step[step >= 0])]
  rows = [packed_rows(x, 512, 16, row_buckets(32, 2), 2) for x in per_step]
  whole = [packed_rows(x, 512, 16, row_buckets(32)) for x in per_step]
  assert train_s(packed) == pytest.approx(sum(costs.train_time(r * 512, 2) for r in rows), rel=1e-9)
  assert all(r >= w for r, w in zip(rows, whole, strict=True)) and sum(rows) > sum(whole)
  one = planner.predict(costs, planner.RunDescription(**kw, seq_len=512, pack=True, num_minibatches=1)).sync
  assert train_s(one) == pytest.approx(sum(costs.train_time(r * 512, 2) for r in whole), rel=1e-9)
  with pytest.raises(ValueError, match="pack needs seq_len"):
    planner.predict(costs, planner.RunDescription(**kw, pack=True))
  with pytest.raises(ValueError, match="must divide batch_size"):
    planner.predict(costs, planner.RunDescription(**kw, seq_len=512, pack=True, num_minibatches=3))


def smollm2_costs():
  """SmolLM2-135M on the 2-core box, learner-bound: a train step of 16 x 256 tokens takes 22 s on one core and 13 s
  on two; a step's sampling 8-11 s on one core."""
  tokens = 16 * (64 + 192)
  return Costs(decode=DecodeCurve(0.03, 1e-6, 1e-3, 0.01), devices_per_engine=1, max_batch=16,
               prefill_s_per_token=1e-4, train_tokens_per_s_per_device=tokens / 22, weight_bytes=2.7e8,
               link_bandwidth=5e9, train_scaling=((1, tokens / 22), (2, tokens / (2 * 13))))


def test_plan_recommends_sync_when_the_pipeline_loses():
  """Learner-bound: the 1:1 pipeline trains on one core (22 s) what sync trains on two (13 s) after sampling on
  both: every pipeline row loses per trained token, and the plan says sync."""
  wl = workload(batch_size=16, group_size=4, max_staleness=2, lengths=L.LogNormal(120.0, 0.5, 192), prompt_len=64,
                train_tokens=lambda lengths: 16 * 256)  # the learner's padded 16 x 256 batch
  p = planner.plan(smollm2_costs(), wl, 2, staleness_bound=2, ks=(1, 2))
  sync = p.sync[16]
  assert 6 < sync.step_time_s - 13 < 11  # sampling on two engines, then the 13 s step
  rec = p.recommended
  assert rec.mode == "sync" and rec.batch_size == 16 and rec.tokens_per_s == sync.tokens_per_s
  assert all(r.token_speedup < 1 for r in p.feasible) and rec.ratio == pytest.approx(p.best.token_speedup)
  assert rec.ratio < 1 and rec.row is p.best
  table = p.table()
  best_line = next(line for line in table.splitlines() if "<- best" in line)
  assert best_line.lstrip().startswith("sync on all 2")


def test_plan_recommends_the_pipeline_when_it_wins():
  """Long-tailed lengths and a fast learner: the best split beats sync per trained token and is recommended."""
  p = planner.plan(small_costs(), workload(lengths=L.LogNormal(40.0, 1.2, 800)), 4, staleness_bound=1)
  rec = p.recommended
  assert rec.mode == "pipeline" and rec.row is p.best and rec.ratio == pytest.approx(p.best.token_speedup)
  assert rec.ratio > 1
  assert p.best.tokens_per_s == max(r.tokens_per_s for r in p.feasible)
  assert p.best.tokens_per_s == pytest.approx(p.results[(p.best.sampler_devices, 32, 1)].tokens_per_s)
  best_line = next(line for line in p.table().splitlines() if "<- best" in line)
  assert best_line.split()[:2] == [str(p.best.sampler_devices), str(p.best.learner_devices)]


@pytest.mark.parametrize("arg, tolerance", [("128", 0.05), ("64", 0.10)])
def test_published_verl_runs_predicted(arg, tolerance):
  # The 128-GPU async step fixed the lengths' spread; the 64-GPU run's async step is predicted out of sample.
  c = load_config("plan_verl_fully_async_7b", arg)
  b = build(c)
  row = next(r for r in run_plan(b).rows if r.sampler_devices == c.published.sampler_devices)
  assert row.sync_step_time_s == pytest.approx(c.published.sync_step_s, rel=0.05)
  assert row.step_time_s == pytest.approx(c.published.pipeline_step_s, rel=tolerance)
  with pytest.raises(ValueError, match="published runs exist for"):
    load_config("plan_verl_fully_async_7b", "48")


def test_plan_cli_prints_the_published_comparison(tmp_path):
  config = f"--config={ROOT}/configs/plan_verl_fully_async_7b.py:64"
  out = subprocess.run([sys.executable, "-m", "jaxrl.sim.plan", config, f"--outdir={tmp_path}"], capture_output=True,
                       text=True, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
  assert "published (verl recipe/fully_async_policy/README.md, Qwen2.5-Math-7B on 64 H20): sync 365.3 s/step" in out


def test_the_reasoning_workload_on_h100s_is_generation_bound_and_the_plan_says_pipeline():
  """configs/plan_reasoning.py (SmolLM2-135M, the long reasoning variant's lengths, roofline H100 costs): unlike the
  2-core CPU, where the learner costs ~2x the sampler per step, the learner idles and the pipeline's overlap pays."""
  p = run_plan(build(load_config("plan_reasoning", "batch16")))
  rec = p.recommended
  assert rec.mode == "pipeline" and rec.ratio > 1.5 and rec.row.max_staleness == 2
  assert p.sync[16].learner_idle_frac > 0.9  # generation-bound: the learner waits
  with pytest.raises(ValueError, match="unknown argument 'x'"):
    load_config("plan_reasoning", "x")


def test_a_plan_configs_pass_fraction_reaches_every_simulation():
  c = load_config("plan_reasoning", "batch16")
  base = build(c)
  with c.unlocked():
    c.pass_fraction = 0.5
  b = build(c)
  assert (base["workload"].pass_fraction, b["workload"].pass_fraction) == (1.0, 0.5)
  p, q = run_plan(base), run_plan(b)
  for plain, filtered in ((p.sync[16], q.sync[16]), (p.best_result(), q.best_result())):
    assert plain.filtered_groups == 0
    kept = filtered.trained.sum() // 8 + filtered.surplus_groups  # trained, or over-asked beyond a step's places
    settled = kept + filtered.filtered_groups
    assert abs(kept / settled - 0.5) < 3 * math.sqrt(0.25 / settled)  # random draws: half, within 3 deviations
