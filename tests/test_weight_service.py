"""Weights between independent programs (jaxrl/distributed/weight_service.py): a learner's WeightServer, samplers'
WeightClients over jax.experimental.transfer; exact bytes, newer-only, checked, every wait bounded."""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
from sampling_util import random_params

from jaxrl.controller.weights import WeightPublisher
from jaxrl.distributed.weight_service import (
  ChecksumError,
  WeightClient,
  WeightServer,
  checksums,
  digest,
  local_copy,
)
from jaxrl.models import ModelConfig, init_params, lora
from jaxrl.sampler import make_engine
from jaxrl.sharding import make_mesh

ROOT = Path(__file__).resolve().parents[1]


def _params(scale=1):
  return {"w": scale * jnp.arange(48, dtype=jnp.float32).reshape(8, 6) - 0.5,
          "n": {"b": jnp.linspace(-2, 2, 10, dtype=jnp.bfloat16) * scale, "i": jnp.arange(-3, 4, dtype=jnp.int8),
                "m": jnp.array([True, False, True])}}


def _on_one(tree):
  return jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), tree)


def _assert_same(got, want):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, path
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), path


def test_a_newer_version_arrives_exactly_once_with_its_tag():
  server = WeightServer()
  calls = []
  client = WeightClient(lambda r: calls.append(r) or server.describe(r), _on_one(_params()), sampler="s0",
                        timeout_s=30)
  assert client.take_newer(-1) is None and calls == [{"sampler": "s0", "have": -1}]  # nothing published yet
  server.publish(_params(), 0)
  got = client.take_newer(-1)
  assert got.version == 0
  _assert_same(got.params, _params())
  assert client.take_newer(0) is None and client.pulled == 1  # the version held is not pulled again
  server.publish(_params(3), 4)
  server.publish(_params(5), 7)  # a version no longer served: the sampler gets the newest
  got = client.take_newer(0)
  assert got.version == 7 and client.pulled == 2
  _assert_same(got.params, _params(5))
  assert client.take_newer(9) is None
  with pytest.raises(ValueError, match="version 7 is not newer than 7"):
    server.publish(_params(), 7)


def test_the_learner_may_donate_its_params_once_published():
  server = WeightServer()
  params = _params()
  server.publish(params, 1)
  jax.jit(lambda tree: jax.tree.map(lambda x: (x + 1).astype(x.dtype), tree), donate_argnums=0)(params)  # a step
  assert all(x.is_deleted() for x in jax.tree.leaves(params))
  _assert_same(WeightClient(server.describe, _on_one(params), timeout_s=30).take_newer(-1).params, _params())


def test_two_samplers_pull_the_same_version_each_by_its_own_uuid():
  server = WeightServer()
  server.publish(_params(2), 3)
  replies = []
  clients = [WeightClient(lambda r: replies.append(server.describe(r)) or replies[-1], _on_one(_params()),
                          sampler=str(i), timeout_s=30) for i in range(2)]
  for client in clients:
    got = client.take_newer(-1)
    assert got.version == 3
    _assert_same(got.params, _params(2))
  assert replies[0]["uuid"] != replies[1]["uuid"]


def test_params_sharded_over_a_mesh_are_served_from_a_gathered_full_copy_with_equal_checksums():
  """A learner over several processes serves its own copy of each version (local_copy); on one process of 8
  devices the same gather yields the bytes and checksums of the params themselves, on the device asked for."""
  mesh = make_mesh({"fsdp": 8}, jax.devices()[:8])
  params = {"w": jnp.arange(64, dtype=jnp.float32).reshape(16, 4) / 7, "b": jnp.linspace(-1, 1, 8)}
  sharded = jax.device_put(params, jax.sharding.NamedSharding(mesh, P("fsdp")))
  device = jax.devices()[3]
  gather = local_copy(mesh, device)
  gather.compile(sharded)
  copy = gather(sharded)
  assert all(x.devices() == {device} for x in jax.tree.leaves(copy))
  _assert_same(copy, params)
  plain, gathered = WeightServer(), WeightServer(device=device, gather=gather)
  plain.publish(params, 2)
  gathered.publish(sharded, 2)
  assert gathered.digests == plain.digests == {2: digest(checksums(jax.tree.leaves(params)))}
  _assert_same(WeightClient(gathered.describe, _on_one(params), timeout_s=30).take_newer(-1).params, params)
  assert gathered.served == 1 and plain.served == 0


@pytest.mark.parametrize("x", [jnp.arange(-3, 4, dtype=jnp.int8), jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16),
                               jnp.array([True, False, False]), jnp.arange(6, dtype=jnp.float32).reshape(2, 3)])
def test_the_checksum_sees_every_element_and_its_place(x):
  """Narrow dtypes are packed 4 bytes a word with a widened partial last word: a changed element anywhere, the tail
  included, or two elements swapped, change the checksum."""
  flat = x.reshape(-1)
  want = checksums([x])
  for i in range(flat.size):
    changed = flat.at[i].set(~flat[i] if x.dtype == jnp.bool_ else flat[i] + 1)
    assert checksums([changed.reshape(x.shape)]) != want, i
  swapped = flat.at[0].set(flat[1]).at[1].set(flat[0])
  assert checksums([swapped.reshape(x.shape)]) != want


def test_corrupt_checksums_or_bytes_are_refused_naming_the_version():
  server = WeightServer()
  server.publish(_params(), 2)

  def lying(request):
    reply = server.describe(request)
    reply["checksums"][2][0] ^= 1  # the metadata says other bytes than were sent
    return reply

  with pytest.raises(ChecksumError, match=r"weights v2 from .*: checksum of \['n'\]\['m'\]"):
    WeightClient(lying, _on_one(_params()), timeout_s=30).take_newer(-1)
  # The bytes served differ from those the checksums were computed on (one element of "w").
  version, leaves, info = server._newest
  server._newest = (version, [leaves[0], leaves[1], leaves[2], leaves[3].at[5].add(1.0)], info)
  with pytest.raises(ChecksumError, match=r"weights v2 from .*: checksum of \['w'\]"):
    WeightClient(server.describe, _on_one(_params()), timeout_s=30).take_newer(-1)


def test_every_wait_is_bounded_and_names_the_peer_and_version():
  server = WeightServer()
  server.publish(_params(), 5)
  never = threading.Event()
  with pytest.raises(TimeoutError, match=r"no answer to describe \(have v-1\) from the learner within 1.0s"):
    WeightClient(lambda r: never.wait(20), _on_one(_params()), timeout_s=1.0).take_newer(-1)
  unserved = {}

  def unregistered(request):  # a pull the server never registered: the transfer would wait for it forever
    unserved.update(server.describe(request), uuid=12345)
    return unserved

  start = time.perf_counter()
  with pytest.raises(TimeoutError, match=rf"pull of v5 from {server.address} \(uuid 12345, 4 arrays\) not complete "
                     r"within 1.0s"):
    WeightClient(unregistered, _on_one(_params()), timeout_s=1.0).take_newer(-1)
  assert time.perf_counter() - start < 10
  never.set()
  # Served late, the abandoned pull completes (its thread ends before the process does).
  server._server.await_pull(12345, server._newest[1])


def test_a_mismatched_tree_is_named():
  server = WeightServer()
  server.publish(_params(), 0)
  other = {"w": jnp.zeros((8, 6)), "x": jnp.zeros(3)}
  with pytest.raises(ValueError, match=r"weights v0 from .*: the learner's tree is not the engine's \(\['n'\]\['b'\] "
                     r"!= \['w'\]\)"):
    WeightClient(server.describe, _on_one(other), timeout_s=30).take_newer(-1)


CFG = ModelConfig.tiny(eos_token_ids=(1,))
LORA = lora.LoRAConfig(rank=2, alpha=4.0, targets=r"attn\.(q|o)_proj|mlp\.down_proj")


def _engine_takes_what_an_in_process_publish_gives(engine, params, version):
  """The pulled tree equals, leaf for leaf and sharding for sharding, what controller.weights publishes in one
  process; the engine places it."""
  server = WeightServer(dtype=engine.dtype, weight_dtype=engine.weight_dtype)
  server.publish(params, version)
  got = WeightClient(server.describe, engine.publish_shardings, timeout_s=60).take_newer(-1)
  want = WeightPublisher(engine.publish_shardings, engine.dtype, weight_dtype=engine.weight_dtype).publish(params,
                                                                                                          version)
  assert got.version == version
  _assert_same(got.params, want.params)
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
    assert a.sharding == b.sharding
  assert engine.place(got.params, got.version).version == version


def test_int8_weights_reach_the_engine_as_an_in_process_publish_places_them():
  params = random_params(init_params(CFG)[1], 0, 0.3)
  engine = make_engine(CFG, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), max_slots=2, max_len=16,
                       steps_per_call=2, min_bucket=8, weight_dtype="int8")
  _engine_takes_what_an_in_process_publish_gives(engine, params, 3)


def test_lora_adapters_alone_reach_an_engine_holding_the_base():
  cfg = CFG.replace(lora=LORA)
  adapters, base = lora.split(random_params(init_params(cfg)[1], 1, 0.3))
  engine = make_engine(cfg, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), max_slots=2, max_len=16,
                       steps_per_call=2, min_bucket=8)
  engine.hold_base(base)
  _engine_takes_what_an_in_process_publish_gives(engine, adapters, 2)


SAMPLER = """
import hashlib, json, sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxrl.distributed.weight_service import WeightClient

def describe(request):  # the learner's "weights" method, over this process's stdin/stdout
  print("DESCRIBE " + json.dumps(request), flush=True)
  return json.loads(sys.stdin.readline())

mesh = jax.make_mesh((2,), ("d",))
shardings = {"n": {"b": NamedSharding(mesh, P()), "i": NamedSharding(mesh, P()), "m": NamedSharding(mesh, P())},
             "w": NamedSharding(mesh, P("d"))}
client, have = WeightClient(describe, shardings, sampler=sys.argv[1], timeout_s=60), -1
while have < 1:
  got = client.take_newer(have)
  if got is None:
    time.sleep(0.05)
    continue
  have = got.version
  sha = {jax.tree_util.keystr(k): hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
         for k, x in jax.tree_util.tree_leaves_with_path(got.params)}
  print("GOT " + json.dumps({"version": have, "sha": sha, "spec": str(got.params["w"].sharding.spec),
                             "pulled": client.pulled}), flush=True)
"""


def _sha(tree):
  return {jax.tree_util.keystr(k): hashlib.sha256(np.asarray(x).tobytes()).hexdigest()
          for k, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.timeout(120)
def test_two_sampler_programs_pull_two_versions_over_loopback():
  """Two independent JAX processes (no jax.distributed; 2 CPU devices each, the learner's 8), each pulling v0 then
  v1 onto its own mesh; describe travels over the child's stdin/stdout."""
  server = WeightServer()
  server.publish(_params(), 0)
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu"}
  children = [subprocess.Popen([sys.executable, "-c", SAMPLER, f"s{i}"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env) for i in range(2)]
  got = [[] for _ in children]

  def serve(child, out):
    for line in child.stdout:
      kind, _, body = line.partition(" ")
      if kind == "DESCRIBE":
        child.stdin.write(json.dumps(server.describe(json.loads(body))) + "\n")
        child.stdin.flush()
      elif kind == "GOT":
        out.append(json.loads(body))

  threads = [threading.Thread(target=serve, args=(c, g), daemon=True) for c, g in zip(children, got, strict=True)]
  for t in threads:
    t.start()
  deadline = time.monotonic() + 90
  while not all(got) and time.monotonic() < deadline:
    time.sleep(0.05)
  server.publish(_params(7), 1)
  try:
    for child in children:
      assert child.wait(max(1, deadline - time.monotonic())) == 0
  finally:
    for child in children:
      child.kill()
  for t in threads:
    t.join(5)
  for out in got:
    assert [(g["version"], g["pulled"]) for g in out] == [(0, 1), (1, 2)]
    assert out[0]["sha"] == _sha(_params()) and out[1]["sha"] == _sha(_params(7))
    assert out[1]["spec"] == str(P("d"))
