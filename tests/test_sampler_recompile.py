"""New policy versions and new Samplers reuse the engine's compiled programs."""

import jax
from flax import nnx

from jaxrl import sharding
from jaxrl.models import Decoder, ModelConfig
from jaxrl.sampler import Engine, Sampler


def test_versions_and_samplers_do_not_recompile():
  cfg = ModelConfig.tiny()
  _, params = nnx.split(Decoder(cfg, nnx.Rngs(0)))
  engine = Engine(cfg, sharding.make_mesh({"data": 1}, jax.devices()[:1]), max_slots=2, max_len=24, steps_per_call=4)
  for version in range(3):
    sampler = Sampler(engine, params, version)
    sampler.submit([1, 2, 3], group_id=version, n=2, max_tokens=5)
    while sampler.num_active or sampler.num_waiting:
      sampler.step()
  assert engine._insert._cache_size() == 1
  assert engine._prefill._cache_size() == 1
  assert engine._generate._cache_size() == 1
  assert engine._zeros._cache_size() == 1
