"""Checksums that let a checkpoint prove it is the one that was saved: one per array, one per file, one for the
run record, kept in a commit marker written once the save is complete.

Array checksums are computed on the devices from the global arrays (two wrapping uint32 sums over the raw bits,
one weighted by position), so they do not depend on the sharding: a checkpoint saved on one mesh verifies when
restored on another. File checksums (CRC-32 and size) name the damaged, truncated or missing file.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

MARKER = "jaxrl_commit.json"  # written last: a step folder without it is an unfinished save or a partial copy


class IntegrityError(RuntimeError):
  """A checkpoint that is not the one that was saved; the message names the step and what is wrong."""


def _bits_u32(x):
  """The raw bits of x as uint32 values (narrower types widened, 8-byte types split in two)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size < 4:
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32)  # adds a trailing axis of 2


# Elements summed at a time. Over a whole array XLA:CPU materialised the uint32 bits and the weighted product: two
# array-sized temporaries per leaf (twice the state: the peak of each save).
BLOCK = 1 << 20


def _block_sums(x_flat, start):
  """The two sums of a block of elements whose first uint32 word is word `start` of the array."""
  bits = _bits_u32(x_flat).ravel()
  weights = (start + jnp.arange(bits.size, dtype=jnp.uint32)) * 2 + 1  # odd: a change at any one position shows
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weights, dtype=jnp.uint32)])


def _checksum(x):
  """Two wrapping uint32 sums of the raw bits, one weighted by 2 * position + 1, taken block by block (sums modulo
  2^32 do not depend on the order, so the value is that of the whole array at once)."""
  flat = x.ravel()
  words = 2 if jnp.dtype(x.dtype).itemsize == 8 else 1  # uint32 words per element
  full, tail = divmod(flat.size, BLOCK)

  def body(i, acc):
    block = jax.lax.dynamic_slice_in_dim(flat, i * BLOCK, BLOCK)
    return acc + _block_sums(block, i.astype(jnp.uint32) * jnp.uint32(BLOCK * words))

  acc = jnp.zeros(2, jnp.uint32)
  if full:
    acc = jax.lax.fori_loop(0, full, body, acc)
  if tail:
    acc = acc + _block_sums(flat[full * BLOCK:], jnp.uint32(full * BLOCK * words))
  return acc


_checksums = jax.jit(lambda tree: jax.tree.map(_checksum, tree))


def array_checksums(tree) -> dict[str, Any]:
  """{path: uint32[2] device array} for every leaf; dispatched asynchronously (fetch with `to_hex`)."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  sums = _checksums([x for _, x in leaves])
  return {jax.tree_util.keystr(p): s for (p, _), s in zip(leaves, sums, strict=True)}


def to_hex(sums: dict[str, Any]) -> dict[str, str]:
  return {k: "".join(f"{int(v):08x}" for v in jax.device_get(s)) for k, s in sums.items()}


def record_digest(record: dict) -> str:
  return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _crc32(path: Path) -> str:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 20):
      crc = zlib.crc32(chunk, crc)
  return f"{crc:08x}"


def file_table(step_dir: Path) -> dict[str, list]:
  """{relative path: [size, crc32]} of every file of a step folder but the marker."""
  files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MARKER)
  return {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in files}


def write_marker(step_dir: Path, arrays: dict[str, str], record_sha256: str) -> None:
  """Writes the commit marker atomically (temporary file, fsync, rename), after every file of the step exists."""
  body = {"arrays": arrays, "record_sha256": record_sha256, "files": file_table(step_dir)}
  tmp = step_dir / (MARKER + ".tmp")
  with open(tmp, "w") as f:
    json.dump(body, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, step_dir / MARKER)


def read_marker(step_dir: Path) -> dict:
  path = step_dir / MARKER
  if not path.exists():
    raise IntegrityError(f"{path}: missing commit marker: the save did not finish (the process was killed or the "
                         "disk filled), or the folder was copied in part")
  try:
    marker = json.loads(path.read_text())
    assert {"arrays", "record_sha256", "files"} <= set(marker)
  except (ValueError, AssertionError, OSError) as e:
    raise IntegrityError(f"{path}: damaged commit marker ({type(e).__name__})") from None
  return marker


def check_files(step_dir: Path, marker: dict) -> None:
  """Raises IntegrityError naming the first file that is missing, truncated or whose checksum differs."""
  for rel, (size, crc) in marker["files"].items():
    path = step_dir / rel
    if not path.exists():
      raise IntegrityError(f"{path}: missing")
    actual = path.stat().st_size
    if actual != size:
      raise IntegrityError(f"{path}: {'truncated' if actual < size else 'grown'} ({actual} bytes, saved {size})")
    if _crc32(path) != crc:
      raise IntegrityError(f"{path}: checksum mismatch (the file's data changed after the save)")


def check_restored(step_dir: Path, marker: dict, arrays: dict[str, str], record: dict) -> None:
  """Raises IntegrityError if the restored arrays or run record differ from what was saved."""
  if record_digest(record) != marker["record_sha256"]:
    raise IntegrityError(f"{step_dir / 'record'}: run record differs from the one saved (checksum mismatch)")
  if set(arrays) != set(marker["arrays"]):
    raise IntegrityError(f"{step_dir / 'state'}: holds other arrays than were saved "
                         f"({sorted(set(arrays) ^ set(marker['arrays']))[:3]} ...)")
  bad = [k for k in arrays if arrays[k] != marker["arrays"][k]]
  if bad:
    raise IntegrityError(f"{step_dir / 'state'}: {len(bad)} arrays differ from those saved (checksum mismatch), "
                         f"first {bad[0]}")
