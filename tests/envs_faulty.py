"""A user-written, untrusted multi-turn env whose tool misbehaves as the prompt's first token says: importable by
the isolating runner's worker processes (tests/test_envs_episodes.py)."""

import os
import time

from jaxrl.envs import Env, EnvTask, Turn
from jaxrl.envs.task import Problem

OK, RAISE, HANG, GARBAGE, BAD_TOKENS, CRASH = 10, 11, 12, 13, 14, 15


class FaultyEnv(Env):
  stop_token_ids = (3,)
  max_turns = 2
  max_tokens = 24

  def reset(self, example):
    self.mode, self.turns = example.meta["mode"], 0
    return (self.mode, 20, 21)

  def step(self, text, ids):
    if self.mode == RAISE:
      raise RuntimeError("the tool broke")
    if self.mode == HANG:
      time.sleep(60)
    if self.mode == GARBAGE:
      return {"observation": "not a Turn"}
    if self.mode == BAD_TOKENS:
      return Turn(observation=[10**6])
    if self.mode == CRASH:
      os._exit(3)
    self.turns += 1
    return Turn(observation=[7, 8]) if self.turns == 1 else Turn(done=True, reward=1.0)


class FaultyTask(EnvTask):
  name = "faulty"
  env_class = FaultyEnv
  text_prompts = False

  def __init__(self, seed=0, modes=(OK,)):
    super().__init__(seed, eval_fraction=0.5)
    self.modes = modes

  def generate(self, rng):
    mode = rng.choice(self.modes)
    return Problem(key=f"{mode}/{rng.random()}", meta={"mode": mode})
