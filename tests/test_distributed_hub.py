"""The learner's hub for independent samplers (jaxrl.distributed.hub) and the samplers' remote channels
(jaxrl.distributed.remote) over real rpc, without a model: admission with fencing tokens, each step's groups split
over the samplers (re-split as they join and leave), a lease that expires (groups generated again, late results
refused and counted), a goodbye, late groups, the checkpoint record, the ledger, and every wait bounded."""

import threading
import time

import numpy as np
import pytest
import secret_util
from secret_util import SECRET

from jaxrl import settings
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.distributed import hub as hub_lib
from jaxrl.distributed import remote, rpc
from jaxrl.rollout import Rollout

MAX_LEN = 8
GROUP = 2


def _group(gid, version, reward=(0.0, 1.0)):
  return [Rollout(np.array([1, 2], np.int32), np.array([3, 4], np.int32), np.zeros(2, np.float32),
                  np.full(2, version, np.int32), "eos", gid, i, reward=reward[i]) for i in range(GROUP)]


@pytest.fixture
def hub():
  rl = settings.RL(group_size=GROUP, groups_per_step=2, seq_len=MAX_LEN, queue_groups=4)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10, max_staleness=1)
  h = hub_lib.Hub(RunRecord(), spec, MAX_LEN, lease_s=1.5, hold_s=0.1, orphan_s=2.0)
  server = secret_util.server(h.handlers())
  h.address = server.address
  yield h
  h.stop.set()
  server.close()


def _join(hub):
  return remote.register(secret=SECRET, address=hub.address, timeout_s=5, reconnect_s=1)


def _admit(coord, n):
  got = []
  for _ in range(n):
    assert coord.admit(lambda gid, again: got.append((gid, again)))
  return got


def test_groups_flow_once_and_the_ledger_counts_them(hub):
  a = _join(hub)
  assert a.progress().shares == 0
  hub.ask()
  hub.go_on(0)
  assert _admit(a, 3) == [(0, False), (1, False), (2, False)]
  out = remote.RemoteRollouts(a, capacity=4, max_len=MAX_LEN)
  groups = [_group(0, 0), _group(1, 0)]
  out.put_all(groups)
  assert groups == [] and hub.depth() == 2
  assert [hub.get(0)[0].group_id for _ in range(2)] == [0, 1]
  hub.settle([_group(0, 0), _group(1, 0)])
  record = hub.checkpoint_record()
  assert record["next_group_id"] == 3 and record["pending_group_ids"] == [2]
  led = record["ledger"]
  assert (led["groups_admitted"], led["samples_generated"], led["samples_trained"]) == (3, 4, 4)


def test_a_sampler_joining_a_resumed_run_starts_from_its_pass_rate_table_and_filter_rate():
  """What a resumed learner's checkpoint says the samplers start from: the pass-rate table and the groups scored
  and rejected so far (over-asking's rate, assembly.scored_groups), in the registration reply."""
  record = RunRecord(next_group_id=5, pass_rate={"alike": {}, "until": {"k": 9}})
  record.ledger.samples_trained, record.ledger.dropped["filtered"] = 2 * GROUP, 3 * GROUP
  rl = settings.RL(group_size=GROUP, groups_per_step=2, seq_len=MAX_LEN)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10, max_staleness=1)
  h = hub_lib.Hub(record, spec, MAX_LEN, lease_s=1.5, hold_s=0.1, orphan_s=2.0)
  server = secret_util.server(h.handlers())
  h.address = server.address
  try:
    a = _join(h)
    assert a.resumed_pass_rate == {"alike": {}, "until": {"k": 9}} and a.resumed_filter == (3, 5)
  finally:
    h.stop.set()
    server.close()


def test_a_silent_sampler_is_dropped_its_groups_go_to_another_and_its_late_results_are_refused(hub):
  a, b = _join(hub), _join(hub)
  hub.go_on(0)
  _admit(a, 2)  # groups 0, 1 held by a
  deadline = time.monotonic() + 10
  while hub.samplers["lost"] < 1 and time.monotonic() < deadline:  # a is silent past its lease (SIGSTOP)
    time.sleep(0.3)
    b.call("heartbeat", seen=None)  # b renews its own
  assert _admit(b, 3) == [(1, True), (0, True), (2, False)]  # a's groups first, generated again
  assert hub.samplers == {"joined": 2, "lost": 1, "left": 0}
  late = [_group(0, 0), _group(1, 0)]
  with pytest.raises(Stopped):  # a wakes up: its packet is refused, counted, and its registration is over
    remote.RemoteRollouts(a, 4, MAX_LEN).put_all(late)
  assert a.ended == "expired" and late == []
  remote.RemoteRollouts(b, 4, MAX_LEN).put_all([_group(0, 0)])
  assert hub.get(0)[0].group_id == 0
  led = hub.ledger
  assert dict(led.samples_refused) == {"fenced": 2 * GROUP}
  assert dict(led.groups_generated_again) == {"sampler_lost": 2}
  assert led.groups_admitted == 3 and led.samples_generated == 3 * GROUP
  assert hub.checkpoint_record()["pending_group_ids"] == [0, 1, 2]  # 0 is taken, not yet settled


def test_goodbye_returns_the_groups_at_once_and_a_stopped_learner_is_a_bounded_wait(hub):
  a = _join(hub)
  _admit(a, 2)
  a.call("goodbye")
  assert hub.samplers["left"] == 1 and dict(hub.ledger.groups_generated_again) == {"sampler_left": 2}
  b = _join(hub)
  assert _admit(b, 1) == [(1, True)]  # the most recently returned first
  hub.stop.set()
  with pytest.raises(Stopped):
    hub.get(0)


def test_a_group_past_its_deadline_is_refused_as_late_and_generated_again(hub):
  a = _join(hub)
  hub.go_on(0)
  _admit(a, 2)
  hub.go_on(2)  # step 2: group 0's tokens (version 0) would be 2 > max_staleness=1 stale
  remote.RemoteRollouts(a, 4, MAX_LEN).put_all([_group(0, 0), _group(1, 2)])  # no token newer than the learner
  assert hub.get(0)[0].group_id == 1
  assert dict(hub.ledger.samples_refused) == {"late": GROUP}
  assert _admit(a, 1) == [(0, True)]


def test_back_pressure_and_the_heartbeat_follow_the_learner(hub):
  a = _join(hub)
  a.start_beating()
  hub.ask()
  deadline = time.monotonic() + 5
  while a.progress().shares < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert a.progress().shares == 1
  _admit(a, 6)
  out = remote.RemoteRollouts(a, 4, MAX_LEN)
  out.put_all([_group(g, 0) for g in range(4)])  # the pool holds queue_groups=4
  blocked = [_group(4, 0), _group(5, 0)]
  sender = threading.Thread(target=out.put_all, args=(blocked,))
  sender.start()
  time.sleep(0.3)
  assert blocked and hub.depth() == 4  # waits for room, renewing its lease
  hub.go_on(0)
  hub.get(0), hub.get(0)
  sender.join(5)
  assert blocked == [] and hub.depth() == 4
  hub.finish()
  deadline = time.monotonic() + 5
  while a.ended is None and time.monotonic() < deadline:
    time.sleep(0.01)
  assert a.ended == "done"


def test_no_sampler_and_no_learner_are_bounded_waits_with_one_line(hub):
  hub.go_on(3)
  _join(hub).start_beating()  # registered and alive, delivers nothing
  with pytest.raises(TimeoutError, match=r"hub: no group delivered for 2s while the learner waited for step 3's "
                     r"groups; samplers registered: \['s0-\w+'\]"):
    hub.get(0)
  with pytest.raises(rpc.RpcError, match=r"rpc 'register' to 127.0.0.1:1: the learner did not take a registration "
                     r"for 0.3s"):
    remote.register(secret=SECRET, address="127.0.0.1:1", timeout_s=1, reconnect_s=0.3)


def test_a_sampler_behind_the_learner_gets_a_tighter_bound_and_none_admits_while_a_step_waits(hub):
  a = _join(hub)
  hub.go_on(5)
  bound = lambda book_step: a.call("heartbeat", seen=None, book_step=book_step)["asks"][2]  # noqa: E731
  assert (bound(None), bound(6), bound(5), bound(2)) == (1, 1, 1, 1 - 3)  # k=1, less the steps others trained
  _admit(a, 2)
  remote.RemoteRollouts(a, 4, MAX_LEN).put_all([_group(0, 5), _group(1, 4)])  # a whole step (2 groups) waits
  assert bound(5) == hub_lib.PAUSED
  hub.go_on(6)  # group 1 (version 4) is now too old to train: one trainable group, admission resumes
  assert bound(5) == 0


def test_once_the_learner_loop_stopped_nothing_changes_the_final_record(hub):
  a = _join(hub)
  _admit(a, 2)
  hub.stop.set()  # the learner loop ended: its last checkpoint's record is taken now
  final = hub.checkpoint_record()
  with pytest.raises(Stopped):
    remote.RemoteRollouts(a, 4, MAX_LEN).put_all([_group(0, 0)])
  assert a.ended == "expired"
  a.call("goodbye", allow_expired=True)
  assert secret_util.call(hub.address, "register", {}, timeout_s=5) == {"stopping": True}
  assert hub.checkpoint_record() == final and hub.registered() == 0
  hub.finish()  # the run is over: a late sampler is told so
  assert secret_util.call(hub.address, "register", {}, timeout_s=5)["done"]


def test_split_shares_each_step_evenly_and_a_joiner_gets_its_part_on_top_until_it_delivers():
  assert hub_lib.split(4, ["a", "b"], set()) == {"a": 2, "b": 2}
  assert hub_lib.split(3, ["a", "b"], set()) == {"a": 2, "b": 1}  # the first to join takes the remainder
  assert hub_lib.split(2, ["a", "b", "c"], set()) == {"a": 1, "b": 1, "c": 0}  # c stands by
  assert hub_lib.split(4, ["a", "b", "c"], {"b", "c"}) == {"a": 4, "b": 1, "c": 1}  # b, c not delivered yet
  assert hub_lib.split(4, ["a", "b", "c"], {"b"}) == {"a": 2, "b": 1, "c": 2}
  assert hub_lib.split(4, ["b"], {"b"}) == {"b": 4} and hub_lib.split(4, [], set()) == {}


def _part(coord) -> int:
  """The sampler's part of each share as the hub answers its heartbeat now."""
  return coord.call("heartbeat", seen=None)["asks"][3]


def _ledger_balances(hub, in_flight: int) -> None:
  led = hub.ledger
  assert led.samples_generated == (led.samples_trained + led.samples_dropped + sum(led.samples_refused.values())
                                   + in_flight)


def test_each_step_is_split_over_the_samplers_and_re_split_as_they_leave_and_join(hub):
  """groups_per_step=2: one group each for a and b; b leaves: a has both; c joins: its part is on top of a's until
  c delivers; a is lost: c has both. The parts reach the sampler loop as Asks.groups; no position is admitted twice
  and the ledger balances."""
  a = _join(hub)
  assert a.progress().groups == 2  # alone: the registration's answer
  b = _join(hub)
  assert (b.progress().groups, _part(a), _part(b)) == (1, 1, 1)
  hub.go_on(0)
  hub.ask()
  a.start_beating()
  deadline = time.monotonic() + 5
  while a.progress().shares < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert a.progress() == (1, 0, 1, 1)
  got = _admit(a, 1) + _admit(b, 1)
  b.call("goodbye")  # b's group goes back, and its part to a
  assert _part(a) == 2 and dict(hub.ledger.groups_generated_again) == {"sampler_left": 1}
  deadline = time.monotonic() + 5
  while a.progress().groups != 2 and time.monotonic() < deadline:  # the held heartbeat answers the new part
    time.sleep(0.01)
  assert a.progress().groups == 2
  got += _admit(a, 1)  # b's group, generated again
  remote.RemoteRollouts(a, 4, MAX_LEN).put_all([_group(0, 0), _group(1, 0)])
  c = _join(hub)
  assert (_part(a), _part(c)) == (2, 1)  # a has delivered, c not yet: the learner does not wait for c's start
  got += _admit(c, 1)
  remote.RemoteRollouts(c, 4, MAX_LEN).put_all([_group(2, 0)])
  assert (_part(a), _part(c)) == (1, 1)
  a.stop.set()  # a's heartbeat ends: a is silent past its lease
  deadline = time.monotonic() + 10
  while hub.samplers["lost"] < 1 and time.monotonic() < deadline:
    time.sleep(0.3)
    _part(c)  # c renews its lease
  assert _part(c) == 2 and hub.samplers == {"joined": 3, "lost": 1, "left": 1}
  assert got == [(0, False), (1, False), (1, True), (2, False)]  # no position handed out twice but b's, again
  trained = [hub.get(0) for _ in range(3)]
  hub.settle(trained)
  assert sorted(g[0].group_id for g in trained) == [0, 1, 2]
  assert hub.ledger.groups_admitted == 3 and hub.checkpoint_record()["pending_group_ids"] == []
  _ledger_balances(hub, in_flight=0)


def test_a_step_that_lacks_groups_nobody_generates_is_asked_again_as_one_more_share(hub):
  """a sends its part of step 0 and b's part never comes (b has taken the share and its delivery was lost): once
  both say they have taken every share they were asked for, the waiting learner gets one more share of each,
  counted as a skipped update (the samplers' deadline books keep the learner's step); not while one still works."""
  a, b = _join(hub), _join(hub)
  hub.go_on(0)
  hub.ask()
  _admit(a, 1)
  remote.RemoteRollouts(a, 4, MAX_LEN).put_all([_group(0, 0)])
  assert hub.get(0)[0].group_id == 0
  got = []
  learner = threading.Thread(target=lambda: got.append(hub.get(0)))
  learner.start()
  asks = lambda coord, pending: coord.call("heartbeat", seen=None, pending=pending)["asks"]  # noqa: E731
  for _ in range(5):  # b still generates its part: nothing is asked again
    time.sleep(0.1)
    assert asks(a, 0) == asks(b, 1) == [1, 0, 1, 1]
  deadline = time.monotonic() + 5
  while asks(a, 0)[0] == 1 and time.monotonic() < deadline:
    asks(b, 0)
    time.sleep(0.05)
  assert asks(a, 0) == asks(b, 0) == [2, 1, 1, 1]  # one more share each, as if an update had been skipped
  _admit(b, 1)
  remote.RemoteRollouts(b, 4, MAX_LEN).put_all([_group(1, 0)])
  learner.join(5)
  assert got[0][0].group_id == 1 and hub.ledger.skipped_updates == 0
