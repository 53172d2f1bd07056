"""Checkpoints: the learner's TrainState (array pytree) and the run's host-side record (JSON) saved together.

Orbax writes each step into a temporary folder and renames it when complete, so a process killed mid-save leaves
the previous checkpoint intact. Restoring takes abstract arrays with shardings, so a checkpoint written on one
mesh or split resumes on another.

Integrity (jaxrl.integrity): once a save is complete, a commit marker records a checksum of every saved array, of
the run record and of every file. Restore verifies them all; a checkpoint that does not verify is named, moved to
`checkpoints.rejected/`, and the newest one that verifies is restored instead (or IntegrityError if none does).
Retention deletes old checkpoints only once a newer one has its marker, so the newest verified one always stays.

In a multi-process job only the learner processes hold the state: `processes` names them, and Orbax's barriers and
writes then involve those processes only (each writes its own shards; `primary` writes the metadata, the record,
the marker and does the retention). The directory must be one that every one of them sees.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl import hostmem, integrity
from jaxrl.integrity import IntegrityError

__all__ = ["Checkpointer", "IntegrityError", "SaveError"]


class SaveError(RuntimeError):
  """A save that failed (no space, permission, an I/O error); the checkpoints saved before it are intact."""


def _savable(state):
  """PRNG key arrays are stored as their raw key data; a LoRA run's frozen base is not stored (it is the loaded
  model the run started from: restore gives frozen=None and the caller puts the base back)."""
  return _without_frozen(state.replace(rng=jax.random.key_data(state.rng)))


def _without_frozen(state):
  return state.replace(frozen=None) if getattr(state, "frozen", None) is not None else state


def _abstract_savable(abstract_state):
  rng = abstract_state.rng
  data = jax.eval_shape(jax.random.key_data, rng)
  sharding = getattr(rng, "sharding", None)
  return _without_frozen(abstract_state.replace(rng=jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)))


def _state_handler(compress: bool, multiprocessing: ocp.options.MultiprocessingOptions):
  """Orbax's StandardCheckpointHandler, its arrays written with or without zstd compression.

  Compressed, TensorStore holds each array's compressed chunks in host memory until the save is written: a save's
  peak RSS grows by about the compressed state and the save takes longer, for a modest saving of disk
  (docs/BENCHMARKS_HISTORY.md, "Under 4 GB (2026-12-05)"). Either kind restores with either setting."""
  handler = ocp.StandardCheckpointHandler(multiprocessing_options=multiprocessing)
  # It does not pass use_compression on: its PyTree handler is replaced by one that does (the same class stays
  # registered for StandardSave / StandardRestore; tests/test_checkpoint_compression.py checks what lands on disk).
  handler._impl = ocp.PyTreeCheckpointHandler(multiprocessing_options=multiprocessing, use_compression=compress)
  return handler


class Checkpointer:
  """Saves (TrainState, record) every `every_steps` learner steps; keeps the newest `max_to_keep` verified ones.

  compress: zstd-compress the saved arrays (less disk for model weights; a save then holds the compressed
  state in host memory until it is written, and takes about twice as long)."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, every_steps: int = 1,
               async_save: bool = True, processes: Sequence[int] | None = None, primary: int = 0,
               read_only: bool = False, compress: bool = False):
    if every_steps < 1 or max_to_keep < 1:
      raise ValueError(f"checkpoint every_steps and max_to_keep must be >= 1, got {every_steps}, {max_to_keep}")
    self.directory = Path(directory).absolute()
    self.every_steps, self.max_to_keep, self.read_only = every_steps, max_to_keep, read_only
    self.is_primary = processes is None or jax.process_index() == primary
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
    # Retention is ours (_prune): Orbax's would count a step whose marker is not written yet, or a damaged one.
    options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=async_save,
                                           create=create and not read_only, read_only=read_only,
                                           multiprocessing_options=multiprocessing)
    handlers = {"state": _state_handler(compress, multiprocessing),
                "record": ocp.JsonCheckpointHandler()}
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
    self._commit: threading.Thread | None = None  # waits for the save under way, then writes its marker
    self._error: SaveError | None = None  # a failed save: every later save, wait and close raises it
    self._reload = False  # steps were moved away: Orbax's list of steps is stale
    self.restored_step: int | None = None  # the step restore() returned (None: nothing restored)
    self.rejected: list[tuple[int, str]] = []  # (step, why) of checkpoints that did not verify

  def _steps_on_disk(self) -> list[int]:
    if not self.directory.is_dir():
      return []
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

  def verified_steps(self) -> list[int]:
    """Steps whose save completed (commit marker written); their contents are checked on restore."""
    return [s for s in self._steps_on_disk() if (self.directory / str(s) / integrity.MARKER).exists()]

  def _reload_if_needed(self) -> None:
    if self._reload:
      self._manager.reload()
      self._reload = False

  def latest_step(self) -> int | None:
    """The newest step saved or being saved."""
    self._reload_if_needed()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The step folders a resume considers. Folders without a commit marker when no folder has one are saves that
    never finished (killed between Orbax's commit and the marker, say): they are set aside and the run starts
    afresh, as it would have had the kill come a moment earlier."""
    steps = self._steps_on_disk()
    if steps and not self.verified_steps() and not self.read_only:
      print(f"jaxrl: no checkpoint in {self.directory} finished saving (none has its commit marker); starting afresh",
            file=sys.stderr, flush=True)
      self._set_aside(steps)
      return []
    return steps

  def should_save(self, step: int) -> bool:
    return step % self.every_steps == 0

  # ---- save ----------------------------------------------------------------------------------------------------

  def save(self, step: int, state, record: dict[str, Any], force: bool = False) -> bool:
    """Starts an (asynchronous) save of the state and the JSON record at `step`; raises SaveError if this or an
    earlier save failed."""
    self._finish_commit()
    self._reload_if_needed()
    savable = _savable(state)
    sums = integrity.array_checksums(savable)  # every learner process takes part (global arrays)
    if self._save_values:
      savable = jax.device_get(savable)
    args = ocp.args.Composite(state=ocp.args.StandardSave(savable), record=ocp.args.JsonSave(record))
    try:
      saved = self._manager.save(step, args=args, force=force)
    except Exception as e:
      self._error = self._save_error(step, e)
      raise self._error from e
    if saved:
      self._commit = threading.Thread(target=self._commit_step, args=(step, sums, integrity.record_digest(record)),
                                      name="jaxrl-checkpoint-commit", daemon=True)
      self._commit.start()
    return saved

  def _save_error(self, step: int, e: BaseException) -> SaveError:
    previous = [s for s in self.verified_steps() if s < step]
    kept = f"checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    return SaveError(f"saving checkpoint {step} in {self.directory} failed: {type(e).__name__}: {e}; {kept}. Free "
                     "space or fix the folder's permissions, then run the same command to resume")

  def _commit_step(self, step: int, sums: dict, record_sha256: str) -> None:
    try:
      self._manager.wait_until_finished()
      hostmem.trim()  # the save's host copies: freed, but kept by the writer threads' heaps
      arrays = integrity.to_hex(sums)
      if self.is_primary:
        integrity.write_marker(self.directory / str(step), arrays, record_sha256)
        self._prune()
    except Exception as e:  # noqa: BLE001 - raised on the caller's thread by the next save, wait or close
      self._error = self._save_error(step, e)
      self._error.__cause__ = e

  def _prune(self) -> None:
    """Deletes every step older than the newest `max_to_keep` verified ones."""
    keep = self.verified_steps()[-self.max_to_keep :]
    for s in self._steps_on_disk():
      if keep and s < keep[0]:
        shutil.rmtree(self.directory / str(s), ignore_errors=True)

  def _finish_commit(self) -> None:
    if self._commit is not None:
      self._commit.join()
      self._commit = None
    if self._error is not None:  # sticky: no later save may pass for good while an earlier one is missing
      raise self._error

  # ---- restore -------------------------------------------------------------------------------------------------

  def restore(self, abstract_state, step: int | None = None):
    """(state, record) at `step`, placed on the shardings of `abstract_state`, verified against the checksums saved
    with it. Without `step`: the newest checkpoint that verifies; those newer that do not are reported on stderr
    and moved to `<directory>.rejected/`. Raises IntegrityError if none (or `step`) verifies."""
    steps = self._steps_on_disk()[::-1] if step is None else [step]
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    for s in steps:
      try:
        state, record = self._restore_step(abstract_state, s)
      except IntegrityError as e:
        self.rejected.append((s, str(e)))
        print(f"jaxrl: checkpoint {s} does not verify: {e}", file=sys.stderr, flush=True)
        continue
      if self.rejected:
        self._set_aside([r for r, _ in self.rejected])
        print(f"jaxrl: resuming from checkpoint {s}, the newest that verifies, instead of {steps[0]}: "
              f"{steps[0] - s} steps to train again", file=sys.stderr, flush=True)
      self.restored_step = s
      return state, record
    raise IntegrityError(f"no checkpoint in {self.directory} verifies: "
                         + "; ".join(f"checkpoint {s}: {why}" for s, why in self.rejected)
                         + ". Move the folder away to start afresh")

  def _restore_step(self, abstract_state, step: int):
    step_dir = self.directory / str(step)
    if not step_dir.is_dir():
      raise IntegrityError(f"{step_dir}: missing")
    marker = integrity.read_marker(step_dir)
    integrity.check_files(step_dir, marker)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract_savable(abstract_state)),
                              record=ocp.args.JsonRestore())
    out = self._manager.restore(step, args=args)
    integrity.check_restored(step_dir, marker, integrity.to_hex(integrity.array_checksums(out["state"])),
                             out["record"])
    state = out["state"]
    return state.replace(rng=jax.random.wrap_key_data(state.rng)), out["record"]

  def _set_aside(self, steps: list[int]) -> None:
    """Moves damaged steps out of the way (kept for a post-mortem): the resumed run saves those steps again."""
    if self.read_only:
      return
    if self.is_primary:
      rejected = self.directory.parent / f"{self.directory.name}.rejected"
      rejected.mkdir(exist_ok=True)
      for s in steps:
        target, n = rejected / str(s), 1
        while target.exists():
          target, n = rejected / f"{s}.{n}", n + 1
        shutil.move(self.directory / str(s), target)
        print(f"jaxrl: checkpoint {s} moved to {target}", file=sys.stderr, flush=True)
    self._reload = True

  def wait(self) -> None:
    """Blocks until the save under way is committed (it then holds no reference to the state); raises SaveError
    if it failed."""
    self._finish_commit()

  @property
  def saving(self) -> bool:
    """A save has started and was not waited for."""
    return self._commit is not None

  def close(self) -> None:
    try:
      self._finish_commit()
    finally:
      self._manager.close()
