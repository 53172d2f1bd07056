"""A task over a finite list of records: held-out split by hashed question, a seeded permutation per epoch.

Training position i is record perm_{i // n}[i % n] of the training side. Held out: the round(eval_fraction *
questions) (at least one) distinct questions with the smallest hashes (jaxrl.envs.task.key_hash), or the records
of a separate eval list; a question never appears on both sides (questions compare case-folded, whitespace
collapsed), so the split does not depend on any seed of the records' source.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Sequence
from typing import Any

from jaxrl.envs.task import EVAL, TRAIN, Example, Task, check_index, key_hash


def question_key(question: str) -> str:
  return " ".join(question.split()).casefold()


class RecordsTask(Task):
  """Subclasses give each record's question text (`question`) and turn a record into an Example (`example`)."""

  def __init__(self, seed: int, records: Sequence[Any], eval_records: Sequence[Any] | None = None,
               eval_fraction: float = 0.05):
    self.seed = int(seed)
    if eval_records is not None:
      keys = {question_key(self.question(r)) for r in eval_records}
      heldout = list(eval_records)
    else:
      if not 0 < eval_fraction < 1:
        raise ValueError(f"{self.name}: eval_fraction must be in (0, 1) (got {eval_fraction})")
      questions = sorted({question_key(self.question(r)) for r in records}, key=key_hash)
      keys = set(questions[: max(1, round(eval_fraction * len(questions)))])
      heldout = [r for r in records if question_key(self.question(r)) in keys]
    self.train = [r for r in records if question_key(self.question(r)) not in keys]
    unique = {}  # one eval example per question: duplicates would weigh a problem twice
    for r in heldout:
      unique.setdefault(question_key(self.question(r)), r)
    self.heldout = list(unique.values())
    self._cached: tuple[int, list[int]] = (-1, [])
    if not self.train:
      raise ValueError(f"{self.name}: no training records left after holding out {len(keys)} question(s)")

  @abc.abstractmethod
  def question(self, record: Any) -> str:
    """The record's question text: what the held-out split hashes."""

  @abc.abstractmethod
  def example(self, split: str, index: int, record: Any) -> Example:
    """The Example of a record at `index` of `split`."""

  def _order(self, epoch: int) -> list[int]:
    cached = self._cached  # positions arrive in order: one shuffle per epoch
    if cached[0] != epoch:
      order = list(range(len(self.train)))
      random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
      self._cached = cached = (epoch, order)
    return cached[1]

  def prompt(self, index: int) -> Example:
    epoch, pos = divmod(check_index(index), len(self.train))
    return self.example(TRAIN, index, self.train[self._order(epoch)[pos]])

  def eval_examples(self, n: int) -> list[Example]:
    if check_index(n) > len(self.heldout):
      raise ValueError(f"{self.name}: {n} eval examples asked, {len(self.heldout)} held out; raise eval_fraction "
                       f"or the number of records")
    return [self.example(EVAL, j, r) for j, r in enumerate(self.heldout[:n])]
