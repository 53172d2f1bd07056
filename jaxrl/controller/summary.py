"""A run's summary and its stop signals, for jaxrl-train and the multi-process entry point alike."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.controller.ledger import Ledger

# Counts a sampler keeps (it admits and generates); every other count is the learner's.
SAMPLER_COUNTS = ("groups_admitted", "samples_generated", "tokens_generated", "skipped_prompts", "prompts_set_aside")


def merge_ledgers(learner: dict, samplers: Sequence[dict]) -> dict:
  """The job's ledger from the learner's and the sampler processes' own (json): the learner's sampler counts are
  those of the checkpoint resumed from (the samplers' counts then), the samplers add what they counted since."""
  ledger = dict(learner)
  for key in SAMPLER_COUNTS:
    ledger[key] = learner.get(key, 0) + sum(s.get(key, 0) for s in samplers)  # a count newer than a post: 0
  return ledger


def merge_episode_stats(parts: Sequence[dict]) -> dict:
  """The job's episode counts (Episodes.stats) from every sampler process's own: numbers add up, and so do the
  counts of the dicts (ends, failures by reason)."""
  out: dict[str, Any] = {}
  for part in parts:
    for key, value in part.items():
      if isinstance(value, dict):
        merged = out.setdefault(key, {})
        for name, n in value.items():
          merged[name] = merged.get(name, 0) + n
      else:
        out[key] = out.get(key, 0) + value
  return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run_summary(mode: str, *, version: int, ledger: dict, staleness: Sequence[int], samples_in_flight: int,
                busy: dict, resumed_from: int | None, stopped_by: str | None = None, **extra) -> dict[str, Any]:
  """What a run did: steps, its ledger and length bias, the samples still in flight, the trained staleness, the
  busy time of each role; `stopped_by` (a signal's name) if it was stopped early, with a checkpoint."""
  out = {"mode": mode, "resumed_from": resumed_from, "steps": version, "version": version, "ledger": ledger,
         "length_bias": Ledger.from_json(ledger).length_bias(), "samples_in_flight": samples_in_flight,
         "staleness_max": max(staleness, default=0),
         "staleness_mean": float(np.mean(staleness)) if len(staleness) else 0.0, "busy": busy, **extra}
  if stopped_by is not None:
    out["stopped_by"] = stopped_by
  before, after = extra.get("eval_before", {}), extra.get("eval_after", {})
  if "accuracy" in before and "accuracy" in after:
    out["eval_accuracy_change"] = accuracy_change(before, after)
  return out


def two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> float:
  """z of the change from k1/n1 to k2/n2 right answers (pooled two-proportion test); 0 when nothing varies."""
  p = (k1 + k2) / (n1 + n2)
  se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
  return (k2 / n2 - k1 / n1) / se if se > 0 else 0.0


def accuracy_change(before: dict, after: dict) -> dict[str, float]:
  """Greedy held-out accuracy before and after training, and the two-proportion z of the change (|z| > 1.96:
  significant at 5%, two-sided)."""
  k1, n1, k2, n2 = before["num_correct"], before["num_judged"], after["num_correct"], after["num_judged"]
  return {"before": k1 / n1, "after": k2 / n2, "n_before": n1, "n_after": n2,
          "z": round(two_proportion_z(k1, n1, k2, n2), 3)}


def write_summary(workdir: Path, summary: dict) -> None:
  (Path(workdir) / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


def exit_status(stopped_by: str) -> int:
  """A stopped run's exit status: 128 + the signal's number (143 for SIGTERM), as the shell reports a signal."""
  return 128 + getattr(signal, stopped_by, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[str], None], signals: Sequence[int], message: str):
  """While the run runs, the first of `signals` (a preemption's SIGTERM, a Slurm time limit) prints
  message.format(name=...) and calls request_stop(name): the run stops after the current step and saves a
  checkpoint. A second signal gets the handler that was there before. Handled from the main thread only."""
  if not signals or threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.getsignal(s) for s in signals}

  def handler(signum, frame):
    name = signal.Signals(signum).name
    print(message.format(name=name), file=sys.stderr, flush=True)
    for s, h in previous.items():
      signal.signal(s, h)
    request_stop(name)

  for s in signals:
    signal.signal(s, handler)
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
