"""Controller plumbing: group assembly, bounded queue, weight publisher, ledger."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl import sharding
from jaxrl.controller.ledger import Ledger
from jaxrl.controller.rollouts import GroupAssembler, RolloutQueue, Stopped
from jaxrl.controller.weights import WeightPublisher
from jaxrl.rollout import Rollout


def _rollout(gid, idx=0, versions=(0,)):
  v = np.asarray(versions, np.int32)
  return Rollout(np.array([1], np.int32), np.zeros(len(v), np.int32), np.zeros(len(v), np.float32), v, "eos", gid, idx)


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
  assert not done.is_set() and q.depth() == 2
  assert q.get()[0].group_id == 0  # FIFO, and taking one unblocks the producer
  t.join(1)
  assert done.is_set() and q.max_depth == 2
  stop.set()
  with pytest.raises(Stopped):
    q.get() if q.depth() == 0 else (q.get(), q.get(), q.get())


def test_publisher_versions_and_bitwise_params():
  learner_devices, sampler_devices = sharding.split_devices(4)
  learner = sharding.make_mesh({"fsdp": -1}, learner_devices)
  sampler = sharding.make_mesh({"data": -1}, sampler_devices)
  x = jax.device_put(np.arange(8.0, dtype=np.float32), jax.sharding.NamedSharding(learner, P()))
  dst = jax.sharding.NamedSharding(sampler, P())
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
  led.drop([_rollout(0), _rollout(0, 1)], "too_long")
  back = Ledger.from_json(led.to_json())
  assert back.samples_dropped == 2 and back.dropped["too_long"] == 2 and back.samples_trained == 6
  back.drop([_rollout(1)], "reward_failed")
  assert back.dropped_groups == 2


def _long(gid, idx, n_tokens, version=0):
  return _rollout(gid, idx, [version] * n_tokens)


def test_ledger_measures_trained_against_generated_lengths():
  led = Ledger(samples_generated=7, tokens_generated=32)
  led.trained([_long(0, 0, 4), _long(0, 1, 6), _long(1, 0, 2), _long(1, 1, 4)])  # mean 4
  led.drop([_long(2, 0, 12), _long(2, 1, 8)], "too_long")  # mean 10
  led.drop([_long(3, 0, 1)], "reward_failed")
  bias = Ledger.from_json(led.to_json()).length_bias()
  assert bias == {"generated_mean_len": 32 / 7, "trained_mean_len": 4.0, "dropped_too_long_mean_len": 10.0,
                  "dropped_reward_failed_mean_len": 1.0, "trained_over_generated": 4.0 / (32 / 7)}


def test_ledger_from_an_older_checkpoint_without_token_counts():
  old = {k: v for k, v in Ledger(samples_trained=4).to_json().items()
         if k not in ("tokens_trained", "tokens_generated", "dropped_tokens")}
  old.update(kept_stale=2, kept_stale_tokens=9)  # written while rl.on_stale existed
  led = Ledger.from_json(old)
  led.drop([_long(0, 0, 3)], "too_long")
  assert led.dropped_tokens["too_long"] == 3 and led.samples_trained == 4 and led.tokens_generated == 0
