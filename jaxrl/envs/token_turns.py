"""Token turns: a token-level multi-turn env for the tiny model (no tokenizer), as target_token is for one turn.

Each model turn ends at `stop_id` or at the turn's token budget; the env answers with the observation tokens
`observation_ids`, and after `turns` turns rewards the fraction of all model tokens that are target ids.
With tool_latency_s > 0 each env step first sleeps a lognormal time (that median, log-space std
tool_latency_sigma, drawn from the problem and the turn): a simulated slow tool (bench/episodes.py).
"""

from __future__ import annotations

import math
import random
import time

from jaxrl.envs.env import Env, EnvTask, Turn
from jaxrl.envs.task import Problem


class TokenTurnsEnv(Env):
  stop_token_ids = (3,)
  max_turns = 3
  max_tokens = 40

  def reset(self, example):
    self.targets = set(example.meta["target_ids"])
    self.observation = list(example.meta["observation_ids"])
    self.turns, self.hits, self.tokens = 0, 0, 0
    self.key, self.latency = " ".join(map(str, example.meta["prompt"])), example.meta["latency"]
    return example.meta["prompt"]

  def step(self, text, ids):
    median, sigma = self.latency
    if median > 0:  # the same problem and turn sleep the same time in every run (its own stream, not the sample's)
      time.sleep(random.Random(f"{self.key}/{self.turns}").lognormvariate(math.log(median), sigma))
    self.turns += 1
    self.hits += sum(int(t) in self.targets for t in ids)
    self.tokens += len(ids)
    if self.turns == self.max_turns:
      return Turn(done=True, reward=self.hits / max(self.tokens, 1))
    return Turn(observation=self.observation)


class TokenTurnsTask(EnvTask):
  name = "token_turns"
  env_class = TokenTurnsEnv
  text_prompts = False
  trusted = True

  def __init__(self, seed: int = 0, *, vocab_size: int, target_ids=(1,), observation_ids=(5, 6), prompt_len: int = 4,
               tool_latency_s: float = 0.0, tool_latency_sigma: float = 1.0, eval_fraction: float = 0.05):
    super().__init__(seed, eval_fraction)
    if not tool_latency_s >= 0 or not tool_latency_sigma >= 0:
      raise ValueError(f"token_turns: tool_latency_s and tool_latency_sigma must be >= 0 (got {tool_latency_s}, "
                       f"{tool_latency_sigma})")
    self.latency = (float(tool_latency_s), float(tool_latency_sigma))
    ids = (*target_ids, *observation_ids)
    if not isinstance(vocab_size, int) or vocab_size < 8 or any(not 0 <= int(t) < vocab_size for t in ids):
      raise ValueError(f"token_turns: vocab_size must be an int >= 8 holding every target and observation id "
                       f"(got {vocab_size!r}, ids {ids})")
    if not observation_ids or not target_ids:
      raise ValueError("token_turns: target_ids and observation_ids must not be empty")
    self.vocab_size, self.prompt_len = vocab_size, prompt_len
    self.target_ids, self.observation_ids = tuple(map(int, target_ids)), tuple(map(int, observation_ids))

  def generate(self, rng: random.Random) -> Problem:
    ids = tuple(rng.randrange(self.vocab_size) for _ in range(self.prompt_len))
    return Problem(key=" ".join(map(str, ids)), meta={"prompt": ids, "target_ids": list(self.target_ids),
                                                      "observation_ids": list(self.observation_ids),
                                                      "latency": self.latency})
