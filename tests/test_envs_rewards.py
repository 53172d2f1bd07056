"""Reward fns on hand-written cases: answer extraction, exact match, format, countdown checker, registry."""

from fractions import Fraction

import pytest

from jaxrl.envs import answers, expr, get_reward, register_reward, reward_names, reward_spec
from jaxrl.envs.countdown import check_solution, extract_expression


@pytest.mark.parametrize("text, expected", [
    ("10-3", ["10", "3"]),  # a minus between numbers is not a sign
    ("x = -5, y=-0.25", ["-5", "-0.25"]),
    ("1,234,567.5 apples", ["1234567.5"]),
    ("1,2,3", ["1", "2", "3"]),  # not thousands separators
    ("(2)-3", ["2", "3"]),
    ("costs $1,200. Then", ["1200"]),
    ("abc123 and 4", ["4"]),  # a number glued to a word is not a number
    ("pi is 3.14.", ["3.14"]),
    ("minus −7", ["-7"]),  # unicode minus
])
def test_numbers(text, expected):
  assert answers.numbers(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("so 5 + 3 = 8", "8"),  # last number
    ("The answer is 42. I counted 3 times to be sure.", "42"),  # "answer is" beats trailing numbers
    ("Answer: -1,234.50 dollars", "-1234.50"),
    ("final answer: 17\n(step 2 took 5 minutes)", "17"),
    ("First \\boxed{3}, corrected: \\boxed{\\frac{1}{2} + 41}", "41"),  # last box, nested braces
    ("\\boxed{x + y}", "x + y"),  # a box without a number keeps its text
    ("work... 2 * 36 = 72\n#### 72", "72"),
    ("#### 1,000 then 5", "1000"),
    ("<answer> 19 </answer> and later 99", "19"),  # tag beats everything else
    ("nothing numeric here", None),
])
def test_extract_answer(text, expected):
  assert answers.extract_answer(text) == expected


def test_parse_number():
  assert answers.parse_number("1,234") == 1234
  assert answers.parse_number(" -3.50 ") == Fraction(-7, 2)
  assert answers.parse_number("$12.") == 12
  assert answers.parse_number("12 apples") is None and answers.parse_number("1,2") is None
  assert answers.parse_number("") is None


@pytest.mark.parametrize("completion, answer, reward", [
    ("23 + 58 = 81. Answer: 81", "81", 1.0),
    ("Answer: 81.0", "81", 1.0),  # exact value, not text
    ("The total is 1,200 dollars.", "1200", 1.0),
    ("The total is 1200 dollars.", "1,200", 1.0),
    ("Answer: -35", "-35", 1.0),
    ("Answer: 35", "-35", 0.0),  # the sign matters
    ("The answer is 12, not 13 as I first thought", "12", 1.0),
    ("I think 12... no wait, 13", "12", 0.0),  # without an explicit form, the last number counts
    ("", "12", 0.0),
    ("\\boxed{Paris}", "paris", 1.0),  # non-numeric answers compare case-folded
])
def test_exact_answer(completion, answer, reward):
  assert get_reward("exact_answer")("What is ...?", completion, {"answer": answer}) == reward


def test_format_reward():
  fmt = get_reward("format")
  assert [fmt("", c, {}) for c in ("Answer: 4", "\\boxed{4}", "#### 4", "<answer>4</answer>", "it is 4",
                                    "the answer is unclear")] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_countdown_checker():
  nums, target = [25, 5, 4, 7], 80
  assert check_solution("(25 - 5) * 4", nums, target) is None
  assert check_solution("25*4 - 5*4", nums, target).startswith("uses numbers not given")  # 4 used twice
  assert check_solution("(25 - 5) * 4 + 7 - 7", nums, target).startswith("uses numbers not given")
  assert check_solution("(25 - 5) * 4", nums, 81) == "evaluates to 80, not 81"
  assert check_solution("25 + 5 + 4 + 7", nums, 41, use_all=True) is None
  assert check_solution("25 + 5 + 4", nums, 34, use_all=True) == "does not use all numbers: [7] unused"
  assert check_solution("7 / (5 - 5)", [7, 5, 5], 1) == "division by zero"
  assert check_solution("7 / 2 * 2", [7, 2, 2], 7) is None  # exact rational arithmetic, no float rounding
  assert check_solution("(25 − 5) × 4", nums, target) is None  # typographic operators


@pytest.mark.parametrize("unsafe, why", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("open('/etc/passwd')", "Call is not allowed"),
    ("25 ** 4", "operator Pow is not allowed"),
    ("25 // 5", "operator FloorDiv is not allowed"),
    ("25 % 5", "operator Mod is not allowed"),
    ("-25 + 5", "UnaryOp is not allowed"),
    ("a + 5", "Name is not allowed"),
    ("2.5 * 4", "literal 2.5 is not an integer"),
    ("(lambda: 80)()", "Call is not allowed"),
    ("[25][0]", "not allowed"),
    ("25 if 1 else 5", "IfExp is not allowed"),
    ("x := 80", "not an expression"),
    ("(" * 200 + "1" + ")" * 200, "longer than 256 characters"),
    ("1 +", "not an expression"),
    ("", "empty expression"),
])
def test_countdown_checker_rejects_unsafe_expressions(unsafe, why):
  with pytest.raises(expr.ExprError, match=why.replace("(", r"\(")):
    expr.parse(unsafe)
  assert check_solution(unsafe, [25, 5, 4, 1, 80], 80).startswith("invalid expression")


def test_countdown_reward_extraction():
  cd = get_reward("countdown")
  meta = {"numbers": [25, 5, 4, 7], "target": 80}
  assert cd("", "25-5=20, 20*4=80 <answer> (25 - 5) * 4 </answer>", meta) == 1.0
  assert cd("", "<answer>(25-5)*4 = 80</answer>", meta) == 1.0  # a trailing "= target" is dropped
  assert cd("", "<answer>1</answer> then <answer>(25-5)*4</answer>", meta) == 1.0  # the last tag counts
  assert cd("", "Answer: (25 - 5) * 4", meta) == 1.0
  assert cd("", "(25 - 5) * 4", meta) == 0.0  # no answer form
  assert cd("", "<answer>25 * 4 - 4 * 5</answer>", meta) == 0.0  # reuses 4
  assert cd("", "<answer>__import__('os')</answer>", meta) == 0.0
  assert extract_expression("<ANSWER> 1+2 </ANSWER>") == "1+2" and extract_expression("no") is None


def test_target_token_reward_on_ids():
  tt = get_reward("target_token")
  assert tt("", "", {"completion_ids": [1, 2, 1, 5], "target_ids": [1]}) == 0.5
  assert tt("", "", {"completion_ids": [1, 2, 1, 5], "target_ids": [1, 5]}) == 0.75
  assert tt("", "", {"completion_ids": [], "target_ids": [1]}) == 0.0
  with pytest.raises(KeyError, match=r"needs meta\['completion_ids'\]"):
    tt("", "", {"target_ids": [1]})


def test_registry():
  assert {"exact_answer", "format", "countdown", "target_token"} <= set(reward_names())
  assert reward_spec("exact_answer").inline
  with pytest.raises(ValueError, match=r"unknown reward 'nope'; known: .*countdown, episode, exact_answer, format"):
    get_reward("nope")

  @register_reward("test_envs_rewards_len")
  def length(prompt, completion, meta):
    return float(len(completion))

  assert get_reward("test_envs_rewards_len") is length and not reward_spec("test_envs_rewards_len").inline
  register_reward("test_envs_rewards_len")(length)  # registering the same fn again (a module reload) is fine
  with pytest.raises(ValueError, match="already registered"):
    register_reward("test_envs_rewards_len")(lambda p, c, m: 0.0)
  # "module:function" imports a fn; a registered one keeps its spec.
  assert get_reward("jaxrl.envs.answers:extract_answer") is answers.extract_answer
  assert reward_spec("jaxrl.envs.rewards:exact_answer").inline
  with pytest.raises(ValueError, match="cannot import it"):
    get_reward("no_such_module_xyz:fn")
