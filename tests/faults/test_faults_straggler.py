"""A straggler: the sampler holds back the first group until three groups admitted after it have finished (they
overtake it). Deadline-based assembly makes the learner wait for it at its deadline (step max_staleness) instead
of dropping it or training it over the bound: nothing is dropped, every trained token's staleness is <= k, and the
sample accounting stays exact."""

from faults_util import NUM_STEPS, TALLY, inject, read_trace, tiny_config

from jaxrl import train as train_lib

HELD_GROUP = 0
OVERTAKEN_BY = 3  # groups that finish before the held one is released


def _hold_first_group(run):
  ctl = run.controller.sampler_loop
  real, held, finished_after = ctl._complete_groups, [], []

  def complete_groups(rollouts):
    out = []
    for g in real(rollouts):
      (held if g[0].group_id == HELD_GROUP else out).append(g)
    if held:
      finished_after.extend(g[0].group_id for g in out)
      if len(finished_after) >= OVERTAKEN_BY:
        out.append(held.pop())
    return out

  ctl._complete_groups = complete_groups


def test_a_straggler_group_is_waited_for_at_its_deadline_not_dropped(tmp_path, monkeypatch):
  inject(monkeypatch, _hold_first_group)
  c = tiny_config("pipeline")
  summary = train_lib.train(c, tmp_path)
  TALLY["straggler groups held back"] += 1
  led, k, g = summary["ledger"], c.rl.max_staleness, c.rl.group_size
  events = read_trace(tmp_path / "trace.jsonl")
  trained = {}  # group -> (step, staleness at training: learner version - oldest token version of the group)
  order = []
  for e in events:
    if e["event"] == "train" and e["applied"]:
      for gid, _, oldest, _ in e["samples"]:
        trained[gid] = (e["version"], max(trained.get(gid, (0, 0))[1], e["version"] - oldest))
        if gid not in order:
          order.append(gid)
  assert summary["steps"] == NUM_STEPS
  assert trained[HELD_GROUP][0] <= k  # admitted at version 0: due at step k, and trained by then
  assert order.index(HELD_GROUP) >= OVERTAKEN_BY  # groups admitted after it were trained before it
  assert max(s for _, s in trained.values()) <= k and summary["staleness_max"] <= k
  assert led["dropped"] == {} and not [e for e in events if e["event"] == "drop"]
  assert led["samples_generated"] == led["samples_trained"] + summary["samples_in_flight"]
  assert led["samples_trained"] == NUM_STEPS * g * c.rl.groups_per_step
  bias = summary["length_bias"]
  assert bias["trained_mean_len"] == led["tokens_trained"] / led["samples_trained"]
  assert bias["generated_mean_len"] == led["tokens_generated"] / led["samples_generated"]
