"""A single-host run: the sampler loop and the learner loop in two threads of one process, joined by the in-process
channels (the bounded rollout queue, the weight publisher, a LocalCoordinator)."""

from __future__ import annotations

import threading

import jax

from jaxrl.controller import sides
from jaxrl.controller.coordinator import LocalCoordinator
from jaxrl.controller.learner_loop import LearnerLoop
from jaxrl.controller.rollouts import RolloutQueue
from jaxrl.controller.sampler_loop import SamplerLoop
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.controller.weights import WeightPublisher


class LocalController:
  """Both role loops of one run and their channels; `run` drives them to spec.num_steps (or a stop request)."""

  def __init__(self, spec: RunSpec, *, sampler, train_step, state, publisher: WeightPublisher, prompts, score,
               record: RunRecord | None = None, checkpointer=None, metrics=None, on_step=None, trace=None,
               resumed_from: int | None = None, poll_s: float = 0.05, telemetry=None):
    self.spec, self.poll_s, self.record = spec, poll_s, record or RunRecord()
    self.coord = LocalCoordinator(self.record, spec.num_steps, spec.group_size, spec.max_failures_in_a_row,
                                  resumed_from, spec.max_filtered_in_a_row)
    self.rollouts = RolloutQueue(spec.queue_groups, self.coord.stop, poll_s)
    self.learner_loop = LearnerLoop(spec, train_step=train_step, state=state, rollouts=self.rollouts,
                                    weights=publisher, coord=self.coord, checkpointer=checkpointer, metrics=metrics,
                                    on_step=on_step, trace=trace, telemetry=telemetry)
    self.sampler_loop = SamplerLoop(spec, sampler=sampler, prompts=prompts, score=score, rollouts=self.rollouts,
                                    weights=publisher, coord=self.coord, trace=trace)

  # what a run's summary reads (controller.summary)
  @property
  def ledger(self):
    return self.coord.ledger

  @property
  def version(self) -> int:
    return self.learner_loop.version

  @property
  def stop_reason(self) -> str | None:
    return self.coord.stop_reason

  @property
  def busy(self) -> dict[str, float]:
    return {"sampler": self.sampler_loop.busy, "learner": self.learner_loop.busy}

  def samples_in_flight(self) -> int:
    return self.sampler_loop.samples_in_flight() + self.learner_loop.samples_in_flight()

  def request_stop(self, reason: str) -> None:
    self.coord.request_stop(reason)

  def finish(self) -> None:
    self.learner_loop.finish()

  def run(self, join_timeout_s: float = 60.0) -> None:
    coord = self.coord
    self.learner_loop.log_start("sync" if self.spec.max_staleness == 0 else "pipeline", self.record)
    threads = [threading.Thread(target=coord.guarded, args=("sampler", self.sampler_loop.run, self.poll_s),
                                name="jaxrl-sampler", daemon=True),
               threading.Thread(target=coord.guarded, args=("learner", self.learner_loop.run), name="jaxrl-learner",
                                daemon=True)]
    for t in threads:
      t.start()
    try:
      while any(t.is_alive() for t in threads) and not coord.stop.is_set():
        coord.stop.wait(self.poll_s)
    finally:
      coord.stop.set()
      for t in threads:
        t.join(join_timeout_s)
      self.learner_loop.drain()
      hung = [t.name for t in threads if t.is_alive()]
      if hung:
        coord.errors.append(("controller", TimeoutError(f"threads did not stop within {join_timeout_s}s: {hung}"), ""))
    coord.raise_errors()


class LocalChannels(sides.OneProcess):
  """The channels of one process holding both sides (controller.sides.Channels): those of a one-process learner,
  and a publisher that casts (or quantizes, for an int8 sampler) each version for the engine as it moves it."""

  def wire(self, built: sides.Built) -> LocalController:
    learner, sampler = built.learner, built.sampler
    state, engine = learner.state, sampler.engine
    publisher = WeightPublisher(engine.publish_shardings, engine.dtype, weight_dtype=engine.weight_dtype)
    return LocalController(learner.spec, sampler=sampler.sampler(state.params, int(jax.device_get(state.version))),
                           train_step=learner.train_step, state=state, publisher=publisher, prompts=sampler.prompts,
                           score=sampler.score, record=learner.record, checkpointer=learner.checkpointer,
                           metrics=learner.metrics, trace=learner.trace, resumed_from=learner.resumed_from,
                           telemetry=learner.telemetry)
