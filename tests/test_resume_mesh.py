"""A checkpoint written with one sampler/learner split resumes on another split and mesh shape."""

import sys
from pathlib import Path

import jax
import numpy as np

from jaxrl.checkpoint import Checkpointer
from jaxrl.train import build, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402


def test_resume_on_a_different_split(tmp_path):
  c = tiny.get_config("sync")
  c.num_steps, c.checkpoint.every_steps = 2, 2
  c.log.tensorboard = c.log.progress = False
  train(c, tmp_path)
  saved = Checkpointer(tmp_path / "checkpoints")
  assert saved.latest_step() == 2
  saved.close()

  c2 = tiny.get_config("sync")
  c2.num_steps = 3
  c2.log.tensorboard = c2.log.progress = False
  c2.mesh.sampler_devices = 2  # was 4: learner now 6 devices as fsdp 2 x tensor 3
  c2.mesh.learner_axes = {"fsdp": 2, "tensor": 3}
  run = build(c2, tmp_path)
  try:
    assert run.resumed_from == 2
    state = run.controller.learner_loop.state
    assert int(state.version) == 2 and int(state.step) == 2
    leaf = state.params["blocks"]["mlp"]["up_proj"][...]
    assert len(leaf.sharding.device_set) == 6 and leaf.sharding.mesh.shape == {"fsdp": 2, "tensor": 3}
    assert run.controller.sampler_loop.sampler.version == 2
    assert run.controller.record.next_group_id == 2 * c.rl.groups_per_step  # data position restored
    run.controller.run()  # sync mode: the loop at max_staleness 0
    assert run.controller.version == 3
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(run.controller.learner_loop.state.params))
  finally:
    run.checkpointer.close()
    run.metrics.close()
    run.controller.sampler_loop.score.close()
