"""GSM8K-style word problems from local JSONL files: {"question": ..., "answer": "... #### 42"} per line.

The whole file is checked when the task is built, before any work starts: bad lines are reported with the file
name and line numbers, and either fail the build (on_error="raise") or are skipped and counted ("skip").
Training order: a seeded permutation of the training records per epoch; position i is record
perm_{i // n}[i % n]. Held out: the round(eval_fraction * questions) (at least one) distinct questions with the
smallest salted hashes, or a separate eval file; a question never appears on both sides, duplicates included
(questions compare case-folded, whitespace collapsed).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from pathlib import Path

from jaxrl.envs.answers import numbers, parse_number
from jaxrl.envs.task import EVAL, TRAIN, Example, Task, check_index, key_hash, user_message

MAX_LISTED_ERRORS = 10


class JsonlError(ValueError):
  """Malformed lines in a JSONL file; `errors` holds (line number, reason) for every bad line."""

  def __init__(self, path: Path, errors: list[tuple[int, str]]):
    self.path, self.errors = path, errors
    listed = "\n".join(f"  {path}:{n}: {why}" for n, why in errors[:MAX_LISTED_ERRORS])
    more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
    super().__init__(f"{path}: {len(errors)} malformed line(s) (pass on_error='skip' to skip them):\n{listed}{more}")


@dataclasses.dataclass(frozen=True)
class Record:
  question: str
  solution: str  # the reference answer text, reasoning included
  answer: str  # the final answer after "####", thousands separators removed
  line: int  # 1-based line number in its file


def final_answer(solution: str) -> str | None:
  """The number after the last "####", without thousands separators; None when there is none."""
  if "####" not in solution:
    return None
  tail = solution.rsplit("####", 1)[1].strip()
  return None if parse_number(tail) is None else numbers(tail)[0]


def _check(obj, question_field: str, answer_field: str) -> tuple[str, str, str] | str:
  """(question, solution, final answer), or the reason the line is bad."""
  if not isinstance(obj, dict):
    return f"expected a JSON object, got {type(obj).__name__}"
  for field in (question_field, answer_field):
    if field not in obj:
      return f"missing field {field!r} (has {sorted(obj)})"
    if not isinstance(obj[field], str) or not obj[field].strip():
      return f"field {field!r} must be a non-empty string"
  answer = final_answer(obj[answer_field])
  if answer is None:
    return f"field {answer_field!r} has no final answer of the form '#### <number>'"
  return obj[question_field].strip(), obj[answer_field], answer


def load_jsonl(path: str | os.PathLike, *, on_error: str = "raise", question_field: str = "question",
               answer_field: str = "answer") -> tuple[list[Record], list[tuple[int, str]]]:
  """(good records, [(line number, reason)] of skipped lines). Blank lines are ignored."""
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error must be 'raise' or 'skip' (got {on_error!r})")
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"JSONL file not found: {path}")
  records, errors = [], []
  with path.open("rb") as f:
    for n, raw in enumerate(f, start=1):
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        errors.append((n, f"not UTF-8 ({e.reason} at byte {e.start})"))
        continue
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        errors.append((n, f"invalid JSON: {e.msg} at column {e.colno}"))
        continue
      got = _check(obj, question_field, answer_field)
      if isinstance(got, str):
        errors.append((n, got))
      else:
        records.append(Record(*got, line=n))
  if errors and on_error == "raise":
    raise JsonlError(path, errors)
  if not records:
    raise ValueError(f"{path}: no usable records ({len(errors)} malformed line(s))")
  return records, errors


def _key(question: str) -> str:
  return " ".join(question.split()).casefold()


class JsonlTask(Task):
  """Word problems with numeric final answers, read from `path` (and `eval_path`, if given)."""

  name = "gsm8k"
  reward = "exact_answer"

  def __init__(self, seed: int = 0, *, path: str | os.PathLike, eval_path: str | os.PathLike | None = None,
               eval_fraction: float = 0.05, on_error: str = "raise", question_field: str = "question",
               answer_field: str = "answer", system: str = "",
               instruction: str = "Solve the problem step by step, then give the final answer after '####'."):
    self.seed, self.system, self.instruction = int(seed), system, instruction
    self.path = Path(path)
    load = functools.partial(load_jsonl, on_error=on_error, question_field=question_field, answer_field=answer_field)
    records, self.skipped = load(self.path)
    self.skipped_eval: list[tuple[int, str]] = []
    if eval_path is not None:
      self.eval_path = Path(eval_path)
      heldout, self.skipped_eval = load(self.eval_path)
      keys = {_key(r.question) for r in heldout}
    else:
      if not 0 < eval_fraction < 1:
        raise ValueError(f"gsm8k: eval_fraction must be in (0, 1) (got {eval_fraction})")
      self.eval_path = self.path
      questions = sorted({_key(r.question) for r in records}, key=key_hash)
      keys = set(questions[: max(1, round(eval_fraction * len(questions)))])
      heldout = [r for r in records if _key(r.question) in keys]
    self.train = [r for r in records if _key(r.question) not in keys]
    unique = {}  # one eval example per question: duplicates would weigh a problem twice
    for r in heldout:
      unique.setdefault(_key(r.question), r)
    self.heldout = list(unique.values())
    self.overlap_removed = len(records) - len(self.train) if eval_path is not None else 0
    self._cached: tuple[int, list[int]] = (-1, [])
    if not self.train:
      raise ValueError(f"gsm8k: no training records left in {self.path} after holding out {len(keys)} question(s)")

  def _example(self, split: str, index: int, r: Record, source: Path) -> Example:
    text = r.question + (f"\n\n{self.instruction}" if self.instruction else "")
    return Example(index, split, user_message(text, self.system), answer=r.answer,
                   meta={"source": str(source), "line": r.line})

  def _order(self, epoch: int) -> list[int]:
    cached = self._cached  # positions arrive in order: one shuffle per epoch
    if cached[0] != epoch:
      order = list(range(len(self.train)))
      random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
      self._cached = cached = (epoch, order)
    return cached[1]

  def prompt(self, index: int) -> Example:
    epoch, pos = divmod(check_index(index), len(self.train))
    return self._example(TRAIN, index, self.train[self._order(epoch)[pos]], self.path)

  def eval_examples(self, n: int) -> list[Example]:
    if check_index(n) > len(self.heldout):
      raise ValueError(f"gsm8k: {n} eval examples asked, {len(self.heldout)} held out; raise eval_fraction or "
                       f"pass eval_path")
    return [self._example(EVAL, j, r, self.eval_path) for j, r in enumerate(self.heldout[:n])]
