"""Page allocator: reference counts, free + used = pool, no write into a shared page, all-or-nothing failures."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxrl.sampler.page_allocator import OutOfPages, PageAllocator, pages_for, shared_pages

SLOTS, PAGE, PER_SLOT = 4, 4, 6


class AllocatorMachine(RuleBasedStateMachine):
  """Random groups, attaches, growth and releases against a model of who references which page."""

  def __init__(self):
    super().__init__()
    self.alloc = PageAllocator(num_pages=14, page_size=PAGE, num_slots=SLOTS, pages_per_slot=PER_SLOT)
    self.prompts = []  # (SharedPrompt, prompt_len) still held by their group
    self.prompt_len = {}  # slot -> prompt length of its sample
    self.pos = {}  # slot -> positions the slot holds pages for

  @rule(prompt_len=st.integers(1, PAGE * PER_SLOT - 1))
  def new_group(self, prompt_len):
    free = self.alloc.num_free
    try:
      self.prompts.append((self.alloc.share_prompt(prompt_len), prompt_len))
    except OutOfPages:
      assert shared_pages(prompt_len, PAGE) > free and self.alloc.num_free == free

  @precondition(lambda self: self.prompts)
  @rule(data=st.data())
  def attach(self, data):
    empty = [s for s in range(SLOTS) if s not in self.pos]
    if not empty:
      return
    slot = data.draw(st.sampled_from(empty))
    prompt, prompt_len = data.draw(st.sampled_from(self.prompts))
    positions = data.draw(st.integers(prompt_len, PAGE * PER_SLOT))
    free = self.alloc.num_free
    try:
      self.alloc.attach(slot, prompt, positions)
    except OutOfPages:
      assert self.alloc.num_free == free and not self.alloc.tables[slot]
      return
    self.pos[slot], self.prompt_len[slot] = positions, prompt_len

  @precondition(lambda self: self.pos)
  @rule(data=st.data(), grow=st.integers(0, 9))
  def reserve(self, data, grow):
    slot = data.draw(st.sampled_from(sorted(self.pos)))
    free, before = self.alloc.num_free, len(self.alloc.tables[slot])
    try:
      added = self.alloc.reserve(slot, self.pos[slot] + grow)
    except OutOfPages:
      assert self.alloc.num_free == free and len(self.alloc.tables[slot]) == before
      return
    assert added == len(self.alloc.tables[slot]) - before
    self.pos[slot] += grow

  @precondition(lambda self: self.pos)
  @rule(data=st.data())
  def finish(self, data):
    slot = data.draw(st.sampled_from(sorted(self.pos)))
    self.alloc.release(slot)
    del self.pos[slot], self.prompt_len[slot]

  @precondition(lambda self: self.prompts)
  @rule(data=st.data())
  def group_placed(self, data):
    i = data.draw(st.integers(0, len(self.prompts) - 1))
    self.alloc.release_prompt(self.prompts.pop(i)[0])

  @invariant()
  def reference_counts(self):
    expected = np.zeros(self.alloc.num_pages, np.int32)
    for prompt, _ in self.prompts:
      np.add.at(expected, list(prompt.pages), 1)
    for table in self.alloc.tables:
      np.add.at(expected, table, 1)
    np.testing.assert_array_equal(self.alloc.refs_P, expected)

  @invariant()
  def free_plus_used_is_the_pool(self):
    free = self.alloc._free
    assert len(set(free)) == len(free)
    assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_pages
    assert all(self.alloc.refs_P[p] == 0 for p in free)

  @invariant()
  def samples_write_only_private_pages(self):
    for slot, positions in self.pos.items():
      held = min(positions, PAGE * PER_SLOT)
      first_write = self.prompt_len[slot] - 1  # the first decode step rewrites the last prompt position
      assert all(self.alloc.writable(slot, p) for p in range(first_write, held))
      shared = self.alloc.num_shared_S[slot]
      assert shared == shared_pages(self.prompt_len[slot], PAGE)
      assert not any(self.alloc.writable(slot, p) for p in range(shared * PAGE))
      assert len(self.alloc.tables[slot]) == min(pages_for(held, PAGE), PER_SLOT)


TestAllocator = AllocatorMachine.TestCase
TestAllocator.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _live_pool(draw):
  """A pool with live slots (some sharing a group prompt), each admitted in slot order, and their next needs."""
  alloc = PageAllocator(num_pages=draw(st.integers(6, 16)), page_size=PAGE, num_slots=SLOTS, pages_per_slot=PER_SLOT)
  prompt_len = draw(st.integers(1, 12))
  prompt = alloc.share_prompt(prompt_len)
  needs = []
  for slot in range(SLOTS):
    held = draw(st.integers(prompt_len, PAGE * PER_SLOT))
    try:
      alloc.attach(slot, prompt if draw(st.booleans()) else None, held)
    except OutOfPages:
      break
    needs.append((slot, held + draw(st.integers(0, 3 * PAGE))))
  alloc.release_prompt(prompt)
  return alloc, needs


@settings(max_examples=80, deadline=None)
@given(_live_pool())
def test_preemption_keeps_every_sample_and_frees_the_newest(pool):
  alloc, needs = pool
  live = [slot for slot, _ in needs]
  growth = sum(max(0, min(pages_for(n, PAGE), PER_SLOT) - len(alloc.tables[slot])) for slot, n in needs)
  fits = growth <= alloc.num_free
  victims, _ = alloc.reserve_or_preempt(needs)
  assert fits == (victims == [])  # preempts exactly when the growth does not fit
  survivors = [slot for slot in live if slot not in victims]
  assert sorted(survivors + victims) == sorted(live)  # every sample is either still live or handed back
  assert victims == live[::-1][: len(victims)]  # newest first, and only the newest
  for slot, positions in needs:
    if slot in victims:
      assert alloc.tables[slot] == []
    else:
      assert len(alloc.tables[slot]) == min(pages_for(positions, PAGE), PER_SLOT)
  assert alloc.num_free + alloc.num_used == alloc.num_pages
  expected = np.zeros(alloc.num_pages, np.int32)
  for table in alloc.tables:
    np.add.at(expected, table, 1)
  np.testing.assert_array_equal(alloc.refs_P, expected)


def test_table_rows_mark_unused_entries_and_shared_prefix():
  alloc = PageAllocator(num_pages=8, page_size=4, num_slots=2, pages_per_slot=4)
  prompt = alloc.share_prompt(9)  # positions 0..7 in two full pages; position 8 (last prompt token) is private
  assert len(prompt.pages) == 2
  alloc.attach(0, prompt, 10)
  alloc.attach(1, prompt, 9)
  np.testing.assert_array_equal(alloc.table_row(0), [0, 1, 2, 8])
  np.testing.assert_array_equal(alloc.table_row(1), [0, 1, 3, 8])
  assert list(alloc.refs_P[:4]) == [3, 3, 1, 1]
  # An update recomputes the shared prompt once, then each slot's own live positions.
  assert alloc.live_spans([(1, 10), (0, 12)]) == [(1, 0, 8), (1, 8, 10), (0, 8, 12)]
  alloc.release_prompt(prompt)
  alloc.release(0)
  alloc.release(1)
  assert alloc.num_free == 8 and alloc.num_used == 0


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match="page_size must be a positive int"):
    PageAllocator(num_pages=4, page_size=0, num_slots=1, pages_per_slot=1)
  alloc = PageAllocator(num_pages=2, page_size=4, num_slots=1, pages_per_slot=4)
  with pytest.raises(OutOfPages, match="3 pages needed, 2 free of 2"):
    alloc.attach(0, None, 12)
  prompt = alloc.share_prompt(5)
  alloc.release_prompt(prompt)
  with pytest.raises(RuntimeError, match="released twice"):
    alloc.release_prompt(prompt)
