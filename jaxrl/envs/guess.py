"""Guess the number: the env holds a number in [1, high] (high drawn in [8, max_high] per problem, so that problems
differ and a held-out split exists); each model turn is a guess, answered "Higher." or
"Lower." until the guess is right (reward 1) or the turns run out (reward 0, or with partial_credit c > 0 the
last guess's closeness c * (1 - |guess - secret| / high): a reward that differs within a group even when no sample
finds the number, so that the group still has a learning signal; held-out success counts only reward 1). At least 3
turns unless the model guesses early: a multi-turn env whose observations depend on what the model said."""

from __future__ import annotations

import random

from jaxrl.envs import answers
from jaxrl.envs.env import Env, EnvTask, Turn, answer_episodes
from jaxrl.envs.task import Problem, user_message


class GuessEnv(Env):
  max_turns = 5
  max_tokens = 120

  def reset(self, example):
    self.secret, self.high = int(example.answer), int(example.meta["high"])
    self.partial_credit = float(example.meta.get("partial_credit", 0.0))
    return example.meta["messages"]

  def step(self, text, ids):
    found = answers.numbers(text)
    if not found:
      return Turn(observation=f"Reply with a number from 1 to {self.high}.")
    guess = float(found[0])
    if guess == self.secret:
      return Turn(done=True, reward=1.0)
    # The reward if the turns run out now (jaxrl.envs.episodes ends the episode with the last turn's reward).
    closeness = self.partial_credit * max(0.0, 1.0 - abs(guess - self.secret) / self.high)
    return Turn(observation="Higher." if guess < self.secret else "Lower.", reward=closeness)


class GuessTask(EnvTask):
  name = "guess"
  env_class = GuessEnv
  trusted = True

  def __init__(self, seed: int = 0, *, max_high: int = 64, system: str = "", eval_fraction: float = 0.05,
               partial_credit: float = 0.0):
    super().__init__(seed, eval_fraction)
    if not isinstance(max_high, int) or max_high < 8:
      raise ValueError(f"guess: max_high must be an int >= 8 (got {max_high!r})")
    if not 0.0 <= partial_credit < 1.0:
      raise ValueError(f"guess: partial_credit must be in [0, 1) (got {partial_credit!r}): a miss must score below "
                       "a find")
    self.max_high, self.system, self.partial_credit = max_high, system, float(partial_credit)

  def check_episodes(self, example):
    return answer_episodes(example)

  def generate(self, rng: random.Random) -> Problem:
    high = rng.randint(8, self.max_high)
    secret = rng.randint(1, high)
    text = (f"I am thinking of a number from 1 to {high}. Guess it: reply with one number, and I will say "
            "'Higher.' or 'Lower.'")
    return Problem(key=f"{secret}/{high}", answer=str(secret),
                   meta={"messages": user_message(text, self.system), "high": high,
                         "partial_credit": self.partial_credit})
