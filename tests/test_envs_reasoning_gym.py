"""reasoning-gym task: held-out split by hashed question (not by seed), its own scorer, run sandboxed."""

import importlib.util
import sys
from pathlib import Path

import pytest
from tiny_hf import hf_folder

from jaxrl.config import override
from jaxrl.controller.summary import two_proportion_z
from jaxrl.envs import EVAL, PromptRenderer, RewardRunner, make_task
from jaxrl.envs.records import question_key
from jaxrl.envs.task import key_hash
from jaxrl.train import train

REPO = Path(__file__).resolve().parents[1]


def _questions(task, n_train):
  return [task.prompt(i).messages[-1]["content"] for i in range(n_train)]


def test_heldout_split_is_by_question_hash_not_by_seed():
  a = make_task("reasoning_gym", seed=0, dataset="basic_arithmetic", size=200, eval_fraction=0.1)
  b = make_task("reasoning_gym", seed=1, dataset="basic_arithmetic", size=200, eval_fraction=0.1)
  # the generator's seeds overlap: item i at seed 1 is item i + 1 at seed 0
  assert b.train[0]["question"] in {r["question"] for r in a.train + a.heldout}
  for task in (a, b):
    held = {question_key(r["question"]) for r in task.heldout}
    assert len(held) == 20 and not held & {question_key(r["question"]) for r in task.train}
    assert len(task.train) + len(task.heldout) == 200  # no duplicate questions in these 200
  # a question is held out wherever it appears: the split is the hash, whatever the seed
  trained = {question_key(r["question"]) for r in a.train + b.train}
  assert not trained & {question_key(r["question"]) for r in a.heldout + b.heldout}
  cut = max(key_hash(question_key(r["question"])) for r in a.heldout)
  assert all(key_hash(question_key(r["question"])) > cut for r in a.train)
  seen_in_training = {question_key(q) for q in _questions(a, 200)}
  assert not seen_in_training & {question_key(e.messages[-1]["content"]) for e in a.eval_examples(20)}
  e = a.eval_examples(1)[0]
  assert e.split == EVAL and e.meta["source_dataset"] == "basic_arithmetic" and e.answer == a.heldout[0]["answer"]
  assert "<answer>" in e.messages[0]["content"]  # the system prompt asks for reasoning, then the tagged answer


def test_weighted_mix_and_bad_options_name_the_key():
  task = make_task("reasoning_gym", dataset={"basic_arithmetic": 3, "chain_sum": 1},
                   config={"chain_sum": {"min_terms": 2, "max_terms": 2}}, size=100)
  sources = [task.prompt(i).meta["source_dataset"] for i in range(len(task.train))]
  assert set(sources) == {"basic_arithmetic", "chain_sum"} and sources.count("basic_arithmetic") > 2 * sources.count(
      "chain_sum")
  with pytest.raises(ValueError, match=r"unknown generator\(s\) \['no_such'\] in task.kwargs.dataset"):
    make_task("reasoning_gym", dataset="no_such")
  with pytest.raises(ValueError, match=r"bad task.kwargs.config for \['chain_sum'\]: TypeError"):
    make_task("reasoning_gym", dataset="chain_sum", config={"bogus": 1})
  with pytest.raises(ValueError, match=r"task.kwargs.config has \['chain_sum'\], which are not in the mix"):
    make_task("reasoning_gym", dataset={"basic_arithmetic": 1}, config={"chain_sum": {}})
  with pytest.raises(ValueError, match=r"task.kwargs.answer_from must be one of \('tag', 'final'\)"):
    make_task("reasoning_gym", dataset="chain_sum", answer_from="last")
  with pytest.raises(ValueError, match="task.kwargs.size must be an int >= 2"):
    make_task("reasoning_gym", dataset="chain_sum", size=0)


def test_scores_with_the_datasets_own_scorer_in_a_sandbox_even_against_hostile_completions(tmp_path):
  task = make_task("reasoning_gym", dataset="polynomial_multiplication", size=40, eval_fraction=0.1)
  meta = task.eval_examples(1)[0].reward_meta
  marker = tmp_path / "pwned"
  completions = [
      f"Multiply out.\n<answer>{meta['answer']}</answer>",  # right
      "<answer>z**2</answer>",  # wrong
      "no tags at all",
      # parse_expr evaluates the text: a completion that runs code is refused by the sandbox (scored 0)
      f"<answer>__import__('os').system('touch {marker}')</answer>",
      f"<answer>open('{marker}', 'w').write('x')</answer>",
      "<answer>max(__import__('itertools').count())</answer>",  # burns CPU: the sandbox's CPU limit kills it
  ]
  # answer_from="final": a model that reasons in prose is read as jaxrl's gsm8k-style tasks read it
  sums = [make_task("reasoning_gym", dataset="basic_arithmetic", size=20, answer_from=a).prompt(0).reward_meta
          for a in ("tag", "final")]
  prose = f"Adding them up, the result equals {sums[0]['answer']}."
  tagged = f"<answer>{sums[0]['answer']}</answer>"
  extra = [("", prose, sums[0]), ("", prose, sums[1]), ("", tagged, sums[1]), ("", f"<answer>= {sums[0]['answer']}"
                                                                                    "</answer>", sums[0])]
  # A wall limit far above the sandbox's CPU limit: on a loaded box the CPU burner must still meet the CPU limit first
  with RewardRunner("reasoning_gym", timeout_s=60, workers=1) as runner:
    assert runner.sandbox is not None and runner.isolation == "process"
    results = runner.score([("", c, meta) for c in completions] + extra)
  assert [r.value for r in results[:5]] == [1.0, 0.0, 0.0, 0.0, 0.0]
  assert not results[5].ok and results[5].reason == "cpu_limit"
  assert not marker.exists()
  # basic_arithmetic's own scorer: exact 1, partial credit for an answer containing the right one
  assert [r.value for r in results[6:9]] == [0.0, 1.0, 1.0]
  assert results[9].value == pytest.approx(len(sums[0]["answer"]) / len(f"= {sums[0]['answer']}"))


def _reasoning_config():
  spec = importlib.util.spec_from_file_location("reasoning", REPO / "configs" / "reasoning.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def test_the_reasoning_configs_prompts_fit_with_smollm2s_tokenizer(smollm2_dir):
  from transformers import AutoTokenizer

  c = _reasoning_config()
  task = make_task(c.task.name, c.seed, **c.task.kwargs.to_dict())
  render = PromptRenderer(AutoTokenizer.from_pretrained(smollm2_dir), c.task.max_prompt_tokens)
  examples = task.eval_examples(c.eval.num_examples) + [task.prompt(i) for i in range(256)]
  lengths = [len(render(e).tokens) for e in examples]  # SkipExample if one were over max_prompt_tokens
  assert max(lengths) + c.sampler.max_new_tokens <= c.sampler.max_len
  assert {e.meta["source_dataset"] for e in examples} == {"basic_arithmetic"}


def test_the_reasoning_config_trains_two_steps_at_tiny_sizes(tmp_path):
  """configs/reasoning.py as it is but for the model (a tiny one with a word-level tokenizer) and its sizes: the
  reasoning-gym prompts, sandboxed scoring, packing and both evaluations run end to end."""
  c = override(_reasoning_config(), **{
      "model.source": str(hf_folder(tmp_path / "model")), "num_steps": 2, "task.kwargs.size": 100,
      "sampler.max_new_tokens": 16, "sampler.max_len": 80, "rl.seq_len": 80, "eval.num_examples": 4,
      "eval.max_new_tokens": 16, "log.progress": False, "log.backends": ("jsonl",)})
  summary = train(c, tmp_path / "run")
  led = summary["ledger"]
  assert summary["steps"] == 2 and led["samples_trained"] == 2 * 16 and not led["reward_failures"]
  before, after = summary["eval_before"], summary["eval_after"]
  assert before["num_examples"] == after["num_examples"] == 4
  assert summary["eval_accuracy_change"] == {  # graded scores: n counts the examples scored 0 or 1
      "before": before["accuracy"], "after": after["accuracy"], "n_before": before["num_judged"],
      "n_after": after["num_judged"], "z": round(two_proportion_z(before["num_correct"], before["num_judged"],
                                                                  after["num_correct"], after["num_judged"]), 3)}


def test_without_the_extra_the_task_names_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # not installed
  with pytest.raises(ValueError, match=r"needs the optional package reasoning-gym \(pip install "
                                       r"'jaxrl\[reasoning\]'\)"):
    make_task("reasoning_gym", dataset="chain_sum")
