"""What checkpoint integrity costs: a save and a restore with jaxrl's Checkpointer (array checksums on the devices,
a commit marker with every file's CRC-32, verification on restore) against Orbax alone, side by side.

    JAX_NUM_CPU_DEVICES=2 .venv/bin/python -m bench.checkpoint                 # ~32M params + Adam moments
    JAX_NUM_CPU_DEVICES=2 .venv/bin/python -m bench.checkpoint --params_m=4    # a quick look

A TrainState of random float32 params (8 matrices) with Adam moments, on one CPU device. Each round saves and
restores once with each (alternating which goes first), into fresh folders; medians over rounds. The integrity
work is also timed alone (the checksum pass over the arrays, the CRC pass over the files). Writes
bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

from jaxrl import integrity
from jaxrl.checkpoint import Checkpointer, _abstract_savable, _savable
from jaxrl.learner import init_train_state

RECORD = {"next_group_id": 1234, "ledger": {"samples_trained": 4096}}


def make_state(params_m: float):
  side = int((params_m * 1e6 / 8) ** 0.5)
  keys = jax.random.split(jax.random.key(0), 8)
  params = {f"w{i}": jax.random.normal(k, (side, side), jnp.float32) for i, k in enumerate(keys)}
  return init_train_state(params, optax.adam(1e-3), rng=0)


def abstract_of(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def orbax_round(state, directory: pathlib.Path) -> tuple[float, float]:
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=None))
  t0 = time.perf_counter()
  manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_savable(state)),
                                          record=ocp.args.JsonSave(RECORD)))
  manager.wait_until_finished()
  t1 = time.perf_counter()
  target = ocp.args.StandardRestore(_abstract_savable(abstract_of(state)))
  out = manager.restore(1, args=ocp.args.Composite(state=target, record=ocp.args.JsonRestore()))
  jax.block_until_ready(out["state"])
  t2 = time.perf_counter()
  manager.close()
  return t1 - t0, t2 - t1


def jaxrl_round(state, directory: pathlib.Path) -> tuple[float, float]:
  ck = Checkpointer(directory, max_to_keep=3)
  t0 = time.perf_counter()
  ck.save(1, state, RECORD)
  ck.wait()
  t1 = time.perf_counter()
  restored, _ = ck.restore(abstract_of(state))
  jax.block_until_ready(restored)
  t2 = time.perf_counter()
  ck.close()
  return t1 - t0, t2 - t1


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--params_m", type=float, default=32.0, help="millions of params (Adam adds twice that)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="bench/results/checkpoint.json")
  opts = parser.parse_args()
  state = make_state(opts.params_m)
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(_savable(state)))
  times = {k: [] for k in ("orbax_save", "orbax_restore", "jaxrl_save", "jaxrl_restore", "checksums", "file_crc")}
  root = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl-bench-ckpt-"))
  try:
    integrity.to_hex(integrity.array_checksums(_savable(state)))  # compile once
    for r in range(opts.rounds):
      order = [("orbax", orbax_round), ("jaxrl", jaxrl_round)]
      for name, fn in order if r % 2 == 0 else order[::-1]:
        save, restore = fn(state, root / f"{name}{r}")
        times[f"{name}_save"].append(save)
        times[f"{name}_restore"].append(restore)
      t0 = time.perf_counter()
      integrity.to_hex(integrity.array_checksums(_savable(state)))
      t1 = time.perf_counter()
      integrity.file_table(root / f"jaxrl{r}" / "1")
      times["checksums"].append(t1 - t0)
      times["file_crc"].append(time.perf_counter() - t1)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  med = {k: statistics.median(v) for k, v in times.items()}
  result = {"params_m": opts.params_m, "state_mib": state_bytes / 2**20, "rounds": opts.rounds,
            "median_s": med, "save_ratio": med["jaxrl_save"] / med["orbax_save"],
            "restore_ratio": med["jaxrl_restore"] / med["orbax_restore"],
            "load": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
  print(f"state {result['state_mib']:.0f} MiB; median of {opts.rounds} rounds")
  for k, v in med.items():
    print(f"  {k:14s} {v:7.3f} s")
  print(f"save: jaxrl / orbax = {result['save_ratio']:.2f}; restore: jaxrl / orbax = {result['restore_ratio']:.2f}")
  pathlib.Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(opts.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
