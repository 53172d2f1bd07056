"""Rewards and environments that cannot fail silently: a start-up self-check and a failure window.

Self-check: before a run admits its first prompt, each reward it uses scores its known cases (rewards.Check: a
right answer scored 1, a wrong one scored below 1; the reward's own and the task's) in its real worker, sandboxed
if the reward is; an env task plays a known right and a known wrong episode through its real env runner. A case
scored otherwise stops the run with one line naming the reward and the worker's own error (what it raised, or the
modules it could not import when a library swallowed the error and scored 0).

Failure window: of the last `size` samples a run scored, more than `max_frac` failing (an exception, a timeout, a
crash, a non-finite value) stops the run with one line naming the reward and its most common error; it stops as
soon as the count is over, so a reward that fails every sample stops the run within its first size * max_frac + 1.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

from jaxrl.envs.rewards import Check
from jaxrl.envs.runner import RewardResult, RewardRunner


class RewardsBroken(RuntimeError):
  """A reward or environment that cannot score: the run stops with this one line (exit status 2)."""


def _worker(runner: RewardRunner) -> str:
  if runner.isolation == "inline":
    return "the calling thread"
  return "its sandboxed worker" if runner.sandbox is not None else "its worker process"


def verdict(check: Check, result: RewardResult) -> str | None:
  """Why a known case's result shows a broken reward, or None."""
  if not result.ok:
    why = f"{result.reason}: {result.error}"
  elif check.right is None or check.right and result.value == 1.0 or check.right is False and result.value < 1.0:
    return None
  else:
    why = (f"a known {'right' if check.right else 'wrong'} answer {check.completion[:80]!r} scored "
           f"{result.value:g}, expected {'1' if check.right else 'below 1'}")
  if result.import_errors:
    why += f"; the worker could not import {', '.join(result.import_errors)}"
  return why


def self_check(name: str, runner: RewardRunner, checks: Sequence[Check]) -> None:
  """Scores `checks` with the runner (its real worker); raises RewardsBroken on the first case it gets wrong."""
  items = [("", c.completion, {"completion_ids": [], **c.meta}) for c in checks]
  for check, result in zip(checks, runner.score(items, count=False), strict=True):
    why = verdict(check, result)
    if why is not None:
      raise RewardsBroken(f"reward {name!r} failed its start-up self-check in {_worker(runner)}: {why} "
                          "(task.self_check=False skips the check)")


class FailureWindow:
  """The last `size` scored samples of a run, every reward's: more than max_frac of them failed stops the run."""

  def __init__(self, size: int, max_frac: float):
    self.size, self.max_frac = size, max_frac
    self._recent: collections.deque[tuple[str, str] | None] = collections.deque(maxlen=size)
    self.failures = 0  # all the run's, for the logs

  def add(self, name: str, result: RewardResult) -> None:
    """Adds one scored sample; raises RewardsBroken when the window holds too many failures."""
    failed = not result.ok or not math.isfinite(result.value)
    self.failures += failed
    self._recent.append((name, f"{result.reason}: {result.error}"[:300]) if failed else None)
    errors = [e for e in self._recent if e is not None]
    if failed and len(errors) > self.max_frac * self.size:
      (reward, error), n = collections.Counter(errors).most_common(1)[0]
      raise RewardsBroken(f"reward {reward!r} failed {len(errors)} of the last {len(self._recent)} samples scored "
                          f"(over task.max_failure_frac={self.max_frac:g} of task.failure_window={self.size}); "
                          f"most common error ({n}x): {error}")
