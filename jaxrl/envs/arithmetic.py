"""Arithmetic: "What is 23 + 58?" with an integer answer; operands of a fixed number of digits."""

from __future__ import annotations

import random

from jaxrl.envs import expr
from jaxrl.envs.task import Problem, ProceduralTask, user_message

OPS = ("+", "-", "*", "/")


class ArithmeticTask(ProceduralTask):
  """Expressions of `num_operands` operands with `digits` digits each, joined by operators drawn from `ops`.

  Usual precedence applies; expressions whose value is not an integer (or is negative, unless allow_negative)
  are redrawn, so "/" only appears where it divides exactly.
  """

  name = "arithmetic"
  reward = "exact_answer"

  def __init__(self, seed: int = 0, *, digits: int = 2, ops=("+", "-"), num_operands: int = 2,
               allow_negative: bool = True, instruction: str = "Give the final answer as 'Answer: <number>'.",
               system: str = "", eval_fraction: float = 0.05):
    super().__init__(seed, eval_fraction)
    ops = tuple(ops)
    if not ops or any(o not in OPS for o in ops):
      raise ValueError(f"arithmetic: ops must be a non-empty subset of {OPS} (got {ops})")
    if not isinstance(digits, int) or not 1 <= digits <= 18:
      raise ValueError(f"arithmetic: digits must be an int in [1, 18] (got {digits!r})")
    if not isinstance(num_operands, int) or num_operands < 2:
      raise ValueError(f"arithmetic: num_operands must be an int >= 2 (got {num_operands!r})")
    self.digits, self.ops, self.num_operands = digits, ops, num_operands
    self.allow_negative, self.instruction, self.system = allow_negative, instruction, system

  def generate(self, rng: random.Random) -> Problem:
    lo, hi = (0 if self.digits == 1 else 10 ** (self.digits - 1)), 10**self.digits - 1
    for _ in range(self.max_draws):
      terms = [str(rng.randint(lo, hi))]
      for _ in range(self.num_operands - 1):
        terms += [rng.choice(self.ops), str(rng.randint(lo, hi))]
      text = " ".join(terms)
      try:
        v = expr.value(text)
      except expr.ExprError:  # division by zero
        continue
      if v.denominator == 1 and (self.allow_negative or v >= 0):
        break
    else:
      raise ValueError(f"arithmetic: no integer-valued expression in {self.max_draws} draws for ops={self.ops}, "
                       f"num_operands={self.num_operands}, digits={self.digits}")
    question = f"What is {text}?" + (f" {self.instruction}" if self.instruction else "")
    return Problem(key=text, messages=user_message(question, self.system), answer=str(v.numerator),
                   meta={"expression": text})
