"""Procedural tasks: determinism and resumability of data positions, held-out disjointness, answers."""

import operator
import re

import pytest

from jaxrl.envs import EVAL, TRAIN, ArithmeticTask, CountdownTask, TargetTokenTask, expr, make_task
from jaxrl.envs.countdown import check_solution

TASKS = {
    "arithmetic": dict(digits=2, ops=("+", "-", "*")),
    "countdown": dict(num_numbers=4),
    "target_token": dict(vocab_size=32, target_ids=(1, 2)),
    "calculator": dict(digits=2),  # multi-turn env tasks draw their problems the same way
    "guess": dict(max_high=64),
    "token_turns": dict(vocab_size=32),
}


def _key(example):
  return (tuple(m["content"] for m in example.messages), example.prompt_tokens, example.answer)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_positions_are_pure_and_resumable(name):
  a = make_task(name, seed=3, **TASKS[name])
  run = [a.prompt(i) for i in range(40)]
  # A "resumed" run builds a fresh task and continues from a checkpointed position, in any order.
  b = make_task(name, seed=3, **TASKS[name])
  assert [b.prompt(i) for i in (39, 25, 25, 30)] == [run[39], run[25], run[25], run[30]]
  assert [b.prompt(i) for i in range(20, 40)] == run[20:]
  assert all(e.index == i and e.split == TRAIN for i, e in enumerate(run))
  # Another seed is another stream; a stream is not constant.
  other = make_task(name, seed=4, **TASKS[name])
  assert sum(_key(other.prompt(i)) == _key(run[i]) for i in range(40)) < 5
  assert len({_key(e) for e in run}) > 30


@pytest.mark.parametrize("name", sorted(TASKS))
def test_eval_split_is_disjoint_from_training(name):
  task = make_task(name, seed=0, eval_fraction=0.1, **TASKS[name])
  held = task.eval_examples(50)
  assert len(held) == 50 and [e.index for e in held] == list(range(50))
  assert all(e.split == EVAL for e in held)
  assert len({_key(e) for e in held}) == 50  # distinct
  train = {_key(task.prompt(i)) for i in range(3000)}
  assert not train & {_key(e) for e in held}
  assert task.eval_examples(50) == held and task.eval_examples(10) == held[:10]
  # The held-out side does not depend on the seed: another seed's training never sees these problems either.
  other = make_task(name, seed=9, eval_fraction=0.1, **TASKS[name])
  assert not {_key(other.prompt(i)) for i in range(3000)} & {_key(e) for e in held}


def test_eval_needs_enough_distinct_held_out_problems():
  tiny = ArithmeticTask(0, digits=1, ops=("+",), eval_fraction=0.05)  # 100 problems, 3 of them held out
  assert len({e.meta["expression"] for e in tiny.eval_examples(3)}) == 3
  with pytest.raises(ValueError, match="only 3 distinct held-out problems found, 4 asked"):
    tiny.eval_examples(4)


def test_arithmetic_two_operands_answers():
  ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
  task = ArithmeticTask(1, digits=3, ops=tuple(ops), instruction="")
  for i in range(300):
    e = task.prompt(i)
    m = re.fullmatch(r"What is (\d{3}) ([-+*/]) (\d{3})\?", e.messages[-1]["content"])
    assert m, e.messages
    a, op, b = int(m[1]), m[2], int(m[3])
    v = ops[op](a, b)
    assert v == int(v) and e.answer == str(int(v)) and e.meta["expression"] == f"{a} {op} {b}"


def test_arithmetic_precedence_and_options():
  task = ArithmeticTask(0, digits=1, ops=("+", "*"), num_operands=3, allow_negative=False)
  for i in range(100):
    e = task.prompt(i)
    assert e.answer == str(expr.value(e.meta["expression"]).numerator) and int(e.answer) >= 0
  assert expr.value("2 + 3 * 4") == 14
  assert all(int(ArithmeticTask(0, ops=("-",), allow_negative=False).prompt(i).answer) >= 0 for i in range(50))
  with pytest.raises(ValueError, match="ops must be"):
    ArithmeticTask(0, ops=("**",))
  with pytest.raises(ValueError, match="digits"):
    ArithmeticTask(0, digits=0)


def test_countdown_problems_are_solvable_and_in_range():
  task = CountdownTask(0, num_numbers=4, max_number=50, max_target=500)
  for i in range(300):
    e = task.prompt(i)
    nums, target = e.meta["numbers"], e.meta["target"]
    assert len(nums) == 4 and all(1 <= n <= 50 for n in nums) and 1 <= target <= 500
    assert check_solution(e.answer, nums, target) is None, (e.answer, nums, target)
    assert str(nums) in e.messages[-1]["content"] and str(target) in e.messages[-1]["content"]
    assert len(expr.literals(expr.parse(e.answer))) >= 3  # min_used defaults to 3


def test_target_token_prompts():
  task = TargetTokenTask(0, vocab_size=8, target_ids=(3,), prompt_len=5)
  assert not task.text_prompts and task.reward == "target_token"
  e = task.prompt(7)
  assert len(e.prompt_tokens) == 5 and all(0 <= t < 8 for t in e.prompt_tokens)
  assert e.messages == () and e.reward_meta == {"target_ids": [3], "answer": ""}
  with pytest.raises(ValueError, match="target_ids"):
    TargetTokenTask(0, vocab_size=8, target_ids=(8,))


def test_make_task_errors():
  known = "arithmetic, calculator, countdown, dataset, gsm8k, guess, reasoning_gym, target_token, token_turns"
  with pytest.raises(ValueError, match=f"unknown task 'nope'; known: {known}"):
    make_task("nope")
  with pytest.raises(ValueError, match=r"unknown options \['digts'\]"):
    make_task("arithmetic", digts=3)
  with pytest.raises(ValueError, match=r"missing options \['vocab_size'\]"):
    make_task("target_token")
  with pytest.raises(ValueError, match="index must be an int >= 0"):
    make_task("arithmetic").prompt(-1)
  with pytest.raises(ValueError, match="eval_fraction"):
    make_task("countdown", eval_fraction=1.0)
