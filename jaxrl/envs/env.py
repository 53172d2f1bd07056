"""Multi-turn environments: an episode starts from a prompt, the model and the environment take turns, and the
reward comes at the end.

Write one by subclassing `Env` (and `EnvTask` to draw its problems), e.g.

  class Echo(Env):
    stop_strings = ("</call>",)  # a model turn ends at one of these (or at eos)
    max_turns = 3

    def reset(self, example):  # the episode's first messages (token ids for a token-level env)
      self.calls = 0
      return example.messages

    def step(self, text, ids):  # the model's turn: its text and token ids
      self.calls += 1
      if "</call>" in text:
        return Turn(observation=f"you said {text!r}")  # shown to the model as a tool turn, then it goes on
      return Turn(done=True, reward=float(self.calls == 2))

An env object is the state of one episode. Unless its task is trusted (the builtin ones), each step runs in a
worker process of the isolating runner (jaxrl.envs.runner): the env is pickled there with the turn, stepped, and its
attributes come back as plain data (JSON: None, bool, int, finite float, str, list, dict with str keys; no tuples),
which is all the trainer accepts from a worker; an env whose state is anything else fails its step, saying so. A
step that raises, hangs past its timeout, crashes the worker or returns garbage ends the episode with a counted
failure (its reward is then a failed reward: the group is dropped and counted), and the run goes on.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, ClassVar

from jaxrl.envs import wire
from jaxrl.envs.rewards import register_reward
from jaxrl.envs.runner import RewardResult
from jaxrl.envs.task import EVAL, TRAIN, Example, Problem, ProceduralTask


@dataclasses.dataclass(frozen=True)
class Turn:
  """What the environment answers to a model turn."""

  observation: str | Sequence[int] = ""  # text (rendered as a tool turn) or token ids, appended to the episode
  done: bool = False  # the episode ends here (no observation is appended)
  reward: float | None = None  # the episode's reward if it ends with this turn: done, or its last turn (None: 0)


class Env(abc.ABC):
  """One episode of a multi-turn environment (see the module docstring)."""

  stop_strings: ClassVar[tuple[str, ...]] = ()  # a model turn ends at the end of one of these, or at eos
  stop_token_ids: ClassVar[tuple[int, ...]] = ()  # ... or at one of these token ids (kept in the turn)
  max_turns: ClassVar[int] = 4  # model turns; the episode ends after the last one whatever the env says
  max_tokens: ClassVar[int] = 256  # model + observation tokens after the prompt; the episode ends when spent

  @abc.abstractmethod
  def reset(self, example: Example) -> tuple:
    """Starts the episode of `example`; returns its first messages (chat dicts), or token ids for a token-level
    env. Must depend on the example only: the prompt is rendered from one env and the episode run in another."""

  @abc.abstractmethod
  def step(self, text: str, ids: Sequence[int]) -> Turn:
    """The model's turn (its text, "" without a tokenizer, and token ids) -> the env's Turn."""


def step_env(env: Env, text: str, ids: Sequence[int]) -> Turn:
  return env.step(text, ids)


def call_env_step(fn, env: Env, text: str, ids: Sequence[int]) -> RewardResult:
  """Runs one env step (in the caller or a runner's worker) and checks what comes back: a Turn whose observation
  is text or ints and whose reward is a finite number; the value is the reward and the payload (env, turn)."""
  try:
    turn = fn(env, text, ids)
  except Exception as e:
    return RewardResult(math.nan, False, f"{type(e).__name__}: {e}", "error")
  bad = garbage(turn)
  if bad:
    return RewardResult(math.nan, False, bad, "bad_value")
  value = 0.0 if turn.reward is None else float(turn.reward)
  return RewardResult(value, True, payload=(env, turn))


def call_env_step_data(fn, env: Env, text: str, ids: Sequence[int]) -> RewardResult:
  """call_env_step in a worker process: the payload goes back as plain data, {"state": the env's attributes,
  "turn": the Turn's fields} (jaxrl.envs.wire: the trainer unpickles nothing a worker sends); an env whose state is
  not plain data fails, saying so."""
  result = call_env_step(fn, env, text, ids)
  if not result.ok:
    return result
  state = getattr(env, "__dict__", None)
  why = "it has no __dict__" if state is None else wire.plain(state)
  if why:
    return RewardResult(math.nan, False, f"{type(env).__name__}'s state is not plain data, which is all a worker "
                        f"process may send back: {why}", "error")
  turn = result.payload[1]
  obs = turn.observation if isinstance(turn.observation, str) else [int(t) for t in turn.observation]
  reward = None if turn.reward is None else float(turn.reward)
  return dataclasses.replace(result, payload={"state": state, "turn": [obs, turn.done, reward]})


def env_from_data(env: Env, result: RewardResult) -> RewardResult:
  """The trainer's side of call_env_step_data: the payload back as (a new env of env's class with the state sent,
  the Turn), checked; a payload of another shape fails the step as a bad message."""
  if not result.ok:
    return result
  payload = result.payload
  try:
    state, (obs, done, reward) = payload["state"], payload["turn"]
    if not isinstance(state, dict):
      raise TypeError("state is not a dict")
    turn = Turn(obs, done, reward)
  except (TypeError, KeyError, ValueError) as e:
    return RewardResult(math.nan, False, f"a malformed env step from the worker: {type(e).__name__}: {e}",
                        "bad_message")
  bad = garbage(turn)
  if bad or (0.0 if reward is None else reward) != result.value:
    return RewardResult(math.nan, False, f"a malformed env step from the worker: {bad or 'reward and value differ'}",
                        "bad_message")
  new = object.__new__(type(env))
  new.__dict__.update(state)
  return dataclasses.replace(result, payload=(new, turn))


def garbage(turn) -> str | None:
  """Why an env's answer is unusable, or None."""
  if not isinstance(turn, Turn):
    return f"step returned {type(turn).__name__}, not a Turn"
  obs = turn.observation
  if not isinstance(obs, str) and not (isinstance(obs, Sequence)
                                       and all(isinstance(t, numbers.Integral) for t in obs)):
    return f"observation is {type(obs).__name__}, neither text nor token ids"
  if not isinstance(turn.done, bool):
    return f"done is {type(turn.done).__name__}, not a bool"
  if turn.reward is not None and not (isinstance(turn.reward, numbers.Real) and math.isfinite(turn.reward)):
    return f"reward {turn.reward!r} is not a finite number"
  return None


class EnvTask(ProceduralTask):
  """A task whose examples are episodes of `env_class`: the prompt is the env's first messages; the reward (the
  builtin "episode" reward) is what the env gave at the end. `trusted`: steps run in the sampler's threads, without
  worker processes (builtin envs); False runs each step in an isolating worker with a timeout."""

  env_class: ClassVar[type[Env]]
  reward = "episode"
  trusted: ClassVar[bool] = False

  def env(self, example: Example) -> Env:
    """A fresh env of the example's episode (not reset)."""
    return self.env_class()

  def check_episodes(self, example: Example) -> tuple[tuple[tuple[str, ...], bool | None], ...]:
    """Scripted episodes of `example` for the run's start-up self-check (Episodes.self_check): (the model's turns,
    right) pairs. A right one must end with reward 1, a wrong one below 1; right None only has to run without an
    env failure, which is all a task that knows no answers can ask (the default: one turn stating the answer)."""
    return (((f"The answer is {example.answer}.",), None),)

  def _example(self, split: str, index: int, p: Problem) -> Example:
    example = Example(index, split, (), (), p.answer, p.meta)
    first = tuple(self.env(example).reset(example))
    if self.text_prompts:
      return dataclasses.replace(example, messages=first)
    return dataclasses.replace(example, prompt_tokens=tuple(int(t) for t in first))


def answer_episodes(example: Example) -> tuple[tuple[tuple[str, ...], bool], ...]:
  """For an env whose final turn is graded against a numeric answer: the answer in one turn is right, the answer
  plus one wrong."""
  return (((f"Answer: {example.answer}",), True), ((f"Answer: {int(example.answer) + 1}",), False))


@register_reward("episode", inline=True)
def episode_reward(prompt: str, completion: str, meta: dict[str, Any]) -> float:
  """The reward a multi-turn episode ended with (meta["episode"], filled by the sampler); its env's failure is the
  reward's failure."""
  episode = meta.get("episode")
  if episode is None:
    raise KeyError("reward 'episode' needs meta['episode'] (a rollout of a multi-turn env task)")
  if episode["error"]:
    raise RuntimeError(f"the episode's env failed: {episode['error']}")
  return episode["reward"]


__all__ = ["EVAL", "TRAIN", "Env", "EnvTask", "Turn", "answer_episodes", "call_env_step", "call_env_step_data",
           "env_from_data", "episode_reward", "step_env"]
