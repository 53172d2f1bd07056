"""controller.sides: one build for every topology. jaxrl.train (both sides in one process) and a job of one learner
and one sampler process (jaxrl.distributed.job, one side each) make the same learner and sampler parts through
the same builders; only their channels differ."""

import ast
import collections
import dataclasses
import sys
from pathlib import Path

import jax
import pytest

from jaxrl import config as config_lib
from jaxrl import train as train_lib
from jaxrl.controller import build as build_lib
from jaxrl.controller import sides
from jaxrl.distributed import job as dist_job
from jaxrl.distributed.roles import LearnerProcess, SamplerProcess
from jaxrl.distributed.runtime import Topology

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402


@dataclasses.dataclass(frozen=True)
class OneHostJob(Topology):
  """A job of one learner process (learner_devices) and one sampler process (sampler_devices), both stood in for by
  this process: process_id (0 or 1) picks the one that is built."""

  @property
  def learner_processes(self):
    return (0,)

  @property
  def sampler_processes(self):
    return (1,)

  def devices_per_process(self):
    return [len(self.learner_devices), len(self.sampler_devices[0])]


class Store:
  """The coordination store's interface over a dict; barriers pass at once (one process stands in for the job)."""

  def __init__(self):
    self.values, self.counters, self.barriers = {}, collections.Counter(), []

  def set(self, key, value):
    self.values[key] = value

  def try_get(self, key, default=None):
    return self.values.get(key, default)

  def get(self, key, timeout_s):
    return self.values[key]

  def incr(self, key, n=1):
    self.counters[key] += n
    return self.counters[key]

  def count(self, key):
    return self.counters[key]

  def barrier(self, name, processes, timeout_s=3600.0):
    self.barriers.append((name, tuple(processes)))


def _config():
  c = tiny.get_config("pipeline")
  return config_lib.override(c, **{"log.tensorboard": False, "log.progress": False, "log.trace": True,
                                   "log.telemetry": True, "rl.compile_ahead": True, "rl.pack": True,
                                   "mesh.sampler_devices": 4})


def _spy(monkeypatch):
  """Records every side and engine built, and the channels each build was given."""
  made = collections.defaultdict(list)
  for name in ("learner_side", "sampler_side"):
    real = getattr(sides, name)

    def spy(*a, _real=real, _name=name, **kw):
      made[_name].append(_real(*a, **kw))
      return made[_name][-1]

    monkeypatch.setattr(sides, name, spy)
  real_build = sides.build
  monkeypatch.setattr(sides, "build", lambda c, workdir, roles, channels: made["channels"].append(
      type(channels).__name__) or real_build(c, workdir, roles, channels))
  real_engine = build_lib.build_engine
  monkeypatch.setattr(build_lib, "build_engine", lambda c, cfg, mesh, **kw: made["engine"].append(
      (cfg, dict(mesh.shape), kw)) or real_engine(c, cfg, mesh, **kw))
  return made


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding.spec), tree)


def _telemetry(t):
  return (t.work, t.learner, t.sampler)


def test_one_host_and_a_two_process_job_make_the_same_sides(tmp_path, monkeypatch):
  made = _spy(monkeypatch)
  c = _config()
  run = train_lib.build(c, tmp_path / "single")
  single = collections.defaultdict(list, made)
  made.clear()
  devices = jax.devices()
  store = Store()
  learner = dist_job.build(c, tmp_path / "job", OneHostJob(0, tuple(devices[:4]), (tuple(devices[4:]),)), store)
  job_learner = collections.defaultdict(list, made)
  made.clear()
  sampler = dist_job.build(c, tmp_path / "job", OneHostJob(1, tuple(devices[:4]), (tuple(devices[4:]),)), store)
  job_sampler = collections.defaultdict(list, made)
  try:
    assert isinstance(learner, LearnerProcess) and isinstance(sampler, SamplerProcess)
    # One build for both topologies; only the channels differ.
    assert (single["channels"], job_learner["channels"], job_sampler["channels"]) == (
        ["LocalChannels"], ["JobChannels"], ["JobChannels"])
    # Each process of the job builds its own side alone: the learner no engine, the sampler no learner.
    assert (len(single["learner_side"]), len(single["sampler_side"]), len(single["engine"])) == (1, 1, 1)
    assert (len(job_learner["learner_side"]), job_learner["sampler_side"], job_learner["engine"]) == (1, [], [])
    assert (job_sampler["learner_side"], len(job_sampler["sampler_side"])) == ([], 1)
    assert store.barriers == [("learners_compiled", (0,))]

    a, b = single["learner_side"][0], job_learner["learner_side"][0]
    assert a is run.learner_side and b.train_step is learner.loop.train_step and b.state is learner.loop.state
    assert a.spec == b.spec and a.spec.row_buckets
    assert a.learner.model_config == b.learner.model_config
    assert _shapes(a.state) == _shapes(b.state)
    # The train step compiled ahead for the same batch shapes, the same telemetry, both writing a trace.
    assert isinstance(a.train_step, build_lib.CompiledSteps) and isinstance(b.train_step, build_lib.CompiledSteps)
    assert set(a.train_step.compiled) == set(b.train_step.compiled) and len(a.train_step.compiled) > 1
    assert _telemetry(a.telemetry) == _telemetry(b.telemetry)
    assert a.trace is not None and b.trace is not None and a.metrics is not None and b.metrics is not None
    assert (a.resumed_from, b.resumed_from) == (None, None)

    s, t = single["sampler_side"][0], job_sampler["sampler_side"][0]
    assert s is run.sampler_side and t.score is sampler.score
    assert single["engine"] == job_sampler["engine"]  # the same model config, mesh shape and engine arguments
    for name in ("kv", "dtype", "weight_dtype", "max_slots", "max_len", "steps_per_call", "buckets"):
      assert getattr(s.engine, name) == getattr(t.engine, name), name
    (tokens_s, meta_s), (tokens_t, meta_t) = s.prompts(3), t.prompts(3)
    assert tokens_s.tolist() == tokens_t.tolist() and meta_s == meta_t and type(s.task) is type(t.task)
    # Only a multi-process sampler compiles the KV recompute of an in-flight update ahead.
    assert (s.compile_rebuilds, t.compile_rebuilds) == (False, True)
  finally:
    train_lib._close(run, score=True)
    learner.loop.checkpointer.close()
    learner.close()
    sampler.score.close()


def test_a_process_of_a_job_holds_the_side_of_its_topology_role():
  devices = jax.devices()
  topology = OneHostJob(1, tuple(devices[:4]), (tuple(devices[4:]),))
  assert dist_job.roles(topology) == sides.Roles(tuple(devices[:4]), (tuple(devices[4:]),), learner=False,
                                                   sampler_rank=0, lead=False)
  lead = dist_job.roles(dataclasses.replace(topology, process_id=0))
  assert (lead.learner, lead.sampler_rank, lead.lead) == (True, None, True)
  one = sides.Roles.single(config_lib.validate(_config()).mesh, devices)
  assert (one.learner_devices, one.sampler_devices, one.learner, one.sampler_rank, one.lead) == (
      tuple(devices[:4]), (tuple(devices[4:]),), True, 0, True)


PIECES = {"build_engine", "build_learner", "build_sampler", "build_task", "open_checkpointer", "open_metrics",
          "restore", "base_params", "CompiledSteps", "make_engine", "jit_train_step", "TraceWriter"}


@pytest.mark.parametrize("path", sorted((REPO / "jaxrl" / "distributed").glob("*.py")), ids=lambda p: p.name)
def test_the_distributed_package_builds_its_sides_only_through_controller_sides(path):
  calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
           for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)}
  assert not calls & PIECES, f"{path.name} builds {sorted(calls & PIECES)} itself: call controller.sides"
