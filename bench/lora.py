r"""Weight publishes with and without LoRA: bytes and seconds per publish, the two side by side.

  JAX_NUM_CPU_DEVICES=2 PYTHONPATH=. .venv/bin/python -m bench.lora          # both parts; JSON: bench/results/lora.json

"publisher": SmolLM2-135M-Instruct's weights (jaxrl-assets smollm2) in one process, the learner on CPU device 0 and
the sampler engine on device 1. One publish as jaxrl-train makes it: WeightPublisher.publish (the cast to the
sampler's dtype, then the copy onto the sampler's shardings) and the sampler's Engine.place (with LoRA: the adapters
put onto the base the engine holds), waited for. Full model and LoRA adapters (rank --rank, every projection)
alternate --reps times; medians and the ratio.

"pipeline": the tiny config as a two-process job (jaxrl.distributed.launch: a learner process and a sampler process,
each one CPU device, the weights crossing through the job's cross-process transfer), run to --steps with and
without model.lora on a wider tiny model (--hidden). Per publish: the bytes it moves (the routes' arrays) and, from
the run's metrics.jsonl after the first step, the learner's publish_s (replicating and cutting the version for the
sampler's layout) and the sampler's update seconds (sampler/update_seconds: taking it on, KV recompute included).
The Ferry's copy between the processes runs on its own thread and is not timed apart.

"decode": what the sampler pays for running base + adapters (the decoder merges W + s A @ B at every weight read,
each decode step): SmolLM2-135M's shapes, one CPU device, --slots slots generating --new_tokens tokens each with the
real Sampler, plain model vs LoRA model on the same base, alternated --reps times; median tokens per second.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nbytes(tree) -> int:
  import jax

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def publisher_part(rank: int, reps: int) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jaxrl.assets import smollm2_path
  from jaxrl.controller.weights import WeightPublisher
  from jaxrl.models import Decoder, hf, lora
  from jaxrl.sampler import make_engine
  from jaxrl.sharding import make_mesh

  learner, sampler = make_mesh({"data": 1}, jax.devices()[:1]), make_mesh({"data": 1}, jax.devices()[1:2])
  path = smollm2_path()
  cfg = hf.load_config(path, lora=lora.LoRAConfig(rank, 2.0 * rank))
  plain, _, base = hf.load_params(path, cfg.replace(lora=None))
  base = jax.device_put(base, learner.devices.flat[0])
  _, adapters = lora.init_adapters(lambda: Decoder(cfg, nnx.Rngs(0)))
  adapters = jax.device_put(adapters, learner.devices.flat[0])
  full_engine = make_engine(plain, sampler, max_slots=4, max_len=64)
  lora_engine = make_engine(cfg, sampler, max_slots=4, max_len=64)
  lora_engine.hold_base(base)
  full_pub = WeightPublisher(full_engine.param_shardings, full_engine.dtype)
  lora_pub = WeightPublisher(lora_engine.publish_shardings, lora_engine.dtype)

  def publish(pub, engine, params, version):
    t0 = time.perf_counter()
    moved = pub.publish(params, version)
    jax.block_until_ready(engine.place(moved.params, version).params)
    return time.perf_counter() - t0, nbytes(moved.params)

  full_s, lora_s = [], []
  for v in range(1, reps + 2):  # the first of each compiles nothing but warms the allocator: not counted
    f, full_bytes = publish(full_pub, full_engine, base, v)
    lo, lora_bytes = publish(lora_pub, lora_engine, adapters, v)
    if v > 1:
      full_s.append(f)
      lora_s.append(lo)
  out = dict(model="SmolLM2-135M-Instruct", rank=rank, targets=cfg.lora.targets,
             dtype=jnp.dtype(full_engine.dtype).name,
             full_bytes=full_bytes, lora_bytes=lora_bytes, bytes_ratio=full_bytes / lora_bytes,
             full_s=statistics.median(full_s), lora_s=statistics.median(lora_s), full_s_all=full_s, lora_s_all=lora_s)
  out["seconds_ratio"] = out["full_s"] / out["lora_s"]
  return out


def decode_part(rank: int, reps: int, slots: int, new_tokens: int) -> dict:
  import jax
  import numpy as np
  from flax import nnx

  from jaxrl.assets import smollm2_path
  from jaxrl.models import Decoder, hf, lora
  from jaxrl.sampler import Sampler, make_engine
  from jaxrl.sharding import make_mesh

  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  path = smollm2_path()
  cfg = hf.load_config(path, lora=lora.LoRAConfig(rank, 2.0 * rank))
  plain, _, base = hf.load_params(path, cfg.replace(lora=None))
  adapters = lora.init_adapters(lambda: Decoder(cfg, nnx.Rngs(0)))[1]
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)  # nonzero B: the merge does real work
  max_len = 16 + new_tokens
  engines = {"full": make_engine(plain, mesh, max_slots=slots, max_len=max_len, steps_per_call=8),
             "lora": make_engine(cfg, mesh, max_slots=slots, max_len=max_len, steps_per_call=8)}
  engines["lora"].hold_base(base)
  samplers = {"full": Sampler(engines["full"], base, eos_token_ids=()),
              "lora": Sampler(engines["lora"], adapters, eos_token_ids=())}

  def tokens_per_s(sampler):
    rng = np.random.default_rng(0)
    for g in range(slots):
      sampler.submit(rng.integers(2, cfg.vocab_size, 12).tolist(), group_id=g, max_tokens=new_tokens)
    t0, n = time.perf_counter(), 0
    while sampler.num_active or sampler.num_waiting:
      n += sum(len(r.completion_tokens) for r in sampler.step())
    return n / (time.perf_counter() - t0)

  rates = {name: [] for name in samplers}
  for i in range(reps + 1):  # the first round compiles: not counted
    for name, sampler in samplers.items():
      rate = tokens_per_s(sampler)
      if i:
        rates[name].append(rate)
  out = dict(model="SmolLM2-135M-Instruct", rank=rank, slots=slots, new_tokens=new_tokens,
             full_tokens_per_s=statistics.median(rates["full"]), lora_tokens_per_s=statistics.median(rates["lora"]),
             all=rates)
  out["lora_over_full"] = out["lora_tokens_per_s"] / out["full_tokens_per_s"]
  return out


def _pipeline_config(hidden: int):
  sys.path.insert(0, str(ROOT / "configs"))
  import tiny

  c = tiny.get_config("pipeline")
  c.model.tiny.update(dict(hidden_size=hidden, intermediate_size=4 * hidden, num_layers=4, num_heads=hidden // 32,
                           num_kv_heads=hidden // 64, head_dim=32))
  return c


def pipeline_run(workdir: Path, steps: int, hidden: int, lora_on: bool, rank: int) -> dict:
  import jax
  import numpy as np

  from jaxrl.controller.build import lora_config, model_source
  from jaxrl.metrics import read_jsonl
  from jaxrl.models import hf, lora

  tiny_flags = [f"--config.model.tiny.{k}={v}" for k, v in _pipeline_config(hidden).model.tiny.items()]
  lora_flags = [f"--config.model.lora.enabled={lora_on}", f"--config.model.lora.rank={rank}",
                f"--config.model.lora.alpha={2.0 * rank}"]
  argv = [sys.executable, "-m", "jaxrl.distributed.launch", "--num_processes=2", "--devices_per_process=1",
          "--timeout_s=900", "--", f"--config={ROOT / 'configs' / 'tiny.py'}", f"--workdir={workdir}",
          f"--config.num_steps={steps}", "--config.mesh.sampler_devices=1", "--config.log.tensorboard=False",
          "--config.log.progress=False", *tiny_flags, *lora_flags]
  t0 = time.perf_counter()
  proc = subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"pipeline run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  wall = time.perf_counter() - t0
  records = read_jsonl(workdir / "metrics.jsonl")[1:]
  c = _pipeline_config(hidden)
  c.model.lora.update(dict(enabled=lora_on, rank=rank, alpha=2.0 * rank))
  cfg = model_source(c.model, c.sampler.max_len)[0]
  abstract = hf.abstract_params(cfg)[1]
  moved = lora.split(abstract)[0] if lora_config(c.model.lora) is not None else abstract
  updates = [r["sampler/update_seconds"] for r in records]
  return dict(lora=lora_on, params=sum(x.size for x in jax.tree.leaves(abstract)), publish_bytes=nbytes(moved),
              publish_s=float(np.median([r["publish_s"] for r in records])),
              sampler_update_s=float(np.median(updates)), step_s=float(np.median([r["step_time_s"] for r in records])),
              reward_first=records[0]["reward_mean"], reward_last=records[-1]["reward_mean"], wall_s=wall)


def main(argv=None):
  from absl import app, flags

  flags.DEFINE_integer("rank", 8, "LoRA rank (every projection adapted)")
  flags.DEFINE_integer("reps", 5, "publishes of each kind (publisher part)")
  flags.DEFINE_integer("steps", 8, "learner steps of each pipeline run")
  flags.DEFINE_integer("hidden", 256, "width of the pipeline part's tiny model (4 layers)")
  flags.DEFINE_integer("slots", 8, "decode slots (decode part)")
  flags.DEFINE_integer("new_tokens", 64, "tokens each slot generates per round (decode part)")
  flags.DEFINE_string("parts", "publisher,pipeline,decode", "which parts to run")
  flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "lora.json"), "JSON report")

  def _main(argv):
    from bench.common import write_json

    fl = flags.FLAGS
    report = dict(load_average_start=os.getloadavg(), cpu_count=os.cpu_count())
    parts = fl.parts.split(",")
    if "publisher" in parts:
      p = publisher_part(fl.rank, fl.reps)
      report["publisher"] = p
      print(f"publisher (SmolLM2-135M, rank {p['rank']}, {p['dtype']}): full {p['full_bytes'] / 2**20:.1f} MiB "
            f"{p['full_s'] * 1e3:.1f} ms, LoRA {p['lora_bytes'] / 2**20:.2f} MiB {p['lora_s'] * 1e3:.2f} ms: "
            f"bytes x{p['bytes_ratio']:.1f}, seconds x{p['seconds_ratio']:.1f}")
    if "pipeline" in parts:
      with tempfile.TemporaryDirectory() as tmp:
        runs = [pipeline_run(Path(tmp) / f"run{int(on)}", fl.steps, fl.hidden, on, fl.rank) for on in (False, True)]
      full, low = runs
      report["pipeline"] = dict(runs=runs, hidden=fl.hidden, steps=fl.steps,
                                bytes_ratio=full["publish_bytes"] / low["publish_bytes"],
                                publish_s_ratio=full["publish_s"] / low["publish_s"],
                                sampler_update_s_ratio=full["sampler_update_s"] / low["sampler_update_s"])
      for r in runs:
        print(f"pipeline ({'LoRA' if r['lora'] else 'full'}, {r['params']} params): {r['publish_bytes'] / 2**20:.2f} "
              f"MiB per publish, learner publish_s {r['publish_s'] * 1e3:.2f} ms, sampler update "
              f"{r['sampler_update_s'] * 1e3:.2f} ms, step {r['step_s']:.3f} s")
      pr = report["pipeline"]
      print(f"pipeline ratios full/LoRA: bytes x{pr['bytes_ratio']:.1f}, publish_s x{pr['publish_s_ratio']:.2f}, "
            f"sampler update x{pr['sampler_update_s_ratio']:.2f}")
    if "decode" in parts:
      d = decode_part(fl.rank, fl.reps, fl.slots, fl.new_tokens)
      report["decode"] = d
      print(f"decode (SmolLM2-135M, {d['slots']} slots): full {d['full_tokens_per_s']:.1f} tok/s, LoRA "
            f"{d['lora_tokens_per_s']:.1f} tok/s: LoRA / full x{d['lora_over_full']:.2f}")
    report["load_average_end"] = os.getloadavg()
    write_json(fl.out, report)

  app.run(_main, argv)


if __name__ == "__main__":
  main()
