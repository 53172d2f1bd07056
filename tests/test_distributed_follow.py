"""The follower channel of a learner over several processes (jaxrl.distributed.follow), over real rpc, without a
model: followers get the lead's decisions and groups in the lead's order, bit for bit; the lead drops what every
follower has; every wait is bounded with one line naming the lead and the entry; out-of-order and dropped entries
are clear errors."""

import threading

import numpy as np
import pytest
import secret_util
from secret_util import SECRET

from jaxrl import settings
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.distributed import follow, remote
from jaxrl.distributed.launch import free_ports
from jaxrl.rollout import Rollout

MAX_LEN = 8


def _group(gid, version, reward=(0.0, 1.0)):
  return [Rollout(np.array([1, 2], np.int32), np.array([3, 4 + i], np.int32), np.array([-0.5, -1.25 * i], np.float32),
                  np.full(2, version, np.int32), "eos", gid, i, reward=reward[i]) for i in range(2)]


def _same(a, b):
  return all(x.group_id == y.group_id and x.sample_index == y.sample_index and x.reward == y.reward
             and np.array_equal(x.completion_tokens, y.completion_tokens) and np.array_equal(x.versions, y.versions)
             and x.logprobs.tobytes() == y.logprobs.tobytes() for x, y in zip(a, b, strict=True))


@pytest.fixture
def lead():
  log = follow.FollowLog([1, 2], MAX_LEN, hold_s=0.1)
  server = secret_util.server({"follow": log.serve})
  yield log, server.address
  server.close()


def _follower(address, pid, **kw):
  return follow.Follower(follow.Lead(address, pid, secret=SECRET, **kw), RunRecord(), MAX_LEN)


def test_followers_get_the_leads_decisions_and_groups_in_order_bit_for_bit(lead):
  log, address = lead
  groups = [_group(g, 0, reward=(0.25 * g, 1.0)) for g in range(3)]
  log.went_on(0, True)
  log.took(groups[0])
  log.took(groups[1])
  log.went_on(1, True)
  log.took(groups[2])
  log.end("done")
  for pid in (1, 2):
    f = _follower(address, pid)
    assert f.go_on(0) is True
    assert _same(f.get(), groups[0]) and _same(f.get(), groups[1])
    assert f.go_on(1) is True
    assert _same(f.get(), groups[2])
    assert f.go_on(2) is False  # the lead's end: the loop stops after the lead's last step
    assert f.stop.is_set() and "the lead learner ended (done)" in f.stop_reason


def test_the_lead_waits_until_every_follower_has_its_end_before_it_closes(lead):
  """A lead whose last step needs no checkpoint reaches its end at once: it keeps serving until each follower has
  acked what stopped it (a go_on the lead decided False, or the end), and names the ones that did not within
  end_wait_s."""
  log, address = lead
  log.end_wait_s = 0.3
  log.went_on(0, False)
  log.end("SIGTERM")
  assert log.wait_fetched() == [1, 2]  # nobody fetched anything: both named after 0.3 s
  f = _follower(address, 1)
  assert f.go_on(0) is False
  assert log.wait_fetched() == [2]
  assert _follower(address, 2).go_on(0) is False and log.wait_fetched() == []
  done = threading.Event()
  threading.Thread(target=lambda: (log.wait_fetched(), done.set())).start()
  assert done.wait(1.0)  # nothing left to fetch: no wait
  # a lead that ended mid-step: a follower stopped in get by the end acks it too
  ended = follow.FollowLog([1], MAX_LEN, hold_s=0.1, end_wait_s=2.0)
  server = secret_util.server({"follow": ended.serve})
  try:
    ended.went_on(0, True)
    ended.end("SIGTERM")
    f = _follower(server.address, 1)
    assert f.go_on(0) is True
    with pytest.raises(Stopped):
      f.get()
    assert ended.wait_fetched() == []
  finally:
    server.close()


def test_a_follower_waiting_in_get_stops_at_the_leads_end(lead):
  log, address = lead
  f = _follower(address, 1)
  log.went_on(0, True)
  assert f.go_on(0)
  threading.Timer(0.3, log.end, ("SIGTERM",)).start()  # the lead stopped mid-step
  with pytest.raises(Stopped):
    f.get()


def test_out_of_lock_step_is_an_error_naming_the_lead(lead):
  log, address = lead
  log.went_on(3, True)
  log.went_on(4, True)
  f = _follower(address, 1)
  with pytest.raises(RuntimeError, match=rf"learner process 1 is at version 2, the lead learner at {address} at 3"):
    f.go_on(2)
  with pytest.raises(RuntimeError, match="waited for a group and the lead learner .* sent a go_on"):
    f.get()


def test_the_lead_keeps_only_what_some_follower_has_not_fetched(lead):
  log, _ = lead
  for v in range(5):
    log.went_on(v, True)
  assert len(log.serve({"follower": 1, "next": 0})["entries"]) == 5
  assert log.serve({"follower": 1, "next": 5})["entries"] == []  # follower 1 has all five
  assert log.held() == 5  # follower 2 has none yet
  assert len(log.serve({"follower": 2, "next": 2})["entries"]) == 3
  assert (log.held(), log.first) == (3, 2)
  log.serve({"follower": 2, "next": 5})
  assert (log.held(), log.first) == (0, 5)
  log.went_on(5, False)
  assert log.held() == 1
  with pytest.raises(LookupError, match="learner process 2 asked for entry 4, dropped .* keeps entries from 5"):
    log.serve({"follower": 2, "next": 4})
  with pytest.raises(ValueError, match="learner process 7 is not a follower"):
    log.serve({"follower": 7, "next": 0})


def test_a_follower_asking_for_a_dropped_entry_gets_a_clear_error(lead):
  log, address = lead
  log.went_on(0, True)
  log.serve({"follower": 1, "next": 1})
  log.serve({"follower": 2, "next": 1})
  with pytest.raises(RuntimeError, match="follow: .*asked for entry 0, dropped.*relaunch every learner process"):
    _follower(address, 1).go_on(0)


def test_a_silent_lead_and_a_lead_without_entries_are_bounded_waits_naming_it(lead):
  log, address = lead
  f = _follower(address, 1, wait_s=0.3)
  log.went_on(0, True)
  assert f.go_on(0)
  with pytest.raises(TimeoutError) as e:
    f.get()
  assert str(e.value) == f"follow: the lead learner at {address} sent learner process 1 no entry 1 (group) in 0.3s"
  (port,) = free_ports(1)  # nobody listens there: a dead lead
  dead = _follower(f"127.0.0.1:{port}", 1, timeout_s=0.5)
  with pytest.raises(TimeoutError) as e:
    dead.go_on(0)
  line = str(e.value)
  assert "\n" not in line and line.startswith(f"follow: learner process 1 heard nothing from the lead learner at "
                                              f"127.0.0.1:{port} for 0.5s while waiting for entry 0 (go_on)")
  stopped = _follower(address, 1)
  stopped.stop.set()
  with pytest.raises(Stopped):
    stopped.lead.next("go_on", stopped.stop)


def test_the_lead_hub_records_what_its_learner_loop_decides_and_takes():
  rl = settings.RL(group_size=2, groups_per_step=2, seq_len=MAX_LEN, queue_groups=4)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10, max_staleness=1)
  log = follow.FollowLog([1], MAX_LEN, hold_s=0.1)
  hub = follow.LeadHub(RunRecord(), spec, MAX_LEN, log=log, lease_s=5.0, hold_s=0.1, orphan_s=5.0)
  server = secret_util.server({**hub.handlers(), "follow": log.serve})
  try:
    sampler = remote.register(secret=SECRET, address=server.address, timeout_s=5, reconnect_s=1)
    hub.ask()
    assert hub.go_on(0)
    for _ in range(2):
      assert sampler.admit(lambda gid, again: None)
    sent = [_group(0, 0), _group(1, 0)]
    remote.RemoteRollouts(sampler, capacity=4, max_len=MAX_LEN).put_all(list(sent))
    taken = [hub.get(), hub.get()]
    f = _follower(server.address, 1, wait_s=2.0)
    assert f.go_on(0) and _same(f.get(), taken[0]) and _same(f.get(), taken[1])
    assert sorted(g[0].group_id for g in taken) == [0, 1]
  finally:
    hub.stop.set()
    server.close()
