"""The Task interface: example i of a split is a pure function of (task config, seed, split, i).

A run checkpoints only its data position (an int); resuming calls `task.prompt(position)` and gets exactly the
examples it would have seen. Held-out examples come from their own stream and are disjoint from training by
content: a problem's key is hashed into a held-out bucket, and each split only keeps problems from its side.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import random
from typing import Any, ClassVar

TRAIN, EVAL = "train", "eval"


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt of a task, with what its reward needs to score a completion."""

  index: int  # position in its split: the data position for train, 0..n-1 for eval
  split: str  # TRAIN or EVAL
  messages: tuple[dict[str, str], ...] = ()  # chat prompt ({"role", "content"}) of a text task
  prompt_tokens: tuple[int, ...] = ()  # token prompt of a token-level task (no tokenizer involved)
  answer: str = ""  # reference answer ("" when the reward needs none)
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # task fields the reward reads

  @property
  def reward_meta(self) -> dict[str, Any]:
    """Meta for the reward fn; the caller adds "completion_ids" (the completion's token ids)."""
    return {**self.meta, "answer": self.answer}


def check_index(index: int) -> int:
  if isinstance(index, bool) or not isinstance(index, int) or index < 0:
    raise ValueError(f"example index must be an int >= 0 (got {index!r})")
  return index


def key_hash(key: str) -> int:
  """A problem key's 64-bit hash, the same in every process, seed and run."""
  return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, person=b"jaxrl-heldout").digest(), "big")


def is_heldout(key: str, fraction: float) -> bool:
  """Whether a problem (by its canonical key) belongs to the held-out side."""
  return key_hash(key) < fraction * 2**64


class Task(abc.ABC):
  """Base of all tasks. Subclasses set `name`, `reward` (default reward fn name) and `text_prompts`."""

  name: ClassVar[str]
  reward: ClassVar[str]
  text_prompts: ClassVar[bool] = True  # False: examples carry prompt_tokens and need no tokenizer

  @abc.abstractmethod
  def prompt(self, index: int) -> Example:
    """Training example at data position `index` (any int >= 0; the stream never ends)."""

  @abc.abstractmethod
  def eval_examples(self, n: int) -> list[Example]:
    """The first n held-out examples (distinct, never seen in training)."""

  def reward_checks(self) -> tuple:
    """Known right and wrong answers (rewards.Check) for the task's own reward, beside the reward's own cases: the
    run's start-up self-check scores them (jaxrl.envs.guard). A reward that needs the task's data (a dataset's
    own scorer) is checked on one of its held-out examples here."""
    return ()


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a procedural generator returns; `key` identifies the problem for the held-out split."""

  key: str
  messages: tuple[dict[str, str], ...] = ()
  prompt_tokens: tuple[int, ...] = ()
  answer: str = ""
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class ProceduralTask(Task):
  """Example i of a split is drawn from random.Random(f"{seed}/{split}/{i}"), rejecting the other side's keys."""

  max_draws: ClassVar[int] = 10_000  # per example: fails only when one side of the split is (nearly) empty

  def __init__(self, seed: int = 0, eval_fraction: float = 0.05):
    if not 0 < eval_fraction < 1:
      raise ValueError(f"{self.name}: eval_fraction must be in (0, 1) (got {eval_fraction})")
    self.seed, self.eval_fraction = int(seed), float(eval_fraction)

  @abc.abstractmethod
  def generate(self, rng: random.Random) -> Problem:
    """One problem drawn with `rng`."""

  def _draw(self, split: str, index: int) -> Problem:
    rng = random.Random(f"{self.seed}/{split}/{index}")
    for _ in range(self.max_draws):
      p = self.generate(rng)
      if is_heldout(p.key, self.eval_fraction) == (split == EVAL):
        return p
    raise ValueError(f"{self.name}: no {split} problem in {self.max_draws} draws; the problem space is too small "
                     f"for eval_fraction={self.eval_fraction}")

  def _example(self, split: str, index: int, p: Problem) -> Example:
    return Example(index, split, p.messages, p.prompt_tokens, p.answer, p.meta)

  def prompt(self, index: int) -> Example:
    index = check_index(index)
    return self._example(TRAIN, index, self._draw(TRAIN, index))

  def eval_examples(self, n: int) -> list[Example]:
    n = check_index(n)
    out, seen, stream = [], set(), 0
    while len(out) < n:
      if stream >= 20 * n + 100:
        raise ValueError(f"{self.name}: only {len(out)} distinct held-out problems found, {n} asked; "
                         f"raise eval_fraction or widen the task")
      p = self._draw(EVAL, stream)
      stream += 1
      if p.key not in seen:
        seen.add(p.key)
        out.append(self._example(EVAL, len(out), p))
    return out


def user_message(text: str, system: str = "") -> tuple[dict[str, str], ...]:
  msgs = ({"role": "system", "content": system},) if system else ()
  return (*msgs, {"role": "user", "content": text})
