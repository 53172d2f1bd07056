"""Checkpoints: the learner's TrainState (array pytree) and the run's host-side record (JSON) saved together.

Orbax writes each step into a temporary folder and renames it when complete, so a process killed mid-save leaves
the previous checkpoint intact. Restoring takes abstract arrays with shardings, so a checkpoint written on one
mesh or split resumes on another.

In a multi-process job only the learner processes hold the state: `processes` names them, and Orbax's barriers and
writes then involve those processes only (each writes its own shards; `primary` writes the metadata and the
record). The directory must be one that every one of them sees (a shared filesystem or a bucket).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def _savable(state):
  """PRNG key arrays are stored as their raw key data."""
  return state.replace(rng=jax.random.key_data(state.rng))


def _abstract_savable(abstract_state):
  rng = abstract_state.rng
  data = jax.eval_shape(jax.random.key_data, rng)
  sharding = getattr(rng, "sharding", None)
  return abstract_state.replace(rng=jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding))


class Checkpointer:
  """Saves (TrainState, record) every `every_steps` learner steps; keeps the newest `max_to_keep`."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, every_steps: int = 1,
               async_save: bool = True, processes: Sequence[int] | None = None, primary: int = 0,
               read_only: bool = False):
    if every_steps < 1:
      raise ValueError(f"checkpoint every_steps must be >= 1, got {every_steps}")
    self.directory = Path(directory).absolute()
    self.every_steps = every_steps
    # Orbax refuses a fully addressable jax.Array in a multi-process job ("Cannot serialize host local
    # jax.Array"), which is what the state is when one learner process holds all of it: that process saves the
    # values instead (the same files; a checkpoint of any split restores on any other).
    self._save_values = processes is not None and len(processes) == 1 and jax.process_count() > 1
    multiprocessing, create = ocp.options.MultiprocessingOptions(), True
    if processes is not None:
      self.directory.mkdir(parents=True, exist_ok=True)  # Orbax does not create it for a subset of processes
      create = False
      if primary not in processes:
        raise ValueError(f"the primary checkpoint process {primary} is not one of the saving processes {processes}")
      multiprocessing = ocp.options.MultiprocessingOptions(primary_host=primary, active_processes=set(processes),
                                                           barrier_sync_key_prefix="jaxrl-learners")
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                           create=create and not read_only, read_only=read_only,
                                           multiprocessing_options=multiprocessing)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.every_steps == 0

  def save(self, step: int, state, record: dict[str, Any], force: bool = False) -> bool:
    """Starts an (asynchronous) save of the state and the JSON record at `step`."""
    state = jax.device_get(_savable(state)) if self._save_values else _savable(state)
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
    return self._manager.save(step, args=args, force=force)

  def restore(self, abstract_state, step: int | None = None):
    """(state, record) at `step` (default: the newest), placed on the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract_savable(abstract_state)),
                              record=ocp.args.JsonRestore())
    out = self._manager.restore(step, args=args)
    state = out["state"]
    return state.replace(rng=jax.random.wrap_key_data(state.rng)), out["record"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
