"""GSM8K-style JSONL task: malformed lines with line numbers, epoch permutations, held-out disjointness."""

import json
from pathlib import Path

import pytest

from jaxrl.envs import EVAL, JsonlError, JsonlTask, get_reward, load_jsonl, make_task
from jaxrl.envs.jsonl import final_answer

DATA = Path(__file__).parent / "data"
TINY, BAD = DATA / "gsm8k_tiny.jsonl", DATA / "gsm8k_bad.jsonl"
BAD_LINES = [2, 4, 5, 7, 9, 10]  # hand-made faults in gsm8k_bad.jsonl; line 8 is blank (ignored)


def _question(example):
  return example.messages[-1]["content"].split("\n\n")[0]


def test_final_answer():
  assert final_answer("2 * 600 = 1,200\n#### 1,200") == "1200"
  assert final_answer("#### -3") == "-3" and final_answer("#### 4.5") == "4.5" and final_answer("#### $7") == "7"
  assert final_answer("a #### 1 then #### 2") == "2"
  assert final_answer("the answer is 4") is None and final_answer("#### four") is None
  assert final_answer("#### 4 apples") is None  # the final answer is a number alone


def test_malformed_lines_fail_fast_with_line_numbers():
  with pytest.raises(JsonlError) as info:
    make_task("gsm8k", path=str(BAD))
  err = info.value
  assert [n for n, _ in err.errors] == BAD_LINES
  msg = str(err)
  assert f"{BAD}: 6 malformed line(s)" in msg and "on_error='skip'" in msg
  for n, why in [(2, "invalid JSON"), (4, "missing field 'answer'"),
                 (5, "field 'answer' has no final answer of the form '#### <number>'"),
                 (7, "expected a JSON object, got list"), (9, "field 'answer' has no final answer"),
                 (10, "field 'question' must be a non-empty string")]:
    assert f"{BAD}:{n}: {why}" in msg


def test_malformed_lines_skipped_and_counted():
  task = make_task("gsm8k", path=str(BAD), on_error="skip", eval_fraction=0.2)
  assert [n for n, _ in task.skipped] == BAD_LINES
  lines = sorted({task.prompt(i).meta["line"] for i in range(3)} | {e.meta["line"] for e in task.eval_examples(1)})
  assert lines == [1, 3, 6, 11]  # every good line is used, on one side or the other
  assert len(task.train) == 3 and len(task.heldout) == 1


def test_error_listing_is_bounded_and_utf8_is_checked(tmp_path):
  path = tmp_path / "many.jsonl"
  path.write_bytes(b"\n".join([b"{oops"] * 25 + [b'{"question": "q\xff", "answer": "#### 1"}']) + b"\n")
  with pytest.raises(JsonlError) as info:
    load_jsonl(path)
  assert len(info.value.errors) == 26 and info.value.errors[-1] == (26, "not UTF-8 (invalid start byte at byte 15)")
  assert "... and 16 more" in str(info.value) and f"{path}:11:" not in str(info.value)
  with pytest.raises(ValueError, match="no usable records"):
    load_jsonl(path, on_error="skip")
  with pytest.raises(FileNotFoundError, match="JSONL file not found"):
    load_jsonl(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="on_error must be"):
    load_jsonl(TINY, on_error="ignore")


def test_epochs_are_seeded_permutations_and_resumable():
  task = JsonlTask(5, path=TINY, eval_fraction=0.1)
  n = len(task.train)
  assert n == 19 and len(task.heldout) == 2  # 21 records: 20 distinct questions, the one asked twice in training
  epochs = [[task.prompt(e * n + i).meta["line"] for i in range(n)] for e in range(3)]
  train_lines = sorted(r.line for r in task.train)
  assert all(sorted(ep) == train_lines for ep in epochs)  # each epoch visits every record once
  assert epochs[0] != epochs[1] != epochs[2]
  fresh = JsonlTask(5, path=TINY, eval_fraction=0.1)  # resume: a new task at a checkpointed position
  assert [fresh.prompt(i) for i in range(2 * n + 3, n - 1, -1)] == [task.prompt(i) for i in range(2 * n + 3, n - 1, -1)]
  other_seed = JsonlTask(6, path=TINY, eval_fraction=0.1)
  assert [other_seed.prompt(i).meta["line"] for i in range(n)] != epochs[0]


def test_heldout_is_disjoint_by_question_including_duplicates():
  task = JsonlTask(0, path=TINY, eval_fraction=0.25)
  held = task.eval_examples(len(task.heldout))
  assert all(e.split == EVAL for e in held) and [e.index for e in held] == list(range(len(held)))
  norm = lambda q: " ".join(q.split()).casefold()
  held_q = {norm(_question(e)) for e in held}
  train_q = {norm(_question(task.prompt(i))) for i in range(len(task.train))}
  assert len(held_q) == len(held) == 5 and not held_q & train_q
  assert len(train_q | held_q) == 20  # the duplicate of question 1 sits on the same side as question 1
  with pytest.raises(ValueError, match="6 eval examples asked, 5 held out"):
    task.eval_examples(6)


def test_eval_file_and_overlap_removal(tmp_path):
  eval_path = tmp_path / "eval.jsonl"
  lines = TINY.read_text().splitlines()
  eval_path.write_text("\n".join(lines[:3]) + "\n")
  task = JsonlTask(0, path=TINY, eval_path=eval_path)
  assert len(task.heldout) == 3 and task.overlap_removed == 4  # questions 1-3, and the duplicate of question 1
  assert [e.meta for e in task.eval_examples(3)] == [{"source": str(eval_path), "line": i} for i in (1, 2, 3)]
  assert len(task.train) == 17


def test_prompt_format_and_reward():
  task = JsonlTask(0, path=TINY, system="Be brief.")
  e = task.prompt(0)
  rec = json.loads(TINY.read_text().splitlines()[e.meta["line"] - 1])
  assert e.messages == ({"role": "system", "content": "Be brief."},
                        {"role": "user", "content": rec["question"] + "\n\n" + task.instruction})
  assert e.answer == rec["answer"].rsplit("#### ", 1)[1].replace(",", "") and task.reward == "exact_answer"
  assert get_reward(task.reward)("", f"so it is\n#### {e.answer}", e.reward_meta) == 1.0
  big = next(r for r in task.train + task.heldout if r.answer == "1200")
  assert big.line == 6
