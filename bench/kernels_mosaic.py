"""The Pallas TPU kernels compiled by Mosaic for TPU slices, deviceless (libtpu on this CPU host: no TPU runs them):
compile time and compiled memory per chip of the splash training attention (forward + backward) and the paged
decode attention at real models' shapes, each in shard_map over a multi-chip mesh (issue 41, item 4).

    nice -n 19 .venv/bin/python -m bench.kernels_mosaic

Writes bench/results/kernels_mosaic.json; docs/KERNELS.md has the table. Compile times are this 2-core box's
(shared, niced), the memory figures the compiler's memory_analysis() per chip. With --train_steps instead:
Qwen2.5-7B's whole train step (remat, bf16 compute, f32 master weights, AdamW; 32 rows x 4096 tokens) on
v5p:4x4x2, splash (fsdp 32; fsdp 8 x tensor 4) against the chunked XLA attention (fsdp 32), about 10 minutes
(bench/results/kernels_mosaic_steps.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold libtpu's lock file

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxrl.kernels import paged_attention  # noqa: E402
from jaxrl.kernels.train_attention import splash_attention  # noqa: E402
from jaxrl.sharding import make_mesh  # noqa: E402

MIB = 2**20
# (model, topology, rows, tokens, q heads, kv heads, head dim): the learner's attention, rows over fsdp, heads
# over tensor (2).
SPLASH = [("qwen2.5-0.5b", "v5e:2x2", 4, 4096, 14, 2, 64), ("qwen2.5-7b", "v5e:2x2", 4, 4096, 28, 4, 128),
          ("qwen2.5-7b", "v5p:4x4x2", 32, 32768, 28, 4, 128), ("llama-3.1-8b", "v5p:2x2x1", 4, 8192, 32, 8, 128)]
# (model, topology, slots, kv heads, q heads per kv head, head dim, layers, pages, page size, pages per slot): the
# sampler's decode step, slots over data, kv heads over tensor (2).
PAGED = [("qwen2.5-7b", "v5e:2x2", 64, 4, 7, 128, 28, 4096, 16, 128),
         ("qwen2.5-7b", "v5p:2x2x1", 128, 4, 7, 128, 28, 8192, 64, 64),
         ("llama-3.1-8b", "v5e:2x2", 64, 8, 4, 128, 32, 2048, 32, 64)]


def compile_on(mesh, fn, args) -> dict:
  t = time.perf_counter()
  with jax.set_mesh(mesh):
    exe = jax.jit(fn).lower(*args).compile()
  m = exe.memory_analysis()
  return {"compile_s": round(time.perf_counter() - t, 2),
          "mosaic_calls": exe.as_text().count('custom_call_target="tpu_custom_call"'),
          "arguments_mib": m.argument_size_in_bytes / MIB, "outputs_mib": m.output_size_in_bytes / MIB,
          "temporaries_mib": m.temp_size_in_bytes / MIB}


def mesh_of(topology: str, batch_axis: str):
  return make_mesh({batch_axis: -1, "tensor": 2}, topologies.get_topology_desc(topology_name=topology,
                                                                               platform="tpu").devices)


def splash_case(topology, rows, t, h, kv, d, dtype) -> dict:
  mesh = mesh_of(topology, "fsdp")
  x = lambda heads: jax.ShapeDtypeStruct((rows, t, heads, d), dtype,
                                         sharding=NamedSharding(mesh, P("fsdp", None, "tensor")))
  seg = jax.ShapeDtypeStruct((rows, t), jnp.int32, sharding=NamedSharding(mesh, P("fsdp")))
  loss = lambda q, k, v, s: jnp.sum(splash_attention(q, k, v, s).astype(jnp.float32) ** 2)
  return compile_on(mesh, jax.grad(loss, argnums=(0, 1, 2)), (x(h), x(kv), x(kv), seg))


def paged_case(topology, slots, kv, g, d, layers, pages, z, per_slot, dtype) -> dict:
  mesh = mesh_of(topology, "data")
  on = lambda spec: NamedSharding(mesh, spec)
  pool = jax.ShapeDtypeStruct((kv, layers, pages, z, d), dtype, sharding=on(P("tensor")))
  ints = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=on(spec))
  args = (jax.ShapeDtypeStruct((slots, 1, kv, g, d), dtype, sharding=on(P("data", None, "tensor"))), pool, pool,
          ints((), P()), ints((slots, per_slot), P("data")), ints((slots, 1), P("data")))
  attend = lambda q, k, v, n, table, pos: paged_attention(q, k, v, n, table, pos, impl="pallas_tpu", layout="KNPZD")
  return compile_on(mesh, attend, args)


def train_step_case(topology: str, attention: str, axes: dict, rows: int = 32, seq_len: int = 4096) -> dict:
  from jaxrl.learner import StepConfig, init_train_state, jit_train_step, make_optimizer, train_state_shardings
  from jaxrl.models import ModelConfig, hf
  from jaxrl.rollout import make_batch
  from jaxrl.sharding import LEARNER_RULES, batch_sharding, param_shardings

  # Qwen2.5-7B's published shape (no weights are read).
  cfg = ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                    num_kv_heads=4, head_dim=128, attention_bias=True, rope_theta=1e6, architecture="qwen2",
                    max_position_embeddings=32768, dtype="bfloat16", remat=True, train_attention=attention)
  mesh = make_mesh(axes, topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
  graphdef, abstract = hf.abstract_params(cfg)
  opt = make_optimizer(1e-6, warmup_steps=1, decay_steps=100)
  state_sh = train_state_shardings(abstract, opt, param_shardings(abstract, mesh, LEARNER_RULES), mesh)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(lambda p: init_train_state(p, opt), abstract), state_sh)
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, batch_size=rows, seq_len=seq_len,
                                   batch_sharding=batch_sharding(mesh, LEARNER_RULES), logprob_chunk=1024), state_sh)
  t = time.perf_counter()
  exe = step.lower(state, jax.eval_shape(lambda: make_batch([], rows, seq_len)),
                   jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile()
  m = exe.memory_analysis()
  return {"model": "qwen2.5-7b", "topology": topology, "axes": axes, "attention": attention, "rows": rows,
          "seq_len": seq_len, "compile_s": round(time.perf_counter() - t, 1),
          "mosaic_calls": exe.as_text().count('custom_call_target="tpu_custom_call"'),
          "arguments_gib": m.argument_size_in_bytes / 2**30, "temporaries_gib": m.temp_size_in_bytes / 2**30}


def train_steps(out: str):
  rows = []
  for attention, axes in (("splash", {"fsdp": -1}), ("splash", {"fsdp": -1, "tensor": 4}), ("chunked", {"fsdp": -1})):
    rows.append(train_step_case("v5p:4x4x2", attention, axes))
    print(json.dumps(rows[-1]), flush=True)
  pathlib.Path(out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1) + "\n")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="bench/results/kernels_mosaic.json")
  parser.add_argument("--train_steps", action="store_true", help="Qwen2.5-7B's train step instead (--out "
                      "defaults to bench/results/kernels_mosaic_steps.json)")
  args = parser.parse_args()
  if args.train_steps:
    return train_steps(args.out.replace(".json", "_steps.json"))
  rows = []
  for dtype in (jnp.float32, jnp.bfloat16):
    name = jnp.dtype(dtype).name
    for model, topology, *shape in SPLASH:
      r = {"kernel": "splash fwd+bwd", "model": model, "topology": topology, "dtype": name,
           "shape": dict(zip(("rows", "tokens", "q_heads", "kv_heads", "head_dim"), shape, strict=True)),
           **splash_case(topology, *shape, dtype)}
      rows.append(r)
      print(json.dumps(r), flush=True)
    for model, topology, *shape in PAGED:
      r = {"kernel": "paged decode", "model": model, "topology": topology, "dtype": name,
           "shape": dict(zip(("slots", "kv_heads", "groups", "head_dim", "layers", "pages", "page_size",
                              "pages_per_slot"), shape, strict=True)), **paged_case(topology, *shape, dtype)}
      rows.append(r)
      print(json.dumps(r), flush=True)
  pathlib.Path(args.out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
