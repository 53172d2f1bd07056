r"""The headline's one-core roles, part by part: what two changes of 2026-12-05 cut from them, each alternative side
by side in one process pinned to one core (as the pipeline's learner and sampler processes are).

  PYTHONPATH=. .venv/bin/python -m bench.headline_parts            # ~1 min; JSON to bench/results/headline_parts.json

1. The learner: configs/bench_headline.py's train step at every packed row bucket, in one chunk
   (rl.microbatch_rows=0) and in chunks of at most 6 rows (the config's setting), both with the layer scan rolled
   (model.scan_unroll=1, the config's), and chunks of 6 with it unrolled (scan_unroll = the model's 4 layers; faster
   here, no gain in the headline's runs: docs/BENCHMARKS_HISTORY.md, "The headline: colocated sync vs pipeline");
   median of `repeats` steps.
2. The sampler's admissions of one group of 4 samples: per sample an eager fold_in of the group key, a device read
   of its key data and an insert (the sampler before), vs the group's keys in one program and one insert_group
   (now); median over `repeats` groups, each into a decode state while no generate call runs.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import write_json

ROOT = Path(__file__).parents[1]


def _median_s(fn, repeats: int) -> float:
  fn()  # compiled and warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def learner_rows(c, repeats: int) -> list[dict]:
  """c: the validated RunConfig."""
  from jaxrl import config as config_lib
  from jaxrl import sharding
  from jaxrl.controller import build as build_lib
  from jaxrl.learner.packing import pack_batch

  mesh = sharding.make_mesh(c.mesh.learner_axes.to_dict(), jax.devices()[:1])
  path = build_lib.model_source(c.model, c.sampler.max_len)[2]
  out, steps = [], {}
  for name, rows, unroll in (("whole", 0, 1), ("chunk_6", 6, 1), ("chunk_6_unrolled", 6, c.model.tiny.num_layers)):
    cc = config_lib.replace(c, rl__microbatch_rows=rows, model__scan_unroll=unroll)
    spec = build_lib.run_spec(cc, build_lib.rows_unit(mesh))
    learner = build_lib.build_learner(mesh, build_lib.model_source(cc.model, cc.sampler.max_len)[0], path, spec,
                                      seed=cc.seed, rl=cc.rl, loss=cc.loss,
                                      optimizer=build_lib.run_optimizer(cc.optimizer, cc.rl, cc.num_steps))
    steps[name] = (learner, spec)
  key = jax.random.key(0)
  for bucket in steps["whole"][1].row_buckets:
    row = dict(rows=bucket)
    for name, (learner, _) in steps.items():
      batch = pack_batch([], c.rl.seq_len, (bucket,), c.rl.max_segments)
      step = learner.train_step.lower(learner.state, batch, key).compile()
      holder = [learner.state]

      def run(step=step, batch=batch, holder=holder):
        holder[0], metrics = step(holder[0], batch, key)
        jax.block_until_ready(holder[0])

      row[f"ms_{name}"] = 1e3 * _median_s(run, repeats)
      learner.state = holder[0]
    row["speedup_chunks"] = row["ms_whole"] / row["ms_chunk_6"]
    row["speedup_both"] = row["ms_whole"] / row["ms_chunk_6_unrolled"]
    out.append(row)
    print(f"train step, {bucket:2d} rows: one chunk {row['ms_whole']:.1f} ms, chunks of <= 6 rows "
          f"{row['ms_chunk_6']:.1f} ms ({row['speedup_chunks']:.2f}x), and unrolled {row['ms_chunk_6_unrolled']:.1f}"
          f" ms ({row['speedup_both']:.2f}x)", flush=True)
  return out


def admissions(c, repeats: int, group: int = 4) -> dict:
  """c: the validated RunConfig."""
  from jaxrl import sharding
  from jaxrl.controller import build as build_lib
  from jaxrl.rollout import SamplingParams
  from jaxrl.sampler.samples import sample_key_data

  model_cfg, _, path = build_lib.model_source(c.model, c.sampler.max_len)
  mesh = sharding.make_mesh(c.mesh.sampler_axes.to_dict(), jax.devices()[:1])
  engine = build_lib.build_engine(c.sampler, model_cfg, mesh)
  _, _, params = build_lib.base_params(c.seed, model_cfg, path,
                                       lambda p: sharding.param_shardings(p, mesh, sharding.SAMPLER_RULES))
  placed = engine.place(params, 0)
  prefix = engine.prefill(placed, np.array([3, 1, 4, 1], np.int32))
  base, sp = jax.random.key(c.seed), SamplingParams()
  holder = [engine.init_decode_state()]
  gid = [0]

  def per_sample():
    gid[0] += 1
    group_key = jax.random.fold_in(base, gid[0])
    for i in range(group):
      settings = engine.slot_settings(jax.random.fold_in(group_key, i), sp, 100)
      holder[0] = engine.insert(prefix, holder[0], i, settings)
    jax.block_until_ready(holder[0])

  def grouped():
    gid[0] += 1
    keys = np.asarray(sample_key_data(base, np.uint32(gid[0]), group))
    settings = [engine.slot_settings(keys[i], sp, 100) for i in range(group)]
    holder[0] = engine.insert_group(prefix, holder[0], list(range(group)), settings)
    jax.block_until_ready(holder[0])

  out = dict(group=group, ms_per_sample_path=1e3 * _median_s(per_sample, repeats),
             ms_grouped=1e3 * _median_s(grouped, repeats))
  out["speedup"] = out["ms_per_sample_path"] / out["ms_grouped"]
  print(f"admitting a group of {group}: per sample {out['ms_per_sample_path']:.2f} ms, grouped "
        f"{out['ms_grouped']:.2f} ms ({out['speedup']:.2f}x)", flush=True)
  return out


def main(argv=None):
  from absl import app, flags

  flags.DEFINE_string("out", str(Path(__file__).parent / "results" / "headline_parts.json"), "JSON results path")
  flags.DEFINE_integer("repeats", 10, "timed calls per alternative")
  flags.DEFINE_integer("core", -1, "the core to pin to (-1: the last one this process may use)")

  def _main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    fl = flags.FLAGS
    core = fl.core if fl.core >= 0 else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})  # before JAX makes its CPU client, which sizes XLA's pool from this mask
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_headline_config", ROOT / "configs" / "bench_headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from jaxrl import config as config_lib

    c = config_lib.validate(module.get_config(""))  # the typed RunConfig (its bench keys are not read here)
    out = dict(core=core, host=platform.node(), load_before=os.getloadavg(), learner=learner_rows(c, fl.repeats),
               admissions=admissions(c, fl.repeats * 10))
    out["load_after"] = os.getloadavg()
    write_json(fl.out, out)

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
