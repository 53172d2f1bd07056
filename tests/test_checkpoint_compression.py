"""checkpoint.compress: what lands on disk follows the setting, and a checkpoint of either kind restores with either
setting (bit for bit, checksums verified)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.checkpoint import Checkpointer
from jaxrl.learner import init_train_state


def _state():
  params = {"w": jnp.zeros((1024, 1024)), "b": jnp.arange(8.0)}  # 4 MiB of zeros: zstd makes them almost nothing
  return init_train_state(params, optax.adam(1e-3), rng=3, version=7)


def _disk_bytes(directory):
  return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _save(directory, compress):
  ck = Checkpointer(directory, compress=compress)
  ck.save(7, _state(), {"next_group_id": 5})
  ck.wait()
  ck.close()
  return _disk_bytes(directory / "7")


def test_compress_setting_decides_what_is_written(tmp_path):
  plain, zstd = _save(tmp_path / "plain", False), _save(tmp_path / "zstd", True)
  assert plain > 3 * 4 * 2**20  # params and two Adam moments of 4 MiB each, as they are
  assert zstd < 2**20  # compressed zeros


@pytest.mark.parametrize("saved_compressed", [False, True])
def test_either_kind_restores_with_either_setting(tmp_path, saved_compressed):
  _save(tmp_path, saved_compressed)
  want = _state()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), want)
  ck = Checkpointer(tmp_path, read_only=True, compress=not saved_compressed)
  state, record = ck.restore(abstract)
  ck.close()
  assert ck.restored_step == 7 and record == {"next_group_id": 5} and int(state.version) == 7
  for a, b in zip(jax.tree.leaves(jax.random.key_data(state.rng)), jax.tree.leaves(jax.random.key_data(want.rng)),
                  strict=True):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(state.replace(rng=None)), jax.tree.leaves(want.replace(rng=None)), strict=True):
    np.testing.assert_array_equal(a, b)
