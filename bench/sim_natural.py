"""The simulator's pipeline/sync ratio per trained token on natural-length runs, calibrated from each run's own logs.

    PYTHONPATH=. .venv/bin/python -m bench.sim_natural [--rounds=2] [--steps=24]   # ~3 min a round on 2 cores

configs/tiny.py with four end-of-sample ids (so lengths are the model's own, not forced; capped at 48 tokens) runs
in sync and in pipeline mode, alternating, `rounds` times. Each run is calibrated from its own metrics.jsonl and
trace.jsonl (jaxrl-profile --from-run: costs and per-group lengths), and the simulator predicts both modes from it;
the predicted ratio of trained tokens per second (pipeline / sync, the pipeline's length bias included: it trains a
step's short groups first) is compared with the measured ratio of the round's two runs.
Writes bench/results/sim_natural.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # configs/tiny.py's mesh: 4 sampler + 4 learner devices

import importlib.util  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bench.common import write_json  # noqa: E402
from jaxrl import config as config_lib  # noqa: E402
from jaxrl.cost_profile import from_run  # noqa: E402
from jaxrl.metrics import read_jsonl  # noqa: E402
from jaxrl.sim import runlog  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 4  # steps left out: compilation


def config(mode: str, steps: int):
  """configs/tiny.py at natural lengths: ids 2-5 end a sample (1/8 of a random draw), up to 48 tokens; no checkpoint
  inside the measured window (a save is a stall the simulator does not model)."""
  spec = importlib.util.spec_from_file_location("tiny", ROOT / "configs" / "tiny.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = config_lib.override(mod.get_config(mode), num_steps=steps, **{
      "log.trace": True, "log.tensorboard": False, "log.progress": False, "sampler.max_new_tokens": 48,
      "sampler.max_len": 64, "rl.seq_len": 64, "checkpoint.every_steps": steps})
  c.model.tiny.eos_token_ids = (2, 3, 4, 5)
  return c


def one_run(mode: str, steps: int, workdir: Path) -> dict:
  """Trains, then calibrates from the run's own logs: measured and predicted figures of both modes."""
  from jaxrl.train import train

  train(config(mode, steps), workdir)
  return calibrated(mode, steps, workdir)


def calibrated(mode: str, steps: int, workdir: Path) -> dict:
  """The run's measured figures and those the simulator predicts for both modes from its logs."""
  c = config(mode, steps)
  r = from_run(c, workdir, devices=8, warmup=WARMUP)
  records = read_jsonl(workdir / "metrics.jsonl")
  lengths = runlog.group_lengths(read_jsonl(workdir / "trace.jsonl"), c.rl.group_size)
  trained = [x["completion_len"] for x in runlog.steady(records, WARMUP)[1:]]
  return dict(measured_step_s=r["measured_step_s"], measured_tokens_per_s=r["measured_tokens_per_s"],
              measured_trained_len=float(np.mean(trained)), generated_len=float(lengths.mean()),
              generated_p99_over_median=float(np.percentile(lengths, 99) / np.median(lengths)),
              predicted_step_s=r["predicted_step_s"], step_error=r["error"],
              predicted_tokens_per_s=r["predicted_tokens_per_s"], predicted_sync_tokens_per_s=r["sync_tokens_per_s"],
              predicted_pipeline_tokens_per_s=r["pipeline_tokens_per_s"], predicted_ratio=r["token_ratio"],
              predicted_sync_trained_len=r["sync_trained_len"],
              predicted_pipeline_trained_len=r["pipeline_trained_len"])


def main(argv):
  del argv
  fl = flags.FLAGS
  rounds = []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(fl.rounds):
      if fl.logs:  # runs kept by --keep: calibrate again, no training
        runs = {mode: calibrated(mode, fl.steps, Path(fl.logs) / f"{mode}{i}") for mode in ("sync", "pipeline")}
      else:
        runs = {mode: one_run(mode, fl.steps, Path(tmp) / f"{mode}{i}") for mode in ("sync", "pipeline")}
      if fl.keep:
        for mode in runs:
          dest = Path(fl.keep) / f"{mode}{i}"
          dest.mkdir(parents=True, exist_ok=True)
          for name in ("metrics.jsonl", "summary.json", "trace.jsonl"):
            shutil.copy(Path(tmp) / f"{mode}{i}" / name, dest / name)
      measured = runs["pipeline"]["measured_tokens_per_s"] / runs["sync"]["measured_tokens_per_s"]
      # Each mode calibrated from its own run (its costs and its lengths), and both modes from one run's costs.
      own = runs["pipeline"]["predicted_pipeline_tokens_per_s"] / runs["sync"]["predicted_sync_tokens_per_s"]
      errors = {"own_runs": own / measured - 1}
      errors.update({f"from_{m}": runs[m]["predicted_ratio"] / measured - 1 for m in runs})
      rounds.append(dict(runs=runs, measured_ratio=measured, predicted_ratio_own_runs=own, ratio_error=errors))
      print(f"round {i}: measured pipeline/sync per trained token {measured:.3f}x (trained length sync "
            f"{runs['sync']['measured_trained_len']:.1f}, pipeline {runs['pipeline']['measured_trained_len']:.1f}); "
            f"each mode calibrated from its own run: {own:.3f}x ({errors['own_runs']:+.1%}); "
            + "; ".join(f"both from the {m} run: {runs[m]['predicted_ratio']:.3f}x ({errors['from_' + m]:+.1%}), its "
                        f"own step {runs[m]['step_error']:+.1%}" for m in runs))
  summary = {}
  for key in rounds[0]["ratio_error"]:
    errs = [abs(r["ratio_error"][key]) for r in rounds]
    summary[key] = dict(median=statistics.median(errs), worst=max(errs))
    print(f"ratio error over {len(rounds)} rounds, {key}: median {summary[key]['median']:.1%}, worst "
          f"{summary[key]['worst']:.1%}")
  write_json(fl.out, dict(config="configs/tiny.py, eos_token_ids=(2, 3, 4, 5), max_new_tokens=48, seq_len=64",
                          steps=fl.steps, warmup=WARMUP, rounds=rounds, ratio_error=summary))


if __name__ == "__main__":
  # Defined here, not at import: tests import config() from this module next to other modules' flags.
  flags.DEFINE_integer("rounds", 2, "sync + pipeline run pairs")
  flags.DEFINE_integer("steps", 24, "learner steps per run")
  flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "sim_natural.json"), "JSON report")
  flags.DEFINE_string("keep", "", "copy each run's logs (metrics, summary, trace) to <keep>/<mode><round>")
  flags.DEFINE_string("logs", "", "calibrate the runs --keep kept in this folder instead of training new ones")
  app.run(main)
