"""jaxrl-compile: every program of a run compiled for a target's chips on this host, from shapes alone: per-chip
memory against the chip's HBM, and FLOPs, bytes and collectives from the compiled programs.

  jaxrl-compile --config=configs/default.py --target=v5e:2x2 --config.model.preset=qwen2.5-0.5b \\
      --config.mesh.num_devices=-1 --config.mesh.sampler_devices=2 --out=report.json

The TPU compiler (libtpu, the `tpu` extra) runs deviceless: jax.experimental.topologies describes the slice's chips,
the run splits them as it would (mesh.sampler_devices; a multi-host slice as jaxrl.distributed does, whole hosts per
side, one sampler replica per host), and the run's own builders (controller.build, the sampler engines) make its
programs on abstract inputs (jax.ShapeDtypeStruct with NamedShardings): the learner's train step for every batch
shape, the sampler's prefill, insert, decode and in-flight recompute, and the publish's cast. No weights, no
allocation, no TPU ran any of it: the memory is the compiler's, the times are datasheet rooflines of its counts.

`compile_run(config, target)` is the same from a notebook; it returns the report (a dict). Exit status 2 with one
line when a program does not fit, naming it, the bytes over and the settings that would shrink it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import compile_efficiency, hlo, platforms
from jaxrl import config as config_lib
from jaxrl.controller import build as build_lib
from jaxrl.controller import sides
from jaxrl.distributed import cli, runtime
from jaxrl.distributed.job import roles
from jaxrl.kernels.train_attention import default_implementation
from jaxrl.learner.step import batch_shardings, batch_shards, chunk_count, fixed_param_pass_count
from jaxrl.models import hf, lora, quant
from jaxrl.rollout import SamplingParams
from jaxrl.settings import RunConfig
from jaxrl.sim.hardware import GiB, Hardware, preset

TPU_CHIPS = {"v5e": "tpu_v5e", "v5p": "tpu_v5p", "v6e": "tpu_v6e"}  # a topology's prefix -> sim.hardware's chip
# The decode attention a TPU target compiles with while the Pallas paged kernel is not compiled for it (docs/TPU.md):
# the XLA one. The learner's "auto" is compiled as is: splash, the Mosaic kernel in shard_map.
TPU_DECODE_ATTENTION = "xla"

class CompileError(ValueError):
  """A target or config that cannot be compiled, in one line."""


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  devices: tuple
  chip: Hardware
  platform: str


def target(name: str) -> Target:
  """The chips of a TPU topology ("v5e:2x2", "v5p:4x4x2", "v6e:4x4", ...) as libtpu describes them."""
  if name.startswith("gpu:"):
    raise CompileError(f"--target={name}: a deviceless GPU compile needs a CUDA jaxlib plugin whose topology API "
                       "works without a GPU; jax-cuda12-plugin 0.12.0.1's says 'No visible GPU devices' (docs/TPU.md), "
                       "so compile on the GPU host (jaxrl-profile, bench/device) instead")
  generation, _, shape = name.partition(":")
  if generation not in TPU_CHIPS or not re.fullmatch(r"[0-9]+(x[0-9]+)*", shape):
    raise CompileError(f"--target={name!r}: a TPU topology like 'v5e:2x2', 'v5p:4x4x2' or 'v6e:4x4' "
                       f"(chips: {sorted(TPU_CHIPS)})")
  platforms.tpu_compiler_env(generation, shape)
  from jax.experimental import topologies

  try:
    devices = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
  except Exception as e:  # noqa: BLE001 - libtpu's errors are RuntimeErrors and XlaRuntimeErrors of many texts
    raise CompileError(f"--target={name!r}: libtpu cannot describe it: {str(e).splitlines()[0]}") from None
  return Target(name, tuple(devices), preset(TPU_CHIPS[generation]), "tpu")


def for_target(c: RunConfig, tgt: Target) -> RunConfig:
  """The config as the target runs it: on TPU, the sampler's "auto" attention is TPU_DECODE_ATTENTION."""
  if tgt.platform == "tpu" and c.sampler.attention == "auto":
    c = config_lib.replace(c, sampler__attention=TPU_DECODE_ATTENTION)
  return c

def split(c: RunConfig, devices) -> sides.Roles:
  """The run's roles on the target's chips, as the run makes them: one process's split (jaxrl.train), or on a
  multi-host slice jaxrl.distributed's (whole hosts per side, one sampler replica per host)."""
  pool = list(devices) if c.mesh.num_devices == -1 else list(devices)[: c.mesh.num_devices]
  if len({d.process_index for d in pool}) == 1:
    return sides.Roles.single(c.mesh, pool)
  try:
    topology = runtime.Topology.split(c.mesh.sampler_devices, pool, 0)
  except ValueError as e:
    raise CompileError(f"config: mesh.sampler_devices={c.mesh.sampler_devices} on {len(pool)} chips of "
                       f"{len({d.process_index for d in pool})} hosts: {e}") from None
  cli.validate_job(c, topology.devices_per_process())
  return roles(topology)


def _abstract(tree, shardings):
  """tree's arrays as ShapeDtypeStructs placed by `shardings` (a tree with the same leaves, NamedShardings)."""
  leaves, treedef = jax.tree.flatten(tree)
  placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  if len(leaves) != len(placed):
    raise ValueError(f"{len(leaves)} arrays but {len(placed)} shardings")
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                      for x, s in zip(leaves, placed, strict=True)])


def per_device_bytes(tree) -> int:
  """Bytes one device holds of abstract arrays (its shard of each; replicated ones whole)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * x.dtype.itemsize  # a key dtype has one too (np.dtype does not know it)
  return total


def _host(mesh, shape=(), dtype=jnp.int32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


@dataclasses.dataclass
class Program:
  """One compiled program: its lowering's inputs grouped by what they are, and what it holds besides them."""

  name: str
  side: str  # "learner" | "sampler"
  fn: Any  # a jitted function
  args: tuple
  static: tuple = ()
  groups: dict = dataclasses.field(default_factory=dict)  # {"params": tree, ...}: per-device bytes by kind
  resident: dict = dataclasses.field(default_factory=dict)  # {kind: bytes} held on the chip, not an input
  per_call: int = 1  # steps one call runs (decode: steps_per_call)


def learner_programs(c: RunConfig, mesh, model_cfg) -> tuple[list[Program], dict]:
  """The train step for every batch shape of the run (packed row buckets, or the padded batch), and the publish's
  cast (int8: quantization) of the params on the learner before they are sent."""
  spec = build_lib.run_spec(c, build_lib.rows_unit(mesh))
  graphdef, abstract = hf.abstract_params(model_cfg)
  params, frozen = lora.split(abstract) if model_cfg.lora is not None else (abstract, None)
  optimizer = build_lib.run_optimizer(c.optimizer, c.rl, c.num_steps)
  step = build_lib.learner_step(c.rl, c.loss, optimizer, mesh, graphdef, params, spec, frozen)
  state = _abstract(build_lib.abstract_init_state(c.seed, c.loss, optimizer, params, frozen), step.state_shardings)
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=NamedSharding(mesh, P()))
  batch_sh = batch_shardings(step.batch_sharding)
  groups = dict(params=state.params, opt_state=state.opt_state, frozen=state.frozen, ref_params=state.ref_params)
  programs = []
  for empty in build_lib.train_step_batches(spec, c.rl.seq_len):
    batch = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=s),
                         batch_sh.replace(experts_BxLxNxK=batch_sh.experts_BxLxNxK if empty.experts_BxLxNxK
                                          is not None else None), empty)
    rows = np.shape(empty.tokens_BxL)[0]
    name = "train_step" + (f"[{rows} rows]" if spec.rl.pack else "")
    programs.append(Program(name, "learner", step.train_step, (state, batch, key), groups=dict(groups, batch=batch)))
  shards = batch_shards(step.batch_sharding)
  updates = spec.rl.num_minibatches * c.rl.num_epochs
  info = dict(spec=spec, state=state, param_count=sum(math.prod(x.shape) for x in jax.tree.leaves(abstract)),
              trained_params=state.params, updates=updates, fixed_passes=fixed_param_pass_count(c.loss, updates),
              row_shards=shards, chunks=chunk_count(spec.rl.batch_size // (spec.rl.num_minibatches * shards), 1,
                                                    c.rl.microbatch_rows),
              trained_param_bytes=sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.params)))
  return programs, info


def publish_program(c: RunConfig, mesh, state, engine) -> Program:
  """The publish's work on the learner: the trained params (a LoRA run's adapters) cast to the sampler's dtype, or
  quantized for an int8 sampler, in the learner's layout; then sent (a transfer, not a program)."""
  params = state.params
  in_sh = jax.tree.map(lambda x: x.sharding, params)
  if engine.weight_dtype == "int8":
    fn = lambda p: quant.quantize_params(p, engine.dtype)  # noqa: E731
    out_sh = quant.quantized_shardings(build_lib._param_shardings(mesh)(params), params)
  else:
    fn = lambda p: jax.tree.map(lambda x: x.astype(engine.dtype), p)  # noqa: E731
    out_sh = in_sh
  others = per_device_bytes(state) - per_device_bytes(params)
  return Program("publish_cast", "learner", jax.jit(fn, out_shardings=out_sh), (params,), groups=dict(params=params),
                 resident=dict(train_state=others))


def sampler_programs(c: RunConfig, engine) -> tuple[list[Program], dict]:
  """Prefill (the run's longest prompt's bucket), insert, generate (the full row bucket) and the in-flight update's
  recompute (sampler.on_update="recompute"; "keep_kv" and "finish" recompute nothing) on one sampler replica."""
  mesh = engine.mesh
  graphdef, abstract = hf.abstract_params(engine.cfg)
  if engine.weight_dtype == "int8":
    abstract = jax.eval_shape(lambda p: quant.quantize_params(p, engine.dtype), abstract)
  params = _abstract(abstract, engine.param_shardings)
  state = _abstract(jax.eval_shape(engine.init_decode_state), engine.decode_state_shardings())
  prompt = engine.bucket(min(c.task.max_prompt_tokens, engine.max_len - 1))
  tokens, length = _host(mesh, (prompt,)), _host(mesh)
  prefix = jax.eval_shape(engine._prefill, params, tokens, length).replace(version=0)  # placed as prefill puts it
  kv = dict(params=params, kv=state.cache, decode_state=state.replace(cache=None))
  key = np.zeros(jax.random.key_data(jax.random.key(0)).shape, np.uint32)
  settings = engine.slot_settings(key, SamplingParams(), 1)
  one = jax.tree.map(lambda x: _host(mesh, np.shape(x), np.asarray(x).dtype), settings)
  scalar = _host(mesh)
  programs = [Program(f"prefill[{prompt}]", "sampler", engine._prefill, (params, tokens, length),
                      groups=dict(params=params), resident=dict(kv=per_device_bytes(state.cache),
                                                                 decode_state=per_device_bytes(kv["decode_state"])))]
  if engine.kv == "dense":
    wide = jax.tree.map(lambda x: _host(mesh, (engine.max_slots, *x.shape), x.dtype), one)
    slots = _host(mesh, (engine.max_slots,))
    programs.append(Program("insert_group", "sampler", engine._insert_dense, (prefix, state, slots, wide, scalar),
                            groups=dict(kv, prefix=prefix)))
    programs.append(Program("decode", "sampler", engine._generate, (params, scalar, state), groups=kv,
                            per_call=engine.steps_per_call))
    if c.sampler.on_update == "recompute":
      programs.append(Program(f"recompute[{engine.max_len}]", "sampler", engine._rebuild, (params, state),
                              static=(engine.bucket(engine.max_len),), groups=kv))
  else:
    row = _host(mesh, (engine.pages_per_slot,))
    programs.append(Program("insert", "sampler", engine._insert, (prefix, state, scalar, one, scalar, row, scalar),
                            groups=dict(kv, prefix=prefix)))
    programs.append(Program(f"decode[{engine.max_slots} rows]", "sampler", engine._generate_live,
                            (params, scalar, state), static=(engine.max_slots,), groups=kv,
                            per_call=engine.steps_per_call))
    if c.sampler.on_update == "recompute":
      rows = _host(mesh, (engine.rebuild_rows,))
      programs.append(Program("recompute_rows", "sampler", engine._rebuild_rows, (params, state, rows, rows, rows),
                              groups=kv))
  return programs, dict(params=params, state=state)


def _memory(program: Program, compiled) -> dict[str, int]:
  """Per-device bytes while the program runs: its inputs by kind, what else the chip holds, the compiler's
  temporaries, and the outputs that do not reuse a donated input's buffer."""
  mem = compiled.memory_analysis()
  out = _held(program)
  inputs = sum(out.values()) - sum(program.resident.values())
  out["other_inputs"] = max(0, int(mem.argument_size_in_bytes) - inputs)
  out["temporaries"] = int(mem.temp_size_in_bytes)
  out["outputs"] = int(mem.output_size_in_bytes - mem.alias_size_in_bytes)
  out["total"] = sum(out.values())
  return out


def _roofline(costs: hlo.Costs, chip: Hardware) -> dict[str, float]:
  """Seconds the counts take on the chip's datasheet peaks (a lower bound: each part alone at peak)."""
  parts = dict(compute_s=costs.flops / chip.peak_flops, memory_s=costs.bytes / chip.hbm_bandwidth,
               collective_s=costs.collectives / chip.link_bandwidth)
  return dict(parts, bound_s=max(parts.values()))


def compile_program(program: Program, chip: Hardware, log=print, hlo_dir: str | None = None) -> dict:
  """Compiles one program for the target's chips and measures it (see the module doc); hlo_dir: its optimized HLO
  is written there as <name>.hlo.txt."""
  t0 = time.perf_counter()
  try:
    compiled = program.fn.lower(*program.static, *program.args).compile()
  except Exception as e:  # noqa: BLE001 - the compiler's own out-of-memory refusal, reported as one
    if "RESOURCE_EXHAUSTED" not in str(e) and "Ran out of memory" not in str(e):
      raise
    message = " ".join(str(e).split())
    memory = _held(program)
    # libtpu says either the whole ("Used 20.5G of 15.75G hbm") or the temporaries ("for HLO temporaries (15.92G)")
    used = re.search(r"Used ([0-9.]+)([KMGT]) of", message)
    temps = re.search(r"HLO temporaries \(([0-9.]+)([KMGT])\)", message)
    size = lambda m: float(m.group(1)) * 1024 ** " KMGT".index(m.group(2))  # noqa: E731
    if temps:
      memory["temporaries"] = size(temps)
    memory["total"] = size(used) if used else sum(memory.values())
    return dict(name=program.name, side=program.side, compiled=False, error=message[:300], memory=memory,
                hbm_fraction=memory["total"] / chip.hbm_bytes, fits=False)
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  if hlo_dir is not None:
    os.makedirs(hlo_dir, exist_ok=True)
    with open(os.path.join(hlo_dir, f"{program.name}.hlo.txt"), "w") as f:
      f.write(text)
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, list) else xla
  memory = _memory(program, compiled)
  report = dict(name=program.name, side=program.side, compiled=True, compile_s=round(seconds, 1), memory=memory,
                hbm_fraction=memory["total"] / chip.hbm_bytes, fits=memory["total"] <= chip.hbm_bytes,
                xla_cost_analysis=dict(flops=float(xla.get("flops", 0.0)), bytes=float(xla.get("bytes accessed", 0.0))),
                steps_per_call=program.per_call, **counts(text, chip))
  log(f"  {program.name:<22} {memory['total'] / GiB:8.2f} GiB  {report['flops']:10.3e} FLOP  "
      f"{report['bytes_accessed']:10.3e} B  {sum(report['collective_bytes'].values()):10.3e} B coll  compiled in "
      f"{seconds:.0f} s")
  return report


def counts(text: str, chip: Hardware) -> dict:
  """A program's report entries from its optimized HLO: FLOPs, bytes, collectives (jaxrl.hlo), their top ops, and
  the datasheet roofline they imply on the chip."""
  costs = hlo.costs(text)
  return dict(flops=costs.flops, bytes_accessed=costs.bytes, collective_bytes=costs.collective_bytes,
              unknown_loops=costs.unknown_loops, kernel_calls=costs.kernel_calls, top_bytes=costs.top_bytes,
              top_collectives=costs.top_collectives, top_flops=costs.top_flops, roofline=_roofline(costs, chip))


def recount(report: dict, hlo_dir: str) -> dict:
  """The report with every compiled program's counts made again from its saved HLO (--hlo_dir) by this version of
  jaxrl.hlo, and its efficiency from them: the same compiled programs, counted anew."""
  chip = preset(report["chip"])
  for p in report["programs"]:
    if p.get("compiled"):
      with open(os.path.join(hlo_dir, f"{p['name']}.hlo.txt")) as f:
        p.update(counts(f.read(), chip))
  if report["fits"]:
    report["efficiency"] = compile_efficiency.efficiency(report)
  return report


def _precheck(programs: list[Program], chip: Hardware) -> dict | None:
  """The first program whose inputs and held buffers alone exceed the chip's HBM (no compile needed to say so)."""
  for p in programs:
    memory = _held(p)
    held = sum(memory.values())
    if held > chip.hbm_bytes:
      return dict(name=p.name, side=p.side, compiled=False, error="its inputs alone exceed HBM",
                  memory=dict(memory, total=held), hbm_fraction=held / chip.hbm_bytes, fits=False)
  return None


def _held(program: Program) -> dict[str, int]:
  """Per-device bytes of a program's inputs by kind and of what else the chip holds while it runs."""
  return {k: per_device_bytes(t) for k, t in program.groups.items() if t is not None} | dict(program.resident)


def remedies(c: RunConfig, program: dict, chip: Hardware, learner_chips: int, sampler_chips: int) -> list[str]:
  """Settings that shrink a program that does not fit, the one that removes the most first."""
  mem = program["memory"]
  if program["side"] == "learner":
    state = sum(mem.get(k, 0) for k in ("params", "opt_state", "frozen", "ref_params"))
    need = math.ceil(state * learner_chips / chip.hbm_bytes)
    out = [f">= {need} learner chips for the train state alone (now {learner_chips}: a bigger slice, or fewer "
           "mesh.sampler_devices)"] if state > 0.5 * chip.hbm_bytes else []
    if not c.model.lora.enabled:
      out.append("model.lora.enabled=True (no optimizer state for the base)")
    if not c.model.remat:
      out.append("model.remat=True")
    rows = c.rl.microbatch_rows
    out.append(f"rl.microbatch_rows={max(1, rows // 2) if rows else 1}")
    if c.rl.atomic_step and c.rl.num_minibatches > 1:
      out.append("rl.atomic_step=False (no copy of the pre-step state)")
    return out
  out = [f"sampler.max_slots={max(1, c.sampler.max_slots // 2)}"]
  if c.sampler.weight_dtype != "int8" and not c.model.lora.enabled:  # weights first where they outweigh the KV
    weights_first = mem.get("params", 0) > mem.get("kv", 0) + mem.get("temporaries", 0)
    out.insert(0 if weights_first else 1, "sampler.weight_dtype='int8'")
  out.append(f"more sampler chips (now {sampler_chips}: mesh.sampler_devices, mesh.sampler_axes tensor)")
  return out


def _prepare(c, target_name: str):
  """The target, the config as it runs there, its roles, model config and (first) sampler engine."""
  tgt = target(target_name)
  c = for_target(config_lib.validate(c, num_devices=len(tgt.devices)), tgt)
  roles = split(c, tgt.devices)
  model_cfg = build_lib.model_config(c.model, c.sampler.max_len, platform=tgt.platform)
  return tgt, c, roles, model_cfg, build_lib.build_engine(c.sampler, model_cfg, roles.sampler_meshes(c.mesh)[0])


def compile_decode(c, target_name: str, log=print, hlo_dir: str | None = None) -> dict:
  """Only the sampler's decode program of config c compiled for the target (a minute, where the whole run takes
  many): its report entry and its bytes per step against its weights and KV read once (compile_efficiency)."""
  tgt, c, _, _, engine = _prepare(c, target_name)
  programs, sampled = sampler_programs(c, engine)
  decode = compile_program(next(p for p in programs if p.name.startswith("decode")), tgt.chip, log, hlo_dir)
  ideal = per_device_bytes(sampled["params"]) + per_device_bytes(sampled["state"].cache)
  return dict(target=tgt.name, chip=tgt.chip.name, kv=engine.kv, decode_attention=getattr(engine, "attention", "xla"),
              layout=getattr(engine, "layout", None), program=decode,
              decode_bytes=compile_efficiency.decode_bytes(decode, ideal))


def compile_run(c, target_name: str, log=print, hlo_dir: str | None = None) -> dict:
  """Every program of config c (a ConfigDict or RunConfig) compiled for `target_name`'s chips: the report (see the
  module doc). report["fits"] is False when one does not fit; report["over"] then names it."""
  tgt, c, roles, model_cfg, engine = _prepare(c, target_name)
  learner_mesh, sampler_meshes = roles.learner_mesh(c.mesh), roles.sampler_meshes(c.mesh)
  learn, info = learner_programs(c, learner_mesh, model_cfg)
  sample, sampled = sampler_programs(c, engine)
  programs = [*learn, publish_program(c, learner_mesh, info["state"], engine), *sample]
  chip = tgt.chip
  hosts = len({d.process_index for d in tgt.devices})
  report: dict[str, Any] = dict(
      target=tgt.name, chip=chip.name, hbm_bytes=chip.hbm_bytes, chips=len(tgt.devices), hosts=hosts,
      split=dict(learner=learner_mesh.size, learner_axes=dict(learner_mesh.shape), sampler=engine.mesh.size,
                 sampler_axes=dict(engine.mesh.shape), sampler_replicas=len(sampler_meshes)),
      model=dict(preset=c.model.preset, source=c.model.source, param_count=info["param_count"],
                 **{k: getattr(model_cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                       "num_heads", "num_kv_heads", "head_dim", "tie_embeddings")},
                 dtype=model_cfg.dtype, param_dtype=model_cfg.param_dtype, sampler_dtype=str(jnp.dtype(engine.dtype)),
                 sampler_weights=engine.weight_dtype,
                 train_attention=_train_attention(model_cfg, c.rl.seq_len, learner_mesh),
                 decode_attention=getattr(engine, "attention", "xla"), remat=model_cfg.remat,
                 lora=model_cfg.lora is not None),
      run=dict(batch_rows=info["spec"].rl.batch_size, seq_len=c.rl.seq_len, num_minibatches=c.rl.num_minibatches,
               num_epochs=c.rl.num_epochs, microbatch_rows=c.rl.microbatch_rows, pack=c.rl.pack,
               max_slots=engine.max_slots, max_len=engine.max_len, kv=engine.kv, on_update=c.sampler.on_update,
               steps_per_call=engine.steps_per_call, **{k: info[k] for k in (
                   "updates", "fixed_passes", "row_shards", "chunks", "trained_param_bytes")},
               full_remat=model_cfg.remat and model_cfg.remat_policy == "nothing_saveable"),
      note="compile-only: no TPU ran any of it; times are datasheet rooflines of the compiled counts",
      programs=[])
  log(f"jaxrl-compile: {tgt.name} ({len(tgt.devices)} x {chip.name}, {chip.hbm_bytes / GiB:.0f} GiB HBM, {hosts} "
      f"host(s)): learner {learner_mesh.size} chips {dict(learner_mesh.shape)}, sampler {engine.mesh.size} chips x "
      f"{len(sampler_meshes)} replica(s) {dict(engine.mesh.shape)}")
  too_big = _precheck(programs, chip)
  if too_big is not None:
    report["programs"].append(too_big)
  else:
    for p in programs:
      report["programs"].append(compile_program(p, chip, log, hlo_dir))
  report["programs"].append(_receive(sampled, info["trained_params"], engine, chip))
  report["kv_capacity"] = kv_capacity(report["programs"], *_kv_per_token(sampled["state"].cache, engine),
                                      chip.hbm_bytes)
  report["fits"] = all(p["fits"] for p in report["programs"])
  if not report["fits"]:
    worst = next(p for p in report["programs"] if not p["fits"])
    over = worst["memory"]["total"] - chip.hbm_bytes
    report["over"] = dict(program=worst["name"], bytes_over=over,
                          remedies=remedies(c, worst, chip, learner_mesh.size, engine.mesh.size))
  else:
    report["efficiency"] = compile_efficiency.efficiency(report)
  return report


def _train_attention(model_cfg, seq_len: int, mesh) -> str:
  """The learner's attention as its step traces it under `mesh` ("auto" picks by the mesh's platform)."""
  if model_cfg.train_attention != "auto":
    return model_cfg.train_attention
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    return default_implementation(seq_len, model_cfg.dtype, model_cfg.attention_block)


def _receive(sampled: dict, trained, engine, chip: Hardware) -> dict:
  """The publish's arrival on a sampler chip (a transfer, no program): the new params (a LoRA run's adapters, in the
  sampler's dtype) held beside the params and KV in use until the swap, and the transfer's time at the chip's
  one-direction link bandwidth (datasheet)."""
  if engine.cfg.lora is None:
    received = per_device_bytes(sampled["params"])
  else:
    received = sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(engine.dtype).itemsize
                   for x in jax.tree.leaves(trained))
  memory = dict(params=per_device_bytes(sampled["params"]), kv=per_device_bytes(sampled["state"].cache),
                decode_state=per_device_bytes(sampled["state"].replace(cache=None)), received=received)
  memory["total"] = sum(memory.values())
  return dict(name="publish_receive", side="sampler", compiled=None, memory=memory,
              hbm_fraction=memory["total"] / chip.hbm_bytes, fits=memory["total"] <= chip.hbm_bytes,
              transfer_s=received / chip.link_bandwidth)


def kv_capacity(programs: list[dict], per_token: float, data: int, hbm_bytes: float,
                lengths=(4096, 16384, 32768)) -> dict:
  """Sequences of each length whose keys and values fit one sampler replica, estimated from the compiled sizes (not
  a compile at that size): for each sampler program, the HBM beside what does not grow with the cache, over a
  token's KV bytes per chip (per_token), the program's temporaries taken to grow with the cache (on TPU they are
  copies of it: docs/TPU.md); the fewest over the programs. data: the chips a dense cache splits its slots over (1
  for the paged pool, whole on every chip)."""
  tokens = math.inf
  for p in programs:
    m = p["memory"]
    if p["side"] != "sampler" or not m.get("kv") or not math.isfinite(m["total"]):
      continue
    grows = m["kv"] + m.get("temporaries", 0)
    tokens = min(tokens, max(0.0, hbm_bytes - (m["total"] - grows)) / (per_token * grows / m["kv"]))
  if not math.isfinite(tokens):
    return {}
  return {str(n): int(tokens // n) * data for n in lengths} | dict(kv_bytes_per_token_chip=per_token,
                                                                  tokens_per_chip=tokens)


def _kv_per_token(cache, engine) -> tuple[float, int]:
  """A token's KV bytes per sampler chip, and the chips a dense cache splits its slots over (1: paged)."""
  pool_tokens = engine.num_pages * engine.page_size if engine.kv == "paged" else engine.max_slots * engine.max_len
  data = 1 if engine.kv == "paged" else engine.mesh.shape.get("data", 1)
  keys = cache.k_pages if engine.kv == "paged" else cache.k_NxSxTxKxD
  return per_device_bytes(keys) * 2 * data / pool_tokens, data


def format_table(report: dict) -> str:
  """The report's programs, one line each: per-chip memory by kind against HBM, and their datasheet times."""
  gib = lambda b: f"{b / GiB:7.2f}"  # noqa: E731
  lines = [f"{'program':<22} {'side':<8} {'params':>7} {'optim':>7} {'kv':>7} {'temp':>7} {'out':>7} {'total':>7} "
           f"{'%HBM':>5}  {'GFLOP':>9} {'GB read':>8} {'GB coll':>8} {'roofline ms':>11}"]
  for p in report["programs"]:
    m = p["memory"]
    if not p.get("compiled"):  # a transfer's arrival, or a program over HBM before or while compiling
      why = f"transfer {1e3 * p['transfer_s']:.2f} ms at the link's datasheet rate" if p["compiled"] is None else \
          f"not compiled: {p['error']}"
      lines.append(f"{p['name']:<22} {p['side']:<8} {gib(m.get('params', 0))} {gib(m.get('opt_state', 0))} "
                   f"{gib(m.get('kv', 0))} {'':>7} {'':>7} {gib(m['total'])} {100 * p['hbm_fraction']:5.1f}  {why}")
      continue
    lines.append(f"{p['name']:<22} {p['side']:<8} {gib(m.get('params', 0))} {gib(m.get('opt_state', 0))} "
                 f"{gib(m.get('kv', 0))} {gib(m['temporaries'])} {gib(m['outputs'])} {gib(m['total'])} "
                 f"{100 * p['hbm_fraction']:5.1f}  {p['flops'] / 1e9:9.1f} {p['bytes_accessed'] / 1e9:8.2f} "
                 f"{sum(p['collective_bytes'].values()) / 1e9:8.2f} {1e3 * p['roofline']['bound_s']:11.2f}")
  return "\n".join(lines)


def fit_line(report: dict) -> str:
  """One line: "fits", or the program over HBM, by how much, and the settings that would shrink it."""
  if report["fits"]:
    worst = max(report["programs"], key=lambda p: p["hbm_fraction"])
    return (f"fits: every program of the run fits {report['target']}'s {report['hbm_bytes'] / GiB:.0f} GiB HBM per "
            f"chip (the fullest, {worst['name']}, uses {100 * worst['hbm_fraction']:.0f}%)")
  over = report["over"]
  need = over["bytes_over"] + report["hbm_bytes"]
  return (f"jaxrl-compile: {over['program']} needs {need / GiB:.2f} GiB per chip, {over['bytes_over'] / GiB:.2f} GiB "
          f"over {report['target']}'s {report['hbm_bytes'] / GiB:.0f} GiB HBM; would shrink it: "
          f"{'; '.join(over['remedies'])}")


def main(argv=None):
  from absl import flags
  from ml_collections import config_flags

  platforms.entry_point()  # this host's own runtime: CPU; the target's chips come from libtpu's topology
  flags_def = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/default.py[:arg]", lock_config=True)
  flags.DEFINE_string("target", None, "TPU topology: v5e:2x2, v5p:4x4x2, v6e:4x4, ...")
  flags.DEFINE_string("out", None, "write the JSON report here")
  flags.DEFINE_string("hlo_dir", None, "write each program's optimized HLO here (<program>.hlo.txt)")
  flags.mark_flags_as_required(["config", "target"])
  config_lib.parse_cli("jaxrl-compile", argv)
  try:
    report = compile_run(flags_def.config, flags_def.target, hlo_dir=flags_def.hlo_dir)
  except (config_lib.ConfigError, CompileError) as e:
    config_lib.cli_error("jaxrl-compile", str(e))
  print(format_table(report))
  if flags_def.out:
    with open(flags_def.out, "w") as f:
      json.dump(report, f, indent=1, default=float)
  if not report["fits"]:
    print(fit_line(report), file=sys.stderr)
    sys.exit(2)
  print(fit_line(report))


if __name__ == "__main__":
  main()
