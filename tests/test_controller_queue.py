"""Controller plumbing: staleness policy, group assembly, bounded queue, weight publisher, ledger."""

import threading
import time

import jax
import numpy as np
import pytest

from jaxrl import sharding
from jaxrl.controller.queue import GroupAssembler, Ledger, RolloutQueue, StalenessPolicy, Stopped, WeightPublisher
from jaxrl.rollout import Rollout


def _rollout(gid, idx=0, versions=(0,)):
  v = np.asarray(versions, np.int32)
  return Rollout(np.array([1], np.int32), np.zeros(len(v), np.int32), np.zeros(len(v), np.float32), v, "eos", gid, idx)


def test_admission_bounds_staleness_in_fifo_order():
  """Simulate FIFO consumption: every admitted group is trained with staleness <= k."""
  for k in range(4):
    policy = StalenessPolicy(max_staleness=k, groups_per_step=3)
    admitted_at = []  # sampler version at admission
    version = 0
    for _ in range(30):
      while policy.may_admit(len(admitted_at), version):
        admitted_at.append(version)
      version += 1  # one learner step: consumes the next 3 groups
    for g, v in enumerate(admitted_at[: 3 * 29]):
      assert g // 3 - v <= k
    assert max(g // 3 - v for g, v in enumerate(admitted_at[: 3 * 29])) == k  # the bound is reached, not loose


def test_staleness_of_a_group_uses_its_oldest_token():
  group = [_rollout(0, 0, [3, 4, 5]), _rollout(0, 1, [2, 5])]
  assert StalenessPolicy.staleness(group, 5) == 3
  policy = StalenessPolicy(2, 1)
  assert not policy.is_fresh(group, 5) and policy.is_fresh(group, 4)
  with pytest.raises(ValueError, match="max_staleness"):
    StalenessPolicy(-1, 1)


def test_group_released_only_when_complete_and_sorted():
  asm = GroupAssembler()
  asm.expect(7, 3)
  assert asm.add(_rollout(7, 2)) is None
  assert asm.add(_rollout(7, 0)) is None
  group = asm.add(_rollout(7, 1))
  assert [r.sample_index for r in group] == [0, 1, 2]
  assert asm.open_groups == []
  with pytest.raises(KeyError, match="unknown group 8"):
    asm.add(_rollout(8))


def test_queue_back_pressure_and_stop():
  stop = threading.Event()
  q = RolloutQueue(2, stop, poll_s=0.01)
  q.put([_rollout(0)])
  q.put([_rollout(1)])
  done = threading.Event()

  def producer():
    try:
      q.put([_rollout(2)])  # blocks: the queue is full
      done.set()
    except Stopped:
      pass

  t = threading.Thread(target=producer)
  t.start()
  time.sleep(0.1)
  assert not done.is_set() and q.qsize() == 2
  assert q.get()[0].group_id == 0  # FIFO, and taking one unblocks the producer
  t.join(1)
  assert done.is_set() and q.max_depth == 2
  stop.set()
  with pytest.raises(Stopped):
    q.get() if q.qsize() == 0 else (q.get(), q.get(), q.get())


def test_publisher_versions_and_bitwise_params():
  meshes = sharding.split_mesh(4, {"fsdp": -1}, {"data": -1})
  x = jax.device_put(np.arange(8.0, dtype=np.float32), jax.sharding.NamedSharding(meshes.learner,
                                                                                    jax.sharding.PartitionSpec()))
  dst = jax.sharding.NamedSharding(meshes.sampler, jax.sharding.PartitionSpec())
  pub = WeightPublisher(dst)
  assert pub.take_newer(0) is None
  pub.publish(x, 1)
  got = pub.take_newer(0)
  assert got.version == 1 and got.params.sharding == dst
  np.testing.assert_array_equal(np.asarray(got.params), np.arange(8.0))
  assert pub.take_newer(1) is None
  with pytest.raises(ValueError, match="not newer"):
    pub.publish(x, 1)


def test_ledger_round_trip():
  led = Ledger(samples_generated=10, samples_trained=6)
  led.drop([_rollout(0), _rollout(0, 1)], "stale")
  back = Ledger.from_json(led.to_json())
  assert back.samples_dropped == 2 and back.dropped["stale"] == 2 and back.samples_trained == 6
  back.drop([_rollout(1)], "reward_failed")
  assert back.dropped_groups == 2


def _long(gid, idx, n_tokens, version=0):
  return _rollout(gid, idx, [version] * n_tokens)


def test_on_stale_drop_or_keep_decides_only_groups_over_the_bound():
  old, new = [_rollout(0, 0, [1, 3])], [_rollout(1, 0, [3])]
  drop, keep = StalenessPolicy(1, 2), StalenessPolicy(1, 2, on_stale="keep")
  assert drop.verdict(new, 3) == keep.verdict(new, 3) == "fresh"
  assert drop.verdict(old, 2) == keep.verdict(old, 2) == "fresh"  # staleness 1 == k
  assert drop.verdict(old, 3) == "drop" and keep.verdict(old, 3) == "keep"  # staleness 2 > k
  with pytest.raises(ValueError, match="on_stale must be one of"):
    StalenessPolicy(1, 2, on_stale="skip")


def test_ledger_measures_the_length_bias_of_dropped_groups():
  led = Ledger()
  led.trained([_long(0, 0, 4), _long(0, 1, 6), _long(1, 0, 2), _long(1, 1, 4)])  # mean 4
  led.drop([_long(2, 0, 12), _long(2, 1, 8)], "stale")  # mean 10
  led.drop([_long(3, 0, 1)], "reward_failed")
  bias = led.length_bias()
  assert bias == {"trained_mean_len": 4.0, "dropped_stale_mean_len": 10.0, "dropped_reward_failed_mean_len": 1.0,
                  "stale_over_trained": 2.5}
  led.keep_stale([_long(4, 0, 9), _long(4, 1, 7)])
  back = Ledger.from_json(led.to_json())
  assert back.length_bias()["kept_stale_mean_len"] == 8.0 and back.dropped_tokens["stale"] == 20
  assert back.tokens_trained == 16 and back.kept_stale == 2


def test_ledger_from_an_older_checkpoint_without_token_counts():
  old = {k: v for k, v in Ledger(samples_trained=4).to_json().items()
         if k not in ("tokens_trained", "dropped_tokens", "kept_stale", "kept_stale_tokens")}
  led = Ledger.from_json(old)
  led.drop([_long(0, 0, 3)], "stale")
  assert led.dropped_tokens["stale"] == 3 and led.samples_trained == 4
