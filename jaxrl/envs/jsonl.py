"""GSM8K-style word problems from local JSONL files: {"question": ..., "answer": "... #### 42"} per line.

The whole file is checked when the task is built, before any work starts: bad lines are reported with the file
name and line numbers, and either fail the build (on_error="raise") or are skipped and counted ("skip").
Training order and the held-out split follow jaxrl.envs.records: a seeded permutation per epoch; the questions with
the smallest hashes held out, or a separate eval file; a question never on both sides, duplicates included.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path

from jaxrl.envs.answers import numbers, parse_number
from jaxrl.envs.records import RecordsTask
from jaxrl.envs.task import EVAL, Example, user_message

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


class JsonlTask(RecordsTask):
  """Word problems with numeric final answers, read from `path` (and `eval_path`, if given)."""

  name = "gsm8k"
  reward = "exact_answer"

  def __init__(self, seed: int = 0, *, path: str | os.PathLike, eval_path: str | os.PathLike | None = None,
               eval_fraction: float = 0.05, on_error: str = "raise", question_field: str = "question",
               answer_field: str = "answer", system: str = "",
               instruction: str = "Solve the problem step by step, then give the final answer after '####'."):
    self.system, self.instruction = system, instruction
    self.path = Path(path)
    load = functools.partial(load_jsonl, on_error=on_error, question_field=question_field, answer_field=answer_field)
    records, self.skipped = load(self.path)
    self.skipped_eval: list[tuple[int, str]] = []
    heldout = None
    self.eval_path = self.path
    if eval_path is not None:
      self.eval_path = Path(eval_path)
      heldout, self.skipped_eval = load(self.eval_path)
    super().__init__(seed, records, heldout, eval_fraction)
    self.overlap_removed = len(records) - len(self.train) if eval_path is not None else 0

  def question(self, record: Record) -> str:
    return record.question

  def example(self, split: str, index: int, r: Record) -> Example:
    text = r.question + (f"\n\n{self.instruction}" if self.instruction else "")
    return Example(index, split, user_message(text, self.system), answer=r.answer,
                   meta={"source": str(self.eval_path if split == EVAL else self.path), "line": r.line})
