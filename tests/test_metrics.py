"""Metrics sinks: JSONL records, TensorBoard event files, arrays split into per-entry scalars."""

import math

import numpy as np

from jaxrl.metrics import MetricsWriter, read_jsonl


def test_jsonl_and_tensorboard(tmp_path, capsys):
  w = MetricsWriter(tmp_path, total_steps=3)
  w.write(1, {"reward_mean": np.float32(0.5), "staleness_hist": np.array([3, 1, 0]), "loss": float("nan"),
              "note": "text"})
  w.write(2, {"reward_mean": 0.75, "ess_frac": 0.9})
  w.close()
  recs = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2]
  assert recs[0]["reward_mean"] == 0.5 and recs[0]["staleness_hist/0"] == 3.0 and recs[0]["staleness_hist/2"] == 0.0
  assert recs[0]["loss"] == "nan" and "note" not in recs[0]  # non-finite kept as text, strings skipped
  assert math.isclose(recs[1]["reward_mean"], 0.75)
  assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
  err = capsys.readouterr().err
  assert "[step 2/3" in err and "reward 0.75" in err and "ess 0.9" in err


def test_a_resumed_run_replaces_the_records_after_its_checkpoint(tmp_path):
  w = MetricsWriter(tmp_path, backends=("jsonl",), progress=False)
  for step in range(1, 6):
    w.write(step, {"reward_mean": step / 10})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "rew')  # a line a SIGKILL cut short
  w = MetricsWriter(tmp_path, backends=("jsonl",), progress=False, resume_step=3)  # resumed from the step-3 checkpoint
  for step in range(4, 7):
    w.write(step, {"reward_mean": step})
  w.close()
  recs = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
  assert [r["reward_mean"] for r in recs] == [0.1, 0.2, 0.3, 4, 5, 6]
  MetricsWriter(tmp_path, backends=("jsonl",), progress=False, resume_step=0).close()  # from scratch: nothing kept
  assert read_jsonl(tmp_path / "metrics.jsonl") == []
  MetricsWriter(tmp_path / "new", backends=("jsonl",), progress=False, resume_step=2).close()  # no file yet: fine
