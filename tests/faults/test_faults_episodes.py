"""Multi-turn episodes under SIGKILL: a pipeline run of the token_turns env (three turns per episode, so episodes
are mid-way when the kill lands) resumes from its checkpoint, regenerates the episodes in flight, and loses nothing:
no sample trained twice, every group trained, dropped with a reason or pending."""

from faults_util import (
  NUM_STEPS,
  TALLY,
  check_history,
  cli,
  committed_steps,
  count_lines,
  kill,
  read_trace,
  start_child,
  tiny_config,
  wait_for,
)

from jaxrl.train import train

EPISODES = {"task__name": "token_turns", "sampler__max_len": 64, "rl__seq_len": 64, "sampler__max_new_tokens": 8}


def test_sigkill_mid_episode_then_resume_loses_nothing(tmp_path):
  workdir = tmp_path / "run"
  proc = start_child(cli(workdir, **EPISODES), tmp_path / "child.log")
  trace = workdir / "trace.jsonl"
  wait_for(lambda: committed_steps(workdir) == [2], proc, what="the step-2 checkpoint")
  lines = count_lines(trace)
  wait_for(lambda: count_lines(trace) > lines, proc, what="a step after the checkpoint")
  kill(proc)
  summary = train(tiny_config(**EPISODES), workdir)
  TALLY["runs resumed after SIGKILL"] += 1
  events = read_trace(trace)
  (start,) = [e for e in events if e["event"] == "start"][1:]
  assert summary["resumed_from"] == 2 and start["regenerate"]  # episodes in flight at the checkpoint
  assert summary["steps"] == NUM_STEPS and summary["ledger"]["samples_trained"] == NUM_STEPS * 16
  check_history(events, summary, group_size=4)
  assert summary["episodes"]["ends"] == {"done": summary["episodes"]["episodes"]}
