"""The simulator's admission and assembly (jaxrl.sim.assembly) make the controller's choices: driven on the same random
event sequences as DeadlineBook driven the way the controller's loops drive it, they admit the same groups with the
same deadlines and hand the learner the same groups at every step."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl.controller.assembly import DeadlineBook
from jaxrl.sim.assembly import Assembly
from jaxrl.sim.costs import Costs, DecodeCurve
from jaxrl.sim.lengths import LogNormal
from jaxrl.sim.simulate import RunSpec, simulate_pipeline


def small_costs():
  return Costs(decode=DecodeCurve(0.01, 1e-6, 2e-4, 1e-3), devices_per_engine=1, max_batch=32,
               prefill_s_per_token=1e-5, train_tokens_per_s_per_device=2e4, weight_bytes=1e8, link_bandwidth=1e10)


class Controller:
  """DeadlineBook as jaxrl/controller/sampler_loop.py and learner_loop.py call it: each sampler's book is built with
  (max_staleness, its share, the start version, num_steps, queue_groups // samplers); a sampler admits while its
  book has room, takes shares while it was asked for more than it handed out; the learner asks for the first share
  at the start and for step s + 1's on taking step s's (none past the last step)."""

  def __init__(self, k, groups_per_step, steps, samplers, queue_groups):
    share = groups_per_step // samplers
    self.books = [DeadlineBook(k, share, 0, steps, queue_groups // samplers) for _ in range(samplers)]
    self.outbox = [collections.deque() for _ in range(samplers)]
    self.steps, self.asked, self.taken = steps, 1, 0

  def admit(self, rank, gid, version):
    if self.books[rank].room(version) < 1:
      return None
    return self.books[rank].admit(gid, version)

  def finish(self, rank, gid):
    self.books[rank].finish(gid)

  def end_of_iteration(self):
    for book, out in zip(self.books, self.outbox, strict=True):
      while book.shares < self.asked:
        share = book.take()
        if share is None:
          break
        out.append(share)

  def learner_take(self):
    if not all(self.outbox):
      return None
    batch = [g for out in self.outbox for g in out.popleft()]
    self.taken += 1
    if self.taken < self.steps:  # learner_loop: `if self.version + 1 < num_steps: ask()`, version = the step taken
      self.asked += 1
    return batch


class Groups(list):
  """A controller group (a list whose first item carries group_id), as the sampler loop hands them in."""

  def __init__(self, gid):
    super().__init__([type("R", (), {"group_id": gid})()])


events = st.lists(st.tuples(st.sampled_from(["admit", "admit", "finish", "finish", "learn", "publish"]),
                            st.integers(0, 1000)), min_size=1, max_size=300)


@settings(max_examples=120, deadline=None)
@given(k=st.integers(0, 3), samplers=st.sampled_from([1, 2]), share=st.integers(1, 3), steps=st.integers(1, 6),
       queue_groups=st.integers(1, 8), script=events)
def test_simulator_assembly_makes_the_controllers_choices(k, samplers, share, steps, queue_groups, script):
  gb = share * samplers
  ctl = Controller(k, gb, steps, samplers, queue_groups)
  sim = Assembly(k, gb, steps, samplers, queue_groups)
  version = taken = next_gid = 0
  open_groups = []  # (rank, gid) admitted, not finished
  for op, x in script:
    if op == "admit":
      rank = x % samplers
      want = ctl.admit(rank, next_gid, version)
      got = sim.admit(rank, next_gid, version) if sim.room(rank, version) >= 1 else None
      assert got == want  # the same room, the same deadline
      if want is not None:
        assert want == version + k
        open_groups.append((rank, next_gid))
        next_gid += 1
    elif op == "finish" and open_groups:
      rank, gid = open_groups.pop(x % len(open_groups))
      ctl.finish(rank, Groups(gid))
      sim.finish(rank, gid)
    elif op == "learn" and taken == version and taken < steps:
      want, got = ctl.learner_take(), sim.next_batch()
      if want is not None:
        assert [g[0].group_id for g in want] == got  # the same groups, sampler by sampler, in completion order
        assert sim.asked == ctl.asked
        taken += 1
        sim.assemble()  # the simulator's samplers take the next share at once, as the loops' next iteration does
      else:
        assert got is None
    elif op == "publish" and taken == version + 1:
      version += 1
    ctl.end_of_iteration()
    sim.assemble()
    assert [list(map(lambda g: g[0].group_id, s)) for out in ctl.outbox for s in out] == [
        s for shares in sim.shares for s in shares]
    assert [b.deadline for b in ctl.books] == [b.deadline for b in sim.books]


def test_simulated_run_trains_every_group_by_its_deadline_and_stops_at_the_last_step():
  """A whole simulated pipeline on the controller's books: no group trained after its deadline, none admitted past
  what the run's last step trains, and each step's groups are those the books handed out."""
  spec = RunSpec(sampler_devices=2, learner_devices=2, batch_size=16, group_size=4, max_staleness=2,
                 lengths=LogNormal(40.0, 1.0, 400), prompt_len=16, steps=5, samplers=2, queue_groups=4)
  r = simulate_pipeline(small_costs(), spec)
  g = r.samples["group"] >= 0
  step, stale = r.samples["step"][g], r.samples["staleness"][g]
  assert (step >= 0).all()  # every admitted group is trained: admission stopped at the run's last step
  assert np.bincount(step).tolist() == [16] * spec.total_steps
  assert stale.max() <= 2
  # Each sampler (engine i % 2) hands half of every step's groups.
  engine_of_group = {int(gr): int(e) for gr, e in zip(r.samples["group"][g], r.samples["engine"][g], strict=True)}
  for s in range(spec.total_steps):
    groups = {int(x) for x in r.samples["group"][g][step == s]}
    assert sorted(collections.Counter(engine_of_group[x] % 2 for x in groups).values()) == [2, 2]


def test_samplers_must_split_a_step():
  with pytest.raises(ValueError, match="does not divide"):
    RunSpec(sampler_devices=2, learner_devices=1, batch_size=12, group_size=4, max_staleness=1,
            lengths=LogNormal(40.0, 1.0, 400), samplers=2)
  with pytest.raises(ValueError, match="cannot be shared by 2 samplers"):
    simulate_pipeline(small_costs(), RunSpec(sampler_devices=3, learner_devices=1, batch_size=16, group_size=4,
                                             max_staleness=1, lengths=LogNormal(40.0, 1.0, 400), samplers=2))


def test_queue_limit_is_per_sampler():
  """rl.queue_groups bounds the finished groups of all samplers: each sampler's book holds its part."""
  sim = Assembly(3, 2, 10, samplers=2, queue_groups=4)
  for gid in range(3):
    sim.admit(0, gid, 0)
  for gid in range(3):
    sim.finish(0, gid)
  sim.assemble()  # the first step's share takes one
  assert sim.books[0].room(0) == 0  # two finished groups wait: this sampler's part of the queue is full
  assert sim.books[0].step == 1 and len(sim.books[0].deadline) == 2  # the deadlines alone would leave room for 1
