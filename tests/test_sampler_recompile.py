"""New policy versions and new Samplers reuse the engine's compiled programs."""

import jax
from flax import nnx

from jaxrl import sharding
from jaxrl.models import Decoder, ModelConfig
from jaxrl.sampler import Sampler, make_engine


def test_versions_and_samplers_do_not_recompile():
  cfg = ModelConfig.tiny()
  _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
  engine = make_engine(cfg, mesh, max_slots=2, max_len=24, steps_per_call=4)
  # Counted from the first version on: `_insert` is jitted once per process and its cache also holds other engines'
  # shapes (other test modules), so absolute counts depend on the test order.
  fns = (engine._insert, engine._prefill, engine._generate)
  sizes = []
  for version in range(3):
    sampler = Sampler(engine, params, version)
    sampler.submit([1, 2, 3], group_id=version, n=2, max_tokens=5)
    while sampler.num_active or sampler.num_waiting:
      sampler.step()
    sizes.append([f._cache_size() for f in fns])
  assert sizes[0] == sizes[1] == sizes[2]
  assert engine._prefill._cache_size() == 1 and engine._generate._cache_size() == 1  # this engine's own
  assert engine._zeros._cache_size() == 1
