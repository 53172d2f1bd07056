"""A straggler: the sampler holds back the first group until the learner has trained two steps without it, so it
reaches batch assembly with staleness 2 > max_staleness 1. `rl.on_stale="drop"` drops it (counted, with its
completion length in the length-bias report); `"keep"` trains it (counted as kept, no stale drop). Both keep the
sample accounting exact."""

import numpy as np
import pytest
from faults_util import NUM_STEPS, TALLY, inject, read_trace, tiny_config

from jaxrl import train as train_lib

HELD_GROUP = 0
RELEASE_AT_VERSION = 2  # trained no earlier than step 2; sampled at version 0


def _hold_first_group(run):
  ctl = run.controller
  real, held = ctl._complete_groups, []

  def complete_groups(rollouts):
    out = []
    for g in real(rollouts):
      (held if g[0].group_id == HELD_GROUP else out).append(g)
    if held and ctl.version >= RELEASE_AT_VERSION:
      out.append(held.pop())
    return out

  ctl._complete_groups = complete_groups


@pytest.mark.parametrize("on_stale", ["drop", "keep"])
def test_a_straggler_group_is_dropped_or_kept_and_counted(on_stale, tmp_path, monkeypatch):
  inject(monkeypatch, _hold_first_group)
  c = tiny_config("pipeline", rl__on_stale=on_stale)
  summary = train_lib.train(c, tmp_path)
  TALLY["straggler groups held back"] += 1
  led, k, g = summary["ledger"], c.rl.max_staleness, c.rl.group_size
  events = read_trace(tmp_path / "trace.jsonl")
  trained = {}  # group -> staleness at training (learner version - oldest token version of the group)
  for e in events:
    if e["event"] == "train" and e["applied"]:
      for gid, _, oldest, _ in e["samples"]:
        trained[gid] = max(trained.get(gid, 0), e["version"] - oldest)
  over = [gid for gid, s in trained.items() if s > k]  # other groups can finish late too (continuous batching)
  assert summary["steps"] == NUM_STEPS
  assert led["samples_generated"] == led["samples_trained"] + sum(led["dropped"].values()) + \
      summary["samples_in_flight"]
  assert led["samples_trained"] == NUM_STEPS * g * c.rl.groups_per_step
  bias = summary["length_bias"]
  assert bias["trained_mean_len"] == led["tokens_trained"] / led["samples_trained"]
  if on_stale == "drop":
    assert HELD_GROUP not in trained and not over
    stale_drops = [e["group"] for e in events if e["event"] == "drop" and e["reason"] == "stale"]
    assert HELD_GROUP in stale_drops and led["dropped"]["stale"] == g * len(stale_drops)
    assert led["kept_stale"] == 0 and summary["staleness_max"] <= k
    assert bias["dropped_stale_mean_len"] == led["dropped_tokens"]["stale"] / led["dropped"]["stale"]
    assert np.isclose(bias["stale_over_trained"], bias["dropped_stale_mean_len"] / bias["trained_mean_len"])
  else:
    assert trained[HELD_GROUP] >= RELEASE_AT_VERSION > k
    assert "stale" not in led["dropped"] and led["kept_stale"] == g * len(over)
    assert summary["staleness_max"] == max(trained.values())
    assert bias["kept_stale_mean_len"] == led["kept_stale_tokens"] / led["kept_stale"]
    kept = {e["group"] for e in events if e["event"] == "keep_stale"}
    assert kept == set(over) and HELD_GROUP in kept
