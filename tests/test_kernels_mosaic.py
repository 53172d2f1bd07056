"""The Pallas TPU kernels compiled by Mosaic and the TPU compiler (libtpu, deviceless: no TPU runs them) at real
shapes on multi-chip meshes, float32 and bfloat16: the splash training attention forward and backward, the paged
decode attention, and a decoder's train step that runs splash. Each executable holds the Mosaic kernels (the
tpu_custom_call), takes exactly its shard of every input per chip (the kernel runs in shard_map, not on gathered
arrays) and keeps temporaries far below what materialised scores or a gathered KV pool would take."""

import functools
import math

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.kernels import paged_attention
from jaxrl.kernels.train_attention import default_implementation, splash_attention
from jaxrl.sharding import make_mesh


@pytest.fixture(autouse=True, scope="module")
def no_compilation_cache():
  """The suite's persistent cache cannot load an executable compiled without its devices ("PjRtCompiler must be
  constructed with a Client"): these would be written and never read."""
  before = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", before)


@functools.cache
def chips(topology: str):
  return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices


# The TPU compiler at its default optimisation level: conftest turns the backend's optimisations off for the CPU
# suite's speed, and without them the TPU compiler keeps copies a real compile would not (temporaries 0 -> 214 MiB).
TPU_OPTIONS = {"xla_backend_optimization_level": 3}


def compiled(fn, mesh, *args):
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args).compile(TPU_OPTIONS)


def kernels(executable) -> int:
  return executable.as_text().count('custom_call_target="tpu_custom_call"')


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
  return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


def holds_just(compiled_bytes: int, arrays) -> bool:
  """The buffers are these arrays' shards, within 16 KiB (the compiler pads small buffers, adds a tuple table to
  several outputs): a chip holding whole arrays, or gathered copies, would be off by megabytes."""
  return abs(compiled_bytes - sum(shard_bytes(x) for x in arrays)) <= 16384


@pytest.mark.parametrize("topology, t, heads, kv_heads, head_dim, dtype", [
    ("v5e:2x2", 2048, 28, 4, 128, jnp.float32),  # Qwen2.5-7B's heads
    ("v5e:2x2", 2048, 28, 4, 128, jnp.bfloat16),
    ("v5e:2x2", 8192, 14, 2, 64, jnp.bfloat16),  # Qwen2.5-0.5B's heads, a long row
    ("v5p:2x2x1", 4096, 32, 8, 128, jnp.bfloat16),  # Llama-3.1-8B's heads
])
def test_splash_forward_and_backward_compile_in_shard_map(topology, t, heads, kv_heads, head_dim, dtype):
  """Rows over fsdp, heads over tensor: three kernels (forward, dq, dkv) on each chip's own rows and heads."""
  mesh = make_mesh({"fsdp": 2, "tensor": 2}, chips(topology))
  sd = lambda shape, spec, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  b = 4
  spec = P("fsdp", None, "tensor")
  args = (sd((b, t, heads, head_dim), spec), sd((b, t, kv_heads, head_dim), spec), sd((b, t, kv_heads, head_dim), spec),
          sd((b, t), P("fsdp"), jnp.int32))
  loss = lambda q, k, v, s: jnp.sum(splash_attention(q, k, v, s).astype(jnp.float32) ** 2)
  exe = compiled(jax.grad(loss, argnums=(0, 1, 2)), mesh, *args)
  assert kernels(exe) == 3
  memory = exe.memory_analysis()
  assert holds_just(memory.argument_size_in_bytes, args) and holds_just(memory.output_size_in_bytes, args[:3])
  # Temporaries are linear in t (q, k, v, out in the kernel's layout, float32 dq): far below a chip's float32
  # scores, which the kernels never materialise.
  scores = (b // 2) * (heads // 2) * t * t * 4
  assert memory.temp_size_in_bytes < scores / 8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tensor", [2, 1])
def test_paged_decode_compiles_in_shard_map(dtype, tensor):
  """Qwen2.5-7B's decode attention (28 q heads, 4 kv heads, D=128, 28 layers) over 4096 pages of 16: slots over
  data, kv heads over tensor; each chip reads its heads' pages of the pool in place (no gather, no copy)."""
  mesh = make_mesh({"data": -1, "tensor": tensor}, chips("v5e:2x2"))
  sd = lambda shape, spec, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  slots, kv, groups, d, layers, pages, z, per_slot = 64, 4, 7, 128, 28, 4096, 16, 128
  pool = sd((kv, layers, pages, z, d), P("tensor"))
  args = (sd((slots, 1, kv, groups, d), P("data", None, "tensor")), pool, pool, sd((), P(), jnp.int32),
          sd((slots, per_slot), P("data"), jnp.int32), sd((slots, 1), P("data"), jnp.int32))
  attend = lambda q, k, v, layer, table, pos: paged_attention(q, k, v, layer, table, pos, impl="pallas_tpu",
                                                                layout="KNPZD")
  exe = compiled(attend, mesh, *args)
  assert kernels(exe) == 1
  memory = exe.memory_analysis()
  assert holds_just(memory.argument_size_in_bytes, args) and holds_just(memory.output_size_in_bytes, args[:1])
  assert memory.temp_size_in_bytes < shard_bytes(pool) / layers / 16  # far below one layer of the pool


def test_paged_tpu_kernel_names_the_head_dim_it_needs():
  q = jnp.zeros((2, 1, 2, 3, 64))
  pool = jnp.zeros((2, 1, 8, 16, 64))
  with pytest.raises(ValueError, match="head_dim a multiple of 128"):
    paged_attention(q, pool, pool, 0, jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                    impl="pallas_tpu", layout="KNPZD")


def test_auto_picks_by_the_mesh_in_scope():
  """A deviceless TPU compile runs on a CPU host: the target's kernel is the mesh's, not jax.default_backend()'s."""
  assert default_implementation(2048, jnp.bfloat16, 512) == "chunked"
  with jax.set_mesh(make_mesh({"fsdp": 4}, chips("v5e:2x2"))):
    assert default_implementation(2048, jnp.bfloat16, 512) == "splash"
  with jax.set_mesh(make_mesh({"fsdp": 4}, jax.devices()[:4])):
    assert default_implementation(2048, jnp.bfloat16, 512) == "chunked"


def test_train_step_with_splash_compiles_for_a_multichip_mesh():
  """A decoder's whole train step (forward, backward, AdamW) on v5e:2x2, fsdp 2 x tensor 2, "auto" attention: the
  step traces under its mesh, so auto is splash and every kernel runs in shard_map (the reference pass included)."""
  from jaxrl.learner import StepConfig, init_train_state, jit_train_step, make_optimizer, train_state_shardings
  from jaxrl.models import ModelConfig, hf
  from jaxrl.rollout import make_batch
  from jaxrl.sharding import LEARNER_RULES, batch_sharding, param_shardings

  cfg = ModelConfig.tiny(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                         head_dim=128, max_position_embeddings=1024, dtype="bfloat16")
  mesh = make_mesh({"fsdp": 2, "tensor": 2}, chips("v5e:2x2"))
  graphdef, abstract = hf.abstract_params(cfg)
  opt = make_optimizer(1e-5, warmup_steps=1, decay_steps=100)
  state_sh = train_state_shardings(abstract, opt, param_shardings(abstract, mesh, LEARNER_RULES), mesh)
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                       jax.eval_shape(lambda p: init_train_state(p, opt), abstract), state_sh)
  rows, seq_len = 4, 1024
  step = jit_train_step(StepConfig(model=graphdef, optimizer=opt, batch_size=rows, seq_len=seq_len,
                                   batch_sharding=batch_sharding(mesh, LEARNER_RULES)), state_sh)
  batch = jax.eval_shape(lambda: make_batch([], rows, seq_len))
  exe = step.lower(state, batch, jax.ShapeDtypeStruct((), jax.random.key(0).dtype)).compile(TPU_OPTIONS)
  assert kernels(exe) == 3  # in the layer scan: forward, dq, dkv


def test_decode_step_with_the_paged_kernel_compiles_for_a_multichip_sampler():
  """A decoder's cached step over a paged pool, laid out as the paged engine lays it out on a sampler mesh of
  data 2 x tensor 2 (slots over data, kv heads over tensor, the pool not split by slot): one kernel in the layer
  loop, each chip holding only its heads' pages."""
  from jaxrl.models import ModelConfig, PagedKVCache, forward_cached, hf
  from jaxrl.sharding import SAMPLER_RULES, param_shardings

  cfg = ModelConfig.tiny(vocab_size=1024, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                         head_dim=128, dtype="bfloat16", param_dtype="bfloat16")
  mesh = make_mesh({"data": 2, "tensor": 2}, chips("v5e:2x2"))
  on = lambda spec: NamedSharding(mesh, spec)
  graphdef, abstract = hf.abstract_params(cfg)
  slots, pages, per_slot = 16, 512, 32
  pool = jax.ShapeDtypeStruct((cfg.num_kv_heads, cfg.num_layers, pages, 16, cfg.head_dim), jnp.bfloat16,
                              sharding=on(P("tensor")))
  ints = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=on(P("data")))
  cache = PagedKVCache(pool, pool, ints((slots, per_slot)), ints((slots,)), layout="KNPZD", attention="pallas_tpu")
  step = jax.jit(lambda *a: forward_cached(graphdef, *a),
                 in_shardings=(param_shardings(abstract, mesh, SAMPLER_RULES), None, None, None))
  with jax.set_mesh(mesh):
    exe = step.lower(abstract, ints((slots, 1)), ints((slots, 1)), cache).compile(TPU_OPTIONS)
  assert kernels(exe) == 1
  assert exe.memory_analysis().temp_size_in_bytes < shard_bytes(pool)  # the pool is updated in place, not copied
