"""Metrics sinks: JSONL (one record per learner step), the experiment trackers of log.backends (jaxrl.trackers:
TensorBoard, wandb, MLflow), and a live progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.trackers import TRACKERS, check_backends

PROGRESS_KEYS = (("reward_mean", "reward"), ("accuracy", "acc"), ("sample_staleness_mean", "stale"),
                 ("ess_frac", "ess"), ("queue_depth", "queue"), ("sampler_busy", "smp"),
                 ("learner_busy", "lrn"), ("step_time_s", "s/step"), ("learner_mfu", "mfu/l"),
                 ("learner_mbu", "mbu/l"), ("sampler_mfu", "mfu/s"), ("sampler_mbu", "mbu/s"),
                 ("reward_failures_total", "reward failures"))
SHOWN_IF_NONZERO = frozenset({"reward_failures_total"})  # a failure count is news only once there is one


def _scalar(v: Any) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Writes scalars per step to workdir/metrics.jsonl and each tracker of `backends`; prints a one-line summary."""

  def __init__(self, workdir: str | os.PathLike, *, backends: Sequence[str] = ("jsonl", "tensorboard"),
               project: str = "jaxrl", run_name: str = "", config: Mapping[str, Any] | None = None,
               progress: bool = True, total_steps: int | None = None, resume_step: int | None = None):
    """backends: from jaxrl.trackers.BACKENDS, "jsonl" included; project, run_name ("": the workdir's name) and
    config (the run's settings) go to the trackers that keep them. resume_step: the run restarts from this step
    (0: from scratch), so records after it in an existing metrics.jsonl (logged before a crash, about to be logged
    again) are removed; None appends to the file as is."""
    self.workdir = Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    backends = check_backends(backends)
    path = self.workdir / "metrics.jsonl"
    if resume_step is not None and path.exists():
      _truncate_after(path, resume_step)
    self._jsonl = open(path, "a", buffering=1)
    run_name = run_name or self.workdir.resolve().name
    self._trackers = []
    try:
      for name in (b for b in backends if b != "jsonl"):
        self._trackers.append(TRACKERS[name](self.workdir, project, run_name, config or {}))
    except BaseException:
      self.close()
      raise
    self._progress = progress
    self._total = total_steps
    self._t0 = time.monotonic()

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    """Scalars as they are; 1-D arrays (e.g. the staleness histogram) as one scalar per entry, name/i."""
    scalars = {}
    for k, v in metrics.items():
      arr = np.asarray(v) if not isinstance(v, (str, bytes)) else None
      if arr is not None and arr.ndim == 1 and arr.dtype.kind in "biuf":
        scalars.update({f"{k}/{i}": float(x) for i, x in enumerate(arr)})
      elif (s := _scalar(v)) is not None:
        scalars[k] = s
    record = {"step": step, "time": time.time(), **{k: (v if math.isfinite(v) else str(v)) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    for tracker in self._trackers:
      tracker.log(step, scalars)
    if self._progress:
      total = f"/{self._total}" if self._total else ""
      parts = [f"{short} {scalars[k]:.3g}" for k, short in PROGRESS_KEYS
               if k in scalars and (scalars[k] or k not in SHOWN_IF_NONZERO)]
      elapsed = time.monotonic() - self._t0
      print(f"[step {step}{total} {elapsed:6.1f}s] " + "  ".join(parts), file=sys.stderr, flush=True)

  def close(self) -> None:
    self._jsonl.close()
    for tracker in self._trackers:
      tracker.close()


def _truncate_after(path: Path, step: int) -> None:
  """Keeps the records of steps <= step (and drops a last line a kill cut short); atomic."""
  keep = []
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if record.get("step", 0) <= step:
      keep.append(line + "\n")
  tmp = path.with_suffix(".jsonl.tmp")
  tmp.write_text("".join(keep))
  os.replace(tmp, path)


def sampler_metrics(samplers: list[dict[str, float]]) -> dict[str, float]:
  """The cumulative counters of a run's samplers (e.g. jaxrl.sampler.SamplerStats as a dict), summed, as
  sampler/<name>."""
  return {f"sampler/{k}": float(sum(s[k] for s in samplers)) for k in samplers[0]} if samplers else {}


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class TraceWriter:
  """Appends one JSON line per controller event to workdir/trace.jsonl (one write per line: a kill loses at most
  the line being written, and a resumed run first ends such a torn line so that its own lines stay whole)."""

  def __init__(self, path: Path):
    self._f = open(path, "a+", buffering=1)
    if self._f.tell():
      self._f.seek(self._f.tell() - 1)
      if self._f.read(1) != "\n":
        self._f.write("\n")
    self._lock = threading.Lock()

  def __call__(self, record: dict) -> None:
    line = json.dumps(record) + "\n"
    with self._lock:
      self._f.write(line)

  def close(self) -> None:
    self._f.close()
