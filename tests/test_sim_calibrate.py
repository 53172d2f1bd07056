"""Calibration: the decode fit recovers known curves, JSON round-trips, bad measurements are refused."""

import json
import math

import numpy as np
import pytest

from jaxrl.sim import calibrate
from jaxrl.sim.costs import DecodeCurve

TRUE = DecodeCurve(weights_s=0.012, kv_s_per_token=3e-8, compute_s_per_seq=8e-5, overhead_s=0.004)  # knee 150
GRID = [(b, s) for b in (1, 4, 16, 64, 128, 256, 512) for s in (256, 2048)]


def rows(curve, noise=0.0, seed=0):
  r = np.random.default_rng(seed)
  return [(b, s, float(curve.step_time(b, b * s)) * (1 + noise * r.standard_normal())) for b, s in GRID]


def measurements(decode):
  return calibrate.Measurements(decode=decode, train_tokens_per_s_per_device=2500.0, max_batch=512,
                                weight_bytes=65e9, link_bandwidth=50e9, devices_per_engine=2,
                                prefill_s_per_token=1e-5)


def test_fit_recovers_exact_curve():
  curve, stats = calibrate.fit_decode(rows(TRUE))
  for name in ("weights_s", "kv_s_per_token", "compute_s_per_seq", "overhead_s"):
    assert getattr(curve, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
  assert stats["max_rel_error"] < 1e-9 and stats["n"] == len(GRID)


def test_fit_recovers_smoothed_knee():
  true = DecodeCurve(0.012, 3e-8, 8e-5, 0.004, knee_sharpness=6.0)
  curve, _ = calibrate.fit_decode(rows(true), knee_sharpness=6.0)
  assert curve.knee_batch == pytest.approx(true.knee_batch, rel=1e-4)


def test_fit_with_noise_predicts_within_noise():
  curve, stats = calibrate.fit_decode(rows(TRUE, noise=0.03))
  assert stats["rms_rel_error"] < 0.04
  b = np.array([2, 32, 300])
  pred, want = curve.step_time(b, b * 1000), TRUE.step_time(b, b * 1000)
  assert np.all(np.abs(pred / want - 1) < 0.05)
  assert curve.knee_batch == pytest.approx(TRUE.knee_batch, rel=0.25)


def test_calibration_round_trip(tmp_path):
  cal = calibrate.fit_calibration(measurements(rows(TRUE)))
  path = tmp_path / "cal.json"
  cal.save(str(path))
  raw = json.loads(path.read_text())
  assert raw["format"] == calibrate.FORMAT and raw["decode"]["knee_sharpness"] is None
  assert len(raw["measurements"]["decode"]) == len(GRID)
  back = calibrate.Calibration.load(str(path))
  assert back == cal
  c = back.costs()
  assert c.decode == cal.decode and c.max_batch == 512 and c.devices_per_engine == 2
  assert c.train_time(5000, devices=2) == pytest.approx(1.0)
  assert math.isinf(back.decode.knee_sharpness)


def test_load_refuses_other_json(tmp_path):
  path = tmp_path / "x.json"
  path.write_text(json.dumps({"format": "something/else"}))
  with pytest.raises(ValueError, match="not a calibration file"):
    calibrate.Calibration.load(str(path))


@pytest.mark.parametrize("decode, match", [
    ([(1, 100, 0.01), (2, 100, 0.02)], "at least 3"),
    ([(1, 100, 0.01), (2, 100, 0.02), (-4, 100, 0.03)], "bad decode measurement"),
    ([(1, 100, 0.01), (2, 100, 0.02), (4, 100, 0.0)], "bad decode measurement"),
    ([(1, 100), (2, 100, 0.02), (4, 100, 0.03)], r"\(batch, context, seconds\)"),
])
def test_bad_measurements(decode, match):
  with pytest.raises(ValueError, match=match):
    measurements(decode)
  with pytest.raises(ValueError, match="train_tokens_per_s_per_device"):
    calibrate.Measurements(decode=rows(TRUE), train_tokens_per_s_per_device=-1.0, max_batch=8, weight_bytes=1.0,
                           link_bandwidth=1.0)
