"""Target token: random token prompts, rewarded by the fraction of completion tokens in a target set.

A dense reward a tiny random model learns in a few steps; it needs no tokenizer, so end-to-end tests run on raw
token ids.
"""

from __future__ import annotations

import random

from jaxrl.envs.task import Problem, ProceduralTask


class TargetTokenTask(ProceduralTask):
  """Prompts of `prompt_len` ids drawn uniformly from [0, vocab_size); meta carries the target ids."""

  name = "target_token"
  reward = "target_token"
  text_prompts = False

  def __init__(self, seed: int = 0, *, vocab_size: int, target_ids=(1,), prompt_len: int = 4,
               eval_fraction: float = 0.05):
    super().__init__(seed, eval_fraction)
    target_ids = tuple(int(t) for t in target_ids)
    if not isinstance(vocab_size, int) or vocab_size < 2:
      raise ValueError(f"target_token: vocab_size must be an int >= 2 (got {vocab_size!r})")
    if not target_ids or any(not 0 <= t < vocab_size for t in target_ids):
      raise ValueError(f"target_token: target_ids {target_ids} must be non-empty ids in [0, {vocab_size})")
    if not isinstance(prompt_len, int) or prompt_len < 1:
      raise ValueError(f"target_token: prompt_len must be an int >= 1 (got {prompt_len!r})")
    self.vocab_size, self.target_ids, self.prompt_len = vocab_size, target_ids, prompt_len

  def generate(self, rng: random.Random) -> Problem:
    ids = tuple(rng.randrange(self.vocab_size) for _ in range(self.prompt_len))
    return Problem(key=" ".join(map(str, ids)), prompt_tokens=ids, meta={"target_ids": list(self.target_ids)})
