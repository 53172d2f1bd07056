"""What a Pallas kernel needs to compile for a TPU mesh (Mosaic): run per device under the mesh in scope, and take
Mosaic's own matmul precision.

A Mosaic kernel is a custom call that XLA cannot partition: on a mesh of several chips it must sit in shard_map,
each chip calling it on its own shards. The mesh is the one in scope (jax.set_mesh, or jaxrl.sharding.under_mesh,
which the learner's step and the sampler's programs trace under): it is part of how a program is traced, like its
shardings, and it is the only place a deviceless TPU compile on a CPU host says which chips it is for.
"""

from __future__ import annotations

import jax

LANES = 128  # Mosaic tiles a block's last dimension by 128 lanes


def per_device(local, specs, *args):
  """local(*args) on each device's shards under the mesh in scope, in shard_map; specs(mesh) -> (in_specs,
  out_specs). No mesh in scope (one device): local(*args) on the whole arrays."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(*args)
  in_specs, out_specs = specs(mesh)
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def mosaic_precision():
  """Traces a kernel's dots at Mosaic's default precision whatever jax_default_matmul_precision says: "highest"
  (the test suite's) makes them fp32 contractions, which Mosaic fails to legalize on bf16 operands (and on the
  paged kernel's f32 x bf16-tiled dot): "failed to legalize operation 'tpu.matmul' ... contract_precision<fp32>"."""
  return jax.default_matmul_precision("default")
