"""Calculator: arithmetic word problems, with a calculator tool the model may call before it answers.

A model turn ending in `<calc>expression</calc>` is a tool call: the env answers with the exact value (or an
error), shown as a tool turn, and the model goes on. A turn without a call is the final answer, rewarded 1 when
its answer (explicit "Answer: n", else its last number) equals the problem's.
"""

from __future__ import annotations

import random
import re

from jaxrl.envs import answers, expr
from jaxrl.envs.env import Env, EnvTask, Turn, answer_episodes
from jaxrl.envs.task import Problem, user_message

NAMES = ("Ann", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana")
ITEMS = ("apples", "stamps", "marbles", "coins", "books", "shells")
# (template, expression): a, b, c are the problem's numbers
TEMPLATES = (
    ("{n} has {a} {i}. {n} buys {b} more. How many {i} does {n} have now?", "{a} + {b}"),
    ("{n} had {a} {i} and gave away {b}. How many {i} does {n} have left?", "{a} - {b}"),
    ("{n} has {a} boxes with {b} {i} in each. How many {i} are there in all?", "{a} * {b}"),
    ("{n} buys {a} packs of {b} {i} and already had {c}. How many {i} does {n} have?", "{a} * {b} + {c}"),
)
SYSTEM = "Use the calculator: write <calc>expression</calc> and the result comes back. Then write 'Answer: <number>'."
# One solved episode before the problem (chat history): the 135M model imitates it; without it, it never calls the
# tool and (almost) never answers right, so RL would have no signal.
EXAMPLE = ({"role": "user", "content": "Sam has 3 bags with 14 pens in each. How many pens are there in all?"},
           {"role": "assistant", "content": "<calc>3 * 14</calc>"}, {"role": "tool", "content": "42"},
           {"role": "assistant", "content": "Answer: 42"})
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


class CalculatorEnv(Env):
  stop_strings = ("</calc>",)
  max_turns = 3
  max_tokens = 96

  def reset(self, example):
    self.answer = example.answer
    return example.meta["messages"]

  def step(self, text, ids):
    call = _CALL.search(text)
    if call is None:
      return Turn(done=True, reward=float(answers.answers_match(answers.extract_answer(text), self.answer)))
    try:
      value = expr.value(call.group(1))
      result = str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"
    except expr.ExprError as e:
      result = f"error: {e}"
    return Turn(observation=result)


class CalculatorTask(EnvTask):
  """Word problems of `digits`-digit numbers over the TEMPLATES (+, -, *, * then +), answers >= 0."""

  name = "calculator"
  env_class = CalculatorEnv
  trusted = True

  def __init__(self, seed: int = 0, *, digits: int = 2, instruction: str = "", system: str = SYSTEM,
               few_shot: bool = True, eval_fraction: float = 0.05):
    super().__init__(seed, eval_fraction)
    if not isinstance(digits, int) or not 1 <= digits <= 6:
      raise ValueError(f"calculator: digits must be an int in [1, 6] (got {digits!r})")
    self.digits, self.instruction, self.system, self.few_shot = digits, instruction, system, few_shot

  def check_episodes(self, example):
    return answer_episodes(example)

  def generate(self, rng: random.Random) -> Problem:
    lo, hi = (1 if self.digits == 1 else 10 ** (self.digits - 1)), 10**self.digits - 1
    text, form = rng.choice(TEMPLATES)
    a, b, c = (rng.randint(lo, hi) for _ in range(3))
    a, b = (max(a, b), min(a, b)) if "-" in form else (a, b)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    question = text.format(n=name, i=item, a=a, b=b, c=c)
    answer = expr.value(form.format(a=a, b=b, c=c)).numerator
    messages = user_message(f"{question} {self.instruction}".strip(), self.system)
    if self.few_shot:
      messages = (*messages[:-1], *EXAMPLE, messages[-1])
    return Problem(key=question, answer=str(answer), meta={"messages": messages})
