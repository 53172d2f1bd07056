"""The real controller loop (tiny model, one CPU device per role) on out-of-order completions at k = 0, 1, 2: the
first step's groups and every fifth group are long (16 tokens), the others short (2), forced per group with EOS
ignored, so short groups overtake long ones. Nothing is dropped, no trained token is over the bound, and every
group admitted early enough to be due within the run is trained, whatever its length."""

import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.config import override
from jaxrl.metrics import read_jsonl
from jaxrl.train import build

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402

NUM_STEPS = 6
LONG, SHORT = 16, 2
# The shorter runs decay the learning rate over NUM_STEPS too: the schedule is part of the train step's program, so
# theirs is the one the out-of-order runs compiled (the persistent cache), not one more per run length.
SCHEDULE = {"optimizer__decay_steps": NUM_STEPS}


def _run_to_the_end(run) -> None:
  ctl = run.controller
  try:
    ctl.run()
  finally:
    ctl.finish()
    run.checkpointer.close()
    run.metrics.close()
    ctl.sampler_loop.score.close()


def _length(gid: int, groups_per_step: int) -> int:
  return LONG if gid < groups_per_step or gid % 5 == 0 else SHORT


@pytest.mark.parametrize("k", [0, 1, 2])
def test_out_of_order_groups_are_trained_by_their_deadline_never_dropped(k, tmp_path):
  c = override(tiny.get_config("pipeline"), num_steps=NUM_STEPS, rl__max_staleness=k, mesh__num_devices=2,
               mesh__sampler_devices=1, log__tensorboard=False, log__progress=False,
               checkpoint__every_steps=NUM_STEPS)
  run = build(c, tmp_path)
  ctl, gb = run.controller, c.rl.groups_per_step
  sampler = ctl.sampler_loop.sampler
  admitted, events = {}, []  # group -> sampler version at admission; the controller's trace events
  real_submit = sampler.submit

  def forced_submit(prompt, gid, n, meta=None, **kw):
    admitted[gid] = sampler.version
    kw.update(max_tokens=_length(gid, gb), ignore_eos=True, stop_token_ids=())
    real_submit(prompt, gid, n, meta, **kw)

  sampler.submit, ctl.learner_loop.trace = forced_submit, events.append
  _run_to_the_end(run)

  trained = {}  # group -> learner version it was trained at
  for e in events:
    if e["event"] == "train":
      assert e["applied"]
      for gid, _, oldest, _ in e["samples"]:
        assert e["version"] - oldest <= k  # per sample: the oldest token's staleness
        trained[gid] = e["version"]
  led = ctl.ledger
  assert ctl.version == NUM_STEPS and not led.dropped
  assert max(ctl.learner_loop.trained_staleness) <= k and led.samples_trained == NUM_STEPS * gb * c.rl.group_size
  for gid, version in trained.items():
    assert version <= admitted[gid] + k  # by its deadline
  due_in_run = {gid for gid, v in admitted.items() if v + k < NUM_STEPS}
  assert due_in_run <= set(trained)  # every group due within the run was trained: long ones too
  lengths = [_length(g, gb) for g in trained]
  assert lengths.count(LONG) >= gb and lengths.count(SHORT) >= gb
  # The trained lengths are the forced (generated) ones, sample by sample.
  assert led.tokens_trained == c.rl.group_size * sum(lengths)
  if k > 0:  # short groups admitted after a long one were trained before it
    order = list(trained)
    assert any(order.index(g) > order.index(h) for g in trained for h in trained
               if g < h and _length(g, gb) == LONG and _length(h, gb) == SHORT)
  assert np.isfinite(led.length_bias()["trained_mean_len"])


def test_a_train_step_never_runs_while_a_checkpoint_save_still_reads_the_state(tmp_path):
  """The step donates the state: with a save in flight it would run beside a second state (issue 14's memory)."""
  c = override(tiny.get_config("pipeline"), num_steps=3, mesh__num_devices=2, mesh__sampler_devices=1,
               log__tensorboard=False, log__progress=False, checkpoint__every_steps=1, **SCHEDULE)
  run = build(c, tmp_path)
  ctl = run.controller
  real_step, real_save, seen = ctl.learner_loop.train_step, run.checkpointer.save, []

  def step(*args):
    seen.append(("step", run.checkpointer.saving))
    return real_step(*args)

  def save(*args, **kw):
    seen.append(("save", run.checkpointer.saving))
    return real_save(*args, **kw)

  ctl.learner_loop.train_step, run.checkpointer.save = step, save
  _run_to_the_end(run)
  assert [e for e, _ in seen] == ["step", "save"] * 3  # finish() finds version 3 saved
  assert not any(saving for e, saving in seen if e == "step")


def test_every_packed_row_bucket_is_compiled_before_the_first_step(tmp_path):
  """A packed run compiles its train step once per row bucket at build time, so no step mid-run pays a compilation
  (the headline's sync runs paid 1.5 s at the first 8-row step before this; issue 17)."""
  # one group a step: 4 rows at most, so 4 row buckets (1, 2, 3, 4) to compile, not the 8 of 16 rows
  c = override(tiny.get_config("pipeline"), num_steps=4, mesh__num_devices=2, mesh__sampler_devices=1,
               log__tensorboard=False, log__progress=False, rl__pack=True, rl__groups_per_step=1,
               sampler__forced_lengths__median=3.0, sampler__forced_lengths__p99_ratio=10.0)
  run = build(c, tmp_path)
  steps = run.controller.learner_loop.train_step
  buckets = run.controller.learner_loop.spec.row_buckets
  assert len(buckets) >= 2 and len(steps.compiled) == len(buckets)
  _run_to_the_end(run)
  rows = [r["train_tokens"] // c.rl.seq_len for r in read_jsonl(tmp_path / "metrics.jsonl")]
  assert len(rows) == c.num_steps and set(rows) <= set(buckets)
  assert steps.fallbacks == 0 and steps.jitted._cache_size() == 0  # every step ran a program compiled at build


@pytest.mark.parametrize("mode", ["pipeline", "sync"])
def test_the_learner_asks_for_the_next_share_before_it_trains_and_never_past_the_last_step(mode, tmp_path):
  """Step s + 1's share is asked for once step s's is taken, so the sampler side assembles and sends it while step s
  trains (issue 17: the learner waited 6-30 ms a step for a share asked after training); the last step asks for
  nothing more, so no group is generated for a step that never comes. Sync (k = 0) trains what it did before."""
  c = override(tiny.get_config(mode), num_steps=4, mesh__num_devices=2, mesh__sampler_devices=1,
               log__tensorboard=False, log__progress=False, checkpoint__every_steps=4, **SCHEDULE)
  run = build(c, tmp_path)
  ctl = run.controller
  events = []
  real_ask, real_step = ctl.coord.ask, ctl.learner_loop.train_step

  def ask():
    events.append("ask")
    real_ask()

  def step(*args):
    events.append("step")
    return real_step(*args)

  ctl.coord.ask, ctl.learner_loop.train_step = ask, step
  _run_to_the_end(run)
  assert events == ["ask"] + ["ask", "step"] * 3 + ["step"]
  led = ctl.ledger
  assert ctl.version == 4 and not led.dropped
  assert led.samples_trained == 4 * c.rl.groups_per_step * c.rl.group_size
  if mode == "sync":
    assert max(ctl.learner_loop.trained_staleness) == 0
