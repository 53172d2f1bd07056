"""A run's first minute on the terminal: what it does before its first step (fetching and converting the model,
loading its weights, compiling, the held-out eval), one line per phase and a bar where it waits on a count.

Off unless an entry point shows it (`shown`): jaxrl-train does on a terminal with log.progress on, so library calls,
tests and logs piped to a file stay as they were. Only the thread that turned it on prints (a context variable).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

_STREAM: contextvars.ContextVar[TextIO | None] = contextvars.ContextVar("jaxrl_console", default=None)
BAR_WIDTH = 24


def for_terminal(progress: bool, stream: TextIO = sys.stderr) -> TextIO | None:
  """`stream` if progress lines are on and it is a terminal, else None (nothing shown)."""
  return stream if progress and stream.isatty() else None


@contextlib.contextmanager
def shown(stream: TextIO | None) -> Iterator[None]:
  """Phases and counts inside go to `stream` (None: nowhere)."""
  token = _STREAM.set(stream)
  try:
    yield
  finally:
    _STREAM.reset(token)


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
  """'jaxrl: <what> ...', then the seconds it took on the same line."""
  stream, t0 = _STREAM.get(), time.monotonic()
  if stream is not None:
    print(f"jaxrl: {what} ...", end="", file=stream, flush=True)
  try:
    yield
  finally:
    if stream is not None:
      print(f" {time.monotonic() - t0:.1f} s", file=stream, flush=True)


def count(what: str, total: int) -> Callable[[int], None]:
  """A callback done -> None that redraws 'jaxrl: <what> [#####.....] done/total' when done changed (on the last,
  the seconds)."""
  stream, t0 = _STREAM.get(), time.monotonic()
  if stream is None or total <= 0:
    return lambda done: None

  drawn = [None]

  def update(done: int) -> None:
    if done == drawn[0]:  # e.g. a decode step that finished nothing
      return
    drawn[0] = done
    filled = BAR_WIDTH * done // total
    end = f" {time.monotonic() - t0:.1f} s\n" if done >= total else ""
    print(f"\rjaxrl: {what} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{total}{end}", end="", file=stream,
          flush=True)

  update(0)
  return update


def note(text: str) -> None:
  """One line 'jaxrl: <text>'."""
  stream = _STREAM.get()
  if stream is not None:
    print(f"jaxrl: {text}", file=stream, flush=True)
