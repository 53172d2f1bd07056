"""Host-side page allocator of a paged KV cache: a pool of pages, one page table per decode slot, reference counts.

A page holds `page_size` consecutive positions of one sequence (every layer, every kv head). A slot's table maps
its position t to page table[t // page_size]. A GRPO group's prompt is prefilled once: its full pages below the
last prompt token are *shared* (referenced by the group and by each of its samples, never written by a sample);
the page holding the last prompt token and every later page are *private* to a slot (reference count 1), since a
sample's first decode step rewrites its last prompt position. Pages are reserved ahead of each generate call for
the positions it may write and freed when a sample ends. Everything here is plain Python; the device only sees
the tables (`table_SxM`, unused entries = `num_pages`, an index whose writes the device drops).
"""

from __future__ import annotations

import dataclasses

import numpy as np


class OutOfPages(Exception):
  """The pool has fewer free pages than a request needs (nothing was allocated)."""


@dataclasses.dataclass
class SharedPrompt:
  """A group's shared prompt pages: ids in position order; the handle holds one reference to each."""

  pages: tuple[int, ...]
  released: bool = False


def shared_pages(prompt_len: int, page_size: int) -> int:
  """Full pages strictly below the last prompt position (which a sample's first decode step writes)."""
  return (prompt_len - 1) // page_size


def pages_for(positions: int, page_size: int) -> int:
  """Pages that hold positions [0, positions)."""
  return -(-positions // page_size)


class PageAllocator:
  """Page pool + per-slot page tables with reference counts; `free + used == num_pages` at all times."""

  def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_slot: int):
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("num_slots", num_slots),
                        ("pages_per_slot", pages_per_slot)):
      if not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"PageAllocator: {name} must be a positive int (got {value!r})")
    self.num_pages, self.page_size = num_pages, page_size
    self.num_slots, self.pages_per_slot = num_slots, pages_per_slot
    self.refs_P = np.zeros(num_pages, np.int32)
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids are handed out first
    self.tables: list[list[int]] = [[] for _ in range(num_slots)]
    self.num_shared_S = np.zeros(num_slots, np.int32)  # leading entries of each table that are shared pages

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def num_used(self) -> int:
    return int(np.count_nonzero(self.refs_P))

  def _take(self, n: int) -> list[int]:
    if n > len(self._free):
      raise OutOfPages(f"{n} pages needed, {len(self._free)} free of {self.num_pages}")
    pages = [self._free.pop() for _ in range(n)]
    self.refs_P[pages] = 1
    return pages

  def _drop(self, pages) -> None:
    for p in pages:
      if self.refs_P[p] < 1:
        raise RuntimeError(f"page {p} released more often than referenced")
      self.refs_P[p] -= 1
      if self.refs_P[p] == 0:
        self._free.append(p)

  def share_prompt(self, prompt_len: int) -> SharedPrompt:
    """Allocates a group's shared prompt pages (raises OutOfPages)."""
    return SharedPrompt(tuple(self._take(shared_pages(prompt_len, self.page_size))))

  def release_prompt(self, prompt: SharedPrompt) -> None:
    """Drops the group's own reference (its samples keep theirs)."""
    if prompt.released:
      raise RuntimeError("a shared prompt released twice")
    prompt.released = True
    self._drop(prompt.pages)

  def attach(self, slot: int, prompt: SharedPrompt | None, positions: int) -> None:
    """Gives an empty slot the group's shared pages and private pages for positions [0, positions).

    All or nothing: raises OutOfPages (the slot stays empty) when the private pages do not fit."""
    if self.tables[slot]:
      raise RuntimeError(f"slot {slot} still holds pages")
    shared = prompt.pages if prompt is not None else ()
    if prompt is not None and prompt.released:
      raise RuntimeError("attaching a released shared prompt")
    private = self._take(max(0, min(pages_for(positions, self.page_size), self.pages_per_slot) - len(shared)))
    self.refs_P[list(shared)] += 1
    self.tables[slot] = [*shared, *private]
    self.num_shared_S[slot] = len(shared)

  def reserve(self, slot: int, positions: int) -> int:
    """Grows the slot's table to hold positions [0, positions) (capped at pages_per_slot); returns pages added.

    All or nothing: raises OutOfPages when the pool cannot hold the growth."""
    need = min(pages_for(positions, self.page_size), self.pages_per_slot) - len(self.tables[slot])
    if need <= 0:
      return 0
    self.tables[slot] += self._take(need)
    return need

  def release(self, slot: int) -> None:
    """Frees a slot's pages (shared ones only lose this slot's reference)."""
    self._drop(self.tables[slot])
    self.tables[slot] = []
    self.num_shared_S[slot] = 0

  def table_row(self, slot: int) -> np.ndarray:
    """The slot's page table for the device: int32 [pages_per_slot], unused entries = num_pages."""
    row = np.full(self.pages_per_slot, self.num_pages, np.int32)
    row[: len(self.tables[slot])] = self.tables[slot]
    return row

  def table_SxM(self) -> np.ndarray:
    return np.stack([self.table_row(s) for s in range(self.num_slots)])

  def writable(self, slot: int, position: int) -> bool:
    """Whether the slot may write `position`: its page is allocated, private and referenced once."""
    index = position // self.page_size
    table = self.tables[slot]
    return index < len(table) and index >= self.num_shared_S[slot] and self.refs_P[table[index]] == 1

  def reserve_or_preempt(self, needs) -> tuple[list[int], bool]:
    """Grows each live slot to its (slot, positions) need, oldest first; when the pool runs out, releases the
    newest slot still live and tries again. Returns (released slots, newest first; whether any table grew)."""
    live = [slot for slot, _ in needs]
    victims, grown = [], False
    for slot, positions in needs:
      while slot in live:
        try:
          grown |= self.reserve(slot, positions) > 0
          break
        except OutOfPages:
          victims.append(live.pop())
          self.release(victims[-1])
    return victims, grown

  def live_spans(self, ends) -> list[tuple[int, int, int]]:
    """(slot, start, end) spans an in-flight update recomputes for live slots holding positions [0, end): each
    shared prompt once, through the first slot that holds it, then each slot's own positions; in that order."""
    shared, own = {}, []
    for slot, end in ends:
      pages = tuple(self.tables[slot][: self.num_shared_S[slot]])
      if pages:
        shared.setdefault(pages, (slot, 0, len(pages) * self.page_size))
      own.append((slot, len(pages) * self.page_size, end))
    return [*shared.values(), *own]
