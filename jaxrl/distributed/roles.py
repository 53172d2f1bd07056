"""One process's role in a multi-process job: the learner loop or one sampler loop, over the cross-process
channels (distributed.cross_process), with the Ferry that moves their copies. Each runs until the lead learner reaches
num_steps (then every Ferry sees "done") or the job is stopped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxrl.controller.learner_loop import LearnerLoop
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.sampler_loop import SamplerLoop
from jaxrl.controller.spec import RunRecord
from jaxrl.distributed.cross_process import Ferry, ReceivedWeights, StoreCoordinator
from jaxrl.distributed.transfer import TransferLog
from jaxrl.sharding import Versioned


def _run(coord: StoreCoordinator, ferry: Ferry, body: Callable[[], None]) -> None:
  ferry.thread.start()
  try:
    body()
  finally:
    coord.stop.set()
  coord.raise_errors()


class LearnerProcess:
  """A learner process: SPMD over the learner mesh, in lock step with the other learner processes."""

  def __init__(self, loop: LearnerLoop, coord: StoreCoordinator, ferry: Ferry, log: TransferLog, record: RunRecord):
    self.loop, self.coord, self.ferry, self.log, self.record = loop, coord, ferry, log, record

  def run(self) -> None:
    _run(self.coord, self.ferry, self._learn)

  def _learn(self) -> None:
    loop, coord = self.loop, self.coord
    loop.log_start("sync" if loop.spec.max_staleness == 0 else "pipeline", self.record)
    coord.learner_started(loop.version, fresh=coord.resumed_from is None)
    loop.weights.publish(loop.state.params, loop.version)
    coord.guarded("learner", loop.run)
    if not coord.errors:
      loop.finish()  # on every learner process (a save over all of them), the final state
      loop.checkpointer.close()
      if coord.is_lead:
        self.log.append({"kind": "done"})
    self.ferry.thread.join()  # every copy up to "done" is issued: the samplers' last pulls can complete
    loop.drain()

  def close(self) -> None:
    if self.loop.metrics is not None:
      self.loop.metrics.close()
    if self.loop.trace is not None:
      self.loop.trace.close()

  def summary(self) -> dict[str, Any]:
    coord, loop = self.coord, self.loop
    return {"process": coord.topology.process_id, "role": coord.topology.name(coord.topology.process_id),
            "ledger": coord.ledger.to_json(), "samples_in_flight": loop.samples_in_flight(),
            "busy": {"learner": loop.busy}, "stopped_by": coord.store.try_get("stopped_by"), "version": loop.version,
            "trained_staleness": loop.trained_staleness, "resumed_from": coord.resumed_from}


class SamplerProcess:
  """A sampler process: one sampler replica on its own devices. Its loop is made once the first weights arrive;
  `evaluate` (the first replica's, or None) scores the held-out examples before a fresh run and after a finished
  one, as single-host jaxrl-train does."""

  def __init__(self, make_loop: Callable[[Versioned], SamplerLoop], coord: StoreCoordinator, ferry: Ferry,
               received: ReceivedWeights, score, evaluate: Callable[[Any, int], dict] | None = None,
               poll_s: float = 0.05):
    self.make_loop, self.coord, self.ferry, self.received = make_loop, coord, ferry, received
    self.score = score  # the reward function (its workers are closed at the end)
    self.evaluate, self.poll_s = evaluate, poll_s
    self.loop: SamplerLoop | None = None
    self.evals: dict[str, dict] = {}

  def run(self) -> None:
    _run(self.coord, self.ferry, self._sample)

  def _sample(self) -> None:
    coord = self.coord
    try:
      first = self.received.wait_first(coord.stop)
    except Stopped:
      return  # the transfer thread failed; run() raises its error
    self.loop = self.make_loop(first)
    resume = coord.sampler_started()
    if self.evaluate is not None and resume["fresh"]:
      self.evals["eval_before"] = self.evaluate(first.params, first.version)
    coord.guarded("sampler", self.loop.run, self.poll_s)
    self.ferry.thread.join()
    if self.evaluate is not None and not coord.errors and coord.store.try_get("stopped_by") is None:
      final = self.received.take_newer(-1)  # every version up to "done" has arrived: the trained policy
      self.evals["eval_after"] = self.evaluate(final.params, final.version)

  def close(self) -> None:
    self.score.close()

  def summary(self) -> dict[str, Any]:
    coord, loop = self.coord, self.loop
    newest = self.received.take_newer(-1)
    episodes = self.score.episodes  # a multi-turn env task's (Scorer), else None
    return {"process": coord.topology.process_id, "role": coord.topology.name(coord.topology.process_id),
            "ledger": coord.ledger.to_json(), "samples_in_flight": loop.samples_in_flight() if loop else 0,
            "busy": {"sampler": loop.busy if loop else 0.0}, "stopped_by": coord.store.try_get("stopped_by"),
            "sampler_version": newest.version if newest is not None else None,  # the newest params received
            "generated_tokens": loop.sampler.stats.generated_tokens if loop is not None else 0, **self.evals,
            **({"episodes": episodes.stats()} if episodes is not None else {})}
