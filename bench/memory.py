"""Where the main job's memory goes: the compiled train step's buffers per setting, and what a checkpoint's
array checksums hold, side by side in one process (issue 14).

    JAX_NUM_CPU_DEVICES=2 .venv/bin/python -m bench.memory

The train step is configs/default.py's (SmolLM2-135M-Instruct, 16 x 80 tokens, 2 mini-batches), lowered from
abstract shapes (no weights are loaded) with model.remat, rl.logprob_chunk, rl.atomic_step and the optimizer (optax's
AdamW chain or make_optimizer's AdamW, both applied by the step's apply_update) varied; `memory_analysis()` gives
its arguments (the donated TrainState) and temporaries. The checksums compare the blocked pass
(jaxrl.integrity) with the whole-array formula it replaced, on the same state shapes (temporaries compiled, time
measured on the params alone). Peak RSS of the whole job is measured separately with /usr/bin/time -v (the command
is in docs/BENCHMARKS.md, "The main job's memory"). Writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp

from configs.default import get_config
from jaxrl import config as config_lib
from jaxrl import integrity, sharding
from jaxrl.controller import build as build_lib
from jaxrl.learner import StepConfig, jit_train_step
from jaxrl.models import hf
from jaxrl.rollout import Batch

GIB = 2**30


def step_memory(remat: bool, logprob_chunk: int, atomic: bool = True, fused: bool = True) -> dict:
  """Buffers of the main job's compiled train step with these settings (fused=False: optax's AdamW chain instead of
  make_optimizer's AdamW, whose update XLA runs in place)."""
  c = get_config()
  c.model.remat, c.rl.logprob_chunk = remat, logprob_chunk
  c = config_lib.validate(c)
  cfg = build_lib.model_source(c.model, c.sampler.max_len)[0]
  learner_mesh = sharding.make_mesh(c.mesh.learner_axes.to_dict(), sharding.split_devices(1, jax.devices()[:2])[0])
  spec = build_lib.run_spec(c)
  graphdef, abstract = hf.abstract_params(cfg)
  optimizer = build_lib.run_optimizer(c.optimizer, c.rl, c.num_steps)
  state = build_lib.abstract_train_state(c.seed, c.loss, optimizer, abstract, learner_mesh,
                                         adapters=cfg.lora is not None)
  state_sh = jax.tree.map(lambda x: x.sharding, state)
  rows = sharding.batch_sharding(learner_mesh, sharding.LEARNER_RULES)
  loss = dataclasses.replace(c.loss, sampling=spec.sampler.sampling)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=optimizer if fused else optimizer.chain, loss=loss,
                                   batch_size=spec.rl.batch_size, seq_len=c.rl.seq_len,
                                   num_minibatches=c.rl.num_minibatches, batch_sharding=rows,
                                   logprob_chunk=logprob_chunk, atomic=atomic), state_sh)
  bl = lambda dtype: jax.ShapeDtypeStruct((spec.rl.batch_size, c.rl.seq_len), dtype)
  b = lambda dtype: jax.ShapeDtypeStruct((spec.rl.batch_size,), dtype)
  i32, f32 = jnp.int32, jnp.float32
  batch = Batch(bl(i32), bl(i32), bl(i32), bl(f32), bl(f32), bl(i32), b(f32), b(i32), b(f32))
  t = time.perf_counter()
  compiled = step.lower(state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
  m = compiled.memory_analysis()
  return dict(remat=remat, logprob_chunk=logprob_chunk, atomic=atomic, fused_optimizer=fused,
              arguments_gib=m.argument_size_in_bytes / GIB,
              temporaries_gib=m.temp_size_in_bytes / GIB, compile_s=time.perf_counter() - t)


def _whole_array(x):
  """The checksum formula over a whole array at once (before blocking)."""
  bits = integrity._bits_u32(x).ravel()
  weights = jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


def checksum_memory(rounds: int) -> dict:
  c = config_lib.validate(get_config())
  cfg = build_lib.model_source(c.model, c.sampler.max_len)[0]
  params = jax.tree.leaves(hf.abstract_params(cfg)[1])
  state = params * 3  # params and two Adam moments
  out = {"state_gb": sum(x.size * x.dtype.itemsize for x in state) / 1e9}
  real = [jnp.ones(x.shape, x.dtype) for x in params]
  for name, fn in (("blocked", integrity._checksum), ("whole_array", _whole_array)):
    checksums = jax.jit(lambda tree, fn=fn: [fn(x) for x in tree])
    out[f"{name}_temporaries_gib"] = checksums.lower(state).compile().memory_analysis().temp_size_in_bytes / GIB
    jax.block_until_ready(checksums(real))
    times = []
    for _ in range(rounds):
      t = time.perf_counter()
      jax.block_until_ready(checksums(real))
      times.append(time.perf_counter() - t)
    out[f"{name}_params_s"] = min(times)
  out["equal"] = bool(all((jax.jit(integrity._checksum)(x) == jax.jit(_whole_array)(x)).all() for x in real))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="bench/results/memory.json")
  args = parser.parse_args()
  settings = [(False, 0, True, False), (True, 0, True, False), (True, 16, True, False), (True, 0, True, True),
              (True, 0, False, False), (True, 0, False, True)]  # (remat, logprob_chunk, atomic, fused optimizer)
  steps = [step_memory(*setting) for setting in settings]
  for s in steps:
    print(f"train step remat={s['remat']!s:5} logprob_chunk={s['logprob_chunk']:2} atomic={s['atomic']!s:5} "
          f"optimizer={'fused' if s['fused_optimizer'] else 'optax'}: arguments {s['arguments_gib']:.2f} GiB, "
          f"temporaries {s['temporaries_gib']:.2f} GiB (compile {s['compile_s']:.0f} s)")
  sums = checksum_memory(args.rounds)
  print(f"checksums of a {sums['state_gb']:.2f} GB state: temporaries blocked {sums['blocked_temporaries_gib']:.3f} "
        f"GiB, whole-array {sums['whole_array_temporaries_gib']:.2f} GiB; on the params: blocked "
        f"{sums['blocked_params_s']:.3f} s, whole-array {sums['whole_array_params_s']:.3f} s "
        f"({sums['whole_array_params_s'] / sums['blocked_params_s']:.2f}x); equal: {sums['equal']}")
  pathlib.Path(args.out).write_text(json.dumps({"train_step": steps, "checksums": sums}, indent=2))


if __name__ == "__main__":
  main()
