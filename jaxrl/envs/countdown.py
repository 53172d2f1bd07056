"""Countdown: reach a target with + - * / over given numbers, each used at most once. Every problem is solvable."""

from __future__ import annotations

import collections
import random
import re

from jaxrl.envs import expr
from jaxrl.envs.task import Problem, ProceduralTask, user_message

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def check_solution(expression: str, numbers, target: int, *, use_all: bool = False) -> str | None:
  """None when `expression` reaches `target` using each of `numbers` at most once (all of them if use_all);
  otherwise the reason it fails."""
  try:
    tree = expr.parse(expression)
  except expr.ExprError as e:
    return f"invalid expression: {e}"
  used, given = collections.Counter(expr.literals(tree)), collections.Counter(int(n) for n in numbers)
  extra = used - given
  if extra:
    return f"uses numbers not given (or more often than given): {sorted(extra.elements())}"
  if use_all and used != given:
    return f"does not use all numbers: {sorted((given - used).elements())} unused"
  try:
    v = expr.evaluate(tree)
  except expr.ExprError as e:
    return str(e)
  return None if v == target else f"evaluates to {float(v):g}, not {target}"


def extract_expression(completion: str) -> str | None:
  """The proposed expression: the last <answer>...</answer>, else the rest of the last "answer:" line.

  A trailing "= <number>" is dropped, so "(25 - 5) * 4 = 80" checks the left side.
  """
  tags = _ANSWER_TAG.findall(completion)
  if tags:
    text = tags[-1]
  else:
    hits = re.findall(r"answer\s*:\s*([^\n]*)", completion, re.IGNORECASE)
    if not hits:
      return None
    text = hits[-1]
  text = text.strip()
  if "=" in text:
    left, _, right = text.rpartition("=")
    if re.fullmatch(r"\s*-?\d+\s*", right):
      text = left
  return text.strip() or None


class CountdownTask(ProceduralTask):
  """`num_numbers` numbers from [1, max_number]; the target is the value of a random expression over at least
  `min_used` of them (default: 3, or all when fewer).

  Intermediate values stay positive integers (no negative or fractional steps), and 1 <= target <= max_target.
  """

  name = "countdown"
  reward = "countdown"

  def __init__(self, seed: int = 0, *, num_numbers: int = 4, max_number: int = 99, max_target: int = 999,
               min_used: int | None = None, system: str = "", eval_fraction: float = 0.05):
    super().__init__(seed, eval_fraction)
    if not isinstance(num_numbers, int) or not 2 <= num_numbers <= 8:
      raise ValueError(f"countdown: num_numbers must be an int in [2, 8] (got {num_numbers!r})")
    min_used = min(3, num_numbers) if min_used is None else min_used
    if not 2 <= min_used <= num_numbers:
      raise ValueError(f"countdown: min_used must be in [2, num_numbers={num_numbers}] (got {min_used})")
    if max_number < 2 or max_target < 1:
      raise ValueError(f"countdown: need max_number >= 2 and max_target >= 1 (got {max_number}, {max_target})")
    self.num_numbers, self.max_number, self.max_target = num_numbers, max_number, max_target
    self.min_used, self.system = min_used, system

  def _solution(self, rng: random.Random, numbers: list[int]) -> tuple[str, int]:
    items = [(str(n), n) for n in rng.sample(numbers, rng.randint(self.min_used, len(numbers)))]
    while len(items) > 1:
      (ea, a), (eb, b) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
      a, b, ea, eb = (a, b, ea, eb) if a >= b else (b, a, eb, ea)
      ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
      op = rng.choice(ops)
      v = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
      items.append((f"({ea} {op} {eb})", v))
    text, v = items[0]
    return text[1:-1], v

  def generate(self, rng: random.Random) -> Problem:
    for _ in range(self.max_draws):
      numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
      solution, target = self._solution(rng, numbers)
      if 1 <= target <= self.max_target:
        break
    else:
      raise ValueError(f"countdown: no target in [1, {self.max_target}] found in {self.max_draws} draws")
    question = (f"Using the numbers {numbers}, write an expression that equals {target}. You may use +, -, *, / "
                f"and parentheses, and each number at most once. Show your work, then give the expression in "
                f"<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
    return Problem(key=f"{sorted(numbers)}->{target}", messages=user_message(question, self.system), answer=solution,
                   meta={"numbers": numbers, "target": target})
