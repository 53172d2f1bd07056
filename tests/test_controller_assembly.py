"""Deadline-based batch assembly (controller.assembly): out-of-order completion at k = 0, 1, 2 never drops a group,
never trains a token over the bound, and trains exactly the lengths that were generated."""

import numpy as np
import pytest

from jaxrl import settings
from jaxrl.controller.assembly import MAX_OVER_ASK, DeadlineBook, over_ask, reject_reason, scored_groups
from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.interfaces import Asks
from jaxrl.controller.ledger import Ledger
from jaxrl.controller.sampler_loop import SamplerLoop
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.rollout import Rollout

GROUP_SIZE, GROUPS_PER_STEP, SLOTS = 2, 4, 16


def _group(gid, length, version=0, reward=0.0):
  v = np.full(length, version, np.int32)
  return [Rollout(np.array([1], np.int32), np.zeros(length, np.int32), np.zeros(length, np.float32), v, "eos", gid, i,
                  reward=reward) for i in range(GROUP_SIZE)]


def _lengths(num_groups, seed):
  """Long groups admitted first (the first step's worth and every fifth), short ones after: they overtake."""
  rng = np.random.default_rng(seed)
  short = np.maximum(1, rng.lognormal(np.log(6), 0.5, num_groups)).astype(int)
  long = 60 + rng.integers(0, 40, num_groups)
  return np.where((np.arange(num_groups) < GROUPS_PER_STEP) | (np.arange(num_groups) % 5 == 0), long, short)


def _run(k, lengths, train_ticks=3, deadline_based=True):
  """A tick-by-tick pipeline: a sampler with SLOTS decode slots admitting by the book, a learner taking a share
  whenever it is idle (completion order only, if not deadline_based). Returns (trained, staleness per group)."""
  book = DeadlineBook(k, GROUPS_PER_STEP)
  version, busy_until, left = 0, 0, {}
  admitted_at, trained, staleness, fifo = {}, [], [], []
  next_gid, t = 0, 0
  while len(trained) < len(lengths):
    # sampler: a version is taken at once; admit while a group fits the slots and the deadlines
    while next_gid < len(lengths) and len(left) * GROUP_SIZE + GROUP_SIZE <= SLOTS and book.room(version):
      book.admit(next_gid, version)
      admitted_at[next_gid], left[next_gid] = version, int(lengths[next_gid])
      next_gid += 1
    for gid in list(left):
      left[gid] -= 1
      if left[gid] == 0:
        del left[gid]
        group = _group(gid, int(lengths[gid]), admitted_at[gid])
        book.finish(group)
        fifo.append(group)
    # learner
    if t >= busy_until:
      if deadline_based:
        share = book.take()
      else:
        share = fifo[:GROUPS_PER_STEP] if len(fifo) >= GROUPS_PER_STEP else None
        if share:
          fifo = fifo[GROUPS_PER_STEP:]
          for g in share:
            book.discard(g[0].group_id)
          book.shares += 1  # the same admission count as deadline-based
      if share is not None:
        for g in share:
          trained.append(g)
          staleness.append(version - min(r.min_version for r in g))
        version += 1
        busy_until = t + train_ticks
    t += 1
    if t > 100_000:
      raise AssertionError("stalled")
  return trained, staleness


@pytest.mark.parametrize("k", [0, 1, 2])
def test_out_of_order_completion_drops_nothing_and_keeps_the_bound(k):
  lengths = _lengths(96, seed=k)
  trained, staleness = _run(k, lengths)
  ids = [g[0].group_id for g in trained]
  assert sorted(ids) == list(range(len(lengths)))  # every group trained once: zero drops
  assert max(staleness) <= k
  assert max(staleness) == k  # the bound is used, not loose
  # Trained lengths are the generated lengths, as a multiset (not only in mean).
  assert sorted(len(r.completion_tokens) for g in trained for r in g) == sorted(np.repeat(lengths, GROUP_SIZE))
  # Short groups did overtake long ones: the order trained is not the order admitted.
  assert ids != sorted(ids)


@pytest.mark.parametrize("k", [1, 2])
def test_completion_order_alone_breaks_the_bound_on_the_same_workload(k):
  """The workload is adversarial: taking finished groups in completion order (the old rule) trains the long
  groups admitted first over the bound."""
  _, staleness = _run(k, _lengths(96, seed=k), deadline_based=False)
  assert max(staleness) > k


def test_a_share_waits_for_a_group_due_now_and_fills_in_completion_order():
  book = DeadlineBook(1, 2)
  for gid in range(4):
    book.admit(gid, 0)  # all due at step 1
  assert book.room(0) == 0 and book.room(1) == 2
  book.finish(_group(3, 1))
  book.finish(_group(2, 1))
  assert [g[0].group_id for g in book.take()] == [3, 2]  # nothing due at step 0: the first two finished
  book.finish(_group(1, 1))
  assert book.take() is None  # group 0 is due at step 1 and still generating
  book.admit(4, 1)  # due at step 2, finishes first
  book.finish(_group(4, 1))
  assert book.take() is None
  book.finish(_group(0, 1))
  assert [g[0].group_id for g in book.take()] == [1, 0]  # both due now, though 4 finished before 0
  assert book.step == 2 and book.open_groups() == [4]


def test_skipped_updates_and_discards_give_the_room_back():
  book = DeadlineBook(0, 2)
  book.admit(0, 0)
  book.admit(1, 0)
  assert book.room(0) == 0
  book.discard(1)  # its reward failed: it will not be trained
  assert book.room(0) == 1
  book.finish(_group(0, 1))
  book.admit(2, 0)
  book.finish(_group(2, 1))
  assert len(book.take()) == 2 and book.step == 1
  book.skipped = 1  # the learner skipped that update: the next share is again for version 0
  assert book.step == 0 and book.room(0) == 2


def test_nothing_is_admitted_past_the_last_step():
  book = DeadlineBook(2, 3, base_step=4, end_step=6)
  assert book.room(4) == 2 * 3  # steps 4 and 5, though k = 2 would allow step 6 too
  book.admit(0, 4)
  assert book.room(5) == 5


def test_finished_groups_waiting_for_the_learner_stop_admission():
  book = DeadlineBook(5, 2, max_finished=3)
  for gid in range(4):
    book.admit(gid, 0)
  book.finish(_group(0, 1))
  book.finish(_group(1, 1))
  assert book.room(0) == 8
  book.finish(_group(2, 1))
  assert book.room(0) == 0  # three wait
  book.take()
  assert book.room(0) == (0 + 5 - 1 + 1) * 2 - 2  # the share left (step 1); one waits, one generates
  assert DeadlineBook(0, 4, max_finished=1).max_finished == 4  # never below a share


def test_over_ask_is_the_inverse_kept_fraction_with_a_prior_within_bounds():
  assert over_ask(0, 0) == over_ask(0, 50) == 1.0
  assert over_ask(1, 1) == 2.0  # one filtered group of one: the prior keeps it from quadrupling admission
  assert over_ask(10, 19) == 2.0 and over_ask(45, 99) == 100 / 55
  assert over_ask(99, 100) == MAX_OVER_ASK == 4.0
  with pytest.raises(ValueError, match=r"rejected=3 groups must be within \[0, finished=2\]"):
    over_ask(3, 2)


def _resumed_record() -> RunRecord:
  """A checkpoint's run record after 3 trained groups of 4, 4 filtered, 1 too long, 1 surplus, 1 whose update was
  skipped and 2 cancelled (12 settled, 10 of them scored, 5 of those not trainable)."""
  ledger = Ledger(samples_trained=12)
  for reason, groups in (("filtered", 4), ("too_long", 1), ("surplus", 1), ("update_skipped", 1), ("cancelled", 2)):
    ledger.dropped[reason] = 4 * groups
  return RunRecord(next_group_id=11, ledger=ledger)


def test_a_resumed_run_starts_over_asking_at_the_filter_rate_its_checkpoint_counted():
  assert scored_groups(_resumed_record().ledger, group_size=4) == (5, 10)
  assert scored_groups(Ledger(), group_size=4) == (0, 0)
  coord = LocalCoordinator(_resumed_record(), num_steps=10, group_size=4, max_failures_in_a_row=9)
  assert coord.resumed_filter == (5, 10)

  class Sampler:  # what the loop reads before its first admission
    version = 3

  for filter_groups, expected in (("zero_variance", over_ask(5, 10)), ("none", 1.0)):
    rl = settings.RL(group_size=4, groups_per_step=2, seq_len=8, filter_groups=filter_groups)
    spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10)
    loop = SamplerLoop(spec, sampler=Sampler(), prompts=None, score=None, rollouts=None, weights=None, coord=coord)
    coord.stop.set()  # the loop sets itself up and returns before its first admission
    loop.run()
    assert loop.book.over_ask == pytest.approx(expected) and coord.progress() == Asks(0, 0, None)
  assert over_ask(5, 10) == pytest.approx(11 / 6)  # nearly twice the places, not the fresh start's one


class _PartOfEachShare(LocalCoordinator):
  """A coordinator that asks for `groups` of each share (an independent sampler's part: distributed.hub) and ends
  the loop at its first idle wait."""

  def __init__(self, groups):
    super().__init__(RunRecord(), num_steps=10, group_size=2, max_failures_in_a_row=9)
    self.groups = groups

  def progress(self):
    return Asks(0, 0, None, self.groups)

  def idle(self, timeout_s):
    self.stop.set()


def _admitting_loop(groups_per_step: int, coord) -> SamplerLoop:
  """A sampler loop at version 0 (k = 1, groups of 2) whose sampler takes every submission and generates nothing,
  so that one run of it admits what its book allows and then idles (coord ends it)."""
  class Engine:
    max_slots, max_len = 64, 100

  class Sampler:
    version, num_waiting, num_active, engine = 0, 0, 0, Engine()

    def submit(self, *args, **kw):
      pass

  class Weights:
    def take_newer(self, version):
      return None

  rl = settings.RL(group_size=2, groups_per_step=groups_per_step, seq_len=8)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10, max_staleness=1)
  return SamplerLoop(spec, sampler=Sampler(), prompts=lambda gid: (np.array([1], np.int32), {}), score=None,
                     rollouts=None, weights=Weights(), coord=coord)


def test_the_sampler_loop_admits_for_the_part_of_each_share_it_is_asked_for():
  for groups, admitted in ((None, 8), (1, 2), (0, 0)):  # k + 1 = 2 steps of places, 4 or 1 or 0 groups each
    loop = _admitting_loop(4, _PartOfEachShare(groups))
    loop.run()
    assert loop.book.open_groups() == list(range(admitted))


class _SkipsAfterStart(_PartOfEachShare):
  """A coordinator whose learner has skipped `skipped` updates since the loop started (none at its start)."""

  def __init__(self, skipped):
    super().__init__(None)
    self.skipped, self.calls = skipped, 0

  def progress(self):
    self.calls += 1
    return Asks(0, 0 if self.calls == 1 else self.skipped, None)


def test_the_sampler_loop_counts_the_learners_skipped_updates_in_its_book():
  """A skipped update trains no version: the sampler loop's book must move its step back by each one the learner
  reports, or its admissions (and deadlines) run a version ahead of the learner and a fault run waits forever for
  groups never admitted. Here, at version 0 with k = 1 and 2 groups a step, each skipped update is room for one
  more step of groups."""
  for skipped, admitted in ((0, 4), (1, 6), (2, 8)):
    loop = _admitting_loop(2, _SkipsAfterStart(skipped))
    loop.run()
    assert loop.book.skipped == skipped and loop.book.step == -skipped
    assert loop.book.open_groups() == list(range(admitted))


def test_a_book_whose_part_shrinks_takes_the_smaller_share_and_leaves_the_rest_out_at_its_deadline():
  book = DeadlineBook(0, 2)
  for gid in range(2):
    book.admit(gid, 0)
  book.gb = 1  # a sampler joined: this one's part of each share is 1
  assert book.room(0) == 0
  for gid in range(2):
    book.finish(_group(gid, 1))
  assert [g[0].group_id for g in book.take()] == [0] and [g[0].group_id for g in book.surplus] == [1]
  book.gb = 0  # standing by: empty shares, no room
  assert book.room(1) == 0 and book.take() == [] and book.step == 2


def test_over_asked_groups_beyond_the_places_are_surplus_at_their_deadline():
  book = DeadlineBook(0, 2)
  book.over_ask = 2.0
  assert book.room(0) == 4
  for gid in range(4):
    book.admit(gid, 0)  # all due at step 0
  book.finish(_group(2, 1, reward=1.0))
  book.discard(0)  # filtered: gives its place back
  assert book.take() is None
  book.finish(_group(3, 1))
  book.finish(_group(1, 1))
  # Among finished groups due now, the first admitted are kept (not the first finished: that would favour short
  # completions); the share lists them in completion order.
  assert [g[0].group_id for g in book.take()] == [2, 1]
  assert [g[0].group_id for g in book.surplus] == [3] and book.open_groups() == [] and book.doomed == set()
  assert book.step == 1 and book.room(1) == 4  # nothing past its deadline holds a place


def test_a_surplus_group_still_generating_is_surplus_when_it_finishes_unless_filtered():
  book = DeadlineBook(0, 1)
  book.over_ask = 3.0
  for gid in range(3):
    book.admit(gid, 0)
  book.finish(_group(0, 1))
  assert [g[0].group_id for g in book.take()] == [0]
  assert book.doomed == {1, 2} and book.surplus == [] and book.room(1) == 3
  book.finish(_group(1, 1))
  book.discard(2)  # filtered after all: dropped for that, not as surplus
  assert [g[0].group_id for g in book.surplus] == [1] and book.doomed == set()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_over_asking_at_a_90_percent_filter_rate_keeps_the_bound_and_accounts_for_every_group(k):
  """Groups of random lengths, 90% of them filtered when they finish: every step still trains a full share, no
  trained group is staler than k, and each admitted group is trained, filtered or surplus, exactly once."""
  rng = np.random.default_rng(k)
  book = DeadlineBook(k, GROUPS_PER_STEP)
  version, busy_until, left, admitted_at = 0, 0, {}, {}
  trained, filtered, staleness, rejected, finished = [], [], [], 0, 0
  t = 0
  while version < 12:
    while len(left) * GROUP_SIZE + GROUP_SIZE <= 4 * SLOTS and book.room(version):
      gid = len(admitted_at)
      book.admit(gid, version)
      admitted_at[gid], left[gid] = version, int(rng.integers(1, 30))
    for gid in list(left):
      left[gid] -= 1
      if left[gid] == 0:
        del left[gid]
        finished += 1
        if rng.random() < 0.9:
          book.discard(gid)
          filtered.append(gid)
          rejected += 1
        else:
          book.finish(_group(gid, 3, admitted_at[gid]))
        book.over_ask = over_ask(rejected, finished)
    if t >= busy_until and (share := book.take()) is not None:
      assert len(share) == GROUPS_PER_STEP
      trained += [g[0].group_id for g in share]
      staleness += [version - admitted_at[g[0].group_id] for g in share]
      version += 1
      busy_until = t + 3
    t += 1
    assert t < 100_000, "stalled"
  surplus = [g[0].group_id for g in book.surplus]
  assert max(staleness) <= k and book.over_ask > 3
  assert len(trained) == 12 * GROUPS_PER_STEP
  accounted = trained + filtered + surplus + list(book.doomed) + book.open_groups()  # open: waiting or generating
  assert sorted(accounted) == sorted(admitted_at)  # none twice, none lost


def test_admission_without_room_and_unknown_groups_are_errors():
  book = DeadlineBook(0, 1)
  book.admit(0, 0)
  with pytest.raises(RuntimeError, match="without room"):
    book.admit(1, 0)
  with pytest.raises(KeyError, match="never admitted"):
    book.finish(_group(5, 1))
  with pytest.raises(ValueError, match="max_staleness"):
    DeadlineBook(-1, 1)
  book.base = 3  # a group due at step 0 still open at step 3
  with pytest.raises(RuntimeError, match="staleness invariant broken"):
    book.due_count()


def test_reject_reason_names_failed_rewards_and_overlong_groups():
  assert reject_reason(_group(0, 3), seq_len=4) is None
  for bad in (float("nan"), float("inf"), -float("inf")):  # a reward fn's overflow is a failure too, not a score
    assert reject_reason(_group(0, 3, reward=bad), seq_len=4) == "reward_failed"
  assert reject_reason(_group(0, 4), seq_len=4) == "too_long"
  surplus = _group(0, 3, reward=1.0)
  for r in surplus:
    r.left_out = "surplus"  # the sampler side's reason crosses with the group: the learner drops it for that
  assert reject_reason(surplus, seq_len=4) == "surplus"
  for r in surplus:
    r.left_out, r.reward = "cancelled", float("nan")  # ended early, never scored: that, not a failed reward
  assert reject_reason(surplus, seq_len=4) == "cancelled"
