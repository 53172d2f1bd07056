"""The host's policy over the engine's KV memory, one per cache, chosen once from the engine (`page_policy_for`).

Each policy owns the decode state and decides where a sample's keys/values go, what a weight update recomputes
and what happens when memory runs short. Dense (`DensePolicy`): every slot owns max_len positions, nothing runs
short, a group's samples go in with one program, an update recomputes a prefix of every slot. Paged
(`PagePolicy`): a group's prompt pages are shared by its samples, each live slot gets pages for the positions the
next call may write before it is dispatched, and pages return to the pool when a sample ends; when a live sample
cannot grow, the most recently admitted live sample is preempted (`grow` returns it: its pages are freed, and it
is prefilled again later, prompt and completion so far); an update recomputes only the live tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxrl.sampler.decode_state import Prefix, SlotSettings
from jaxrl.sampler.dense_engine import DenseEngine
from jaxrl.sampler.page_allocator import OutOfPages, PageAllocator, SharedPrompt, pages_for
from jaxrl.sampler.paged_engine import PagedEngine
from jaxrl.sampler.samples import Group, Sample
from jaxrl.sharding import Versioned


class DensePolicy:
  """Dense cache: samples placed in one admission round go in per group, with one program each."""

  def __init__(self, engine: DenseEngine):
    self.engine = engine
    self.state = engine.init_decode_state()
    self._placed: list[tuple[Prefix, int, SlotSettings]] = []  # placed, not yet inserted

  def prefill_group(self, g: Group, params: Versioned) -> None:
    g.prefix = self.engine.prefill(params, g.prompt)

  def place(self, slot: int, g: Group, settings: SlotSettings) -> None:
    self._placed.append((g.prefix, slot, settings))

  def insert_placed(self) -> None:
    """Inserts what `place` placed, one program per group (not one dispatch and transfer per sample)."""
    placed, self._placed = self._placed, []
    while placed:
      prefix = placed[0][0]
      group = [p for p in placed if p[0] is prefix]
      placed = [p for p in placed if p[0] is not prefix]
      self.state = self.engine.insert_group(prefix, self.state, [slot for _, slot, _ in group],
                                            [settings for _, _, settings in group])

  def release_group(self, g: Group) -> None:
    """Nothing is shared between a dense cache's slots."""

  def check_room(self, positions: int) -> None:
    """A dense slot always holds max_len positions."""

  def insert(self, slot: int, prefix: Prefix, settings: SlotSettings, num_generated: int) -> None:
    self.state = self.engine.insert(prefix, self.state, slot, settings, num_generated=num_generated)

  def grow(self, slots: Sequence[Sample | None]) -> list[int]:
    """A dense slot never grows: nothing is preempted."""
    return []

  def reserve(self, slot: int, end: int) -> None:
    """A dense slot already holds every position."""

  def free(self, slot: int) -> None:
    """A dense slot's rows are overwritten by the next insert."""

  def rebuild(self, params: Versioned, live: Sequence[tuple[int, Sample]], ahead: int) -> int:
    """Recomputes positions [0, longest live position + ahead) of every slot; returns the positions computed."""
    length = self.engine.bucket(min(max(s.pos for _, s in live) + ahead, self.engine.max_len))
    self.state = self.engine.rebuild(params, self.state, length)
    return self.engine.max_slots * length


class PagePolicy:
  """Paged cache: shared prompt pages, pages reserved ahead of each call, preemption when the pool runs short."""

  def __init__(self, engine: PagedEngine):
    self.engine = engine
    self.state = engine.init_decode_state()
    self.pages = PageAllocator(engine.num_pages, engine.page_size, engine.max_slots, engine.pages_per_slot)

  def horizon(self, pos: int) -> int:
    """Positions a slot at host position `pos` needs pages for before the next call: the call in flight and the
    next one may each write steps_per_call positions."""
    return min(pos + 2 * self.engine.steps_per_call, self.engine.max_len)

  def prefill_group(self, g: Group, params: Versioned) -> None:
    """The group's prompt pages (raises OutOfPages), prefilled and stored once for all its samples."""
    if g.shared is not None:  # samples placed before keep their references to the old pages
      self.pages.release_prompt(g.shared)
      g.shared = None
    g.shared = self.pages.share_prompt(len(g.prompt))
    g.prefix = self.engine.prefill(params, g.prompt)
    self.state = self.engine.store_prefix(g.prefix, self.state, g.shared.pages)

  def place(self, slot: int, g: Group, settings: SlotSettings) -> None:
    self._insert(slot, g.prefix, settings, g.shared, 0)

  def insert_placed(self) -> None:
    """`place` inserted each sample already (each has its own page table)."""

  def release_group(self, g: Group) -> None:
    if g.shared is not None:
      self.pages.release_prompt(g.shared)

  def check_room(self, positions: int) -> None:
    """Raises OutOfPages when the pool cannot hold a slot at position `positions` (before a wasted prefill)."""
    need = pages_for(self.horizon(positions), self.engine.page_size)
    if need > self.pages.num_free:
      raise OutOfPages(f"{need} pages needed, {self.pages.num_free} free")

  def insert(self, slot: int, prefix: Prefix, settings: SlotSettings, num_generated: int) -> None:
    self._insert(slot, prefix, settings, None, num_generated)

  def _insert(self, slot, prefix, settings, shared: SharedPrompt | None, num_generated: int) -> None:
    self.pages.attach(slot, shared, self.horizon(int(prefix.length) - 1))
    row, first_private = self.pages.table_row(slot), int(self.pages.num_shared_S[slot])
    self.state = self.engine.insert(prefix, self.state, slot, settings, num_generated=num_generated,
                                    table_row=row, first_private=first_private)

  def grow(self, slots: Sequence[Sample | None]) -> list[int]:
    """Reserves pages for what the next call may write; preempts the latest admitted samples when they run out
    and returns their slots. Slots parked for their env write nothing meanwhile: they reserve nothing here and
    are never preempted."""
    live = sorted((i for i, s in enumerate(slots) if s is not None and not s.parked), key=lambda i: slots[i].admitted)
    victims, grown = self.pages.reserve_or_preempt([(i, self.horizon(slots[i].pos)) for i in live])
    for victim in victims:
      self.state = self.engine.release(self.state, victim)
    if grown:
      self.state = self.engine.set_tables(self.state, self.pages.table_SxM())
    return victims

  def reserve(self, slot: int, pos: int) -> None:
    """Pages for a slot continued at position `pos` and what the next calls may write (raises OutOfPages)."""
    if self.pages.reserve(slot, self.horizon(pos)):
      self.state = self.engine.set_tables(self.state, self.pages.table_SxM())

  def free(self, slot: int) -> None:
    self.pages.release(slot)

  def rebuild(self, params: Versioned, live: Sequence[tuple[int, Sample]], ahead: int) -> int:
    """Recomputes the live tokens (each shared prompt once); returns the positions computed."""
    max_len = self.engine.max_len
    spans = self.pages.live_spans([(slot, min(s.pos + 1 + ahead, max_len)) for slot, s in live])
    self.state = self.engine.rebuild_spans(params, self.state, spans)
    return sum(end - start for _, start, end in spans)


def page_policy_for(engine: DenseEngine | PagedEngine) -> DensePolicy | PagePolicy:
  return PagePolicy(engine) if isinstance(engine, PagedEngine) else DensePolicy(engine)
