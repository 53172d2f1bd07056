"""Checkpoints and resume (jaxrl.checkpoint, controller.build.restore): the newest checkpoint is the one restored
and the one kept, and a resume gets back the step, version, rng, data position and pending groups it saved, with the
samples it cannot train counted as discarded."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl.checkpoint import Checkpointer
from jaxrl.controller import build
from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.ledger import Ledger
from jaxrl.controller.spec import RunRecord
from jaxrl.learner import init_train_state


def _state(version, rng):
  state = init_train_state({"w": jnp.arange(4.0) + version}, optax.sgd(0.1), rng=rng, version=version)
  return state.replace(step=state.step + version + 1)  # a skipped step: one more step than versions


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def _key_data(state):
  return jax.random.key_data(state.rng).tolist()


def _same(a, b):
  assert _key_data(a) == _key_data(b)
  for x, y in zip(jax.tree.leaves(a.replace(rng=None)), jax.tree.leaves(b.replace(rng=None)), strict=True):
    np.testing.assert_array_equal(x, y)


def test_the_newest_checkpoint_is_restored_and_the_newest_ones_are_kept(tmp_path):
  ck = Checkpointer(tmp_path, max_to_keep=2)
  for v in (1, 2, 3):
    ck.save(v, _state(v, rng=10 + v), {"next_group_id": v})
    ck.wait()
  ck.close()
  assert ck.verified_steps() == [2, 3]
  ck = Checkpointer(tmp_path, read_only=True)
  state, record = ck.restore(_abstract(_state(0, rng=0)))
  ck.close()
  assert ck.restored_step == 3 and record == {"next_group_id": 3}
  assert int(state.version) == 3 and int(state.step) == 4
  _same(state, _state(3, rng=13))


def test_a_resume_gets_back_its_state_and_data_position_and_counts_the_samples_it_discards(tmp_path):
  ledger = Ledger(samples_generated=20, samples_trained=12)
  ledger.dropped["too_long"] = 2
  saved = RunRecord(next_group_id=12, pending_group_ids=[9, 11], ledger=ledger, unadmitted_group_ids=[10])
  ck = Checkpointer(tmp_path)
  ck.save(4, _state(4, rng=7), saved.to_json())
  ck.close()
  live = _state(0, rng=1)
  ck = Checkpointer(tmp_path)
  state, record = build.restore(ck, live, jax.tree.map(lambda x: x.sharding, live))
  ck.close()
  _same(state, _state(4, rng=7))
  assert record.next_group_id == 12 and record.pending_group_ids == [9, 11] and record.unadmitted_group_ids == [10]
  assert record.ledger.samples_discarded_at_resume == 20 - 12 - 2  # finished, neither trained nor dropped
  assert record.ledger.held_at_checkpoint() == 0  # a second resume discards nothing more
  # The resumed run generates the pending groups again, then the positions no sampler admitted, then new ones.
  coord = LocalCoordinator(record, num_steps=8, group_size=2, max_failures_in_a_row=10)
  admitted = []
  for _ in range(4):
    coord.admit(admitted.append)
  assert admitted == [9, 11, 10, 12] and record.ledger.samples_regenerated == 2 * 2
  assert record.ledger.groups_admitted == ledger.groups_admitted + 2  # 9 and 11 were counted when first admitted


def test_no_checkpoint_starts_from_the_live_state_and_a_new_record(tmp_path):
  live = _state(0, rng=1)
  ck = Checkpointer(tmp_path)
  state, record = build.restore(ck, live, jax.tree.map(lambda x: x.sharding, live))
  ck.close()
  assert state is live and record == RunRecord() and ck.restored_step is None
