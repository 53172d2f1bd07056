"""Reward fns: plain callables `(prompt, completion, meta) -> float`, registered by name.

`meta` is the example's `reward_meta` (its answer and task fields) plus "completion_ids", the completion's token
ids. Fns registered with inline=True are fast and trusted: the RewardRunner calls them in the calling thread.
Any other fn (a user's) runs in a worker process with a timeout; one registered with sandbox=True (it treats the
model's text as code, like the countdown expression reward) in a sandboxed one (jaxrl.envs.sandbox). A name of
the form "package.module:function" imports that function (registering it if the module uses the decorator).
Rewards of optional extras (OPTIONAL_REWARDS) are registered when their module is first asked for.

A reward registers the cases a working copy of it must score as expected (`checks`: a known right answer, scored
1, and a known wrong one, scored below 1): a run scores them in the reward's real (sandboxed) worker before its first
prompt (jaxrl.envs.guard), so a reward broken by its install fails the run's start rather than scoring zeros.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.envs import answers, countdown

RewardFn = Callable[[str, str, Mapping[str, Any]], float]


@dataclasses.dataclass(frozen=True)
class Check:
  """A known case: a working reward scores `completion` (with `meta`) 1 if `right`, a finite number below 1 if not
  `right`, and any finite number if `right` is None (a reward with no known cases only has to run)."""
  completion: str
  meta: Mapping[str, Any]
  right: bool | None


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  name: str
  fn: RewardFn
  inline: bool  # trusted and fast: called in the caller's thread, without a timeout
  sandbox: bool = False  # treats model text as code: runs in sandboxed worker processes (jaxrl.envs.sandbox)
  checks: tuple[Check, ...] = ()  # known right and wrong cases (the start-up self-check)


_REGISTRY: dict[str, RewardSpec] = {}
# name -> (module that registers it, the extra that installs what it imports)
OPTIONAL_REWARDS = {"reasoning_gym": ("jaxrl.envs.reasoning_gym_reward", "reasoning"),
                    "math_verify": ("jaxrl.envs.math_verify_reward", "math")}


def _qualname(fn) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_reward(name: str, *, inline: bool = False, sandbox: bool = False,
                    checks: tuple[Check, ...] = ()) -> Callable[[RewardFn], RewardFn]:
  """Decorator: registers a reward fn under `name` (registering the same function again is allowed), with the
  known cases a run's self-check scores (`checks`)."""
  if inline and sandbox:
    raise ValueError(f"reward {name!r}: a sandboxed fn cannot run inline")

  def register(fn: RewardFn) -> RewardFn:
    old = _REGISTRY.get(name)
    if old is not None and _qualname(old.fn) != _qualname(fn):
      raise ValueError(f"reward {name!r} is already registered to {_qualname(old.fn)}")
    _REGISTRY[name] = RewardSpec(name, fn, inline, sandbox, tuple(checks))
    return fn

  return register


def reward_names() -> list[str]:
  return sorted(set(_REGISTRY) | set(OPTIONAL_REWARDS))


def reward_spec(name: str) -> RewardSpec:
  """The registered spec of `name`, or of a "module:function" path (imported; never inline)."""
  if name in OPTIONAL_REWARDS and name not in _REGISTRY:
    module, extra = OPTIONAL_REWARDS[name]
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise ValueError(f"reward {name!r} needs an optional package (pip install 'jaxrl[{extra}]'): {e}") from None
  if name in _REGISTRY:
    return _REGISTRY[name]
  if ":" in name:
    module, _, attr = name.partition(":")
    try:
      fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(f"reward {name!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not callable(fn):
      raise ValueError(f"reward {name!r} is not callable")
    return registered_spec(fn) or RewardSpec(name, fn, inline=False)
  raise ValueError(f"unknown reward {name!r}; known: {', '.join(reward_names())} (or 'package.module:function')")


def registered_spec(fn: RewardFn) -> RewardSpec | None:
  """The spec a function object was registered with, if any."""
  return next((s for s in _REGISTRY.values() if s.fn is fn), None)


def get_reward(name: str) -> RewardFn:
  return reward_spec(name).fn


def need(meta: Mapping[str, Any], key: str, reward: str, what: str):
  if key not in meta:
    raise KeyError(f"reward {reward!r} needs meta[{key!r}] ({what}); meta has {sorted(meta)}")
  return meta[key]


def right_and_wrong(right: str, wrong: str, meta: Mapping[str, Any]) -> tuple[Check, Check]:
  return Check(right, meta, True), Check(wrong, meta, False)


@register_reward("exact_answer", inline=True,
                 checks=right_and_wrong("So the answer is <answer>1,234</answer>.", "<answer>1243</answer>",
                                        {"answer": "1234"}))
def exact_answer(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """1 if the completion's final answer (explicit form, else its last number) equals meta["answer"]."""
  reference = need(meta, "answer", "exact_answer", "the reference answer")
  return float(answers.answers_match(answers.extract_answer(completion), str(reference)))


@register_reward("format", inline=True, checks=right_and_wrong("<answer>7</answer>", "no answer", {}))
def answer_format(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """1 if the completion states a final answer explicitly (<answer>, \\boxed{}, "####", "answer: x")."""
  return float(answers.explicit_answer(completion) is not None)


@register_reward("countdown", sandbox=True,  # evaluates an expression the model wrote
                 checks=right_and_wrong("<answer>(3 + 5) * 2</answer>", "<answer>3 + 5 + 2</answer>",
                                        {"numbers": [2, 3, 5], "target": 16}))
def countdown_reward(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """1 if the proposed expression uses the given numbers at most once each and equals the target."""
  numbers = need(meta, "numbers", "countdown", "the given numbers")
  target = need(meta, "target", "countdown", "the target")
  expression = countdown.extract_expression(completion)
  return float(expression is not None and countdown.check_solution(expression, numbers, target) is None)


@register_reward("target_token", inline=True,
                 checks=(Check("", {"completion_ids": [3, 3], "target_ids": [3]}, True),
                         Check("", {"completion_ids": [3, 4], "target_ids": [3]}, False)))
def target_token(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """Fraction of completion token ids in meta["target_ids"] (0 for an empty completion)."""
  ids = need(meta, "completion_ids", "target_token", "the completion's token ids")
  targets = set(int(t) for t in need(meta, "target_ids", "target_token", "the rewarded token ids"))
  ids = [int(t) for t in ids]
  return sum(t in targets for t in ids) / len(ids) if ids else 0.0
