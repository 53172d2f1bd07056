"""Dataset task: verl-style parquet / JSONL rows (chat or text prompts, dotted answer keys, a reward per data
source), bad rows named with their key, a hub name that fails at once offline, and a short training run on files
written here and on the one shipped in data/."""

import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_hf import hf_folder

from jaxrl.config import override
from jaxrl.envs import EVAL, TRAIN, make_task
from jaxrl.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "data" / "arithmetic.jsonl"


def arithmetic_rows(n: int = 64) -> list[dict]:
  """data/arithmetic.jsonl: the project's arithmetic problems as verl-style rows."""
  task = make_task("arithmetic", seed=0, digits=2, ops=("+", "*"))
  return [{"data_source": "jaxrl/arithmetic", "prompt": list(e.messages), "reward_model": {"ground_truth": e.answer}}
          for e in (task.prompt(i) for i in range(n))]


def _verl_rows(n: int) -> list[dict]:
  rows = []
  for i in range(n):
    source = "lighteval/MATH" if i % 2 else "openai/gsm8k"
    rows.append({"data_source": source, "prompt": [{"role": "user", "content": f"What is {i} + {i} ?"}],
                 "reward_model": {"ground_truth": str(2 * i), "style": "rule"}})
  return rows


def test_the_shipped_dataset_is_the_projects_arithmetic_problems():
  assert [json.loads(line) for line in SHIPPED.read_text().splitlines()] == arithmetic_rows()


def test_parquet_and_jsonl_rows_chat_or_text_prompts_and_a_reward_per_data_source(tmp_path):
  pq.write_table(pa.Table.from_pylist(_verl_rows(40)), tmp_path / "train.parquet")
  (tmp_path / "test.jsonl").write_text("".join(json.dumps({"question": f"What is {i} - 1 ?", "answer": i - 1}) + "\n"
                                               for i in range(5)))
  task = make_task("dataset", train_files=str(tmp_path / "train.parquet"), answer_key="reward_model.ground_truth",
                   rewards={"lighteval/MATH": "math_verify"}, instruction="Put the answer in \\boxed{}.",
                   system="Be brief.", eval_fraction=0.1)
  assert len(task.train) == 36 and len(task.heldout) == 4
  seen = [task.prompt(i) for i in range(36)]
  assert sorted(e.meta["row"] for e in seen) == sorted(r["row"] for r in task.train)  # one epoch: every row once
  e = seen[0]
  assert e.split == TRAIN and e.messages[0] == {"role": "system", "content": "Be brief."}
  assert e.messages[1]["content"].endswith("?\n\nPut the answer in \\boxed{}.")
  assert e.answer == str(2 * e.meta["row"])
  assert e.meta.get("reward") == ("math_verify" if e.meta["row"] % 2 else None)  # None: the run's reward
  held = {h.messages[-1]["content"] for h in task.eval_examples(4)}
  assert not held & {s.messages[-1]["content"] for s in seen}

  # text prompts and numeric answers; a separate eval file is the whole held-out side, less the training questions
  (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"question": f"What is {i} - 1 ?", "answer": i - 1}) + "\n"
                                               for i in (3, 4, 7, 8)))
  both = make_task("dataset", train_files=str(tmp_path / "test.jsonl"), eval_files=str(tmp_path / "eval.jsonl"),
                   prompt_key="question")
  assert sorted(both.prompt(i).answer for i in range(3)) == ["-1", "0", "1"]  # 3 and 4 are held out
  assert both.prompt(0).messages == ({"role": "user", "content": f"What is {int(both.prompt(0).answer) + 1} - 1 ?"},)
  evals = both.eval_examples(4)
  assert [e.answer for e in evals] == ["2", "3", "6", "7"] and {e.split for e in evals} == {EVAL}
  assert evals[0].meta["source"].endswith("eval.jsonl")


def test_bad_rows_and_options_name_the_key(tmp_path):
  pq.write_table(pa.Table.from_pylist(_verl_rows(8)), tmp_path / "train.parquet")
  path = str(tmp_path / "train.parquet")
  with pytest.raises(ValueError, match=r"8 bad row\(s\) of 8:\n.*row 0: no key 'answer' of task.kwargs.answer_key="
                                       r"'answer' \(has \['data_source', 'prompt', 'reward_model'\]\)"):
    make_task("dataset", train_files=path)
  with pytest.raises(ValueError, match=r"row 0: 'reward_model' must be non-empty text or a list of chat messages"):
    make_task("dataset", train_files=path, prompt_key="reward_model", answer_key="reward_model.ground_truth")
  with pytest.raises(FileNotFoundError, match=r"task.kwargs.train_files: no such file"):
    make_task("dataset", train_files=str(tmp_path / "nope.parquet"))
  with pytest.raises(ValueError, match="give task.kwargs.train_files .* or task.kwargs.hub"):
    make_task("dataset")
  (tmp_path / "x.csv").write_text("a\n")
  with pytest.raises(ValueError, match=r"x.csv is not .parquet, .jsonl or .json"):
    make_task("dataset", train_files=str(tmp_path / "x.csv"))


def test_a_hub_name_fails_at_once_without_a_route_to_the_hub(monkeypatch):
  import datasets
  from huggingface_hub import constants

  monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # a name that never resolves, with or without
  t0 = time.monotonic()  # a network
  with pytest.raises(ValueError, match=r"hub='openai/gsm8k': hub.invalid cannot be reached .*HF_DATASETS_OFFLINE=1"):
    make_task("dataset", hub="openai/gsm8k", hub_config="main")
  assert time.monotonic() - t0 < 5  # datasets itself retries for ~23 s
  # offline: only datasets' cache is read, and a name not in it fails at once too
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
  t0 = time.monotonic()
  with pytest.raises(ValueError, match=r"hub='jaxrl/no-such-dataset' split='train' could not be loaded "
                                       r"\(HF_DATASETS_OFFLINE is set: only datasets' cache was read\)"):
    make_task("dataset", hub="jaxrl/no-such-dataset")
  assert time.monotonic() - t0 < 5



def test_a_run_trains_on_the_shipped_jsonl_and_a_parquet_file_with_a_reward_per_data_source(tmp_path, monkeypatch):
  from jaxrl import train as train_lib

  rows = [{**r, "data_source": "lighteval/MATH"} for r in _verl_rows(24)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "math.parquet")
  c = override(tiny.get_config("sync"), **{
      "model.source": str(hf_folder(tmp_path / "model")), "task.name": "dataset", "num_steps": 2,
      "mesh.num_devices": 2, "mesh.sampler_devices": 1, "sampler.max_len": 48, "rl.seq_len": 48,
      "sampler.max_new_tokens": 8, "task.max_prompt_tokens": 40, "rl.groups_per_step": 4, "eval.num_examples": 4,
      "eval.max_new_tokens": 8, "log.tensorboard": False, "log.progress": False})
  c.task.kwargs.train_files = (str(SHIPPED), str(tmp_path / "math.parquet"))
  c.task.kwargs.answer_key = "reward_model.ground_truth"
  c.task.kwargs.rewards = {"lighteval/MATH": "math_verify"}
  built = {}
  real_build = train_lib.build_run

  def build(c, workdir):
    built["run"] = real_build(c, workdir)
    return built["run"]

  monkeypatch.setattr(train_lib, "build_run", build)
  summary = train(c, tmp_path / "run")
  led = summary["ledger"]
  assert summary["steps"] == 2 and led["samples_trained"] == 2 * 16 and not led["reward_failures"]
  assert summary["eval_before"]["num_examples"] == summary["eval_after"]["num_examples"] == 4
  runners = built["run"].controller.sampler_loop.score.runners
  assert sorted(runners) == ["exact_answer", "math_verify"]
  task = built["run"].sampler_side.task
  used = [task.prompt(g) for g in range(led["samples_generated"] // 4)]  # sync: positions 0.. in order
  math_rows = sum(e.meta.get("reward") == "math_verify" for e in used)
  evals = task.eval_examples(4)
  eval_math = sum(e.meta.get("reward") == "math_verify" for e in evals)
  assert math_rows > 0 and runners["math_verify"].stats.calls == 4 * math_rows + 2 * eval_math
  assert runners["exact_answer"].stats.calls == 4 * (len(used) - math_rows) + 2 * (4 - eval_math)
