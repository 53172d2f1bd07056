r"""The simulator's pipeline step with and without the multi-process hand-off term, on the same runs.

  PYTHONPATH=. .venv/bin/python -m bench.handoff                  # 3 pipeline runs of configs/bench_headline.py:test

Each round runs the headline's pipeline (bench.headline.command: a learner and a sampler process) and fits the run's
own logs twice with jaxrl-profile --from-run: as it is (the window's least learner wait charged as a per-step
hand-off, jaxrl.sim.runlog.handoff_s) and with that term at 0 (as before it). Prints both errors against the
measured step time; JSON to bench/results/handoff.json.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

from bench.common import write_json
from bench.headline import ROOT, command


def one_round(config: str, workdir: Path, steps: int) -> dict:
  sys.path.insert(0, str(ROOT / "configs"))
  import bench_headline

  from jaxrl import config as config_lib
  from jaxrl.cost_profile import from_run

  argv, env = command("pipeline", config, workdir, steps)
  proc = subprocess.run(argv, env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
                        text=True)
  if proc.returncode:
    raise RuntimeError(f"pipeline run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  c = config_lib.override(bench_headline.get_config(config.rpartition(":")[2]), mode="pipeline")
  fit = from_run(c, workdir, devices=2, warmup=c.bench.warmup_steps)
  with mock.patch("jaxrl.sim.runlog.handoff_s", lambda records, warmup: 0.0):
    plain = from_run(c, workdir, devices=2, warmup=c.bench.warmup_steps)
  return dict(measured_step_s=fit["measured_step_s"], handoff_s=fit["details"]["handoff_s"],
              predicted_step_s=fit["predicted_step_s"], error=fit["error"],
              predicted_without_handoff_s=plain["predicted_step_s"], error_without_handoff=plain["error"],
              load_average=os.getloadavg())


def main(argv=None):
  from absl import app, flags

  flags.DEFINE_string("config", f"{ROOT / 'configs' / 'bench_headline.py'}:test", "headline config[:workload]")
  flags.DEFINE_integer("rounds", 3, "pipeline runs")
  flags.DEFINE_integer("steps", 7, "learner steps per run")
  flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "handoff.json"), "JSON report")

  def _main(argv):
    fl = flags.FLAGS
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
      for i in range(fl.rounds):
        r = one_round(fl.config, Path(tmp) / f"run{i}", fl.steps)
        rounds.append(r)
        print(f"round {i}: measured {r['measured_step_s']:.4f} s; simulator without hand-off "
              f"{r['predicted_without_handoff_s']:.4f} s ({r['error_without_handoff']:+.1%}), with "
              f"{r['handoff_s'] * 1e3:.1f} ms {r['predicted_step_s']:.4f} s ({r['error']:+.1%}); load "
              f"{r['load_average'][0]:.1f}", flush=True)
    write_json(fl.out, dict(config=fl.config, steps=fl.steps, rounds=rounds))

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
