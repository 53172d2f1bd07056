"""The learner loop's own checks and bookkeeping (controller.learner_loop) around a stand-in train step: a group over
the staleness bound or drawn with other sampling settings stops the step, a skipped update drops and counts its
groups, tells the samplers and publishes nothing, an applied update publishes its version, and every step trains
with its own rng."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.learner_loop import LearnerLoop, routing_recorded
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.settings import RL, Sampler, Task

GROUP_SIZE, SEED = 2, 5
DEFAULT = SamplingParams()


@flax.struct.dataclass
class _State:
  params: jax.Array
  version: jax.Array
  step: jax.Array


class _Rollouts:
  def __init__(self, groups):
    self.groups = list(groups)

  def get(self, rank):
    return self.groups.pop(0)

  def depth(self):
    return len(self.groups)


class _Weights:
  def __init__(self):
    self.published = []

  def publish(self, params, version):
    self.published.append((float(params), version))


def _group(gid, version, sampling=DEFAULT):
  return [Rollout(np.array([1], np.int32), np.array([2, 3], np.int32), np.zeros(2, np.float32),
                  np.full(2, version, np.int32), "eos", gid, i, sampling=sampling, reward=float(i))
          for i in range(GROUP_SIZE)]


def _loop(groups, *, version=0, num_steps=2, applies=None, max_staleness=1, filter_groups="none"):
  """A learner loop over `groups` (one a step) from state `version`; `applies`: whether each call of the stand-in
  train step applies its update (default: all). Returns (loop, weights, the rng keys the steps were given)."""
  rl = RL(group_size=GROUP_SIZE, groups_per_step=1, seq_len=8, num_minibatches=1, filter_groups=filter_groups)
  spec = RunSpec(rl=rl, sampler=Sampler(), task=Task(), num_steps=num_steps, max_staleness=max_staleness, seed=SEED)
  applies, keys = list(applies or []), []

  def train_step(state, batch, key):
    keys.append(key)
    applied = applies.pop(0) if applies else True
    return state.replace(params=state.params + applied, version=state.version + applied, step=state.step + 1), \
        {"updates_nonfinite": jnp.int32(not applied)}

  coord = LocalCoordinator(RunRecord(), num_steps, GROUP_SIZE, max_failures_in_a_row=100)
  admitted = []
  while len(admitted) < len(groups):  # the groups' data positions, admitted (pending until settled)
    coord.admit(lambda gid, again: admitted.append(gid))
  assert admitted == [g[0].group_id for g in groups]
  state = _State(jnp.float32(0.0), jnp.int32(version), jnp.int32(version))
  weights = _Weights()
  loop = LearnerLoop(spec, train_step=train_step, state=state, rollouts=_Rollouts(groups), weights=weights,
                     coord=coord)
  return loop, weights, keys


def test_an_applied_step_trains_its_samples_and_publishes_its_version():
  loop, weights, _ = _loop([_group(0, 0), _group(1, 0)])
  loop.run()
  led = loop.ledger
  assert loop.version == 2 and weights.published == [(1.0, 1), (2.0, 2)]
  assert led.samples_trained == 2 * GROUP_SIZE and not led.dropped and led.skipped_updates == 0
  assert loop.coord.checkpoint_record()["pending_group_ids"] == [] and loop.trained_staleness == [0, 0, 1, 1]


def test_a_skipped_update_drops_its_groups_tells_the_samplers_and_publishes_nothing(capsys):
  loop, weights, _ = _loop([_group(0, 0), _group(1, 0), _group(2, 0)], applies=[False, True, True])
  loop.run()
  led = loop.ledger
  assert loop.version == 2 and weights.published == [(1.0, 1), (2.0, 2)]  # the skipped step published nothing
  assert led.skipped_updates == 1 and led.dropped == {"update_skipped": GROUP_SIZE} and led.dropped_groups == 1
  assert led.samples_trained == 2 * GROUP_SIZE and loop.coord.progress().updates_skipped == 1
  # the skipped group is settled too: a checkpoint does not regenerate it
  assert loop.coord.checkpoint_record()["pending_group_ids"] == []
  assert "update skipped at version 0" in capsys.readouterr().err


def test_filtered_and_cancelled_groups_are_dropped_under_their_reasons_never_trained():
  """The learner's own check of what reaches it (caught in seconds here, not only end to end): with
  rl.filter_groups a group scored alike is dropped as "filtered", a group the sampler cancelled as "cancelled"; each
  is settled (not pending), counted under its reason, takes no place of a step and stops nothing."""
  alike = _group(1, 0)
  for r in alike:
    r.reward = 1.0
  cancelled = _group(2, 0)
  for r in cancelled:
    r.left_out = "cancelled"
  loop, weights, keys = _loop([_group(0, 0), alike, cancelled, _group(3, 0)], filter_groups="zero_variance")
  loop.run()
  led = loop.ledger
  assert loop.version == 2 and len(keys) == 2 and weights.published == [(1.0, 1), (2.0, 2)]
  assert led.samples_trained == 2 * GROUP_SIZE and led.filtered_groups == 1
  assert led.dropped == {"filtered": GROUP_SIZE, "cancelled": GROUP_SIZE} and led.dropped_groups == 2
  assert loop.coord.checkpoint_record()["pending_group_ids"] == [] and not loop.coord.stop.is_set()


def test_every_step_trains_with_the_rng_of_its_own_train_step():
  loop, _, keys = _loop([_group(0, 0), _group(1, 0), _group(2, 0)], applies=[False, True, True])
  loop.run()
  want = [jax.random.fold_in(jax.random.key(SEED), s) for s in range(3)]  # by train step, skipped ones included
  assert [jax.random.key_data(k).tolist() for k in keys] == [jax.random.key_data(k).tolist() for k in want]


def test_a_group_at_the_staleness_bound_trains_and_one_past_it_stops_the_step():
  loop, weights, _ = _loop([_group(0, 1)], version=2, num_steps=3)
  loop.run()
  assert loop.version == 3 and loop.trained_staleness == [1, 1]
  loop, weights, _ = _loop([_group(0, 0)], version=2, num_steps=3)
  with pytest.raises(RuntimeError, match=r"staleness invariant broken at step 2: \(group, staleness\) \[\(0, 2\)"):
    loop.run()
  assert loop.version == 2 and not weights.published and loop.ledger.samples_trained == 0


def test_a_group_drawn_with_other_sampling_settings_stops_the_step():
  loop, weights, _ = _loop([_group(0, 0, SamplingParams(temperature=0.5))])
  with pytest.raises(ValueError, match=r"rollout \(group 0, sample 0\) was drawn with"):
    loop.run()
  assert loop.version == 0 and not weights.published


def test_routing_recorded_counts_the_model_tokens_routed_as_the_sampler_did():
  """Of 3 + 4 model tokens (prompts of one token: no input before the last): the first sample's observation token
  (loss mask 0) does not count, a token with every layer -1 was not recorded, a token with one layer recorded was; a
  sample without routing records none."""
  a = Rollout(np.array([1], np.int32), np.array([2, 3, 4, 5], np.int32), np.zeros(4, np.float32),
              np.array([0, -1, 0, 0], np.int32), "length", 0, loss_mask=np.array([1, 0, 1, 1], np.float32),
              experts=np.array([[[1, 2], [-1, -1]], [[-1, -1], [-1, -1]], [[-1, -1], [-1, -1]], [[-1, -1], [3, 0]]],
                               np.int16))
  b = Rollout(np.array([1], np.int32), np.array([2, 3, 4, 5], np.int32), np.zeros(4, np.float32),
              np.zeros(4, np.int32), "length", 0, sample_index=1)
  assert routing_recorded([a]) == 2 / 3
  assert routing_recorded([a, b]) == 2 / 7
  assert routing_recorded([]) == 0.0
  # a prompt of 3 tokens: its 2 inputs before the last one count, one recorded (the other -1 in every layer)
  c = Rollout(np.array([1, 2, 3], np.int32), np.array([4], np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32),
              "length", 1, experts=np.zeros((1, 2, 2), np.int16),
              prompt_experts=np.array([[[-1, -1], [-1, -1]], [[0, 1], [2, 3]]], np.int16))
  assert routing_recorded([c]) == 2 / 3
