"""Tasks as the controller sees them: prompt tokens by group id (= data position), rewards for finished groups,
and greedy held-out evaluation."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl.controller.spec import SkipPrompt
from jaxrl.envs import EnvTask, Episodes, PromptRenderer, RewardRunner, SkipExample, make_task
from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.sampler import Sampler

ACCURACY_REWARDS = ("exact_answer", "countdown", "episode")  # rewards that are 1 exactly when the answer is right


def make_prompt_source(c, tokenizer, model_cfg):
  """(task, prompts) where prompts(group_id) -> (prompt tokens, meta) for the group's data position."""
  kwargs = c.task.kwargs.to_dict()
  if c.task.name in ("target_token", "token_turns"):
    kwargs.setdefault("vocab_size", model_cfg.vocab_size)
  task = make_task(c.task.name, seed=c.seed, **kwargs)
  renderer = PromptRenderer(tokenizer, c.task.max_prompt_tokens, chat_template=c.task.chat_template,
                            text_prompts=task.text_prompts, vocab_size=model_cfg.vocab_size)

  def prompts(group_id: int) -> tuple[np.ndarray, dict[str, Any]]:
    example = task.prompt(group_id)
    try:
      prompt = renderer(example)
    except SkipExample as e:
      raise SkipPrompt(str(e)) from e
    return prompt.tokens, example_meta(task, example, prompt)

  task.renderer = renderer
  task.episodes = None
  if isinstance(task, EnvTask):  # multi-turn: the sampler runs each sample's episode (request meta "episode")
    task.episodes = Episodes(task, tokenizer, vocab_size=model_cfg.vocab_size, chat_template=c.task.chat_template,
                             timeout_s=c.task.reward_timeout_s, workers=c.task.env_workers)
  return task, prompts


def example_meta(task, example, prompt) -> dict[str, Any]:
  """A request's meta: what the reward reads, and the episode of a multi-turn task."""
  meta = {"prompt_text": prompt.text, "reward_meta": example.reward_meta}
  if getattr(task, "episodes", None) is not None:
    meta["episode"] = task.episodes.start(example)
  return meta


class Scorer:
  """Fills `reward` of every rollout of a group through an isolating RewardRunner."""

  def __init__(self, c, task, tokenizer):
    self.reward_name = c.task.reward or task.reward
    self.runner = RewardRunner(self.reward_name, timeout_s=c.task.reward_timeout_s)
    self.tokenizer = tokenizer
    self.episodes = getattr(task, "episodes", None)

  def _text(self, ids: np.ndarray) -> str:
    return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True) if self.tokenizer is not None else ""

  def __call__(self, group: list[Rollout]) -> None:
    items = [(r.meta["prompt_text"], self._text(r.completion_tokens),
              {**r.meta["reward_meta"], "completion_ids": r.completion_tokens.tolist(),
               "episode": r.meta.get("episode")}) for r in group]
    for r, res in zip(group, self.runner.score(items), strict=True):
      r.reward = res.value
      if not res.ok:
        r.meta["reward_error"] = f"{res.reason}: {res.error}"
      elif self.reward_name in ACCURACY_REWARDS:
        r.meta["correct"] = res.value >= 1.0

  def close(self) -> None:
    self.runner.close()
    if self.episodes is not None:
      self.episodes.close()


def make_scorer(c, task, tokenizer) -> Scorer:
  return Scorer(c, task, tokenizer)


def evaluate(run, params, version: int) -> dict[str, float]:
  """Greedy completions of the first c.eval.num_examples held-out examples: mean reward and accuracy."""
  c = run.config
  return evaluate_policy(run.engine, run.task, run.controller.sampler_loop.score, params, version,
                         num_examples=c.eval.num_examples, max_new_tokens=c.eval.max_new_tokens, seed=c.seed,
                         detokenize=run.controller.sampler_loop.sampler.detokenize)[0]


def evaluate_policy(engine, task, score, params, version: int, *, num_examples: int, max_new_tokens: int,
                    seed: int = 0, eos_token_ids=None, detokenize=None) -> tuple[dict[str, float], list[Rollout]]:
  """(summary, rollouts): greedy completions of the task's first `num_examples` held-out examples, scored.

  The summary has the examples scored (those the prompt renderer skips are left out), the version, the mean reward
  and, for rewards that mark right answers, the accuracy and the number correct."""
  sampler = Sampler(engine, params, version, seed=seed, eos_token_ids=eos_token_ids, detokenize=detokenize)
  greedy = SamplingParams(greedy=True)
  n = 0
  for i, example in enumerate(task.eval_examples(num_examples)):
    try:
      prompt = task.renderer(example)
    except SkipExample:
      continue
    sampler.submit(prompt.tokens, i, 1, meta=example_meta(task, example, prompt), sampling=greedy,
                   max_tokens=max_new_tokens)
    n += 1
  rollouts = []
  while sampler.num_active or sampler.num_waiting:
    rollouts += sampler.step()
  rollouts.sort(key=lambda r: r.group_id)
  score(rollouts)
  rewards = np.array([r.reward for r in rollouts], np.float64)
  out = {"num_examples": n, "version": version, "reward_mean": float(np.nanmean(rewards)) if n else float("nan")}
  correct = [r.meta["correct"] for r in rollouts if "correct" in r.meta]
  if correct:
    out["accuracy"] = float(np.mean(correct))
    out["num_correct"] = int(np.sum(correct))
  return out, rollouts
