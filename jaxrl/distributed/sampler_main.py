"""jaxrl-sampler: one sampler as its own program (its own JAX runtime, in no jax.distributed job), serving a
learner started by jaxrl-learner; it may start, die, be stopped or be preempted at any time.

  jaxrl-sampler --config=configs/tiny.py --learner=127.0.0.1:7470 --secret_file=/tmp/jaxrl-ind/run.secret

Every call to the learner proves the run's secret (--secret_file, or JAXRL_RUN_SECRET; distributed.secret).

It builds the sampler side as every topology does (controller.sides.build) and runs the single-host SamplerLoop on
remote channels (distributed.remote: coordinator and rollouts; distributed.weight_service: weights). A registration
ends when the run is done (exit 0), when the learner dropped this sampler (stopped past its lease: its groups went
to others; the results it still holds are sent once, to be refused and counted) or when the learner cannot be
reached (killed or restarting): the program then registers again, within --reconnect_s, pulls the learner's
version and starts a new loop on the same engine. SIGTERM says goodbye (the learner hands this sampler's groups
to the others at once) and exits 143.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax

from jaxrl import config as config_lib
from jaxrl import platforms
from jaxrl.controller import build as build_lib
from jaxrl.controller import sides
from jaxrl.controller import summary as summary_lib
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.sampler_loop import SamplerLoop
from jaxrl.distributed import packets, remote, rpc
from jaxrl.distributed import secret as secret_lib
from jaxrl.distributed.weight_service import WeightClient
from jaxrl.rollout import Rollout
from jaxrl.sharding import Versioned


class PulledWeights:
  """controller.interfaces.Weights over the weight service (of the learner process the hub named at registration);
  a learner that does not answer ends the registration."""

  timed_out = False  # a pull of this process timed out (its thread cannot be cancelled)

  def __init__(self, coord: remote.RemoteCoordinator, shardings, timeout_s: float):
    self.coord = coord
    describe = lambda request: coord.call("weights", at=coord.weights_at, **request)  # noqa: E731
    self.client = WeightClient(describe, shardings, sampler=coord.sampler, timeout_s=timeout_s)

  def take_newer(self, version: int) -> Versioned | None:
    try:
      return self.client.take_newer(version)
    except (TimeoutError, jax.errors.JaxRuntimeError) as e:  # the learner went away, or closed the pull's socket
      PulledWeights.timed_out |= isinstance(e, TimeoutError)  # its thread is left behind (weight_service)
      self.coord.end("lost", f"weights from {self.coord.address}: {(str(e).splitlines() or [''])[0]}")
      raise Stopped from None

  def first(self, timeout_s: float) -> Versioned:
    """The learner's newest version (it publishes one before it serves anyone)."""
    end = time.monotonic() + timeout_s
    while (newest := self.take_newer(-1)) is None:
      if time.monotonic() > end:
        raise TimeoutError(f"weights: the learner at {self.coord.address} published no version in {timeout_s:g}s")
      time.sleep(0.1)
    return newest


class SamplerChannels(sides.OneProcess):
  """The sampler program's channels (controller.sides.Channels): nothing of the learner is built here."""

  def __init__(self, learner: str, *, secret: bytes, timeout_s: float = 30.0, reconnect_s: float = 120.0,
               poll_s: float = 0.05):
    self.learner, self.timeout_s, self.reconnect_s, self.poll_s = learner, timeout_s, reconnect_s, poll_s
    self.secret = secret

  def wire(self, built: sides.Built) -> SamplerProgram:
    return SamplerProgram(built.config, built.sampler, self)


class SamplerProgram:
  """Registrations with the learner, one SamplerLoop each, until the run is done or this program is stopped."""

  def __init__(self, c, side: sides.SamplerSide, channels: SamplerChannels):
    self.c, self.side, self.ch = c, side, channels
    self.spec = build_lib.run_spec(c)
    self.coord: remote.RemoteCoordinator | None = None
    self.stopping: str | None = None  # the signal that stops this program
    self.ended: list[str] = []  # how each registration ended
    self.generated = 0
    self._left: tuple[remote.RemoteCoordinator, list[list[Rollout]]] | None = None

  def request_stop(self, name: str) -> None:
    self.stopping = name
    if self.coord is not None:
      self.coord.request_stop(name)

  def run(self) -> str:
    """How the program ended: "done" (the run is over) or the signal that stopped it."""
    ch = self.ch
    while self.stopping is None:
      coord = self.coord = remote.register(ch.learner, secret=ch.secret, timeout_s=ch.timeout_s,
                                           reconnect_s=ch.reconnect_s,
                                           poll_s=ch.poll_s, stopping=lambda: self.stopping is not None)
      if coord is None:  # stopped while the learner could not be reached
        break
      self._refuse_left()
      if coord.ended == "done":
        return "done"
      how = self._serve(coord)
      self.ended.append(how)
      if how == "done":
        return how
    return self.stopping

  def _serve(self, coord: remote.RemoteCoordinator) -> str:
    ch = self.ch
    weights = PulledWeights(coord, self.side.engine.publish_shardings, ch.timeout_s)
    coord.start_beating()  # the lease holds while the weights arrive and the loop compiles
    try:
      first = weights.first(ch.timeout_s)
    except Stopped:
      return coord.ended
    loop = SamplerLoop(self.spec, sampler=self.side.sampler(first.params, first.version), prompts=self.side.prompts,
                       score=self.side.score, rollouts=remote.RemoteRollouts(coord, self.spec.rl.queue_groups,
                                                                           self.c.sampler.max_len),
                       weights=weights, coord=coord, num_samplers=1)
    coord.book = lambda: loop.book  # its admission bound, and the shares it has taken
    print(f"jaxrl-sampler: sampler {coord.sampler} of {coord.address} from version {first.version}, weights from "
          f"{coord.weights_at or coord.address}", file=sys.stderr, flush=True)
    coord.guarded("sampler", loop.run, ch.poll_s)
    coord.raise_errors()
    self.generated += loop.ledger.samples_generated
    if self.stopping is not None or coord.ended == "done":
      try:
        coord.call("goodbye")
      except Stopped:
        pass
      return coord.ended or "stopped"
    self._left = (coord, loop.finished_held())
    return coord.ended

  def _refuse_left(self) -> None:
    """Sends what a lost registration still held, under its old name: the learner refuses and counts it."""
    if self._left is None:
      return
    old, groups = self._left
    self._left = None
    capacity = self.spec.rl.queue_groups  # the learner's frames hold a delivery of at most this many groups
    for at in range(0, len(groups), capacity):
      chunk = groups[at : at + capacity]
      request = {"sampler": old.sampler, "incarnation": old.incarnation, "tokens": [],
                 "packet": packets.encode(chunk, self.c.sampler.max_len)}
      try:
        rpc.call(old.address, "deliver", request, timeout_s=self.ch.timeout_s, secret=self.ch.secret)
      except rpc.RpcError as e:
        print(f"jaxrl-sampler: {e}; {len(groups) - at} groups of a lost registration not reported", file=sys.stderr)
        return


def main(argv=None):
  platforms.entry_point()
  from absl import flags
  from ml_collections import config_flags

  flags_def = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py[:arg]", lock_config=True)
  flags.DEFINE_string("learner", None, "HOST:PORT of the jaxrl-learner to serve")
  flags.DEFINE_float("timeout_s", 30.0, "every call to the learner (and weight pull) gets this long")
  flags.DEFINE_float("reconnect_s", 120.0, "how long to keep trying to register with an unreachable learner")
  flags.DEFINE_string("secret_file", None, "the run's secret (the learner's workdir/run.secret); else "
                      "$JAXRL_RUN_SECRET")
  flags.mark_flags_as_required(["config", "learner"])
  config_lib.parse_cli("jaxrl-sampler", argv)
  try:
    c = config_lib.validate(flags_def.config, None, num_devices=len(jax.devices()))
    config_lib.validate_data_files(c)
    secret = secret_lib.required(flags_def.secret_file, "jaxrl-sampler")
  except (config_lib.ConfigError, ValueError, OSError) as e:
    print(f"jaxrl-sampler: {e}", file=sys.stderr)
    sys.exit(2)
  roles = sides.Roles.single(c.mesh, jax.devices()[: c.mesh.num_devices])
  held = sides.Roles(roles.learner_devices, roles.sampler_devices, learner=False, sampler_rank=0, lead=False)
  channels = SamplerChannels(flags_def.learner, secret=secret, timeout_s=flags_def.timeout_s,
                             reconnect_s=flags_def.reconnect_s)
  program = sides.build(c, None, held, channels).runner
  code = 0
  try:
    with summary_lib.stop_on_signals(program.request_stop, (signal.SIGTERM,),
                                     "jaxrl-sampler: {name}: saying goodbye to the learner"):
      how = program.run()
    print(json.dumps({"ended": how, "registrations": program.ended, "samples_generated": program.generated}))
    code = 0 if how == "done" else summary_lib.exit_status(how)
  except (rpc.RpcError, TimeoutError) as e:  # the learner gone for good: one line naming it and the wait
    print(f"jaxrl-sampler: {e}", file=sys.stderr)
    code = 1
  finally:
    program.side.score.close()
  if PulledWeights.timed_out:  # a pull thread is stuck for good: a normal exit would abort in the runtime
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)


if __name__ == "__main__":
  main()
