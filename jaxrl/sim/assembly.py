"""The simulated run's admission and batch assembly: the controller's own DeadlineBook (jaxrl.controller.assembly),
one per sampler, called in the order the controller calls it.

The controller's sampler loop admits while its book has room, marks complete groups finished, and takes a share
whenever the learner has asked for one more than it was handed; the learner asks for step s + 1's share as soon as
it has taken step s's (jaxrl.controller.learner_loop), and trains a step once every sampler's share is in. The
simulator's engines are the samplers' (engine i belongs to sampler i % samplers) and groups are plain ids.

Dynamic sampling: a group the filter drops gives its place back (`settle`), and the book over-asks by the kept
fraction so far, as the sampler loop's _finish does. What the simulator does not model, and so never calls:
skipped updates (the book's `skipped`), the adaptive admission bound (`admit_k`), and the other rejections
(reject_reason: a simulated reward never fails, no sample outgrows its row).
"""

from __future__ import annotations

import collections

from jaxrl.controller.assembly import DeadlineBook, over_ask


class Assembly:
  """Books of `samplers` samplers of a run of `steps` learner steps (the last one stops admission, as in a run)."""

  def __init__(self, max_staleness: int, groups_per_step: int, steps: int, samplers: int = 1,
               queue_groups: int = 0):
    if samplers < 1 or groups_per_step % samplers:
      raise ValueError(f"{samplers} samplers cannot split the {groups_per_step} groups of a step evenly")
    share = groups_per_step // samplers
    # queue_groups 0: admission alone bounds the finished groups (the controller's rl.queue_groups is >= 1).
    max_finished = queue_groups // samplers if queue_groups else None
    self.books = [DeadlineBook(max_staleness, share, 0, steps, max_finished, group_id=int) for _ in range(samplers)]
    self.steps = steps
    self.asked = 1  # shares asked of every sampler: the first step's at the start
    self.shares: list[collections.deque[list[int]]] = [collections.deque() for _ in range(samplers)]
    self.scored = [[0, 0] for _ in range(samplers)]  # (rejected, finished) groups of each sampler: its over_ask

  def room(self, rank: int, version: int) -> int:
    return self.books[rank].room(version)

  def admit(self, rank: int, group: int, version: int) -> int:
    return self.books[rank].admit(group, version)

  def finish(self, rank: int, group: int) -> None:
    self.books[rank].finish(group)

  def settle(self, rank: int, group: int, kept: bool) -> None:
    """A complete group: into the book if the filter kept it, else its place given back; then the over-ask."""
    book, scored = self.books[rank], self.scored[rank]
    if kept:
      self.finish(rank, group)
    else:
      book.discard(group)
      scored[0] += 1
    scored[1] += 1
    book.over_ask = over_ask(*scored)

  def take_surplus(self) -> int:
    """Groups the books left out past their deadline since the last call (over-asked beyond their step's places)."""
    n = sum(len(b.surplus) for b in self.books)
    for b in self.books:
      b.surplus.clear()
    return n

  def assemble(self) -> None:
    """Every sampler takes the shares asked of it that it can form now (the end of a sampler-loop iteration)."""
    for book, shares in zip(self.books, self.shares, strict=True):
      while book.shares < self.asked:
        share = book.take()
        if share is None:
          break
        shares.append(share)

  def next_batch(self) -> list[int] | None:
    """The next learner step's groups (sampler by sampler), or None until every share is in; taking them asks
    for the following step's shares (none past the run's last step)."""
    if not all(self.shares):
      return None
    batch = [g for shares in self.shares for g in shares.popleft()]
    self.asked = min(self.asked + 1, self.steps)
    return batch

  def open_groups(self) -> int:
    return sum(len(b.deadline) for b in self.books)

  def finished_groups(self) -> int:
    return sum(len(b.finished) for b in self.books)
