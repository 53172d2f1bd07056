"""jaxrl.distributed pieces on one process: packets, roles, weight layout, shard dumps, watchdog, launcher.

The multi-process runs themselves are in test_distributed_multiprocess.py.
"""

import collections
import copy
import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import config as config_lib
from jaxrl import sharding
from jaxrl.controller.spec import RunRecord
from jaxrl.distributed import launch, packets
from jaxrl.distributed.cross_process import StoreCoordinator
from jaxrl.distributed.job import build
from jaxrl.distributed.runtime import Topology
from jaxrl.distributed.transfer import WeightRoute, load_shards, save_local_shards, source_devices
from jaxrl.distributed.watchdog import Watchdog
from jaxrl.models import Decoder, ModelConfig
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import Rollout, SamplingParams

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402

# ---- packets -------------------------------------------------------------------------------------------------------


def _rollout(gid, index, prompt, completion, reward, **kw):
  c = len(completion)
  rng = np.random.default_rng(gid * 10 + index)
  return Rollout(np.asarray(prompt, np.int32), np.asarray(completion, np.int32),
                 rng.standard_normal(c).astype(np.float32), rng.integers(0, 9, c).astype(np.int32),
                 kw.pop("finish_reason", "length"), gid, index, reward=reward, **kw)


def test_packet_round_trip_is_bitwise():
  groups = [
      [_rollout(7, 0, [1, 2, 3], [4, 5], 0.1 + 0.2, meta={"correct": True}),  # a reward with no exact float32
       _rollout(7, 1, [1, 2, 3], [], float("nan"), finish_reason="cancelled", meta={"correct": False}),
       _rollout(7, 2, [1, 2, 3], [6], 1.0, finish_reason="eos")],
      [_rollout(2**31 - 1, 0, [9] * 10, list(range(22)), -0.0, finish_reason="stop",
                sampling=SamplingParams(temperature=0.7, top_k=40, top_p=0.95), left_out="surplus")],
  ]
  groups[0][0].logprobs[1] = np.float32(-1e-45)  # a denormal survives too
  packet = packets.encode(groups, max_len=32)
  assert packet.dtype == np.int32 and packet.shape == (4, packets.packet_width(32))
  back = packets.decode(packet, max_len=32)
  assert [[r.group_id for r in g] for g in back] == [[7, 7, 7], [2**31 - 1]]
  for want, got in zip([r for g in groups for r in g], [r for g in back for r in g], strict=True):
    for field in ("prompt_tokens", "completion_tokens", "logprobs", "versions"):
      a, b = getattr(want, field), getattr(got, field)
      assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), field
    assert np.float64(want.reward).tobytes() == np.float64(got.reward).tobytes()
    assert (want.finish_reason, want.sample_index, want.left_out) == (got.finish_reason, got.sample_index,
                                                                      got.left_out)
    assert got.meta == {k: v for k, v in want.meta.items() if k == "correct"}
    assert got.sampling == want.sampling  # exactly: the learner refuses tokens drawn under other settings


def test_packet_carries_the_loss_mask_of_multi_turn_samples():
  """Observation tokens (loss mask 0) cross as version -1 and come back masked; a version -1 elsewhere is refused."""
  r = _rollout(4, 0, [1, 2], [5, 6, 7, 8, 9], 1.0)
  r.versions[1:3] = -1
  r.logprobs[1:3] = 0.0
  r.loss_mask = np.array([1, 0, 0, 1, 1], np.float32)
  (back,), = packets.decode(packets.encode([[r]], max_len=16), max_len=16)
  np.testing.assert_array_equal(back.loss_mask, r.loss_mask)
  assert back.min_version == r.min_version >= 0
  r.loss_mask = None
  with pytest.raises(ValueError, match="exactly the observation tokens"):
    packets.encode([[r]], max_len=16)


def test_packet_errors_name_the_problem():
  with pytest.raises(ValueError, match="group 3 sample 0 has 9 tokens, more than max_len=8"):
    packets.encode([[_rollout(3, 0, [1] * 5, [2] * 4, 1.0)]], max_len=8)
  with pytest.raises(ValueError, match=r"does not match max_len=8 \(expected \[rows, 41\], routing None\)"):
    packets.decode(np.zeros((2, 5), np.int32), max_len=8)
  routed, dense = _rollout(4, 1, [1, 2], [3], 1.0), _rollout(4, 0, [1, 2], [3], 1.0)
  routed.experts = np.zeros((1, 2, 2), np.int16)
  with pytest.raises(ValueError, match=r"must share a routing shape .*\(2, 2\)"):
    packets.encode([[dense, routed]], max_len=8)
  packet = packets.encode([[routed]], max_len=8)
  with pytest.raises(ValueError, match=r"expected \[rows, 57\], routing \(2, 2\)"):
    packets.decode(packet[:, :-1], max_len=8)


def test_packet_carries_mixture_of_experts_routing_bit_for_bit():
  """Routing replay across processes: each completion token's and prompt input's recorded experts (layers x
  experts per token, -1 where none was recorded) come back exactly, an odd count of int16 entries included; the
  width says the shape. A prompt without recorded routing comes back without."""
  rng = np.random.default_rng(0)
  samples = [_rollout(5, i, [1, 2, 3], list(range(4 + i)), 0.5) for i in range(2)]
  for r in samples:
    r.experts = rng.integers(-1, 64, (len(r.completion_tokens), 3, 3)).astype(np.int16)
  samples[0].prompt_experts = rng.integers(0, 64, (2, 3, 3)).astype(np.int16)
  packet = packets.encode([samples], max_len=11)  # 11 * 3 * 3 = 99 int16 entries: one padded word
  assert packet.shape == (2, packets.packet_width(11, (3, 3))) == (2, 17 + 33 + 50)
  back, = packets.decode(packet, max_len=11)
  for want, got in zip(samples, back, strict=True):
    assert got.experts.dtype == np.int16 and got.experts.tobytes() == want.experts.tobytes()
  assert back[0].prompt_experts.tobytes() == samples[0].prompt_experts.tobytes() and back[1].prompt_experts is None
  dense, = packets.decode(packets.encode([[_rollout(6, 0, [1], [2, 3], 1.0)]], max_len=11), max_len=11)
  assert dense[0].experts is None


# ---- roles ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int


def _devices(processes, per_process):
  return [FakeDevice(p * 100 + i, p) for p in range(processes) for i in range(per_process)]


def test_topology_learner_first_then_one_sampler_per_process():
  devices = _devices(4, 2)
  topo = Topology.split(4, devices, process_id=3)
  assert topo.learner_processes == (0, 1) and topo.sampler_processes == (2, 3)
  assert topo.learner_devices == tuple(devices[:4])
  assert topo.sampler_devices == (tuple(devices[4:6]), tuple(devices[6:]))
  assert (topo.role, topo.sampler_rank, topo.lead) == ("sampler", 1, 0)
  assert [topo.name(p) for p in range(4)] == ["learner 0", "learner 1", "sampler 0", "sampler 1"]
  assert Topology.split(2, devices, process_id=1).role == "learner"
  with pytest.raises(ValueError, match="cuts through a process"):
    Topology.split(3, devices, process_id=0)


def test_source_devices_spread_over_learner_hosts():
  learner = _devices(2, 2)
  assert source_devices(learner, 2, replica=0) == learner[:2]
  assert source_devices(learner, 2, replica=1) == learner[2:]
  assert source_devices(learner, 1, replica=3) == [learner[3]]
  with pytest.raises(ValueError, match="replica of 5 devices needs as many learner devices"):
    source_devices(learner, 5, replica=0)


# ---- weights -------------------------------------------------------------------------------------------------------


def test_weight_route_stages_the_destination_layout_and_copies_exactly():
  """Learner FSDP over devices 0-3, a sampler replica with tensor parallelism over 4-7: the source arrays have the
  replica's exact layout on learner devices (what a cross-host copy requires), and the copy is the params."""
  devices = jax.devices()
  cfg = ModelConfig.tiny(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
  params = nnx.split(Decoder(cfg, nnx.Rngs(0)))[1]
  learner = sharding.make_mesh({"fsdp": 4}, devices[:4])
  params = jax.device_put(params, sharding.param_shardings(params, learner, sharding.LEARNER_RULES))
  replica = sharding.make_mesh({"data": 2, "tensor": 2}, devices[4:8])
  abstract = abstract_params(cfg)[1]
  dst = sharding.param_shardings(abstract, replica, sharding.SAMPLER_RULES)
  route = WeightRoute(abstract, dst, source_devices(devices[:4], 4, replica=1))
  replicated = jax.jit(lambda p: p, out_shardings=NamedSharding(learner, P()))(params)
  staged = route.stage(replicated)
  want_dst = jax.tree.leaves(jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), dst, abstract))
  assert any(s.spec != P(*[None] * len(s.spec)) for s in want_dst)  # some parameters really are split
  for x, s in zip(staged, want_dst, strict=True):
    assert x.sharding.spec == s.spec and x.sharding.mesh.axis_names == s.mesh.axis_names
    assert x.sharding.mesh.devices.shape == s.mesh.devices.shape
    assert set(x.sharding.device_set) <= set(devices[:4])
  copied = route.copy(staged)
  for want, got, s in zip(jax.tree.leaves(params), jax.tree.leaves(copied), want_dst, strict=True):
    assert got.sharding == s
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_shard_dumps_reassemble_whole_arrays(tmp_path):
  mesh = sharding.make_mesh({"fsdp": 4}, jax.devices()[:4])
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  tree = {"w": jax.device_put(x, NamedSharding(mesh, P("fsdp"))), "r": jax.device_put(x[0], NamedSharding(mesh, P()))}
  save_local_shards(tree, tmp_path / "a.npz")
  out = load_shards([tmp_path / "a.npz"])
  assert out["['w']"].tobytes() == x.tobytes() and out["['r']"].tobytes() == x[0].tobytes()

  np.savez(tmp_path / "half.npz", **{"['w']|8,4|0:2,0:4": x[:2]})
  with pytest.raises(ValueError, match=r"\['w'\]: shards do not cover the whole array"):
    load_shards([tmp_path / "half.npz"])
  np.savez(tmp_path / "other.npz", **{"['r']|4|0:4": x[0] + 1})
  with pytest.raises(ValueError, match=r"\['r'\]: replicated shards disagree"):
    load_shards([tmp_path / "a.npz", tmp_path / "other.npz"])


# ---- watchdog ------------------------------------------------------------------------------------------------------


class FakeStore:
  def __init__(self):
    self.values, self.counters, self.down = {}, collections.Counter(), False

  def _up(self):
    if self.down:
      raise RuntimeError("UNAVAILABLE: connection refused")

  def incr(self, key, n=1):
    self._up()
    self.counters[key] += n
    return self.counters[key]

  def count(self, key):
    return self.incr(key, 0)

  def set(self, key, value):
    self._up()
    self.values[key] = value

  def try_get(self, key, default=None):
    self._up()
    return self.values.get(key, default)


class Clock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


NAMES = {0: "learner 0", 1: "learner 1", 2: "sampler 0"}.get


def test_watchdog_names_the_silent_process_and_stops_everyone():
  store, clock = FakeStore(), Clock()
  dog = Watchdog(store, 0, NAMES, 3, timeout_s=10, clock=clock)
  assert dog.check() is None
  for t in (4.0, 8.0, 12.0):
    clock.t = t
    store.incr("hb/1")  # learner 1 keeps beating, sampler 0 went silent at t=0
    reason = dog.check()
  assert reason == "process 2 (sampler 0) sent no heartbeat for 12s: it died or hangs"
  assert store.values["stop"] == reason and dog.dead == 2
  assert store.counters["hb/0"] == 4


def test_watchdog_ignores_a_clean_exit_and_follows_a_stop_request():
  store, clock = FakeStore(), Clock()
  dog = Watchdog(store, 1, NAMES, 3, timeout_s=10, clock=clock)
  dog.check()
  store.values["exit/0"] = store.values["exit/2"] = True
  clock.t = 60.0
  assert dog.check() is None
  store.values["stop"] = "process 2 (sampler 0) failed: ValueError: bad reward"
  assert dog.check() == "process 2 (sampler 0) failed: ValueError: bad reward"


def test_watchdog_gives_up_on_a_lost_store():
  store, clock = FakeStore(), Clock()
  dog = Watchdog(store, 2, NAMES, 3, timeout_s=10, clock=clock)
  dog.check()
  store.down = True
  clock.t = 5.0
  assert dog.check() is None  # a blip is tolerated
  clock.t = 11.0
  assert dog.check().startswith("lost the coordination service for 11s (process 0 runs it): ")


def test_process_zero_leaves_last_so_that_the_others_can_read_why():
  class SlowLeavers(FakeStore):
    def try_get(self, key, default=None):
      self.reads += 1
      if self.reads == 5:
        self.values["gone/1"] = True
      return super().try_get(key, default)

  store, clock, exits = SlowLeavers(), Clock(), []
  store.reads = 0
  dog = Watchdog(store, 0, NAMES, 3, timeout_s=10, clock=clock, exit=exits.append)
  dog.dead = 2  # never comes back: not waited for
  dog.leave(3)
  assert exits == [3] and store.values["gone/0"] and store.reads >= 5


# ---- launcher ------------------------------------------------------------------------------------------------------


def test_launcher_kills_the_rest_after_a_failure_and_reports_it(tmp_path, monkeypatch, capsys):
  (tmp_path / "job.py").write_text(textwrap.dedent("""
      import os, sys, time
      me = int(os.environ["JAXRL_PROCESS_ID"])
      env = os.environ
      print(f"process {me} of {env['JAXRL_NUM_PROCESSES']} at {env['JAX_COORDINATOR_ADDRESS']}", flush=True)
      if me == 1:
        sys.exit(5)
      time.sleep(600)  # a process that would hang forever
  """))
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  assert launch.main(["--num_processes=3", "--module=job", "--grace_s=1", "--", "--unused"]) == 5
  out = capsys.readouterr().out
  assert "process 1 failed (exit status 5)" in out
  assert "killing process 0, still running 1s after the failure" in out
  assert "process 0: killed by SIGKILL, process 1: exit status 5, process 2: killed by SIGKILL" in out
  assert "] process 2 of 3 at 127.0.0.1:" in out


def test_launcher_passes_a_sigterm_on_to_every_process(tmp_path, monkeypatch, capsys):
  (tmp_path / "graceful.py").write_text(textwrap.dedent("""
      import os, pathlib, signal, sys, time
      me = os.environ["JAXRL_PROCESS_ID"]
      def stop(signum, frame):
        print(f"process {me}: SIGTERM, stopping", flush=True)
        sys.exit(143)
      signal.signal(signal.SIGTERM, stop)
      pathlib.Path(sys.argv[1], f"ready{me}").touch()
      time.sleep(600)
  """))
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))

  def preempt():  # what a cluster does to the launcher once every process is up
    while len(list(tmp_path.glob("ready*"))) < 2:
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)

  before = signal.getsignal(signal.SIGTERM)
  threading.Thread(target=preempt, daemon=True).start()
  assert launch.main(["--num_processes=2", "--module=graceful", "--grace_s=30", "--", str(tmp_path)]) == 143
  out = capsys.readouterr().out
  assert "jaxrl.launch: SIGTERM: passing it on to every process" in out
  assert "] process 0: SIGTERM, stopping" in out and "] process 1: SIGTERM, stopping" in out
  assert "process 0: exit status 143, process 1: exit status 143" in out and "killing" not in out
  assert signal.getsignal(signal.SIGTERM) is before  # the launcher's handler is gone with the job


def test_a_cpu_job_caches_only_programs_that_run_on_one_process(tmp_path, monkeypatch, capsys):
  """The persistent compilation cache is off in a multi-process CPU job whose learner spans processes: with it,
  process 0 alone ran executables loaded from the cache (its key holds each process's own CPU topology) beside the
  others' fresh compiles, whose collectives XLA:CPU issued in another order, and a 2-learner-process job hung
  (runtime.initialize). With the learner on one process no program crosses processes, and the cache is back on
  (runtime.cache_process_local_programs): process 0, the one JAX lets write, caches its programs."""
  cache = tmp_path / "cache"
  (tmp_path / "cache_probe.py").write_text(textwrap.dedent(f"""
      import os
      import jax, numpy as np
      from jax.sharding import NamedSharding, PartitionSpec as P
      from jaxrl.distributed import runtime
      runtime.initialize()
      jax.config.update("jax_compilation_cache_dir", {str(cache)!r})
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
      jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
      topology = runtime.Topology.split(1, jax.devices(), jax.process_index())  # one sampler process: the last
      on = runtime.cache_process_local_programs(topology)
      learners = topology.learner_devices
      if len(learners) == 2 and jax.process_index() in topology.learner_processes:  # a learner across processes
        mesh = jax.make_mesh((2,), ("data",), devices=learners)
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")),
                                                   np.full(3, jax.process_index() + 1.0))
        total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
      else:
        total = jax.jit(lambda a: a.sum())(jax.device_put(np.full(3, 3.0), jax.local_devices()[0]))
      jax.effects_barrier()
      entries = len(os.listdir({str(cache)!r})) if os.path.isdir({str(cache)!r}) else 0
      print(f"process {{jax.process_index()}}: cache {{on}}, sum {{float(total)}}, cache entries {{entries}}",
            flush=True)
  """))
  monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
  assert launch.main(["--num_processes=3", "--devices_per_process=1", "--module=cache_probe", "--"]) == 0
  out = capsys.readouterr().out
  for p in range(3):
    assert f"] process {p}: cache False, sum 9.0, cache entries 0" in out, out[-2000:]
  assert launch.main(["--num_processes=2", "--devices_per_process=1", "--module=cache_probe", "--"]) == 0
  out = capsys.readouterr().out
  assert "] process 0: cache True, sum 9.0, cache entries 1" in out, out[-2000:]
  assert "] process 1: cache True, sum 9.0" in out, out[-2000:]


def test_launcher_success_and_usage(tmp_path, monkeypatch, capsys):
  (tmp_path / "ok.py").write_text("print('hello')\n")
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  assert launch.main(["--num_processes=2", "--module=ok", "--"]) == 0
  assert "all 2 processes finished" in capsys.readouterr().out
  assert launch.main(["--num_processes=2"]) == 2
  with pytest.raises(ValueError, match="at least 2 processes"):
    launch.launch(1, [])
  assert launch.main(["--independent_samplers=1", "--learner_processes=0", "--", "--workdir=x"]) == 2
  assert "jaxrl.launch: --learner_processes must be at least 1 (got 0)" in capsys.readouterr().err


# ---- config checks and launch scripts ----------------------------------------------------------------------------


def _tiny(**overrides):
  c = tiny.get_config()
  c.log.tensorboard = c.log.progress = False
  return config_lib.override(c, **overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"mesh.num_devices": 6}, "a multi-process run uses every device of the job"),
    ({"mesh.sampler_axes": {"data": -1, "tensor": 4}}, r"mesh.sampler_axes on a sampler replica of 2 device\(s\)"),
    ({"rl.groups_per_step": 3, "rl.num_minibatches": 1},  # 12 rows: one mini-batch over 4 learner devices
     "rl.groups_per_step=3 does not split evenly over the 2 sampler replicas"),
])
def test_bad_multiprocess_configs_fail_before_any_work(tmp_path, overrides, message):
  topology = Topology.split(4, _devices(4, 2), process_id=0)
  with pytest.raises(config_lib.ConfigError, match=message):
    build(_tiny(**overrides), tmp_path, topology, store=None)


def test_a_replica_larger_than_the_learner_is_a_config_error(tmp_path):
  devices = [FakeDevice(0, 0), *_devices(4, 2)[2:]]  # learner: 1 device; sampler replicas: 2 devices each
  topology = Topology.split(6, devices, process_id=0)
  with pytest.raises(config_lib.ConfigError, match="a sampler replica of 2 devices needs as many learner devices"):
    build(_tiny(**{"rl.groups_per_step": 3, "rl.num_minibatches": 1, "mesh.sampler_devices": 6}), tmp_path, topology,
          store=None)  # 12 rows


@pytest.mark.parametrize("script", ["local.sh", "tpu_vm.sh", "slurm_gpu.sbatch"])
def test_launch_scripts_parse_and_name_real_configs_and_fields(script):
  path = REPO / "launch" / script
  subprocess.run(["bash", "-n", str(path)], check=True)
  text = path.read_text()
  assert "jaxrl.distributed." in text
  configs = set(re.findall(r"configs/\w+\.py", text))
  assert configs and all((REPO / c).is_file() for c in configs), configs
  c = config_lib.base()
  for field in re.findall(r"--config\.([\w.]+)=", text):
    node = c
    for part in field.split("."):
      assert part in node, f"{script}: --config.{field} is not a config field"
      node = node[part]


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-q"]))


def test_cpu_sets_split_and_explicit():
  avail = {0, 1, 2, 3, 4, 5, 6, 7}
  assert launch.cpu_sets("split", 2, avail) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
  assert launch.cpu_sets("split", 3, avail) == [{0, 1}, {2, 3}, {4, 5}]
  assert launch.cpu_sets("0-2;3,5;7", 3, avail) == [{0, 1, 2}, {3, 5}, {7}]
  assert launch.cpu_sets("", 2, avail) is None and launch.cpu_sets("none", 2, avail) is None


@pytest.mark.parametrize("spec, n, match", [
    ("split", 3, "2 cores for 3 processes"),
    ("0;1;1", 3, "3 core sets for 3 processes|processes 1 and 2 share cores"),
    ("0;5", 2, r"process 1 asks for cores \[5\]"),
    ("0;x", 2, "bad core list 'x'"),
    ("0", 2, "names 1 core sets for 2 processes"),
])
def test_cpu_sets_bad_specs(spec, n, match):
  with pytest.raises(ValueError, match=match):
    launch.cpu_sets(spec, n, {0, 1})


def test_launcher_pins_each_process_to_its_cores(tmp_path, monkeypatch, capsys):
  (tmp_path / "where.py").write_text("import os; print('cores', sorted(os.sched_getaffinity(0)), flush=True)\n")
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  cores = sorted(os.sched_getaffinity(0))
  assert launch.main(["--num_processes=2", "--module=where", "--cpu_affinity=split", "--"]) == 0
  out = capsys.readouterr().out
  half = len(cores) // 2
  assert "process 0 pid" in out and f"on cores {','.join(map(str, cores[:half]))}" in out
  assert f"cores {cores[:half]}" in out and f"cores {cores[half:2 * half]}" in out
  assert launch.main(["--num_processes=2", "--module=where", "--cpu_affinity=0;0", "--"]) == 2
  assert "processes 0 and 1 share cores [0]" in capsys.readouterr().err


class DictStore:
  """The coordination store's interface over a dict (one process stands in for the whole job)."""

  def __init__(self):
    self.values: dict = {}

  def set(self, key, value):
    self.values[key] = value

  def try_get(self, key, default=None):
    return self.values.get(key, default)

  def get(self, key, timeout_s):
    if key not in self.values:
      time.sleep(timeout_s)
      raise TimeoutError(key)
    return self.values[key]


def test_a_checkpoint_record_holds_every_admitted_unsettled_group_and_every_position_no_sampler_reached():
  """Resumed at data position 9 with groups 5 and 7 pending, on 1 learner + 2 sampler processes: sampler 1
  regenerates 5 and 7 and admits 9 first; then each sampler posts what it admitted. The lead's record: pending =
  admitted and neither trained nor skipped; unadmitted = positions below the new data position no sampler reached;
  the ledger adds the samplers' counts of the same posts."""
  devices = _devices(3, 1)
  learner = Topology.split(2, devices, process_id=0)
  record = RunRecord(next_group_id=9, pending_group_ids=[5, 7])
  record.ledger.groups_admitted = 8
  # the pass-rate table saved with the checkpoint (task.pass_rate_filter): a prompt set aside below position 20
  table = {"alike": {"a1": 1}, "until": {"b2": 20}}
  record.pass_rate = copy.deepcopy(table)
  record.ledger.samples_trained, record.ledger.dropped["filtered"] = 8, 12  # 2 groups trained, 3 filtered
  store = DictStore()
  lead = StoreCoordinator(store, learner, record, num_steps=10, group_size=4, max_failures_in_a_row=9)
  lead.learner_started(version=2, fresh=False)
  assert store.values["resume"] == {"version": 2, "fresh": False, "base": 10, "admit_k": None, "pass_rate": table,
                                    "filter": (3, 5), "regenerate": [[], [5, 7]], "unadmitted": [[], [9]]}
  assert record.ledger.samples_regenerated == 8  # 2 groups of 4

  sampler1 = StoreCoordinator(store, Topology.split(2, devices, process_id=2), RunRecord(), num_steps=10,
                              group_size=4, max_failures_in_a_row=9, poll_s=0.01)
  sampler1.sampler_started()
  sampler1.stop.set()  # its thread that follows the asks
  # a sampler process starts its own pass-rate table from the one the learners resumed from, not from nothing
  assert sampler1.resumed_pass_rate == table and sampler1.resumed_pass_rate is not record.pass_rate
  assert sampler1.resumed_filter == (3, 5)  # over-asking starts at the run's filter rate (assembly.scored_groups)
  admitted = []
  for _ in range(5):
    sampler1.admit(lambda gid, again: admitted.append(gid))
  assert admitted == [5, 7, 9, 11, 13] and sampler1.ledger.groups_admitted == 3  # 5 and 7 were counted before

  counts = {"groups_admitted": 2, "samples_generated": 8, "tokens_generated": 40, "skipped_prompts": 1}
  store.set("sampler/0", {"costs": {}, "admitted": {"next": 14, "left": [], "skipped": [12],
                                                    "skip_reasons": ["prompt of 40 tokens"], "ledger": counts}})
  store.set("sampler/1", {"costs": {}, "admitted": {"next": 11, "left": [7, 9], "skipped": [], "skip_reasons": [],
                                                    "ledger": {
      "groups_admitted": 0, "samples_generated": 4, "tokens_generated": 20, "skipped_prompts": 0}}})
  lead.settle([[_rollout(g, 0, [1], [2], 1.0)] for g in (10, 5)])  # trained
  saved = lead.checkpoint_record()
  # Admitted: 10 and 12 (sampler 0), 5 (regenerated; 7 is still due); 12 was skipped; 11 and 9 nobody reached.
  assert (saved["next_group_id"], saved["pending_group_ids"], saved["unadmitted_group_ids"]) == (13, [7], [9, 11])
  assert (saved["ledger"]["groups_admitted"], saved["ledger"]["samples_generated"]) == (10, 12)
  # The lead's trace shows each skip once, with its reason, before the record that counts it (LearnerLoop).
  assert lead.skips_to_trace() == [(12, "prompt of 40 tokens")]
  lead.checkpoint_record()
  assert lead.sampler_costs() == [{}, {}] and lead.skips_to_trace() == []
