"""Tasks as the controller sees them: prompt tokens by group id (= data position), rewards for finished groups,
and greedy held-out evaluation."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from jaxrl import console, settings
from jaxrl.controller.spec import SkipPrompt
from jaxrl.envs import EnvTask, Episodes, PromptRenderer, RewardRunner, SkipExample, guard, make_task, reward_spec
from jaxrl.envs.isolation import require as require_isolation
from jaxrl.envs.sandbox import SandboxLimits
from jaxrl.rollout import Rollout, SamplingParams
from jaxrl.sampler import Sampler

# Rewards that are 1 exactly when the answer is right, and 0 otherwise: every sample counts toward accuracy
ACCURACY_REWARDS = ("exact_answer", "countdown", "episode", "math_verify")
# Graded scores in [0, 1] (some reasoning-gym scorers give partial credit): a sample counts toward accuracy only
# when its score is 0 or 1
GRADED_REWARDS = ("reasoning_gym",)


def is_correct(reward: str, value: float) -> bool | None:
  """Whether a scored sample is right; None when its reward does not say."""
  if reward in ACCURACY_REWARDS or reward in GRADED_REWARDS and value in (0.0, 1.0):
    return value >= 1.0
  return None


def make_prompt_source(t: settings.Task, seed: int, tokenizer, model_cfg, episodes: bool = True):
  """(task, prompts) of a run's task settings (RunConfig.task) where prompts(group_id) -> (prompt tokens, meta) for
  the group's data position; episodes=False: a multi-turn task's episodes are not made (the learner's hub reads the
  prompts of single-turn tasks only)."""
  kwargs = t.kwargs.to_dict()
  if t.name in ("target_token", "token_turns"):
    kwargs.setdefault("vocab_size", model_cfg.vocab_size)
  task = make_task(t.name, seed=seed, **kwargs)
  renderer = PromptRenderer(tokenizer, t.max_prompt_tokens, chat_template=t.chat_template,
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
  if isinstance(task, EnvTask) and episodes:  # multi-turn: the sampler runs each sample's episode (meta "episode")
    task.episodes = Episodes(task, tokenizer, vocab_size=model_cfg.vocab_size, chat_template=t.chat_template,
                             timeout_s=t.reward_timeout_s, workers=t.env_workers)
  return task, prompts


def example_meta(task, example, prompt) -> dict[str, Any]:
  """A request's meta: what the reward reads, and the episode of a multi-turn task."""
  meta = {"prompt_text": prompt.text, "reward_meta": example.reward_meta}
  if getattr(task, "episodes", None) is not None:
    meta["episode"] = task.episodes.start(example)
  return meta


class Scorer:
  """Fills `reward` of every rollout of a group through isolating RewardRunners: the run's reward, and those a
  task's rows select by data source (`task.rewards`, meta "reward"), each started before the run. Every result
  goes through the failure window (jaxrl.envs.guard): too many failures stop the run."""

  def __init__(self, t: settings.Task, task, tokenizer):
    self.window = guard.FailureWindow(t.failure_window, t.max_failure_frac)
    self.reward_name = t.reward or task.reward
    names = sorted({self.reward_name, *getattr(task, "rewards", {}).values()})
    self.episodes = getattr(task, "episodes", None)  # before the runners: a runner that fails to start closes both
    self.runners: dict[str, RewardRunner] = {}
    # Sandboxed rewards handle a model's text as code: without the kernel's isolation the run stops here, one line
    # (isolation.Unavailable: exit 2), unless the config opts out, unsafely
    unsafe = any(reward_spec(n).sandbox for n in names) and require_isolation(t.allow_unsafe_sandbox)
    try:
      for name in names:
        sandbox = SandboxLimits(process_per_item=t.reward_process_per_item) if reward_spec(name).sandbox else None
        self.runners[name] = RewardRunner(name, timeout_s=t.reward_timeout_s, sandbox=sandbox, unsafe_sandbox=unsafe)
    except BaseException:
      self.close()
      raise
    self.tokenizer = tokenizer

  def self_check(self, task) -> None:
    """Each reward scores its known cases (its own and the task's) in its real worker, and an env task plays its
    scripted episodes; raises guard.RewardsBroken naming the first that fails (jaxrl.envs.guard)."""
    for name, runner in self.runners.items():
      if name == "episode" and self.episodes is not None:
        continue  # an episode's reward is its env's: checked by the episodes below
      checks = (*reward_spec(name).checks, *(task.reward_checks() if name == task.reward else ()))
      if not checks:  # a user's reward with no known cases: nothing can say what it should score
        print(f"jaxrl: reward {name!r} has no known cases to self-check (register_reward(..., checks=...)); the "
              "failure window alone guards it", file=sys.stderr)
      guard.self_check(name, runner, checks)
    if self.episodes is not None:
      self.episodes.self_check()

  def _text(self, ids: np.ndarray) -> str:
    return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True) if self.tokenizer is not None else ""

  def __call__(self, group: list[Rollout]) -> None:
    items = [(r.meta["prompt_text"], self._text(r.completion_tokens),
              {**r.meta["reward_meta"], "completion_ids": r.completion_tokens.tolist(),
               "episode": r.meta.get("episode")}) for r in group]
    by_reward: dict[str, list[int]] = {}
    for i, r in enumerate(group):
      by_reward.setdefault(r.meta["reward_meta"].get("reward", self.reward_name), []).append(i)
    for name, rows in by_reward.items():
      for i, res in zip(rows, self.runners[name].score([items[i] for i in rows]), strict=True):
        r = group[i]
        r.reward = res.value
        self.window.add(name, res)
        if not res.ok:
          r.meta["reward_error"] = f"{res.reason}: {res.error}"
        elif (correct := is_correct(name, res.value)) is not None:
          r.meta["correct"] = correct

  def close(self) -> None:
    for runner in self.runners.values():
      runner.close()
    if self.episodes is not None:
      self.episodes.close()


def make_scorer(t: settings.Task, task, tokenizer) -> Scorer:
  """The run's Scorer, its rewards and env self-checked (t.self_check) before it scores any rollout."""
  scorer = Scorer(t, task, tokenizer)
  if t.self_check:
    try:
      scorer.self_check(task)
    except BaseException:
      scorer.close()
      raise
  return scorer


def evaluate_policy(engine, task, score, params, version: int, *, num_examples: int, max_new_tokens: int,
                    seed: int = 0, eos_token_ids=None, detokenize=None) -> tuple[dict[str, float], list[Rollout]]:
  """(summary, rollouts): greedy completions of the task's first `num_examples` held-out examples, scored.

  The summary has the examples scored (those the prompt renderer skips are left out), the version, the mean reward
  and, for rewards that mark right answers, the accuracy, the number correct and the number judged right or wrong
  (all scored examples, but for graded rewards only those scored 0 or 1)."""
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
  scoring = console.count(f"held-out eval of version {version}: greedy answers", n)
  while sampler.num_active or sampler.num_waiting:
    rollouts += sampler.step()
    scoring(len(rollouts))
  rollouts.sort(key=lambda r: r.group_id)
  score(rollouts)
  rewards = np.array([r.reward for r in rollouts], np.float64)
  out = {"num_examples": n, "version": version, "reward_mean": float(np.nanmean(rewards)) if n else float("nan")}
  correct = [r.meta["correct"] for r in rollouts if "correct" in r.meta]
  if correct:
    out["accuracy"] = float(np.mean(correct))
    out["num_correct"] = int(np.sum(correct))
    out["num_judged"] = len(correct)
  return out, rollouts
