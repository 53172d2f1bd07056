"""Shared devices: processor sharing in mean field (exact rates), the planner's fixed point, bad placements."""

import numpy as np
import pytest

from jaxrl.sim import lengths as L
from jaxrl.sim import planner
from jaxrl.sim.costs import Costs, DecodeCurve
from jaxrl.sim.placement import Placement, shared_rate


@pytest.mark.parametrize("others, rate", [
    ((), 1.0),  # alone
    ((1.0,), 0.5),  # a co-tenant always runnable: half the device
    ((0.5,), 0.75),  # runnable half the time: whole device half the time, half of it the other half
    ((1.0, 1.0), 1 / 3),
    ((0.5, 0.5), 0.25 + 0.5 / 2 + 0.25 / 3),  # N = 0, 1, 2 with probabilities 1/4, 1/2, 1/4
    ((0.0, 0.0, 0.0), 1.0),
])
def test_shared_rate_is_the_mean_share(others, rate):
  assert shared_rate(others) == pytest.approx(rate, rel=1e-12)


def test_rates_follow_the_devices_each_process_names():
  p = Placement(devices=(0, 1), learner=(0,), engines=((1,), (1,), (0, 1)))
  np.testing.assert_allclose(p.rates([1.0, 1.0, 1.0, 0.0]), [1.0, 0.5, 0.5, 1 / 3])
  # a sharded engine runs at the pace of its slowest device: device 1's two busy engines, not device 0's idle learner
  np.testing.assert_allclose(p.rates([0.0, 1.0, 1.0, 1.0]), [0.5, 1 / 3, 1 / 3, 1 / 3])
  alone = Placement(devices=("a", "b", "c"), learner=("a",), engines=(("b",), ("c",)))
  np.testing.assert_array_equal(alone.rates([1.0, 1.0, 1.0]), [1.0, 1.0, 1.0])


@pytest.mark.parametrize("kw, match", [
    (dict(engines=((1,), (2,))), r"engine 1 names device 2, which is not one of \(0, 1\)"),
    (dict(learner=(3,)), r"the learner names device 3, which is not one of \(0, 1\)"),
    (dict(devices=(0, 0)), "must name distinct devices"),
    (dict(engines=()), "engines is empty"),
    (dict(engines=((1,), ())), "engine 1 computes on no device"),
    (dict(learner_host_s=-1.0), "learner_host_s must be >= 0"),
])
def test_bad_placement(kw, match):
  with pytest.raises(ValueError, match=match):
    Placement(**{**dict(devices=(0, 1), learner=(0,), engines=((1,),)), **kw})


def test_rates_need_one_busy_fraction_per_process_within_0_and_1():
  p = Placement(devices=(0,), learner=(0,), engines=((0,),))
  with pytest.raises(ValueError, match="3 busy fractions for 2 processes"):
    p.rates([0.5, 0.5, 0.5])
  with pytest.raises(ValueError, match=r"must lie in \[0, 1\] \(got 1.5\)"):
    p.rates([1.5, 0.5])


def sampler_bound(placement=None, sampler_devices=2):
  """Engines of 4 slots at 10 ms a decode step, groups of 4 samples of 10 tokens (0.1 s a group per engine), 2 groups a
  step, a learner that costs nothing: the engines bound the step."""
  costs = Costs(decode=DecodeCurve(weights_s=0.01, kv_s_per_token=0.0, compute_s_per_seq=0.0), devices_per_engine=1,
                max_batch=4, prefill_s_per_token=0.0, train_tokens_per_s_per_device=1e30, weight_bytes=1.0,
                link_bandwidth=1e30)
  run = planner.RunDescription(sampler_devices=sampler_devices, learner_devices=1, batch_size=8, group_size=4,
                               lengths=L.Empirical([10]), max_staleness=1, prompt_len=1, steps=16, num_minibatches=1,
                               placement=placement)
  return planner.predict(costs, run)


def test_a_placement_of_own_devices_changes_nothing():
  base = sampler_bound()
  own = sampler_bound(Placement(devices=(0, 1, 2), learner=(0,), engines=((1,), (2,)), learner_host_s=0.5))
  np.testing.assert_array_equal(own.pipeline.step_end_s, base.pipeline.step_end_s)
  assert own.stretch == (1.0, 1.0, 1.0)  # the learner's host work loads its own core only


def test_two_engines_on_one_core_halve_each_engines_throughput():
  one = sampler_bound(sampler_devices=1)
  shared = sampler_bound(Placement(devices=(0, 1), learner=(0,), engines=((1,), (1,))))
  assert one.pipeline_step_s == pytest.approx(0.2, rel=1e-9)  # one engine generates the step's two groups
  assert sampler_bound().pipeline_step_s == pytest.approx(0.1, rel=1e-9)  # two engines on cores of their own
  assert shared.pipeline_step_s == pytest.approx(0.2, rel=0.01)  # two on one core: as fast as one
  assert shared.stretch[0] == 1.0 and shared.stretch[1:] == pytest.approx((2.0, 2.0), rel=0.01)


def test_a_sampler_beside_a_busy_learner_gets_what_the_learner_leaves():
  # The learner's process wants its core 0.05 s a step beside a free train step; engine 1 shares that core.
  p = sampler_bound(Placement(devices=(0, 1), learner=(0,), engines=((1,), (0,)), learner_host_s=0.05))
  busy = planner._busy(p.pipeline, 0.05 * p.stretch[0])
  np.testing.assert_allclose(1 / np.array(p.stretch), Placement((0, 1), (0,), ((1,), (0,))).rates(busy), rtol=2e-3)
  assert p.stretch[1] == 1.0 and 1.0 < p.stretch[2] < 2.0  # engine 0 keeps its core, engine 1 shares core 0
  assert sampler_bound().pipeline_step_s < p.pipeline_step_s < sampler_bound(sampler_devices=1).pipeline_step_s


def test_a_placement_must_place_the_runs_engines():
  with pytest.raises(ValueError, match=r"the placement places 1 engines; the run has 2 \(2 sampler devices"):
    sampler_bound(Placement(devices=(0, 1), learner=(0,), engines=((1,),)))
