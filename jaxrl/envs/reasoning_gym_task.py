"""reasoning-gym generators as a task (optional extra `reasoning`): `task.name="reasoning_gym"`.

  task.kwargs = dict(dataset="basic_arithmetic", config=dict(min_terms=2, max_terms=3), size=1000)
  task.kwargs = dict(dataset={"basic_arithmetic": 2, "chain_sum": 1}, config={"chain_sum": {...}}, size=1000)

The task's records are items 0..size-1 of `reasoning_gym.create_dataset(dataset, seed, size, **config)` (a weighted
mix is reasoning-gym's "composite" dataset). Items of a generator at seed s+1 are its items at seed s shifted by
one, so a second seed is no held-out split: the split is jaxrl's hash of the question (jaxrl.envs.records). The
reward is the dataset's own `score_answer` on the completion's answer, run in a sandboxed worker
(jaxrl.envs.reasoning_gym_reward): several scorers parse the model's text with sympy, which can run code. The
answer is the last <answer>...</answer> (answer_from="tag", reasoning-gym's convention) or, for models too small to
keep to the tags, jaxrl's final-answer extraction (answer_from="final": a tag, \\boxed{}, "####", "Answer: x", else
the last number; jaxrl.envs.answers).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jaxrl.envs.records import RecordsTask
from jaxrl.envs.rewards import right_and_wrong
from jaxrl.envs.task import Example, user_message

EXTRA = "pip install 'jaxrl[reasoning]'"
# Chain of thought, then the answer in the tags the reward reads.
SYSTEM = ("Think through the problem step by step, then give only the final answer between <answer> and </answer>, "
          "for example <answer>42</answer>.")


ANSWER_FROM = ("tag", "final")


def import_reasoning_gym():
  try:
    import reasoning_gym
  except ImportError as e:
    raise ValueError(f"reasoning_gym needs the optional package reasoning-gym ({EXTRA}): {e}") from None
  return reasoning_gym


def dataset_spec(dataset: str | Mapping[str, float], config: Mapping[str, Any] | None, seed: int,
                 size: int) -> dict:
  """The plain, JSON-able description of a reasoning-gym dataset (what a reward worker rebuilds it from)."""
  config = dict(config or {})
  if isinstance(dataset, str):
    return {"name": dataset, "config": config, "seed": seed, "size": size}
  if not isinstance(dataset, Mapping) or not dataset:
    raise ValueError(f"reasoning_gym: task.kwargs.dataset must be a generator name or a mix {{name: weight}} "
                     f"(got {dataset!r})")
  extra = sorted(set(config) - set(dataset))
  if extra:
    raise ValueError(f"reasoning_gym: task.kwargs.config has {extra}, which are not in the mix {sorted(dataset)}")
  mix = [{"name": n, "weight": float(w), "config": dict(config.get(n, {}))} for n, w in dataset.items()]
  return {"name": "composite", "config": {"datasets": mix}, "seed": seed, "size": size}


def build_dataset(spec: dict):
  """The reasoning-gym dataset of a spec; a bad name or option is a ValueError naming task.kwargs."""
  rg = import_reasoning_gym()
  from reasoning_gym.composite import DatasetSpec

  known = sorted(rg.factory.DATASETS)
  config = dict(spec["config"])
  names = [d["name"] for d in config["datasets"]] if spec["name"] == "composite" else [spec["name"]]
  unknown = [n for n in names if n not in rg.factory.DATASETS]
  if unknown:
    raise ValueError(f"reasoning_gym: unknown generator(s) {unknown} in task.kwargs.dataset; known: "
                     f"{', '.join(known)}")
  if spec["name"] == "composite":
    config["datasets"] = [DatasetSpec(**d) for d in config["datasets"]]
  try:
    return rg.create_dataset(spec["name"], seed=spec["seed"], size=spec["size"], **config)
  except (TypeError, AssertionError, ValueError) as e:
    raise ValueError(f"reasoning_gym: bad task.kwargs.config for {names}: {type(e).__name__}: {e}") from None


class ReasoningGymTask(RecordsTask):
  """Prompts from a reasoning-gym dataset, scored by its own score_answer (rewards in [0, 1], some partial)."""

  name = "reasoning_gym"
  reward = "reasoning_gym"

  def __init__(self, seed: int = 0, *, dataset: str | Mapping[str, float], config: Mapping[str, Any] | None = None,
               size: int = 1000, eval_fraction: float = 0.05, system: str = SYSTEM, answer_from: str = "tag"):
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
      raise ValueError(f"reasoning_gym: task.kwargs.size must be an int >= 2 (got {size!r})")
    if answer_from not in ANSWER_FROM:
      raise ValueError(f"reasoning_gym: task.kwargs.answer_from must be one of {ANSWER_FROM} (got {answer_from!r})")
    self.answer_from = answer_from
    self.spec = dataset_spec(dataset, config, int(seed), size)
    json.dumps(self.spec)  # the spec travels to reward workers; a config that is not plain data fails here
    self.system = system
    data = build_dataset(self.spec)
    super().__init__(seed, [data[i] for i in range(size)], eval_fraction=eval_fraction)

  def question(self, record) -> str:
    return record["question"]

  def example(self, split: str, index: int, record) -> Example:
    meta = {"reasoning_gym": self.spec, "entry": record, "answer_from": self.answer_from,
            "source_dataset": record["metadata"].get("source_dataset", self.spec["name"])}
    return Example(index, split, user_message(record["question"], self.system), answer=str(record["answer"]),
                   meta=meta)

  def reward_checks(self) -> tuple:
    """The dataset's own answer to its first training item scores 1 with its own scorer; a non-answer below 1."""
    example = self.prompt(0)
    return right_and_wrong(f"<answer>{example.answer}</answer>", "<answer>jaxrl self-check: no answer</answer>",
                           example.reward_meta)
