"""Numerics: inf logits, an inf reward and NaN behavior logprobs (so NaN loss and gradients) make the learner skip
that update, which the controller counts (ledger.skipped_updates, its groups dropped as "update_skipped") without
publishing, logging or checkpointing a version twice; a huge importance ratio is truncated and counted; groups
whose rewards are all equal (zero advantage) are counted. Params stay finite; the run reaches its step count."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from faults_util import NUM_STEPS, TALLY, check_history, inject, params_finite, read_trace, tiny_config

from jaxrl import train as train_lib
from jaxrl.learner import step as step_lib
from jaxrl.metrics import read_jsonl

# train_step call (1-based) -> fault injected into that call's batch
FAULTS = {2: "inf_logits", 4: "inf_reward", 6: "nan_behavior", 8: "huge_ratio"}
SKIPPED = {"inf_logits": "skip/nonfinite", "inf_reward": "skip/reward", "nan_behavior": "skip/nonfinite"}
UPDATES = 2  # optimizer updates per learner step: the tiny config's rl.num_minibatches; a fault skips the step


def _marking_logits_fn(model):
  """The real logits, except +inf on every position of a row whose tokens the test negated (-t - 1)."""
  real = _REAL_AS_LOGITS_FN(model)

  def logits_fn(params, tokens, positions, segments):
    marked = tokens < 0
    logits = real(params, jnp.where(marked, -tokens - 1, tokens), positions, segments)
    return jnp.where(marked[..., None], jnp.inf, logits)

  return logits_fn


_REAL_AS_LOGITS_FN = step_lib.as_logits_fn


def _corrupt(batch, fault: str):
  completion_0 = batch.loss_mask_BxL[0] > 0
  if fault == "inf_logits":
    return batch.replace(tokens_BxL=np.concatenate([-batch.tokens_BxL[:1] - 1, batch.tokens_BxL[1:]]))
  if fault == "inf_reward":
    rewards = batch.rewards_B.copy()
    rewards[0] = np.inf
    return batch.replace(rewards_B=rewards)
  behavior = batch.behavior_logprobs_BxL.copy()
  behavior[0, completion_0] = np.nan if fault == "nan_behavior" else -1e4  # ratio pi / mu = e^10000
  return batch.replace(behavior_logprobs_BxL=behavior)


def _inject_faults(run, calls: list):
  ctl, sampling = run.controller.learner_loop, run.controller.sampler_loop
  real_step, real_score = ctl.train_step, sampling.score
  counter = itertools.count(1)

  def train_step(state, batch, key):
    fault = FAULTS.get(next(counter))
    calls.append({"fault": fault, "rewards": np.asarray(batch.rewards_B), "groups": np.asarray(batch.group_ids_B)})
    state, metrics = real_step(state, batch if fault is None else _corrupt(batch, fault), key)
    calls[-1]["metrics"] = jax.device_get(metrics)
    return state, metrics

  def score(group):  # every third group gets equal rewards: zero advantage
    real_score(group)
    if group[0].group_id % 3 == 0:
      for r in group:
        r.reward = 0.5

  ctl.train_step, sampling.score = train_step, score
  sampling.score.close = real_score.close


@pytest.fixture(scope="module", params=["sync", "pipeline"])
def faulty_run(request, tmp_path_factory):
  workdir = tmp_path_factory.mktemp(f"numerics-{request.param}")
  calls = []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(step_lib, "as_logits_fn", _marking_logits_fn)
    built = inject(mp, lambda run: _inject_faults(run, calls))
    summary = train_lib.train(tiny_config(request.param), workdir)
  TALLY["numeric faults injected"] += len(FAULTS)
  return {"summary": summary, "calls": calls, "workdir": workdir, "run": built["run"]}


def test_nonfinite_updates_are_skipped_and_counted(faulty_run):
  """A fault in one row (one mini-batch of two) skips the whole step: the other update is rolled back."""
  calls, summary = faulty_run["calls"], faulty_run["summary"]
  assert tiny_config("sync").rl.num_minibatches == UPDATES
  led = summary["ledger"]
  assert len(calls) == NUM_STEPS + len(SKIPPED)
  for call in calls:
    fault, m = call["fault"], call["metrics"]
    if fault in SKIPPED:
      assert m["updates_applied"] == 0 and m[SKIPPED[fault]] == 1, fault
    else:
      assert m["updates_applied"] == UPDATES and np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]), fault
  assert led["skipped_updates"] == len(SKIPPED)
  assert led["dropped"].get("update_skipped") == len(SKIPPED) * 16
  assert led["samples_trained"] == NUM_STEPS * 16 and summary["steps"] == NUM_STEPS
  check_history(read_trace(faulty_run["workdir"] / "trace.jsonl"), summary, group_size=4)


def test_params_stay_finite_and_each_version_is_logged_once(faulty_run):
  assert params_finite(faulty_run["run"].controller.learner_loop.state.params)
  records = read_jsonl(faulty_run["workdir"] / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
  assert records[-1]["updates_skipped_total"] == len(SKIPPED)
  assert all(np.isfinite(r["loss"]) for r in records)


def test_a_huge_importance_ratio_is_truncated_and_counted(faulty_run):
  (huge,) = [c["metrics"] for c in faulty_run["calls"] if c["fault"] == "huge_ratio"]
  assert huge["updates_applied"] == UPDATES
  # Row 0's tokens have w = prox / mu = e^20 after the log-ratio clamp, cut to is_cap; no other token is.
  assert 0 < huge["is_truncated_frac"] <= 1 / 4 + 1e-6
  assert np.isfinite(huge["grad_norm"])


def test_groups_with_all_equal_rewards_are_counted(faulty_run):
  expected = forced = 0
  for call in faulty_run["calls"]:
    for g in np.unique(call["groups"][call["groups"] >= 0]):
      expected += len(set(call["rewards"][call["groups"] == g].tolist())) == 1
      forced += g % 3 == 0
  assert faulty_run["summary"]["ledger"]["zero_advantage_groups"] == expected >= forced > 0


def test_every_update_skipped_stops_the_run_instead_of_looping(tmp_path, monkeypatch):
  def corrupt_every_batch(run):
    learner = run.controller.learner_loop
    real_step = learner.train_step
    learner.train_step = lambda state, batch, key: real_step(state, _corrupt(batch, "inf_logits"), key)

  monkeypatch.setattr(step_lib, "as_logits_fn", _marking_logits_fn)
  inject(monkeypatch, corrupt_every_batch)
  with pytest.raises(RuntimeError, match=r"no progress: 3 failures in a row .*'update_skipped': 3"):
    train_lib.train(tiny_config("sync", rl__max_failures_in_a_row=3), tmp_path)


def test_without_atomic_steps_a_fault_skips_only_its_minibatchs_update(tmp_path, monkeypatch):
  """rl.atomic_step=False: a NaN or inf in row 0 skips that row's mini-batch alone, the step applies and its
  samples are trained (counted as a partial step); a non-finite reward still skips the whole step."""
  calls = []
  monkeypatch.setattr(step_lib, "as_logits_fn", _marking_logits_fn)
  built = inject(monkeypatch, lambda run: _inject_faults(run, calls))
  summary = train_lib.train(tiny_config("pipeline", rl__atomic_step=False), tmp_path)
  led = summary["ledger"]
  assert len(calls) == NUM_STEPS + 1
  for call in calls:
    fault, m = call["fault"], call["metrics"]
    if fault == "inf_reward":
      assert m["updates_applied"] == 0 and m["skip/reward"] == 1, fault
    elif fault in SKIPPED:
      assert m["updates_applied"] == UPDATES - 1 and m["updates_nonfinite"] == 1 and m["skip/nonfinite"] == 0, fault
      assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]), fault  # the applied update's
    else:
      assert m["updates_applied"] == UPDATES and m["updates_nonfinite"] == 0, fault
  assert (led["partial_steps"], led["skipped_updates"]) == (2, 1)
  assert led["dropped"].get("update_skipped") == 16 and led["samples_trained"] == NUM_STEPS * 16
  assert params_finite(built["run"].controller.learner_loop.state.params)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
  assert records[-1]["partial_steps_total"] == 2 and all(np.isfinite(r["loss"]) for r in records)
  check_history(read_trace(tmp_path / "trace.jsonl"), summary, group_size=4)
