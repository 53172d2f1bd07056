"""Dynamic sampling (rl.filter_groups="zero_variance") at a 90% filter rate: no group whose rewards are all equal
reaches the train step, every step still trains groups_per_step groups within the staleness bound, the ledger
balances with the filtered groups counted by reason, in every topology and across a kill and resume; a policy that
leaves nothing to train stops the run with one line instead of sampling for ever."""

import json
import threading
import types

import pytest
from faults_util import NUM_STEPS, check_history, committed_steps, inject, read_trace, tiny_config, wait_for
from test_faults_topologies import GROUP_SIZE, TOPOLOGIES, command, kill_job, start_job

from jaxrl import train as train_lib
from jaxrl.controller.data import make_prompt_source
from jaxrl.controller.pass_rate import prompt_key

FILTER = {"task__reward": "faults_rewards:rare", "rl__filter_groups": "zero_variance"}


@pytest.mark.parametrize("mode", ["pipeline", "sync"])
def test_only_groups_with_signal_are_trained_and_every_filtered_group_is_counted(mode, tmp_path, monkeypatch):
  trained_rewards = []

  def record(run):
    loop = run.controller.learner_loop
    real = loop._train

    def train(groups):
      trained_rewards.extend([r.reward for r in g] for g in groups)
      return real(groups)

    loop._train = train

  inject(monkeypatch, record)
  summary = train_lib.train(tiny_config(mode, **FILTER), tmp_path)
  led = summary["ledger"]
  assert summary["steps"] == NUM_STEPS and led["samples_trained"] == NUM_STEPS * 16
  assert len(trained_rewards) == NUM_STEPS * 4 and all(len(set(g)) > 1 for g in trained_rewards)
  assert led["zero_advantage_groups"] == 0
  # ~90% of the groups filtered: each a counted drop, its samples and tokens under "filtered"
  assert led["filtered_groups"] >= 4 * NUM_STEPS * 4 and led["dropped"]["filtered"] == GROUP_SIZE * led[
      "filtered_groups"]
  assert led["dropped_tokens"]["filtered"] > 0 and "dropped_filtered_mean_len" in summary["length_bias"]
  # k = 1 (sync: 0): nothing trained staler (the learner also asserts it every step), over-asked groups that came
  # out with signal beyond their step's places included: those are dropped as "surplus", counted
  assert summary["staleness_max"] <= (mode == "pipeline")
  assert led["dropped"].get("surplus", 0) % GROUP_SIZE == 0
  events = read_trace(tmp_path / "trace.jsonl")
  counts = check_history(events, summary, group_size=GROUP_SIZE)
  assert counts["trained"] == NUM_STEPS * 16
  # A surplus group still generating when its step's share left it out is cancelled (its slots go to groups a step
  # can train): never trained, dropped as surplus unless still on its way at the end (sync at this seed: 24 groups
  # cancelled, 21 of them dropped by the end)
  cancelled = {e["group"] for e in events if e["event"] == "cancelled"}
  surplus = {e["group"] for e in events if e["event"] == "drop" and e["reason"] == "surplus"}
  trained = {s[0] for e in events if e["event"] == "train" for s in e["samples"]}
  assert not cancelled & trained
  assert mode == "pipeline" or cancelled & surplus


def test_a_policy_that_leaves_nothing_to_train_stops_the_run_with_one_line(tmp_path, monkeypatch):
  # Without the bound the run would sample for ever: a deadline stops it (cleanly, so the test fails, not hangs).
  deadline = []

  def stop_late(run):
    timer = threading.Timer(120.0, run.controller.request_stop, args=("the test's deadline",))
    timer.daemon = True
    timer.start()
    deadline.append(timer)

  inject(monkeypatch, stop_late)
  c = tiny_config("pipeline", task__reward="faults_rewards:always_zero", rl__filter_groups="zero_variance",
                  rl__max_filtered_in_a_row=12)
  try:
    with pytest.raises(RuntimeError, match=r"no progress: 12 groups in a row filtered out \(all their rewards "
                                           r"equal\)"):
      train_lib.train(c, tmp_path)
  finally:
    deadline[0].cancel()
  assert committed_steps(tmp_path) == [0]


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_dynamic_sampling_resumes_exactly_and_the_ledger_balances_in_every_topology(topology, tmp_path):
  workdir, log = tmp_path / "run", tmp_path / "job.log"
  args = command(topology, workdir, **FILTER)
  proc = start_job(args, log)
  wait_for(lambda: 2 in committed_steps(workdir), proc, timeout=300, what="the step-2 checkpoint")
  kill_job(proc, log)
  assert start_job(args, log).wait(timeout=300) == 0, log.read_text()[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  led = summary["ledger"]
  assert summary["steps"] == NUM_STEPS and summary["resumed_from"] is not None
  assert led["filtered_groups"] > 0 and led["dropped"]["filtered"] == GROUP_SIZE * led["filtered_groups"]
  check_history(read_trace(workdir / "trace.jsonl"), summary, group_size=GROUP_SIZE)


# 16 prompts (2 ids of 4) seen again and again; about 90% of groups score alike: a prompt is set aside after one
PASS_RATE = {"task__reward": "faults_rewards:rare", "task__kwargs": {"vocab_size": 4, "prompt_len": 2},
             "task__pass_rate_filter": 1, "task__pass_rate_aside_steps": 8, "rl__max_failures_in_a_row": 2}


def test_the_pass_rate_filter_sets_prompts_aside_counted_and_its_table_survives_resume(tmp_path):
  """Set-aside prompts are skipped with their reason, counted, and no failure (two failures in a row would stop
  the run); the table is in the checkpoint, and a resumed run skips every new position whose prompt it set aside."""
  c = tiny_config("pipeline", **PASS_RATE)
  first = train_lib.train(c, tmp_path)
  led = first["ledger"]
  events = read_trace(tmp_path / "trace.jsonl")
  skips = [e for e in events if e["event"] == "skip_prompt"]
  assert led["prompts_set_aside"] == led["skipped_prompts"] == len(skips) > 0
  assert all("set aside by the pass-rate filter" in e["reason"] for e in skips)
  check_history(events, first, group_size=GROUP_SIZE)
  saved = json.loads((tmp_path / "checkpoints" / str(NUM_STEPS) / "record" / "metadata").read_text())
  until = saved["pass_rate"]["until"]
  assert until

  second = train_lib.train(tiny_config("pipeline", **PASS_RATE, num_steps=NUM_STEPS + 2), tmp_path)
  resumed = read_trace(tmp_path / "trace.jsonl")[len(events):]
  assert second["resumed_from"] == NUM_STEPS
  # the run's prompts as its sampler renders them (raw ids: a model vocabulary only bounds them)
  _, prompts = make_prompt_source(c.task, c.seed, None, types.SimpleNamespace(vocab_size=4))
  skipped = {e["group"] for e in resumed if e["event"] == "skip_prompt"}
  regenerated = set(saved["pending_group_ids"])
  due = [g for g in range(saved["next_group_id"], resumed[-1]["next_group_id"])
         if g not in regenerated and until.get(prompt_key(prompts(g)[0]), 0) > g]
  assert due and set(due) <= skipped  # the saved table decides from the first position on
  check_history(read_trace(tmp_path / "trace.jsonl"), second, group_size=GROUP_SIZE)
