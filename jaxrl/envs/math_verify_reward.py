"""math-verify as a reward (optional extra `math`): `task.reward="math_verify"`.

The reference answer and the completion are parsed with math-verify's LaTeX and expression extraction (a boxed
answer first), then compared symbolically: 1/2, \\frac{1}{2} and 0.5 agree, as do 1,234 and 1234. Its parse and
verify time limits use signal.alarm, which works only in a process's main thread: the reward is registered
sandboxed, so it runs in a worker process's main thread (jaxrl.envs.runner), under the runner's time limit and the
sandbox's CPU limit. Sandboxed also because parsing an expression goes through sympy's parse_expr, which runs code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from jaxrl.envs.rewards import need, register_reward, right_and_wrong

# Below the sandbox's CPU limit (2 s): a slow parse scores 0 here rather than costing a worker restart.
PARSE_TIMEOUT_S = 1
VERIFY_TIMEOUT_S = 1
GOLD = (LatexExtractionConfig(), ExprExtractionConfig())
# The model's last boxed answer wins over any other LaTeX; plain text needs an anchor ("answer is", "####") or a
# last number (the expression extraction)
ANSWER = (LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False), ExprExtractionConfig())


# LaTeX on both sides: the self-check goes through the LaTeX parser and its lazily imported runtime (antlr4)
@register_reward("math_verify", sandbox=True,
                 checks=right_and_wrong(r"so the answer is $\boxed{\frac{1}{2}}$", r"$\boxed{\frac{1}{3}}$",
                                        {"answer": r"$\frac{2}{4}$"}))
def math_verify_reward(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """1 if the completion's answer is mathematically equal to meta["answer"], else 0."""
  reference = str(need(meta, "answer", "math_verify", "the reference answer"))
  gold = parse(reference, GOLD, parsing_timeout=PARSE_TIMEOUT_S)
  if not gold:  # a bare symbolic reference ("x", "a+b") has no anchor: read it as inline math
    gold = parse(f"${reference}$", GOLD, parsing_timeout=PARSE_TIMEOUT_S)
  if all(isinstance(g, str) for g in gold):  # only the raw text back: nothing math-verify could read as math
    raise ValueError(f"math_verify cannot parse the reference answer {reference[:80]!r}")
  answer = parse(completion, ANSWER, parsing_timeout=PARSE_TIMEOUT_S)
  return float(bool(answer) and verify(gold, answer, timeout_seconds=VERIFY_TIMEOUT_S))
