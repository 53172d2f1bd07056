r"""The real-model headline on the reasoning workload: configs/reasoning.py (SmolLM2-135M-Instruct, chain of thought,
natural lengths up to 96 tokens) run as bench/headline.py runs its workloads -- colocated sync (one process on both
cores) and the pipeline (a learner process and a sampler process on a core each) -- one after the other, same
config and seed, held-out evaluation off; seconds per trained token and per step after the warm-up steps.

  PYTHONPATH=. .venv/bin/python -m bench.reasoning_headline --steps=10 --warmup=2
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from absl import app, flags

from bench.common import write_json
from bench.headline import MODES, ROOT, command, measure

_STEPS = flags.DEFINE_integer("steps", 10, "learner steps per run")
_WARMUP = flags.DEFINE_integer("warmup", 2, "steps left out of the measurement")
_OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "reasoning_headline.json"), "JSON results path")
_DIR = flags.DEFINE_string("dir", "/tmp/jaxrl-reasoning-headline", "the runs' workdirs")


def main(argv):
  del argv
  import importlib.util

  spec = importlib.util.spec_from_file_location("reasoning_config", ROOT / "configs" / "reasoning.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  out = dict(config="configs/reasoning.py", steps=_STEPS.value, warmup=_WARMUP.value, load_before=os.getloadavg())
  for mode in MODES:
    workdir = Path(_DIR.value) / mode
    argv, env = command(mode, str(ROOT / "configs" / "reasoning.py"), workdir, _STEPS.value)
    t0 = time.perf_counter()
    proc = subprocess.run([*argv, "--config.eval.num_examples=0"], env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f"{mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    out[mode] = dict(wall_s=time.perf_counter() - t0, **measure(c, mode, workdir, _WARMUP.value))
    print(f"{mode}: {out[mode]['s_per_token'] * 1e3:.1f} ms per trained token, {out[mode]['step_s']:.1f} s per step, "
          f"completion {out[mode]['completion_len_mean']:.1f} tokens (load {os.getloadavg()[0]:.1f})", flush=True)
  out["speedup_per_token"] = out["sync"]["s_per_token"] / out["pipeline"]["s_per_token"]
  out["speedup_per_step"] = out["sync"]["step_s"] / out["pipeline"]["step_s"]
  out["load_after"] = os.getloadavg()
  print(f"pipeline vs colocated sync: {out['speedup_per_token']:.2f}x per trained token, "
        f"{out['speedup_per_step']:.2f}x per step")
  write_json(_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
