"""The sampler loop: takes newer weights between decode calls, admits groups while every deadline stays feasible,
scores finished groups and assembles each learner step's share by deadline (controller.assembly), then puts the
share on the rollouts channel. It talks to the learner side only through the three channels (controller.interfaces).

Sync mode is this same loop with max_staleness 0: a step's groups are admitted only once the sampler holds that
step's params, and handed over only once all have finished.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable

import numpy as np

from jaxrl.controller.assembly import DeadlineBook, over_ask, reject_reason
from jaxrl.controller.interfaces import Coordinator, Rollouts, Weights
from jaxrl.controller.pass_rate import PassRateTable, make_table
from jaxrl.controller.rollouts import GroupAssembler
from jaxrl.controller.spec import RunSpec, SkipPrompt
from jaxrl.rollout import Rollout


class SamplerLoop:
  """One sampler replica (`rank` of `num_samplers`): it admits the data positions its coordinator hands it (rank,
  rank + num_samplers, ...) and assembles its share (groups_per_step / num_samplers) of every step from its own
  groups."""

  def __init__(self, spec: RunSpec, *, sampler, prompts: Callable[[int], tuple[np.ndarray, dict]],
               score: Callable[[list[Rollout]], None], rollouts: Rollouts, weights: Weights, coord: Coordinator,
               num_samplers: int = 1, trace: Callable[[dict], None] | None = None):
    self.spec, self.sampler, self.prompts, self.score = spec, sampler, prompts, score
    self.rollouts, self.weights, self.coord = rollouts, weights, coord
    self.num_samplers, self.trace = num_samplers, trace
    self.share = spec.rl.groups_per_step // num_samplers
    self.book: DeadlineBook | None = None  # made when the loop starts, at the sampler's version
    self.assembler = GroupAssembler()
    self.busy = 0.0
    self._outbox: list[list[Rollout]] = []  # complete groups not put on the channel yet
    # groups scored (here, and by the run before its resume) and of those not trainable: over_ask's rate
    self.finished_groups = self.rejected_groups = 0
    self.pass_rate: PassRateTable | None = None  # task.pass_rate_filter: made when the loop starts
    self._cancelled: set[int] = set()  # surplus groups ended early (Sampler.cancel), not yet complete here

  @property
  def ledger(self):
    return self.coord.ledger

  def run(self, poll_s: float = 0.05) -> None:
    spec, coord = self.spec, self.coord
    # this sampler's own table of the groups it scores, from the one resumed from (known once the loop starts)
    self.pass_rate = make_table(spec.task.pass_rate_filter, spec.pass_rate_aside_positions,
                                copy.deepcopy(coord.resumed_pass_rate))
    self.book = DeadlineBook(spec.max_staleness, self.share, self.sampler.version, spec.num_steps,
                             spec.rl.queue_groups // self.num_samplers)
    # a resumed run's filter rate so far, not a fresh estimate (the groups this sampler scores add to it)
    self.rejected_groups, self.finished_groups = coord.resumed_filter
    self._over_ask()
    skipped_at_start = coord.progress().updates_skipped
    while not coord.stop.is_set():
      t0 = time.perf_counter()
      newer = self.weights.take_newer(self.sampler.version)
      if newer is not None:
        self.sampler.update_params(newer.params, newer.version)
      asks = coord.progress()
      self.book.skipped = asks.updates_skipped - skipped_at_start
      self.book.admit_k = asks.admit_k
      if asks.groups is not None:
        self.book.gb = asks.groups
      # Admit while every deadline stays feasible; keep the waiting list short so new versions are used soon.
      while self.sampler.num_waiting < self.sampler.engine.max_slots and self.book.room(self.sampler.version):
        self._admit_one()
      if self.sampler.num_active or self.sampler.num_waiting:
        self._finish(self._complete_groups(self.sampler.step()))
      while self.book.shares < coord.progress().shares:
        share = self.book.take()
        if share is None:
          break
        self._outbox += share
        self._finish(self._complete_groups(self._cancel_doomed()))
      self._outbox += self._surplus()
      self.busy += time.perf_counter() - t0
      if not (self._outbox or self.sampler.num_active or self.sampler.num_waiting):
        coord.idle(poll_s)  # no room, or finished groups the learner has not asked for: no spinning
      if self._outbox:
        coord.sending(dict(dataclasses.asdict(self.sampler.stats), busy_s=self.busy))
        sent = self.rollouts.send_s
        self.rollouts.put_all(self._outbox)  # blocks when the learner is behind (back-pressure)
        self.busy += self.rollouts.send_s - sent  # sending is the loop's work (a packet's encoding and copy-out)

  def _cancel_doomed(self) -> list[Rollout]:
    """Ends the groups that a share just left past their deadline while they still generate (surplus once they
    finish, never trained): their slots and pages go to groups a step can still train. The cut samples finish the
    groups here, unscored; they reach the learner left out as "cancelled", counted (_finish)."""
    out = []
    if not self.spec.rl.cancel_surplus:
      return out
    for gid in sorted(self.book.doomed - self._cancelled):
      ended = self.sampler.cancel(gid)
      if ended:
        self._cancelled.add(gid)
        out += ended
    return out

  def _finish(self, groups: list[list[Rollout]]) -> None:
    """Finished, scored groups into the book, or (not trainable) on their own to the learner, which drops and counts
    them; with rl.filter_groups, the rate of the latter sets how far admission over-asks. A cancelled group is
    left out as "cancelled": it says nothing of the filter's rate nor of its prompt's pass rate (it was not
    scored)."""
    for g in groups:
      if g[0].group_id in self._cancelled:
        self._cancelled.remove(g[0].group_id)
        for r in g:
          r.left_out = "cancelled"
        self.book.finish(g)  # doomed: with the surplus
        continue
      if self.pass_rate is not None:
        self.pass_rate.observe(g)
      if reject_reason(g, self.spec.rl.seq_len, self.spec.rl.filter_groups) is None:
        self.book.finish(g)
      else:
        self.book.discard(g[0].group_id)
        self._outbox.append(g)
        self.rejected_groups += 1
      self.finished_groups += 1
    self._over_ask()

  def _over_ask(self) -> None:
    if self.spec.rl.filter_groups != "none":
      self.book.over_ask = over_ask(self.rejected_groups, self.finished_groups)

  def _surplus(self) -> list[list[Rollout]]:
    """Groups over-asked beyond their step's places, past their deadline: marked (a cancelled one is already), for
    the learner to drop."""
    groups, self.book.surplus = self.book.surplus, []
    for r in (r for g in groups for r in g):
      r.left_out = r.left_out or "surplus"
    return groups

  def _admit_one(self) -> bool:
    """Submits the next group (a regenerated one first); False if the prompt was skipped."""
    return self.coord.admit(self._start)

  def _start(self, gid: int, again: bool) -> str | None:
    """Submits group `gid` (the coordinator's admit holds its lock); the reason its prompt is skipped, or None."""
    try:
      prompt, meta = self.prompts(gid)
      room = self.sampler.engine.max_len
      if len(prompt) >= room:
        raise SkipPrompt(f"prompt of {len(prompt)} tokens leaves no room to generate in sampler.max_len={room}")
      # A pending group is generated again as admitted (it was counted admitted before the filter could see it)
      skip = self.pass_rate.aside(prompt, gid) if self.pass_rate is not None and not again else None
    except SkipPrompt as e:
      print(f"jaxrl: skipping prompt {gid}: {e}", file=sys.stderr)
      skip = str(e)
    if skip is not None:
      if self.trace is not None:
        self.trace({"event": "skip_prompt", "group": gid, "reason": str(skip)})
      return skip
    self.book.admit(gid, self.sampler.version)
    self.sampler.submit(prompt, gid, self.spec.rl.group_size, meta=meta, sampling=self.spec.sampler.sampling,
                        max_tokens=self.spec.sampler.max_new_tokens)
    self.assembler.expect(gid, self.spec.rl.group_size)
    return None

  def _complete_groups(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
    """Counts finished samples, releases complete groups with their rewards computed."""
    groups = []
    self.ledger.generated(rollouts)
    for r in rollouts:
      group = self.assembler.add(r)
      if group is not None:
        groups.append(group)
        # A cancelled group is never trained: not scored, and its cut lengths are not its lengths
        cancelled = group[0].group_id in self._cancelled
        if not cancelled:
          self.score(group)
        if self.trace is not None:  # every generated group's lengths: jaxrl-profile --from-run fits them
          self.trace({"event": "cancelled" if cancelled else "generated", "group": group[0].group_id,
                      "version": self.sampler.version, "lengths": [s.num_model_tokens for s in group]})
    return groups

  def finished_held(self) -> list[list[Rollout]]:
    """Complete groups still on this side: waiting for a share, surplus, or not yet on the channel."""
    return self._outbox + (self.book.finished + self.book.surplus if self.book else [])

  def samples_in_flight(self) -> int:
    """Finished samples neither trained nor dropped on this side: in open groups, waiting for a share, not yet on
    the channel, or on the channel's sending end."""
    partial = sum(len(v) for v in self.assembler._open.values())
    return partial + sum(len(g) for g in self.finished_held()) + self.rollouts.unsent()
