"""The pass-rate prompt filter (task.pass_rate_filter, controller.pass_rate): a prompt whose last n groups all scored
alike is skipped below a data position, counted apart from failures, and its table is part of the run record."""

import numpy as np
import pytest

from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.pass_rate import PassRateTable, SetAside, make_table, prompt_key
from jaxrl.controller.spec import RunRecord
from jaxrl.rollout import Rollout


def _group(gid, prompt, rewards):
  return [Rollout(np.asarray(prompt, np.int32), np.zeros(2, np.int32), np.zeros(2, np.float32),
                  np.zeros(2, np.int32), "eos", gid, i, reward=r) for i, r in enumerate(rewards)]


def test_a_prompt_is_set_aside_after_its_window_of_alike_groups_until_a_data_position():
  state = {}
  table = PassRateTable(window=2, aside_positions=8, state=state)
  table.observe(_group(3, [5, 6], [1.0, 1.0]))  # all right
  assert table.aside([5, 6], 4) is None  # one alike group of a window of two
  table.observe(_group(5, [5, 6], [0.0, 0.0]))  # all wrong: alike too
  reason = table.aside([5, 6], 12)
  assert isinstance(reason, SetAside) and "until data position 13" in reason and "last 2 group(s)" in reason
  assert table.aside([5, 6], 13) is None and table.aside([5, 7], 6) is None  # past it; another prompt
  assert state == {"alike": {}, "until": {prompt_key([5, 6]): 13}}  # the state is the table, changed in place


def test_signal_breaks_the_streak_and_failed_rewards_say_nothing():
  table = PassRateTable(window=2, aside_positions=4, state={})
  table.observe(_group(0, [1], [1.0, 1.0]))
  table.observe(_group(1, [1], [0.0, 1.0]))  # signal
  table.observe(_group(2, [1], [1.0, 1.0]))
  assert table.aside([1], 3) is None
  table.observe(_group(3, [1], [float("nan"), 1.0]))  # a failed reward: neither alike nor signal
  assert table.aside([1], 4) is None
  table.observe(_group(4, [1], [0.0, 0.0]))
  assert table.aside([1], 5) is not None and table.alike == {}  # a new window starts after it comes back


def test_the_table_survives_the_run_record_and_is_off_at_zero():
  record = RunRecord(next_group_id=9)
  table = make_table(1, 6, record.pass_rate)
  table.observe(_group(2, [4, 4], [0.5, 0.5]))
  back = RunRecord.from_json(record.to_json())
  assert back.pass_rate == {"alike": {}, "until": {prompt_key([4, 4]): 8}}
  assert make_table(1, 6, back.pass_rate).aside([4, 4], 7) is not None
  assert RunRecord.from_json({k: v for k, v in record.to_json().items() if k != "pass_rate"}).pass_rate == {}
  assert make_table(0, 6, {}) is None
  with pytest.raises(ValueError, match="window >= 1 and aside_positions >= 1, got 1 and 0"):
    PassRateTable(1, 0, {})


def test_a_set_aside_prompt_is_skipped_and_counted_but_is_no_failure():
  coord = LocalCoordinator(RunRecord(), num_steps=4, group_size=2, max_failures_in_a_row=1)
  for _ in range(3):  # one failure in a row would stop the run
    assert not coord.admit(lambda gid, again: SetAside("set aside"))
  assert coord.ledger.skipped_prompts == coord.ledger.prompts_set_aside == 3
  with pytest.raises(RuntimeError, match="no progress: 1 failures in a row"):
    coord.admit(lambda gid, again: "too long")
