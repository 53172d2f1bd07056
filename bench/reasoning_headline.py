r"""The real-model headline on the reasoning workload: configs/reasoning.py (SmolLM2-135M-Instruct, chain of thought,
natural lengths up to 96 tokens) run as bench/headline.py runs its workloads -- colocated sync (one process on both
cores) and the pipeline (a learner process and a sampler process on a core each) -- one after the other, same
config and seed, held-out evaluation off; seconds per trained token and per step after the warm-up steps.

  PYTHONPATH=. .venv/bin/python -m bench.reasoning_headline --steps=10 --warmup=2
  PYTHONPATH=. .venv/bin/python -m bench.reasoning_headline --variant=long --steps=6 --auto --auto_steps=13 \
      --out=bench/results/reasoning_headline_long.json      # 256 tokens to think; mode=auto beside the fixed modes

--auto also runs mode=auto through the launcher (bench/headline.py: sync segments colocated, pipeline segments as
two processes), with a measuring segment of 5 steps and re-check segments of 4; reported after its measuring
segment.
"""

from __future__ import annotations

import os
from pathlib import Path

from absl import app, flags

from bench.common import write_json
from bench.headline import AUTO, MODES, ROOT, measure, ratios, run

_STEPS = flags.DEFINE_integer("steps", 10, "learner steps per run")
_WARMUP = flags.DEFINE_integer("warmup", 2, "steps left out of the measurement")
_OUT = flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "reasoning_headline.json"), "JSON results path")
_DIR = flags.DEFINE_string("dir", "/tmp/jaxrl-reasoning-headline", "the runs' workdirs")
_VARIANT = flags.DEFINE_string("variant", "", "configs/reasoning.py's argument besides the mode: '' or 'long'")
_AUTO = flags.DEFINE_bool("auto", False, "also run mode=auto (through the launcher)")
_AUTO_STEPS = flags.DEFINE_integer("auto_steps", 13, "mode=auto's steps (a 5-step sync segment, then 4-step ones)")


def main(argv):
  del argv
  import importlib.util

  spec = importlib.util.spec_from_file_location("reasoning_config", ROOT / "configs" / "reasoning.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(",".join(w for w in ("auto" if _AUTO.value else "", _VARIANT.value) if w))
  config = f"{ROOT / 'configs' / 'reasoning.py'}:{_VARIANT.value}" if _VARIANT.value else str(ROOT / "configs" /
                                                                                               "reasoning.py")
  out = dict(config=config, steps=_STEPS.value, warmup=_WARMUP.value, load_before=os.getloadavg())
  cache = Path(_DIR.value) / "compilation_cache"  # the auto run's segments reuse what the fixed runs compiled
  for mode in (*MODES, AUTO) if _AUTO.value else MODES:
    workdir = Path(_DIR.value) / mode
    steps = _AUTO_STEPS.value if mode == AUTO else _STEPS.value
    extra = ["--config.eval.num_examples=0"]
    if mode == AUTO:
      extra += ["--config.auto.measure_steps=5", "--config.auto.recheck_steps=4"]
    wall = run(mode, config, workdir, steps, cache, tuple(extra))
    out[mode] = dict(wall_s=wall, **measure(c, mode, workdir, _WARMUP.value))
    print(f"{mode}: {out[mode]['s_per_token'] * 1e3:.1f} ms per trained token, {out[mode]['step_s']:.1f} s per step, "
          f"completion {out[mode]['completion_len_mean']:.1f} tokens (load {os.getloadavg()[0]:.1f})", flush=True)
  out.update(ratios(out), load_after=os.getloadavg())
  print(f"pipeline vs colocated sync: {out['speedup_per_token']:.2f}x per trained token, "
        f"{out['speedup_per_step']:.2f}x per step")
  if _AUTO.value:
    print(f"auto ({','.join(ch for _, _, ch in out[AUTO]['choices'])}) after its measuring segment: "
          f"{out['auto_vs_best']:.2f}x the better fixed mode, {out['auto_vs_sync']:.2f}x sync per trained token "
          f"(whole run: {out['auto_whole_run_vs_best']:.2f}x)")
  write_json(_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
