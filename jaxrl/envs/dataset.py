"""Prompts from a user's dataset (optional extra `data`): `task.name="dataset"`.

  task.kwargs = dict(train_files="train.parquet", eval_files="test.parquet", prompt_key="prompt",
                     answer_key="reward_model.ground_truth", rewards={"openai/gsm8k": "exact_answer"})   # verl-style
  task.kwargs = dict(hub="openai/gsm8k", hub_config="main", prompt_key="question", answer_key="answer")   # TRL-style

Files are parquet (read with pyarrow) or JSONL / JSON (read with json). A row's prompt is text or chat messages
([{"role", "content"}, ...]); its answer is found by a dotted key. A row's data source (`data_source_key`) selects
its reward through `rewards` (verl picks its scorer by data_source); other rows use the run's reward. Without eval
files the held-out questions are chosen by hash (jaxrl.envs.records). A hub name is loaded with `datasets`; with
no route to the hub it fails at once (datasets would retry for tens of seconds), and with HF_DATASETS_OFFLINE=1
it reads datasets' local cache.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlparse

from jaxrl.envs.records import RecordsTask
from jaxrl.envs.task import Example

EXTRA = "pip install 'jaxrl[data]'"
MAX_LISTED_ERRORS = 5


def data_files(files: str | Sequence[str], key: str) -> list[Path]:
  """The paths of task.kwargs.<key>; raises naming the key if one is missing or of an unknown kind."""
  paths = [Path(f) for f in ([files] if isinstance(files, (str, os.PathLike)) else files)]
  if not paths:
    raise ValueError(f"dataset: task.kwargs.{key} is empty")
  for p in paths:
    if not p.is_file():
      raise FileNotFoundError(f"dataset: task.kwargs.{key}: no such file {p}")
    if p.suffix not in (".parquet", ".jsonl", ".json"):
      raise ValueError(f"dataset: task.kwargs.{key}: {p} is not .parquet, .jsonl or .json")
  return paths


def read_rows(path: Path) -> list[dict]:
  """The rows of a parquet, JSONL or JSON-list file, as dicts."""
  if path.suffix == ".parquet":
    try:
      import pyarrow.parquet as pq
    except ImportError as e:
      raise ValueError(f"dataset: reading {path} needs pyarrow ({EXTRA}): {e}") from None
    return pq.read_table(path).to_pylist()
  text = path.read_text(encoding="utf-8")
  try:
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(s) for s in text.splitlines() if s.strip()]
  except json.JSONDecodeError as e:
    raise ValueError(f"dataset: {path}: invalid JSON ({e})") from None
  if not isinstance(rows, list):
    raise ValueError(f"dataset: {path}: a .json file must hold a list of rows")
  return rows


def hub_rows(name: str, config: str | None, split: str) -> list[dict]:
  """A hub dataset's split; no route to the hub fails at once unless HF_DATASETS_OFFLINE asks for the cache."""
  try:
    import datasets
  except ImportError as e:
    raise ValueError(f"dataset: hub={name!r} needs the datasets package ({EXTRA}): {e}") from None
  from huggingface_hub import constants

  offline = bool(datasets.config.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "") in ("1", "true", "YES")
  if not offline:
    host = urlparse(constants.ENDPOINT).hostname
    try:
      socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
      raise ValueError(f"dataset: hub={name!r}: {host} cannot be reached ({e}); pass local train_files, or set "
                       "HF_DATASETS_OFFLINE=1 to read datasets' cache") from None
  try:
    return list(datasets.load_dataset(name, config, split=split))
  except (ConnectionError, FileNotFoundError, ValueError) as e:
    where = " (HF_DATASETS_OFFLINE is set: only datasets' cache was read)" if offline else ""
    raise ValueError(f"dataset: hub={name!r} split={split!r} could not be loaded{where}: {e}") from None


def lookup(row: Mapping, dotted: str, setting: str):
  """row["a"]["b"] for dotted="a.b"; a ValueError naming the setting and the missing part."""
  node = row
  for part in dotted.split("."):
    if not isinstance(node, Mapping) or part not in node:
      has = sorted(node) if isinstance(node, Mapping) else type(node).__name__
      raise ValueError(f"no key {part!r} of task.kwargs.{setting}={dotted!r} (has {has})")
    node = node[part]
  return node


def _messages(prompt, key: str) -> tuple[dict[str, str], ...]:
  if isinstance(prompt, str) and prompt.strip():
    return ({"role": "user", "content": prompt},)
  if (isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) and isinstance(m.get("role"), str)
                                                           and isinstance(m.get("content"), str) for m in prompt)):
    return tuple({"role": m["role"], "content": m["content"]} for m in prompt)
  raise ValueError(f"{key!r} must be non-empty text or a list of chat messages with 'role' and 'content'")


class DatasetTask(RecordsTask):
  """Chat prompts and reference answers from local files or a hub dataset."""

  name = "dataset"
  reward = "exact_answer"

  def __init__(self, seed: int = 0, *, train_files: str | Sequence[str] = (), eval_files: str | Sequence[str] = (),
               hub: str = "", hub_config: str | None = None, split: str = "train", eval_split: str = "",
               prompt_key: str = "prompt", answer_key: str = "answer", data_source_key: str = "data_source",
               rewards: Mapping[str, str] | None = None, system: str = "",
               instruction: str = "", eval_fraction: float = 0.05):
    if bool(hub) == bool(train_files):
      raise ValueError("dataset: give task.kwargs.train_files (local files) or task.kwargs.hub (a hub name), "
                       "exactly one")
    self.rewards = dict(rewards or {})  # data source -> reward name; other rows: the run's reward
    self.prompt_key, self.answer_key, self.source_key = prompt_key, answer_key, data_source_key
    self.system, self.instruction = system, instruction
    if hub:
      train = self._records(hub_rows(hub, hub_config, split), f"{hub}[{split}]")
      heldout = self._records(hub_rows(hub, hub_config, eval_split), f"{hub}[{eval_split}]") if eval_split else None
    else:
      train = [r for p in data_files(train_files, "train_files") for r in self._records(read_rows(p), str(p))]
      heldout = ([r for p in data_files(eval_files, "eval_files") for r in self._records(read_rows(p), str(p))]
                 if eval_files else None)
    super().__init__(seed, train, heldout, eval_fraction)

  def _records(self, rows: list, where: str) -> list[dict]:
    """Checked rows: {"messages", "answer", "source", "row"}; every bad row is listed with its number."""
    records, errors = [], []
    for i, row in enumerate(rows):
      try:
        if not isinstance(row, Mapping):
          raise ValueError(f"expected an object, got {type(row).__name__}")
        messages = _messages(lookup(row, self.prompt_key, "prompt_key"), self.prompt_key)
        answer = lookup(row, self.answer_key, "answer_key")
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer).strip() == "":
          raise ValueError(f"{self.answer_key!r} must be a non-empty string or a number (got {answer!r})")
        source = row.get(self.source_key) if isinstance(row.get(self.source_key), str) else ""
      except ValueError as e:
        errors.append(f"row {i}: {e}")
        continue
      records.append({"messages": messages, "answer": str(answer), "source": source, "row": i, "file": where})
    if errors:
      listed = "\n".join(f"  {where}: {e}" for e in errors[:MAX_LISTED_ERRORS])
      more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
      raise ValueError(f"dataset: {where}: {len(errors)} bad row(s) of {len(rows)}:\n{listed}{more}")
    if not records:
      raise ValueError(f"dataset: {where} has no rows")
    return records

  def question(self, record) -> str:
    return record["messages"][-1]["content"]

  def example(self, split: str, index: int, record) -> Example:
    messages = record["messages"]
    if self.instruction:
      *head, last = messages
      messages = (*head, {**last, "content": f"{last['content']}\n\n{self.instruction}"})
    if self.system and messages[0]["role"] != "system":
      messages = ({"role": "system", "content": self.system}, *messages)
    meta = {"source": record["file"], "row": record["row"], "data_source": record["source"]}
    if record["source"] in self.rewards:
      meta["reward"] = self.rewards[record["source"]]
    return Example(index, split, tuple(messages), answer=record["answer"], meta=meta)
