"""bench/time_to_accuracy.py's arithmetic: curves from metrics records, the time to a target, the ratios to sync."""

import pytest

from bench import time_to_accuracy as tta

RECORDS = [{"step": s, "step_time_s": 2.0 * s, "sampler/generated_tokens": 100.0 * s} for s in (3, 1, 2, 4)]


def test_a_curve_sums_step_seconds_up_to_each_evaluated_step():
  points = tta.curve(RECORDS, {0: 0.1, 2: 0.3, 4: 0.5})
  assert points == [{"step": 0, "seconds": 0.0, "tokens": 0.0, "accuracy": 0.1},
                    {"step": 2, "seconds": 6.0, "tokens": 200.0, "accuracy": 0.3},
                    {"step": 4, "seconds": 20.0, "tokens": 400.0, "accuracy": 0.5}]


def test_time_to_a_target_is_the_first_point_at_or_above_it():
  points = tta.curve(RECORDS, {0: 0.1, 1: 0.4, 2: 0.3, 4: 0.5})
  assert tta.time_to(points, 0.4) == {"step": 1, "seconds": 2.0, "tokens": 100.0}
  assert tta.time_to(points, 0.5) == {"step": 4, "seconds": 20.0, "tokens": 400.0}
  assert tta.time_to(points, 0.6) is None


def test_ratios_are_seconds_to_target_over_syncs_where_both_got_there():
  runs = {"sync": {"to_target": {"seconds": 20.0}}, "pipeline": {"to_target": {"seconds": 12.0}},
          "pipeline_filter": {"to_target": None}}
  assert tta.ratios(runs) == {"pipeline": pytest.approx(0.6)}


def test_every_run_keeps_its_checkpoints_and_skips_its_own_eval():
  assert tta.run_flags(1, 2) == ("--config.seed=1", "--config.checkpoint.every_steps=2",
                                 "--config.checkpoint.max_to_keep=10000", "--config.eval.num_examples=0")
  assert {mode for mode, _ in tta.VARIANTS.values()} == {"sync", "pipeline"}
  assert [name for name, (_, extra) in tta.VARIANTS.items() if extra == (tta.FILTER,)] == ["sync_filter",
                                                                                          "pipeline_filter"]
