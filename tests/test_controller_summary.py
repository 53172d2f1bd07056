"""The pieces both entry points share: the run summary, the exit status of a stopped run, the stop signals; the
in-process coordinator's data positions; and the role loops' separation (each talks to the other only through
controller.interfaces)."""

import ast
import os
import signal
from pathlib import Path

import pytest

from jaxrl.controller import summary
from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.ledger import Ledger
from jaxrl.controller.spec import RunRecord

CONTROLLER = Path(__file__).resolve().parents[1] / "jaxrl" / "controller"


def _ledger(**counts) -> dict:
  return Ledger(**counts).to_json()


def test_merge_ledgers_adds_the_samplers_counts_to_the_learners_base():
  learner = _ledger(groups_admitted=4, samples_generated=16, tokens_generated=100, samples_trained=12,
                    tokens_trained=80, skipped_prompts=1)
  samplers = [_ledger(groups_admitted=3, samples_generated=10, tokens_generated=50, skipped_prompts=2),
              _ledger(groups_admitted=2, samples_generated=6, tokens_generated=30)]
  merged = summary.merge_ledgers(learner, samplers)
  assert (merged["groups_admitted"], merged["samples_generated"], merged["tokens_generated"],
          merged["skipped_prompts"]) == (9, 32, 180, 3)
  assert merged["samples_trained"] == 12 and merged["tokens_trained"] == 80  # the learner's own counts
  assert learner["groups_admitted"] == 4  # the inputs are left alone


def test_run_summary_fields_and_stop_reason():
  led = _ledger(samples_generated=8, tokens_generated=40, samples_trained=4, tokens_trained=12)
  out = summary.run_summary("pipeline", version=3, ledger=led, staleness=[0, 1, 1, 0], samples_in_flight=4,
                            busy={"learner": 1.0}, resumed_from=None, extra=7)
  assert out["steps"] == out["version"] == 3 and out["extra"] == 7 and "stopped_by" not in out
  assert out["staleness_max"] == 1 and out["staleness_mean"] == 0.5
  assert out["length_bias"]["generated_mean_len"] == 5.0 and out["length_bias"]["trained_mean_len"] == 3.0
  stopped = summary.run_summary("sync", version=0, ledger=_ledger(), staleness=[], samples_in_flight=0, busy={},
                                resumed_from=2, stopped_by="SIGTERM")
  assert stopped["stopped_by"] == "SIGTERM" and stopped["staleness_max"] == 0 and stopped["staleness_mean"] == 0.0
  assert summary.exit_status("SIGTERM") == 143 and summary.exit_status("SIGINT") == 130


def test_held_out_accuracy_change_and_its_two_proportion_z():
  assert summary.two_proportion_z(16, 64, 32, 64) == pytest.approx(0.25 / (0.375 * 0.625 * 2 / 64) ** 0.5)
  assert round(summary.two_proportion_z(16, 64, 32, 64), 3) == 2.921
  assert summary.two_proportion_z(32, 64, 16, 64) == -summary.two_proportion_z(16, 64, 32, 64)
  assert summary.two_proportion_z(0, 10, 0, 20) == 0.0  # nothing varies
  before = {"accuracy": 0.25, "num_correct": 16, "num_judged": 64}
  out = summary.run_summary("sync", version=2, ledger=_ledger(), staleness=[], samples_in_flight=0, busy={},
                            resumed_from=None, eval_before=before,
                            eval_after={"accuracy": 0.5, "num_correct": 30, "num_judged": 60})
  assert out["eval_accuracy_change"] == {"before": 0.25, "after": 0.5, "n_before": 64, "n_after": 60,
                                         "z": round(summary.two_proportion_z(16, 64, 30, 60), 3)}
  no_accuracy = summary.run_summary("sync", version=2, ledger=_ledger(), staleness=[], samples_in_flight=0, busy={},
                                    resumed_from=None, eval_before=before, eval_after={"reward_mean": 0.1})
  assert "eval_accuracy_change" not in no_accuracy


def test_stop_on_signals_asks_once_then_restores_the_previous_handler(capsys):
  asked, previous = [], signal.getsignal(signal.SIGUSR1)
  seen = []
  signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
  try:
    with summary.stop_on_signals(asked.append, (signal.SIGUSR1,), "stopping on {name}"):
      os.kill(os.getpid(), signal.SIGUSR1)
      os.kill(os.getpid(), signal.SIGUSR1)  # the second one reaches the handler that was there before
    assert asked == ["SIGUSR1"] and seen == [signal.SIGUSR1]
    assert "stopping on SIGUSR1" in capsys.readouterr().err
  finally:
    signal.signal(signal.SIGUSR1, previous)


def test_local_coordinator_regenerates_pending_groups_first_and_checkpoints_them():
  record = RunRecord(next_group_id=10, pending_group_ids=[7, 8])
  record.ledger.groups_admitted = 12
  coord = LocalCoordinator(record, num_steps=5, group_size=4, max_failures_in_a_row=3)
  # Counted once when first admitted: a regenerated group is not admitted a second time (nothing is reset).
  assert record.ledger.samples_regenerated == 8 and record.ledger.groups_admitted == 12
  admitted = []

  def start(gid, again):
    admitted.append(gid)

  assert coord.admit(start)
  assert admitted == [7] and coord.checkpoint_record()["pending_group_ids"] == [7, 8]  # 8 not admitted: still due
  assert coord.admit(lambda gid, again: "too long") is False  # 8, skipped: settled for good, counted
  assert coord.admit(start) and coord.admit(start) and admitted == [7, 10, 11]
  record = coord.checkpoint_record()
  assert (record["next_group_id"], record["pending_group_ids"]) == (12, [7, 10, 11])
  assert record["ledger"]["groups_admitted"] == 14 and record["ledger"]["skipped_prompts"] == 1
  assert coord.go_on(4) and not coord.go_on(5)
  coord.request_stop("test")
  assert not coord.go_on(0) and coord.stop_reason == "test"


def test_failures_in_a_row_stop_the_run_and_an_applied_update_resets_them():
  coord = LocalCoordinator(RunRecord(), num_steps=5, group_size=4, max_failures_in_a_row=3)
  coord.fail("too_long")
  coord.fail("too_long")
  coord.update_done(applied=True)
  coord.fail("skipped_prompt")
  coord.update_done(applied=False)  # a skipped update is a failure too
  with pytest.raises(RuntimeError, match="3 failures in a row"):
    coord.fail("skipped_prompt")


@pytest.mark.parametrize("loop, other", [("sampler_loop", "learner_loop"), ("learner_loop", "sampler_loop")])
def test_a_role_loop_imports_neither_the_other_loop_nor_a_transport(loop, other):
  tree = ast.parse((CONTROLLER / f"{loop}.py").read_text())
  imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
  imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
  assert f"jaxrl.controller.{other}" not in imported and "jaxrl.controller.local" not in imported
  assert not any(m.startswith("jaxrl.distributed") or m == "threading" for m in imported), imported


def _protocol_members() -> set[str]:
  from jaxrl.controller.interfaces import Coordinator

  return {n for n in vars(Coordinator) if not n.startswith("_")} | set(Coordinator.__annotations__)


def test_both_coordinators_implement_every_verb_of_the_protocol_and_keep_their_lock_and_record_private():
  from jaxrl.distributed.cross_process import StoreCoordinator

  verbs = _protocol_members()
  data = ("stop", "ledger", "resumed_pass_rate", "resumed_filter")  # members an instance sets
  assert {"admit", "settle", "fail", "update_done", "checkpoint_record", "progress", "request_stop"} <= verbs
  for impl in (LocalCoordinator, StoreCoordinator):
    missing = [v for v in verbs if not hasattr(impl, v) and v not in data]
    assert not missing, (impl.__name__, missing)
  local = LocalCoordinator(RunRecord(), num_steps=1, group_size=1, max_failures_in_a_row=1)
  assert isinstance(local.ledger, Ledger) and all(hasattr(local, name) for name in data)
  # The lock, the record and the admission state are private: no loop can take them.
  private = ("lock", "record", "live", "skipped", "regenerate", "unadmitted", "failures", "next_group")
  assert not [name for name in private if hasattr(local, name)]


@pytest.mark.parametrize("loop", ["sampler_loop", "learner_loop"])
def test_a_role_loop_reaches_only_the_coordinator_protocol(loop):
  tree = ast.parse((CONTROLLER / f"{loop}.py").read_text())
  reached = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and (
        isinstance(node.value, ast.Name) and node.value.id == "coord"
        or isinstance(node.value, ast.Attribute) and node.value.attr == "coord"):
      reached.add(node.attr)
  assert reached and reached <= _protocol_members(), reached - _protocol_members()
