"""jaxrl-train: builds a run from a config and drives it with the controller (sync mode: max_staleness 0).

  jaxrl-train --config=configs/tiny.py --workdir=/tmp/jaxrl-tiny
  jaxrl-train --config=configs/default.py --config.mode=sync --workdir=runs/smollm2-sync

From a notebook: `from jaxrl.train import train; train(get_config(), workdir)`. A workdir holding a checkpoint
resumes from it (same step, version, data position and rng).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax

from jaxrl import config as config_lib
from jaxrl import console, hostmem, platforms
from jaxrl.checkpoint import IntegrityError, SaveError
from jaxrl.controller import auto, sides
from jaxrl.controller import summary as summary_lib
from jaxrl.controller.local import LocalChannels, LocalController
from jaxrl.envs import isolation
from jaxrl.envs.guard import RewardsBroken
from jaxrl.models import hf


@dataclasses.dataclass
class Run:
  """A run in this process: its two sides (controller.sides) and the `controller` that drives their loops."""

  config: config_lib.RunConfig
  workdir: Path
  controller: LocalController
  learner_side: sides.LearnerSide
  sampler_side: sides.SamplerSide

  @property
  def checkpointer(self):
    return self.learner_side.checkpointer

  @property
  def metrics(self):
    return self.learner_side.metrics

  @property
  def trace(self):
    return self.learner_side.trace

  @property
  def resumed_from(self) -> int | None:
    return self.learner_side.resumed_from


def build(c, workdir: str | Path) -> Run:
  """The run of config c (an ml_collections config or a RunConfig, validated here against this host's devices): from
  here on every piece gets the typed RunConfig, or its own section of it. This process holds both sides of the run,
  made by the build of every topology (controller.sides.build) and joined by the in-process channels."""
  return build_run(config_lib.validate(c, workdir, num_devices=len(jax.devices())), Path(workdir))


def build_run(c: config_lib.RunConfig, workdir: Path) -> Run:
  """The run of a validated RunConfig (build's, without checking it again)."""
  config_lib.validate_data_files(c)
  devices = jax.devices() if c.mesh.num_devices == -1 else jax.devices()[: c.mesh.num_devices]
  built = sides.build(c, workdir, sides.Roles.single(c.mesh, devices), LocalChannels())
  return Run(c, workdir, built.runner, built.learner, built.sampler)


def _close(run, *, score: bool) -> None:
  """Closes the run's checkpointer, metrics writers and trace (and its reward workers if `score`)."""
  run.checkpointer.close()
  run.metrics.close()
  if run.trace is not None:
    run.trace.close()
  if score:
    run.controller.sampler_loop.score.close()


def train(c, workdir: str | Path, stop_signals: tuple[int, ...] = (signal.SIGTERM,)) -> dict[str, Any]:
  """Runs a config to c.num_steps (resuming from workdir's checkpoint) and returns a summary.

  A signal in `stop_signals` (default SIGTERM, what a preempted TPU VM or a Slurm time limit sends; handled when
  called from the main thread) stops the run early after saving a checkpoint: the summary then has `stopped_by`
  and fewer steps; the same call resumes it. mode="auto" runs fixed-mode segments chosen by jaxrl.controller.auto."""
  workdir = Path(workdir)
  c = config_lib.validate(c, workdir, num_devices=len(jax.devices()))  # once: the typed RunConfig from here on
  if c.mode != "auto":
    summary, _ = _train_fixed(c, workdir, stop_signals)
    summary_lib.write_summary(workdir, summary)
    return summary
  def run_segment(seg_c, first: bool, last: bool):
    return _train_fixed(seg_c, workdir, stop_signals, evaluate_before=first, evaluate_after=last)

  devices = len(jax.devices()) if c.mesh.num_devices == -1 else c.mesh.num_devices
  summary = auto.supervise(c, workdir, run_segment, functools.partial(auto.metrics_records, workdir),
                           lambda: auto.run_context(c, devices))
  summary_lib.write_summary(workdir, summary)
  return summary


def _train_fixed(c: config_lib.RunConfig, workdir: Path, stop_signals, *, evaluate_before: bool = True,
                 evaluate_after: bool = True) -> tuple[dict[str, Any], list[int]]:
  """One fixed-mode run to c.num_steps: (its summary, the completion lengths of the samples it trained)."""
  run = build_run(c, workdir)
  ctl = run.controller
  evals = {}
  try:
    if evaluate_before and c.eval.num_examples and run.resumed_from is None:
      evals["eval_before"] = run.sampler_side.evaluate(ctl.learner_loop.state.params, ctl.version)[0]
  except BaseException:  # (e.g. a task with fewer held-out examples than asked) nothing ran: close what was opened
    _close(run, score=True)
    raise
  hostmem.trim()  # what loading, compiling and the first evaluation freed, before the steps add theirs
  t0 = time.perf_counter()
  finished = False
  evaluate_after = evaluate_after and bool(c.eval.num_examples)
  console.note(f"training to step {c.num_steps} from step {ctl.version} (the first step includes compiling)")
  try:
    with summary_lib.stop_on_signals(ctl.request_stop, stop_signals,
                                     "jaxrl: {name}: stopping after the current step and saving a checkpoint"):
      ctl.run()  # sync mode is this pipeline with max_staleness 0 (run_spec)
    finished = ctl.stop_reason is None
  finally:
    ctl.finish()
    _close(run, score=not (finished and evaluate_after))  # a failed run closes its reward workers too
  train_seconds = time.perf_counter() - t0
  if finished and evaluate_after:
    evals["eval_after"] = run.sampler_side.evaluate(ctl.learner_loop.state.params, ctl.version)[0]
    ctl.sampler_loop.score.close()
  summary = summary_lib.run_summary(c.mode, version=ctl.version, ledger=ctl.ledger.to_json(),
                                    staleness=ctl.learner_loop.trained_staleness,
                                    samples_in_flight=ctl.samples_in_flight(), busy=ctl.busy,
                                    resumed_from=run.resumed_from, stopped_by=ctl.stop_reason,
                                    train_seconds=train_seconds, **evals)
  episodes = getattr(run.sampler_side.task, "episodes", None)
  if episodes is not None:  # a multi-turn env task (the evals' episodes included)
    summary["episodes"] = episodes.stats()
  return summary, ctl.learner_loop.trained_lengths


def _cpu_devices() -> None:
  """On a CPU-only host, 8 virtual devices so the sampler and learner submeshes exist (no effect on GPU/TPU, and
  none once jax is initialised); an explicit JAX_NUM_CPU_DEVICES wins. Set by the CLI, not at import."""
  if "JAX_NUM_CPU_DEVICES" not in os.environ:
    jax.config.update("jax_num_cpu_devices", 8)


def main(argv=None):
  platforms.entry_point()
  _cpu_devices()
  hostmem.return_freed_memory()
  from absl import flags
  from ml_collections import config_flags

  flags_def = flags.FLAGS
  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py[:arg]", lock_config=True)
  flags.DEFINE_string("workdir", None, "run folder: checkpoints, metrics; an existing checkpoint resumes")
  flags.mark_flags_as_required(["config", "workdir"])
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save at INFO
  config_lib.parse_cli("jaxrl-train", argv)  # bad flags end here with one line, before any work
  try:
    with console.shown(console.for_terminal(flags_def.config.log.progress)):  # a terminal: the first minute, said
      summary = train(flags_def.config, flags_def.workdir)
  except (config_lib.ConfigError, hf.CheckpointError, FileNotFoundError, IntegrityError, RewardsBroken,
          isolation.Unavailable) as e:
    print(f"jaxrl-train: {e}", file=sys.stderr)
    sys.exit(2)
  except SaveError as e:
    print(f"jaxrl-train: {e}", file=sys.stderr)
    sys.exit(1)
  print(json.dumps(summary, indent=2, default=str))
  if "stopped_by" in summary:
    print(f"jaxrl-train: stopped by {summary['stopped_by']} at step {summary['steps']} of "
          f"{flags_def.config.num_steps}; checkpoint saved; the same command resumes the run", file=sys.stderr)
    sys.exit(summary_lib.exit_status(summary["stopped_by"]))


if __name__ == "__main__":
  main()
