"""The reward of reasoning_gym tasks: the dataset's own score_answer, in a sandboxed worker process.

reasoning-gym is imported with this module, so a worker loads it (and sympy) before the sandbox confines it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import reasoning_gym  # noqa: F401 - imported before confinement, see above
from reasoning_gym.utils import extract_answer

from jaxrl.envs import answers
from jaxrl.envs.reasoning_gym_task import build_dataset
from jaxrl.envs.rewards import need, register_reward


@functools.lru_cache(maxsize=8)
def _dataset(spec_json: str):
  return build_dataset(json.loads(spec_json))


@register_reward("reasoning_gym", sandbox=True)  # scorers parse the model's text with sympy (parse_expr runs code)
def reasoning_gym_score(prompt: str, completion: str, meta: Mapping[str, Any]) -> float:
  """The dataset's score_answer of the completion's answer: its last <answer>...</answer>, or with
  meta["answer_from"] == "final" jaxrl's final-answer extraction (None when there is none)."""
  spec = need(meta, "reasoning_gym", "reasoning_gym", "the dataset spec")
  entry = need(meta, "entry", "reasoning_gym", "the reasoning-gym item")
  dataset = _dataset(json.dumps(spec, sort_keys=True))
  final = meta.get("answer_from", "tag") == "final"
  return float(dataset.score_answer(answers.extract_answer(completion) if final else extract_answer(completion),
                                    entry))
