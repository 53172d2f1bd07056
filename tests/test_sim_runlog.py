"""A calibration from a run's logs: the filter's pass fraction from the ledger's counts, the weight take left out of
the decode rows (also where sampler stats arrive late), and bad logs."""

import pytest

from jaxrl.sim import runlog


def record(step, trained, dropped, filtered, calls, busy):
  """One learner step's record: cumulative ledger counts and sampler stats (2 live rows, 10 context per call)."""
  return {"step": step, "time": float(step), "step_time_s": 1.0, "train_s": 0.5, "wait_s": 0.1, "train_tokens": 64.0,
          "publish_s": 0.1, "samples_trained": trained, "samples_dropped": dropped, "filtered_groups": filtered,
          "sampler/decode_calls": calls, "sampler/live_rows": 2 * calls, "sampler/context_tokens": 20 * calls,
          "sampler/busy_s": busy, "sampler/update_seconds": 0.0}


# groups of 4: per step 2 trained; 3 filtered (12 samples) and then 1 surplus group (4 samples) dropped
RECORDS = [record(1, 8, 0, 0, 4, 2.0), record(2, 16, 12, 3, 8, 4.0), record(3, 24, 28, 6, 12, 6.0),
           record(4, 32, 28, 6, 12, 6.0), record(5, 40, 40, 9, 20, 10.0)]


def test_pass_fraction_is_the_settled_groups_the_filter_kept():
  # window from step 1: 8 trained groups, 10 dropped of which 9 filtered (1 surplus, which the filter kept)
  assert runlog.pass_fraction(RECORDS, 1, 4) == pytest.approx(1 - 9 / 18)
  assert runlog.pass_fraction([record(s, 8 * s, 0, 0, 4 * s, 2.0 * s) for s in range(1, 6)], 1, 4) == 1.0


def test_the_take_is_left_out_of_the_decode_rows_once_per_step():
  plain = runlog.decode_rows(RECORDS, 1, steps_per_call=2)
  taken = runlog.decode_rows(RECORDS, 1, steps_per_call=2, take_s=0.4)
  assert [r[:2] for r in taken] == [r[:2] for r in plain] == [(2.0, 10.0)] * 3
  assert [r[2] for r in plain] == pytest.approx([0.25, 0.25, 0.25])  # 2 s over 4 calls of 2 steps
  # steps 3 -> 4 brought no sampler news: the row of 4 -> 5 holds two steps' work, and two takes
  assert [r[2] for r in taken] == pytest.approx([(2.0 - 0.4) / 8, (2.0 - 0.4) / 8, (4.0 - 0.8) / 16])


def test_pass_fraction_needs_the_ledger_counts_and_settled_groups():
  old = [{k: v for k, v in r.items() if k != "filtered_groups"} for r in RECORDS]
  with pytest.raises(ValueError, match=r"lacks the ledger's \['filtered_groups'\]"):
    runlog.pass_fraction(old, 1, 4)
  idle = [record(s, 0, 0, 0, 4 * s, 2.0 * s) for s in range(1, 6)]
  with pytest.raises(ValueError, match="no group was settled over the window"):
    runlog.pass_fraction(idle, 1, 4)
