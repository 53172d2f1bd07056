"""Admission: which waiting sample goes into a free slot, and when.

Preempted samples go first (they hold tokens already), then groups in submission order, each group's samples one
after another (one prefill per group, shared by its samples, redone when the params changed since). "continuous"
refills a slot as soon as it frees; "static" waits until every slot is free (a static batch padded to its longest
sample). Nothing is admitted while an update waits for in-flight samples to finish, nor once the cache's memory
runs short (until samples end and free it).
"""

from __future__ import annotations

import collections

import numpy as np

from jaxrl.sampler.page_allocator import OutOfPages
from jaxrl.sampler.samples import Group, Sample

ADMISSION = ("continuous", "static")


class Admission:
  """The waiting groups and preempted samples, placed into free slots through the page policy."""

  def __init__(self, mode: str, engine, policy, stats):
    if mode not in ADMISSION:
      raise ValueError(f"admission must be one of {ADMISSION} (got {mode!r})")
    self.mode, self.engine, self.policy, self.stats = mode, engine, policy, stats
    self.waiting: collections.deque[Group] = collections.deque()
    self.preempted: collections.deque[Sample] = collections.deque()
    self.count = 0  # samples admitted so far, numbering their admission order

  @property
  def num_waiting(self) -> int:
    """Samples submitted but not yet in a slot (preempted ones included)."""
    return sum(g.request.n - g.placed for g in self.waiting) + len(self.preempted)

  def admit(self, slots: list[Sample | None], params, blocked: bool) -> None:
    """Fills free slots (in slot order) while samples wait and memory lasts."""
    if blocked or (self.mode == "static" and any(s is not None for s in slots)):
      return
    for slot, occupant in enumerate(slots):
      if occupant is not None:
        continue
      try:
        if self.preempted:
          slots[slot] = self._resume(slot, self.preempted[0], params)
          self.preempted.popleft()
        elif self.waiting:
          slots[slot] = self._place(slot, self.waiting[0], params)
        else:
          break
      except OutOfPages:  # stop admitting until samples end and free pages
        break
    self.policy.insert_placed()

  def _place(self, slot: int, g: Group, params) -> Sample:
    """The group's next sample into the slot."""
    if g.prefix is None or g.prefix.version != params.version:  # the prefill is shared by the group's samples
      self.policy.prefill_group(g, params)
      self._count_prefill(len(g.prompt))
    r = g.request
    settings = self.engine.slot_settings(g.keys[g.placed], r.sampling, g.max_new[g.placed], g.stop_ids)
    self.policy.place(slot, g, settings)
    self.count += 1
    start = r.meta.get("episode")
    sample = Sample(g, g.placed, admitted=self.count, episode=start.driver.open(start) if start is not None else None,
                    prompt_experts=g.prefix.experts_PxNxK)
    g.placed += 1
    if g.placed == r.n:
      self.waiting.popleft()
      self.policy.release_group(g)
      g.prefix = g.shared = None
    return sample

  def _resume(self, slot: int, sample: Sample, params) -> Sample:
    """Continues a preempted sample: prefills its prompt and completion so far (with the current params)."""
    g, r = sample.group, sample.group.request
    tokens = np.concatenate([g.prompt, np.asarray(sample.tokens, np.int32)])
    self.policy.check_room(len(tokens) - 1)  # before the prefill, which would be wasted
    prefix = self.engine.prefill(params, tokens)
    self._count_prefill(len(tokens))
    drawn, limit = sample.budget()
    settings = self.engine.slot_settings(g.keys[sample.index], r.sampling, limit, g.stop_ids)
    self.policy.insert(slot, prefix, settings, drawn)
    sample.prompt_experts = prefix.experts_PxNxK  # the keys/values it reads from now on
    self.count += 1
    sample.admitted = self.count
    return sample

  def _count_prefill(self, n: int) -> None:
    """One prefill of n tokens (causal: token i attends i + 1 keys)."""
    self.stats.prefills += 1
    self.stats.prefill_tokens += n
    self.stats.prefill_keys += n * (n + 1) // 2
