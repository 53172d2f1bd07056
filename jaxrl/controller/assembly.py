"""Deadline-based batch assembly: which finished groups make up the next learner step, so that no group is ever
dropped for staleness and every trained token's staleness is at most k (the systems model's rule, jaxrl.sim).

A group admitted while the sampler holds version v is due at step v + k. Admission holds while the open groups
(admitted, not yet handed to the learner) fit the steps left before the new group's deadline; so every deadline
stays feasible. Step s first takes the groups due at s (waiting while they generate), then fills the batch with
finished groups in completion order. Long groups are trained late but trained: the trained lengths are the
generated lengths.

The book lives on the sampler side, which alone knows every group it admitted: it hands the learner one step's
share of groups at a time, and nothing about it has to cross a thread or a process boundary.

Dynamic sampling (rl.filter_groups): a finished group the learner would not train (all rewards equal) gives its
place back, so a new prompt is admitted in its stead. To fill a step in one round rather than in several, the book
over-asks: it admits `over_ask` groups per place, 1 / the fraction of groups kept so far. Deadlines still bound
staleness: a share holds `groups_per_step` groups, and a group that survived filtering beyond its step's places is
left out at its deadline as "surplus" (counted, never trained late), as DAPO discards its surplus groups.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl.rollout import Rollout

FILTER_GROUPS = ("none", "zero_variance")  # rl.filter_groups: which scored groups are not trained (reject_reason)
# At most this many groups admitted per place: at a 90% filter rate a step fills in ~3 rounds rather than ~10,
# while the surplus a lucky round leaves (generated, not trained) stays bounded.
MAX_OVER_ASK = 4.0


def over_ask(rejected: int, finished: int) -> float:
  """Groups to admit per place: 1 / the fraction of finished groups kept so far, with one kept group of prior (a
  first filtered group does not quadruple admission), within [1, MAX_OVER_ASK]."""
  if not 0 <= rejected <= finished:
    raise ValueError(f"rejected={rejected} groups must be within [0, finished={finished}]")
  return min(MAX_OVER_ASK, (finished + 1) / (finished - rejected + 1))


# The reasons reject_reason gives for a group that is not trainable (a surplus group was trainable: left out later)
REJECTED = ("reward_failed", "too_long", "filtered")
# The reasons the sampler side leaves a group out with (Rollout.left_out): dynamic sampling's cost, not failures.
# "surplus": scored, trainable, past its deadline; "cancelled": past its deadline while still generating, ended
# early (Sampler.cancel) and never scored, so no count of scored groups holds it.
LEFT_OUT = ("surplus", "cancelled")


def scored_groups(ledger, group_size: int) -> tuple[int, int]:
  """(rejected, finished): the groups a run had scored and of those the ones not trainable, as its checkpointed
  ledger counts them (every settled group: trained, or dropped with its reason, but a cancelled one). A resumed
  run's samplers start over_ask from these, so that they do not learn the filter rate again from nothing."""
  settled = (ledger.samples_trained + ledger.samples_dropped - ledger.dropped.get("cancelled", 0)) // group_size
  return sum(ledger.dropped.get(r, 0) for r in REJECTED) // group_size, settled


def scored_alike(group: list[Rollout]) -> bool:
  """Every reward of the scored group is equal: its advantages are all zero, it carries no policy gradient (what
  rl.filter_groups="zero_variance" filters, the pass-rate filter counts and the ledger's zero_advantage_groups)."""
  return len({r.reward for r in group}) == 1


def reject_reason(group: list[Rollout], seq_len: int, filter_groups: str = "none") -> str | None:
  """Why a finished group is not trained ("reward_failed", "too_long", "filtered": rl.filter_groups, or the reason
  the sampler side left it out with, Rollout.left_out: LEFT_OUT), or None. The sampler side leaves such a group out
  of every step's share (its place goes to a new prompt); the learner side drops and counts it; both ask this one
  function, so they agree in every topology."""
  if group[0].left_out is not None:
    return group[0].left_out
  if any(not np.isfinite(r.reward) for r in group):
    return "reward_failed"
  if any(r.num_tokens > seq_len for r in group):
    return "too_long"
  if filter_groups == "zero_variance" and scored_alike(group):
    return "filtered"
  return None


class DeadlineBook:
  """Open groups and their deadlines, for one sampler's share of every learner step.

  `step` is the learner step the next share is for: base (the version the run started from) plus the shares
  handed out, minus the learner's skipped updates (a skipped update trains no version, so the steps after it come
  one version earlier, which only lowers staleness).

  A group is whatever the caller hands in (the controller: its list of Rollouts); `group_id` names it. The
  simulator (jaxrl.sim) books plain group ids with group_id=int: one rule for the run and its prediction."""

  def __init__(self, max_staleness: int, groups_per_step: int, base_step: int = 0, end_step: int | None = None,
               max_finished: int | None = None, group_id: Callable[[Any], int] = lambda g: g[0].group_id):
    if max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if groups_per_step < 1:
      raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
    self.k, self.gb, self.base, self.end = max_staleness, groups_per_step, base_step, end_step
    # gb may change between calls (an independent sampler's part, which the hub assigns: Asks.groups): every rule
    # reads it afresh; open groups beyond a smaller part's places are surplus at their deadline, and a part of 0
    # admits nothing and hands out empty shares.
    # The bound new groups are admitted under (rl.max_staleness="auto" moves it within [k_min, k]); None: k. A
    # smaller bound only makes the room stricter, so the deadlines of groups already open stay feasible.
    self.admit_k: int | None = None
    # Back-pressure: no admission while this many finished groups wait for the learner (never fewer than a share,
    # or a share could wait for groups that nothing generates).
    self.max_finished = max(groups_per_step, max_finished or 0) if max_finished is not None else None
    self.group_id = group_id
    self.deadline: dict[int, int] = {}  # open group -> the step that must train it
    self.finished: list = []  # open and finished groups, in completion order
    self.shares = 0  # shares handed out
    self.skipped = 0  # learner updates skipped so far (known to this side)
    self.over_ask = 1.0  # groups admitted per place (dynamic sampling: over_ask(); 1 admits exactly the places)
    self.surplus: list = []  # finished groups no share took by their deadline: to be dropped, counted
    self.doomed: set[int] = set()  # groups past their deadline still generating: surplus once they finish

  @property
  def admit_bound(self) -> int:
    return self.k if self.admit_k is None else min(self.admit_k, self.k)

  @property
  def step(self) -> int:
    return self.base + self.shares - self.skipped

  def room(self, version: int) -> int:
    """Groups that may still be admitted at sampler version `version` (all due at version + k); none past what the
    steps before end_step (the run's last) will train, and none while max_finished groups wait."""
    if self.max_finished is not None and len(self.finished) >= self.max_finished:
      return 0
    k = self.admit_bound
    last = version + k if self.end is None else min(version + k, self.end - 1)
    places = max(0, last - self.step + 1) * self.gb
    return max(0, math.ceil(places * self.over_ask - 1e-9) - len(self.deadline))

  def admit(self, group_id: int, version: int) -> int:
    """Opens a group admitted at sampler version `version`; returns its deadline."""
    if self.room(version) < 1:
      raise RuntimeError(f"group {group_id} admitted at version {version} without room (step {self.step}, "
                         f"{len(self.deadline)} open): its deadline could not be met")
    if group_id in self.deadline:
      raise ValueError(f"group {group_id} is already open")
    self.deadline[group_id] = version + self.admit_bound
    return self.deadline[group_id]

  def finish(self, group) -> None:
    """A group whose samples are all done (and scored), ready for a share (or surplus, past its deadline)."""
    if self.group_id(group) in self.doomed:
      self.doomed.remove(self.group_id(group))
      self.surplus.append(group)
      return
    if self.group_id(group) not in self.deadline:
      raise KeyError(f"finished group {self.group_id(group)} was never admitted")
    self.finished.append(group)

  def discard(self, group_id: int) -> None:
    """A group that will not be trained (its reward failed, it is too long, filtered): it stops holding a place."""
    if group_id in self.doomed:
      self.doomed.remove(group_id)
      return
    del self.deadline[group_id]
    self.finished = [g for g in self.finished if self.group_id(g) != group_id]

  def due_count(self) -> int:
    """Open groups the share for `step` must hold: the most, over deadlines d, by which the open groups due by d
    exceed the places of steps step + 1 .. d."""
    counts = collections.Counter(self.deadline.values())
    late = [d for d in counts if d < self.step]
    if late:
      raise RuntimeError(f"staleness invariant broken: groups due at step {min(late)} are still open at step "
                         f"{self.step}")
    need, total = 0, 0
    for d in sorted(counts):
      total += counts[d]
      need = max(need, total - (d - self.step) * self.gb)
    return need

  def take(self) -> list | None:
    """The next share (groups_per_step groups, in completion order), or None while it cannot be formed yet: a
    group it must hold is still generating, or too few groups have finished."""
    if len(self.finished) < self.gb:
      return None
    step = self.step
    need = min(self.due_count(), self.gb)  # more only when over-asked: the rest is surplus at its deadline
    done = {self.group_id(g) for g in self.finished}
    # Earliest deadlines first; within one deadline, finished groups first (then by admission order).
    order = sorted(self.deadline, key=lambda gid: (self.deadline[gid], gid not in done, gid))
    due = set(order[:need])
    if not due <= done:
      return None
    fill = [g for g in self.finished if self.group_id(g) not in due][: self.gb - need]
    chosen = due | {self.group_id(g) for g in fill}
    share = [g for g in self.finished if self.group_id(g) in chosen]
    self.finished = [g for g in self.finished if self.group_id(g) not in chosen]
    for gid in chosen:
      del self.deadline[gid]
    self.shares += 1
    self._leave_out_past(step, done - chosen)
    return share

  def _leave_out_past(self, step: int, done: set[int]) -> None:
    """Groups due by `step` that its share did not take can no longer be trained within their bound (there are
    only more than places when over-asked): surplus now if finished, once they finish otherwise."""
    past = [gid for gid, d in self.deadline.items() if d <= step]
    for gid in past:
      del self.deadline[gid]
      if gid not in done:
        self.doomed.add(gid)
    past_done = set(past) & done
    self.surplus += [g for g in self.finished if self.group_id(g) in past_done]
    self.finished = [g for g in self.finished if self.group_id(g) not in past_done]

  def open_groups(self) -> list[int]:
    return sorted(self.deadline)
