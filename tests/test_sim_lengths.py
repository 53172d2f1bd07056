"""Response-length distributions: shapes, clipping, mixtures, growth, config parsing and bad input."""

import numpy as np
import pytest

from jaxrl.sim import lengths as L


def rng():
  return np.random.default_rng(0)


def test_lognormal_median_and_clip():
  d = L.LogNormal(median=400.0, sigma=0.5, max_len=1000)
  x = d.sample(rng(), 50_000)
  assert x.dtype == np.int64 and x.min() >= 1 and x.max() == 1000
  assert np.median(x) == pytest.approx(400, rel=0.02)
  # mass above max_len lands on max_len: P(X > 1000) = P(Z > ln(2.5) / 0.5)
  assert np.mean(x == 1000) == pytest.approx(0.0334, abs=0.004)
  assert np.all(L.LogNormal(5.0, 0.0, 100).sample(rng(), 10) == 5)


def test_mixture_weights():
  d = L.Mixture([L.LogNormal(10.0, 0.0, 10_000), L.LogNormal(1000.0, 0.0, 10_000)], [3.0, 1.0])
  x = d.sample(rng(), 40_000)
  assert set(np.unique(x)) == {10, 1000}
  assert np.mean(x == 1000) == pytest.approx(0.25, abs=0.01)
  assert d.weights == (0.75, 0.25) and d.max_len == 10_000


def test_empirical_resamples_logged_lengths():
  d = L.Empirical([3, 3, 7, 20])
  x = d.sample(rng(), 20_000)
  assert set(np.unique(x)) == {3, 7, 20} and d.max_len == 20
  assert np.mean(x == 3) == pytest.approx(0.5, abs=0.02)
  assert L.Empirical([0, 5]).sample(rng(), 100).min() >= 1  # a logged 0 (empty completion) counts as 1


def test_growing_lengths_scale_with_step():
  base = L.LogNormal(100.0, 0.0, 10_000)
  g = L.Growing(base, rate=0.5, max_len=250)
  assert np.all(g.sample(rng(), 5, step=0) == 100)
  assert np.all(g.sample(rng(), 5, step=2) == 200)
  assert np.all(g.sample(rng(), 5, step=10) == 250)  # capped
  assert L.Scaled(base, 0.5, 1000).mean() == 50


def test_from_config():
  d = L.from_config(dict(kind="mixture", weights=[1, 1], components=[
      dict(kind="lognormal", median=4.0, sigma=0.0, max_len=8), dict(kind="empirical", lengths=[6, 6])]))
  assert set(np.unique(d.sample(rng(), 1000))) == {4, 6}
  grown = L.from_config(dict(kind="lognormal", median=4.0, sigma=0.0, max_len=8, growth_rate=1.0,
                             growth_max_len=100))
  assert np.all(grown.sample(rng(), 3, step=3) == 16)


@pytest.mark.parametrize("bad, match", [
    (lambda: L.Empirical([]), "no mass"),
    (lambda: L.Empirical([0, 0, 0]), "no mass"),
    (lambda: L.Empirical([5, -1]), ">= 0"),
    (lambda: L.Mixture([L.LogNormal(5.0, 0.1, 10)], [0.0]), "no mass"),
    (lambda: L.Mixture([L.LogNormal(5.0, 0.1, 10)], [1.0, 2.0]), "one weight per component"),
    (lambda: L.LogNormal(5.0, 0.1, 0), "max_len"),
    (lambda: L.LogNormal(-5.0, 0.1, 10), "median"),
    (lambda: L.LogNormal(5.0, 0.1, 10).sample(rng(), -1), "negative"),
    (lambda: L.from_config(dict(kind="pareto")), "unknown length distribution"),
])
def test_bad_input(bad, match):
  with pytest.raises(ValueError, match=match):
    bad()


def test_replay_per_sample_lengths_in_group_order():
  """Natural lengths: [groups, group_size] replayed sample by sample, a step's groups at a time, restarting with a
  new rng; forced lengths ([groups]) give every sample of a group its group's length."""
  per_sample = np.array([[3, 9], [4, 4], [12, 1]])
  d = L.Replay(per_sample, 2)
  r = rng()
  assert d.sample(r, 4).tolist() == [3, 9, 4, 4] and d.sample(r, 2).tolist() == [12, 1]
  assert d.sample(rng(), 2).tolist() == [3, 9] and d.max_len == 12
  assert L.Replay(np.array([5, 7]), 2).sample(rng(), 4).tolist() == [5, 5, 7, 7]
  with pytest.raises(ValueError, match="not 3"):
    L.Replay(per_sample, 3)
  with pytest.raises(ValueError, match="ran out of groups"):
    d.sample(rng(), 8)


def test_group_lengths_from_a_trace():
  from jaxrl.sim.runlog import group_lengths

  events = [{"event": "start"}, {"event": "generated", "group": 1, "version": 0, "lengths": [5, 6]},
            {"event": "generated", "group": 0, "version": 0, "lengths": [1, 2]},
            {"event": "train", "samples": [], "lengths": [1, 2, 5, 6]}]
  assert group_lengths(events, 2).tolist() == [[1, 2], [5, 6]]
  with pytest.raises(ValueError, match="log.trace=True"):
    group_lengths(events[:1], 2)
  with pytest.raises(ValueError, match="not group_size=4"):
    group_lengths(events, 4)
