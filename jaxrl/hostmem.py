"""Host memory that glibc keeps once it is freed, handed back to the system (the main job's RSS, issue 14).

No-ops where the C library is not glibc (macOS)."""

from __future__ import annotations

import ctypes

MMAP_THRESHOLD = 4 << 20  # bytes; glibc's M_MMAP_THRESHOLD
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _glibc():
  try:
    return ctypes.CDLL("libc.so.6")
  except OSError:
    return None


def return_freed_memory() -> bool:
  """Makes glibc map blocks of MMAP_THRESHOLD or more one by one and unmap them when freed (True if it took).

  By default glibc raises its mmap threshold (up to 32 MB) each time a mapped block is freed, after which such
  blocks come from per-thread heaps that keep them: Orbax's host copies of a save, XLA's buffers. RSS then stays
  near the sum of each thread's peak (a train step after a save peaks higher than before it:
  docs/BENCHMARKS_HISTORY.md, "The main job's memory (issue 14)"). Process-wide, so set by the CLI, not by the
  library."""
  libc = _glibc()
  return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim() -> bool:
  """Returns the free pages of every glibc heap to the system (malloc_trim; True if any was returned).

  Small blocks (below the mmap threshold) freed by a thread stay in that thread's heap: a checkpoint's save leaves
  many of them. Cheap next to a save (timed in docs/BENCHMARKS_HISTORY.md, "Under 4 GB (2026-12-05)")."""
  libc = _glibc()
  return libc is not None and bool(libc.malloc_trim(0))
