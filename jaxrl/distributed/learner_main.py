"""jaxrl-learner: the learner of a run whose samplers are independent programs (jaxrl-sampler), which join and
leave while it trains.

  jaxrl-learner --config=configs/tiny.py --workdir=/tmp/jaxrl-ind --port=7470
  jaxrl-sampler --config=configs/tiny.py --learner=127.0.0.1:7470      # as many as wanted, whenever
  python -m jaxrl.distributed.launch --independent_samplers=2 -- --config=configs/tiny.py --workdir=/tmp/jaxrl-ind

It builds the learner side as every topology does (controller.sides.build) on the config's learner devices, and
serves, on --port: the hub (distributed.hub: registration, leases, data positions, rollouts) and the weights
(distributed.weight_service: each published version pulled over jax.experimental.transfer). The learner loop is the
single-host one. SIGTERM stops after the current step with a checkpoint (exit 143); the same command resumes from
it, and the samplers, which keep trying to register for --reconnect_s, start over with the restarted learner. When
the run ends, the samplers are told so and exit. workdir/summary.json counts every admitted group: trained,
dropped, pending, or generated again (groups_generated_again: sampler_lost, sampler_left, late) with the samples
refused (samples_refused: fenced, late).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl import config as config_lib
from jaxrl import platforms
from jaxrl.controller import sides
from jaxrl.controller import summary as summary_lib
from jaxrl.controller.learner_loop import LearnerLoop
from jaxrl.distributed import rpc
from jaxrl.distributed.hub import Hub
from jaxrl.distributed.weight_service import WeightServer
from jaxrl.sampler.slot_engine import compute_dtype_name


class HubChannels(sides.OneProcess):
  """The learner program's channels (controller.sides.Channels): the hub and the weight server on one rpc port,
  for a learner that is one process."""

  def __init__(self, *, host: str = "127.0.0.1", port: int = 0, lease_s: float = 10.0, orphan_s: float = 600.0):
    self.host, self.port, self.lease_s, self.orphan_s = host, port, lease_s, orphan_s

  def wire(self, built: sides.Built) -> LearnerProgram:
    c, side = built.config, built.learner
    hub = Hub(side.record, side.spec, c.sampler.max_len, side.resumed_from, lease_s=self.lease_s,
              orphan_s=self.orphan_s)
    sampler_mesh = sides.Roles.single(c, jax.devices()[: c.mesh.num_devices]).sampler_meshes(c)[0]
    dtype = jnp.dtype(compute_dtype_name(c.sampler.dtype, side.learner.model_config, sampler_mesh))
    weights = WeightServer(dtype=dtype, weight_dtype=c.sampler.weight_dtype, host=self.host)
    loop = LearnerLoop(side.spec, train_step=side.train_step, state=side.state, rollouts=hub, weights=weights,
                       coord=hub, checkpointer=side.checkpointer, metrics=side.metrics, trace=side.trace,
                       telemetry=side.telemetry)
    server = rpc.Server({**hub.handlers(), "weights": weights.describe}, self.host, self.port)
    return LearnerProgram(c, side, hub, loop, weights, server)


class LearnerProgram:
  """The learner loop over the hub, and what it serves."""

  def __init__(self, c, side: sides.LearnerSide, hub: Hub, loop: LearnerLoop, weights: WeightServer,
               server: rpc.Server):
    self.c, self.side, self.hub, self.loop, self.weights, self.server = c, side, hub, loop, weights, server

  def run(self, linger_s: float = 5.0) -> None:
    """Trains to num_steps (or a stop request); then tells the samplers, waiting up to linger_s for their goodbyes,
    and closes. The final state is checkpointed whatever stopped the loop."""
    loop, hub = self.loop, self.hub
    loop.log_start("sync" if loop.spec.max_staleness == 0 else "pipeline", self.side.record)
    loop.weights.publish(loop.state.params, loop.version)
    print(f"jaxrl-learner: serving samplers on {self.server.address} from version {loop.version}", file=sys.stderr,
          flush=True)
    try:
      with summary_lib.stop_on_signals(hub.request_stop, (signal.SIGTERM,),
                                       "jaxrl-learner: {name}: stopping after the current step with a checkpoint"):
        hub.guarded("learner", loop.run)
    finally:
      loop.finish()
      if loop.version >= loop.spec.num_steps:
        hub.finish()
        end = time.monotonic() + linger_s
        while hub.registered() and time.monotonic() < end:
          time.sleep(0.05)
      self.close()
    loop.drain()
    hub.raise_errors()

  def close(self) -> None:
    self.server.close()
    self.weights.close()
    self.side.checkpointer.close()
    for writer in (self.side.metrics, self.side.trace):
      if writer is not None:
        writer.close()

  def summary(self, train_seconds: float) -> dict[str, Any]:
    loop, hub = self.loop, self.hub
    return summary_lib.run_summary(self.c.mode, version=loop.version, ledger=hub.ledger.to_json(),
                                   staleness=loop.trained_staleness, samples_in_flight=loop.samples_in_flight(),
                                   busy={"learner": loop.busy}, resumed_from=self.side.resumed_from,
                                   stopped_by=hub.stop_reason, topology="independent_samplers",
                                   samplers=dict(hub.samplers), train_seconds=train_seconds)


def train(c, workdir: str | Path, **channels) -> dict[str, Any]:
  """Runs the learner of config c with independent samplers to c.num_steps; returns (and writes) the summary."""
  workdir = Path(workdir)
  c = config_lib.validate(c, workdir, num_devices=len(jax.devices()))
  roles = sides.Roles.single(c, jax.devices()[: c.mesh.num_devices])
  held = sides.Roles(roles.learner_devices, roles.sampler_devices, learner=True, sampler_rank=None)
  program = sides.build(c, workdir, held, HubChannels(**channels)).runner
  t0 = time.perf_counter()
  program.run()
  summary = program.summary(time.perf_counter() - t0)
  summary_lib.write_summary(workdir, summary)
  return summary


def main(argv=None):
  platforms.skip_tpu_probe()
  from absl import flags
  from ml_collections import config_flags

  flags_def = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py[:arg]", lock_config=True)
  flags.DEFINE_string("workdir", None, "run folder: checkpoints, metrics, summary; an existing checkpoint resumes")
  flags.DEFINE_string("host", "127.0.0.1", "the address samplers reach this learner at")
  flags.DEFINE_integer("port", 0, "the port samplers call (0: a free one, printed)")
  flags.DEFINE_float("lease_s", 10.0, "a sampler silent this long is dropped; its groups are generated again")
  flags.DEFINE_float("orphan_s", 600.0, "give up (one line) when the learner waited this long for groups and none came")
  flags.mark_flags_as_required(["config", "workdir"])
  config_lib.parse_cli("jaxrl-learner", argv)
  try:
    summary = train(flags_def.config, flags_def.workdir, host=flags_def.host, port=flags_def.port,
                    lease_s=flags_def.lease_s, orphan_s=flags_def.orphan_s)
  except config_lib.ConfigError as e:
    print(f"jaxrl-learner: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(summary, indent=2, default=str))
  if "stopped_by" in summary:
    sys.exit(summary_lib.exit_status(summary["stopped_by"]))


if __name__ == "__main__":
  main()
