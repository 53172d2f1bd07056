"""Prompt filtering by pass rate (task.pass_rate_filter): a prompt whose last n groups all scored alike (every
sample right, or every sample wrong: no learning signal) is set aside for a while instead of being sampled again.

Dynamic sampling (rl.filter_groups) drops such a group after paying for its generation; this filter avoids
generating it at all, for prompts seen before: it matters on datasets a run goes through more than once.

The clock is the data position, not a step: a prompt set aside when its group at position g is scored is skipped
at every position below g + aside_positions (task.pass_rate_aside_steps steps' worth of groups). So the table is a
function of the scored groups alone, the same on the sampler that decides and on the learner that checkpoints it.
A prompt is known by its tokens (a hash), so any task works, and a prompt that comes back in another epoch is the
same prompt.

Who holds it: each sampler keeps its own table of the groups it scored and decides by it; the learner side keeps the
union of every settled group's outcome (the groups of all samplers), saved in the checkpoint's run record; a
resumed run's samplers start from that union. Groups in flight at the checkpoint are generated again and observed
then, as a resume treats them anyway.
"""

from __future__ import annotations

import hashlib

import numpy as np

from jaxrl.controller.assembly import scored_alike
from jaxrl.rollout import Rollout


def prompt_key(prompt_tokens) -> str:
  """A prompt's identity: a hash of its token ids (stable across processes and runs)."""
  return hashlib.blake2b(np.asarray(prompt_tokens, np.int32).tobytes(), digest_size=8).hexdigest()


class SetAside(str):
  """The reason a prompt was skipped because the pass-rate filter set it aside: not a failure (the coordinator
  counts it apart, ledger.prompts_set_aside), unlike a prompt the renderer could not fit."""


class PassRateTable:
  """Per prompt: how many of its last groups in a row scored alike, and the data position it is set aside until."""

  def __init__(self, window: int, aside_positions: int, state: dict):
    """`state` (a RunRecord's pass_rate, JSON) is the table itself, changed in place: pass a copy to keep it."""
    if window < 1 or aside_positions < 1:
      raise ValueError(f"the pass-rate filter needs window >= 1 and aside_positions >= 1, got {window} and "
                       f"{aside_positions}")
    self.window, self.aside_positions = window, aside_positions
    self.alike: dict[str, int] = state.setdefault("alike", {})  # groups in a row that scored alike
    self.until: dict[str, int] = state.setdefault("until", {})  # set aside below this data position

  def observe(self, group: list[Rollout]) -> None:
    """A scored group of one prompt; failed rewards (NaN) say nothing about it."""
    if not all(np.isfinite([r.reward for r in group])):
      return
    key, gid = prompt_key(group[0].prompt_tokens), group[0].group_id
    if not scored_alike(group):  # signal: the streak is broken
      self.alike.pop(key, None)
      return
    self.alike[key] = self.alike.get(key, 0) + 1
    if self.alike[key] >= self.window:
      del self.alike[key]  # back from the side, it needs another full window to be set aside again
      self.until[key] = max(self.until.get(key, 0), gid + self.aside_positions)

  def aside(self, prompt_tokens, group_id: int) -> SetAside | None:
    """Why the prompt at data position group_id is skipped, or None if it is not set aside there."""
    until = self.until.get(prompt_key(prompt_tokens))
    if until is None or group_id >= until:
      return None
    return SetAside(f"set aside by the pass-rate filter until data position {until}: its last {self.window} "
                    "group(s) all scored alike (task.pass_rate_filter)")


def make_table(window: int, aside_positions: int, state: dict) -> PassRateTable | None:
  """The run's table over `state` (task.pass_rate_filter = window), or None when the filter is off."""
  return PassRateTable(window, aside_positions, state) if window else None
