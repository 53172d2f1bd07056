"""Tasks with verifiable rewards: prompts by data position, reward fns by name, and an isolating reward runner.

  task = make_task("arithmetic", seed=0, digits=2)
  example = task.prompt(position)            # pure in (config, seed, position): resume = same position
  prompt = PromptRenderer(tokenizer, 64, text_prompts=task.text_prompts)(example)   # SkipExample if too long
  runner = RewardRunner(task.reward, timeout_s=5.0)
  results = runner.score([(prompt.text, completion, {**example.reward_meta, "completion_ids": ids})])

Multi-turn environments (jaxrl.envs.env: Env, Turn, EnvTask) are tasks too ("calculator", "guess", "token_turns"):
their episodes run in the sampler through an `Episodes` driver (jaxrl.envs.episodes).
"""

import inspect

from jaxrl.envs.arithmetic import ArithmeticTask
from jaxrl.envs.calculator import CalculatorTask
from jaxrl.envs.countdown import CountdownTask
from jaxrl.envs.dataset import DatasetTask
from jaxrl.envs.env import Env, EnvTask, Turn
from jaxrl.envs.episodes import Episodes
from jaxrl.envs.guess import GuessTask
from jaxrl.envs.jsonl import JsonlError, JsonlTask, load_jsonl
from jaxrl.envs.prompts import ChatTemplateError, Prompt, PromptRenderer, SkipExample
from jaxrl.envs.reasoning_gym_task import ReasoningGymTask
from jaxrl.envs.rewards import get_reward, register_reward, reward_names, reward_spec
from jaxrl.envs.runner import RewardResult, RewardRunner, RewardStats
from jaxrl.envs.target_token import TargetTokenTask
from jaxrl.envs.task import EVAL, TRAIN, Example, Task
from jaxrl.envs.token_turns import TokenTurnsTask

TASKS = {t.name: t for t in (ArithmeticTask, CalculatorTask, CountdownTask, DatasetTask, GuessTask, JsonlTask,
                              ReasoningGymTask, TargetTokenTask, TokenTurnsTask)}


def make_task(name: str, seed: int = 0, **kwargs) -> Task:
  """A task by name; kwargs are the task's options (e.g. digits=3, path="train.jsonl", vocab_size=32)."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(TASKS))}")
  params = dict(inspect.signature(TASKS[name]).parameters)
  params.pop("seed")
  unknown = sorted(set(kwargs) - set(params))
  missing = sorted(k for k, p in params.items() if p.default is p.empty and k not in kwargs)
  if unknown or missing:
    raise ValueError(f"task {name!r}: unknown options {unknown}, missing options {missing}; "
                     f"options: {', '.join(params)}")
  return TASKS[name](seed, **kwargs)


__all__ = [
    "EVAL", "TASKS", "TRAIN", "ArithmeticTask", "CalculatorTask", "ChatTemplateError", "CountdownTask", "DatasetTask",
    "Env", "EnvTask", "Episodes", "Example", "GuessTask", "JsonlError", "JsonlTask", "Prompt", "PromptRenderer",
    "ReasoningGymTask", "RewardResult", "RewardRunner", "RewardStats", "SkipExample", "TargetTokenTask", "Task",
    "TokenTurnsTask", "Turn",
    "get_reward", "load_jsonl", "make_task", "register_reward", "reward_names", "reward_spec",
]
