"""Checkpoint integrity: each kind of damage to the newest checkpoint (bit flips in array data, a truncated file, a
missing file, no commit marker, a damaged run record, arrays that differ from the saved checksums) is named, the
checkpoint is set aside and the previous good one restored (it still exists); damage to every checkpoint stops the
CLI with exit status 2 naming the files; a save that fails (no space, permission, I/O error) ends the run with a
clear message and leaves the previous checkpoint intact, which retention does not delete; a run whose updates are
all non-finite right after a resume names the checkpoint it resumed from."""

import errno
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from faults_util import NUM_STEPS, TALLY, check_history, cli, committed_steps, inject, read_trace, run_cli, tiny_config
from orbax.checkpoint._src.path import atomicity

from jaxrl import integrity
from jaxrl import train as train_lib
from jaxrl.checkpoint import Checkpointer, SaveError

KEEP = {"checkpoint.max_to_keep": 3}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished sync run with checkpoints 2, 4 and 6, and the abstract state that restores them."""
  workdir = tmp_path_factory.mktemp("finished")
  with pytest.MonkeyPatch.context() as mp:
    built = inject(mp)
    train_lib.train(tiny_config("sync", **KEEP), workdir)
  state = built["run"].controller.learner_loop.state
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  assert committed_steps(workdir) == [2, 4, 6]
  return workdir, abstract


@pytest.fixture
def copy(finished, tmp_path):
  shutil.copytree(finished[0], tmp_path / "run")
  return tmp_path / "run"


def _data_files(step_dir: Path) -> list[Path]:
  return sorted(p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d")


def _flip_bits(step_dir):
  for p in _data_files(step_dir):  # one bit in the middle of every array data file
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x10
    p.write_bytes(b)
  return _data_files(step_dir)[0]


def _truncate(step_dir):
  p = max(_data_files(step_dir), key=lambda p: p.stat().st_size)
  p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
  return p


def _remove(step_dir):
  p = _data_files(step_dir)[-1]
  p.unlink()
  return p


def _no_marker(step_dir):
  (step_dir / integrity.MARKER).unlink()
  return step_dir / integrity.MARKER


def _damage_record(step_dir):
  p = step_dir / "record" / "metadata"
  record = json.loads(p.read_text())
  record["next_group_id"] += 1  # still valid JSON: only the checksums can tell
  p.write_text(json.dumps(record))
  return p


def _arrays_differ(step_dir):
  """Files as saved, but one array's recorded checksum differs (what a wrong restore would look like)."""
  p = step_dir / integrity.MARKER
  marker = json.loads(p.read_text())
  key = sorted(marker["arrays"])[0]
  marker["arrays"][key] = "0" * 16
  p.write_text(json.dumps(marker))
  return key


DAMAGE = {"bit_flips": _flip_bits, "truncated": _truncate, "missing_file": _remove, "no_marker": _no_marker,
          "damaged_record": _damage_record, "arrays_differ": _arrays_differ}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_restored(damage, finished, copy, capsys):
  named = DAMAGE[damage](copy / "checkpoints" / "6")
  ck = Checkpointer(copy / "checkpoints", max_to_keep=3)
  state, record = ck.restore(finished[1])
  ck.close()
  TALLY["checkpoints damaged"] += 1
  assert ck.restored_step == 4 and int(jax.device_get(state.version)) == 4 and record["next_group_id"] >= 16
  ((step, why),) = ck.rejected
  assert step == 6 and str(named) in why, why
  err = capsys.readouterr().err
  assert f"checkpoint 6 does not verify: {why}" in err and "resuming from checkpoint 4" in err and "2 steps" in err
  assert (copy / "checkpoints.rejected" / "6").is_dir() and committed_steps(copy) == [2, 4]  # set aside, kept


def test_resume_past_a_damaged_checkpoint_retrains_its_steps(copy):
  """The issue's case: 32 bytes zeroed in every data file of the newest checkpoint, then resumed."""
  for p in _data_files(copy / "checkpoints" / "6"):
    b = bytearray(p.read_bytes())
    b[len(b) // 2 : len(b) // 2 + 32] = bytes(32)
    p.write_bytes(b)
  summary = train_lib.train(tiny_config("sync", num_steps=NUM_STEPS + 2, **KEEP), copy)
  assert summary["resumed_from"] == 4 and summary["steps"] == NUM_STEPS + 2
  assert summary["ledger"]["samples_trained"] == (NUM_STEPS + 2) * 16
  assert committed_steps(copy) == [4, 6, 8]  # 6 saved again; 2 pruned only once 8 verified
  check_history(read_trace(copy / "trace.jsonl"), summary, group_size=4)


def test_no_checkpoint_verifies_the_cli_stops_with_status_2_naming_them(copy):
  flipped = [_flip_bits(copy / "checkpoints" / str(s)) for s in (2, 4)]
  _no_marker(copy / "checkpoints" / "6")
  proc = run_cli(cli(copy, "sync"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("jaxrl-train: no checkpoint in") and "Traceback" not in proc.stderr
  assert all(str(p) in last for p in flipped) and integrity.MARKER in last
  assert committed_steps(copy) == [2, 4]  # nothing set aside or deleted


def test_a_first_save_killed_before_its_marker_starts_afresh(copy, capsys):
  """Only unfinished saves (no commit marker anywhere): the same state as a kill a moment before Orbax's commit."""
  for s in (2, 4, 6):
    _no_marker(copy / "checkpoints" / str(s))
  ck = Checkpointer(copy / "checkpoints")
  assert ck.all_steps() == [] and ck.latest_step() is None
  ck.close()
  assert "finished saving" in capsys.readouterr().err
  assert sorted(p.name for p in (copy / "checkpoints.rejected").iterdir()) == ["2", "4", "6"]


def test_array_checksums_do_not_depend_on_the_sharding():
  x = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 7
  mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("d")))
  one, two = (integrity.to_hex(integrity.array_checksums({"x": a, "k": a.astype(jnp.bfloat16)}))
              for a in (x, sharded))
  assert one == two
  flipped = x.at[13, 5].set(jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x[13, 5], jnp.uint32) ^ 1,
                                                        jnp.float32))
  changed = integrity.to_hex(integrity.array_checksums({"x": flipped, "k": x.astype(jnp.bfloat16)}))
  assert changed["['x']"] != one["['x']"] and changed["['k']"] == one["['k']"]


_FINALIZE = atomicity.AtomicRenameTemporaryPath.finalize


@pytest.mark.parametrize("mode, error", [("sync", OSError(errno.ENOSPC, "No space left on device")),
                                         ("sync", PermissionError(errno.EACCES, "Permission denied")),
                                         ("pipeline", OSError(errno.EIO, "Input/output error"))],
                         ids=["no_space", "permission", "io_pipeline"])
def test_a_failed_save_ends_the_run_clearly_and_keeps_the_previous_checkpoint(mode, error, tmp_path, monkeypatch):
  async def failing_commit(self):  # the step-4 save's files are written; committing them fails
    if self.get_final().name == "4":
      raise error
    await _FINALIZE(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", failing_commit)
  built = inject(monkeypatch)
  with pytest.raises(Exception) as info:
    train_lib.train(tiny_config(mode, **{"checkpoint.max_to_keep": 1}), tmp_path)
  monkeypatch.undo()
  TALLY["checkpoint saves failed on purpose"] += 1
  err = info.value
  save_error = err if isinstance(err, SaveError) else err.__cause__
  assert isinstance(save_error, SaveError), repr(err)
  msg = str(save_error)
  assert f"saving checkpoint 4 in {tmp_path / 'checkpoints'} failed" in msg and error.strerror in msg
  assert "checkpoint 2 is intact" in msg
  assert committed_steps(tmp_path) == [2]  # max_to_keep=1, yet the only verified checkpoint was not deleted
  ck = Checkpointer(tmp_path / "checkpoints")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          built["run"].controller.learner_loop.state)
  state, _ = ck.restore(abstract)
  ck.close()
  assert ck.restored_step == 2 and not ck.rejected


def test_nonfinite_right_after_a_resume_names_the_checkpoint(finished, tmp_path, capsys):
  """A checkpoint that verifies but holds a broken state (NaN params saved as such): every update after the resume
  is skipped, and the run stops naming that checkpoint instead of blaming the data."""
  workdir, abstract = finished
  ck = Checkpointer(workdir / "checkpoints", read_only=True)
  state, record = ck.restore(abstract, 2)
  ck.close()
  broken = state.replace(params=jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), state.params))
  ck = Checkpointer(tmp_path / "checkpoints")
  ck.save(2, broken, record)
  ck.close()
  with pytest.raises(RuntimeError, match="no update has applied since the run resumed from checkpoint 2"):
    train_lib.train(tiny_config("sync", **{"rl.max_failures_in_a_row": 2}), tmp_path)
  assert "right after resuming from checkpoint 2" in capsys.readouterr().err
  assert not np.isfinite(np.asarray(jax.tree.leaves(broken.params)[0])).any()
