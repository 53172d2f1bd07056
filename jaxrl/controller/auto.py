"""mode="auto": the run measures its own costs, asks the systems model which mode and staleness bound train the most
tokens per second, runs that, and checks the choice against what it measures.

A run is a sequence of segments, each a plain fixed-mode run resumed from the previous segment's checkpoint (exact
resume: the same step, version, data position and rng; groups in flight at a segment's end are generated again and
counted, never lost or trained twice). The first segment is synchronous (`auto.measure_steps` steps): its metrics
calibrate the simulator (jaxrl.sim.runlog, the costs the run paid) on its own completion lengths, and the simulator
predicts the trained tokens per second of sync and of the pipeline at every k in 1..`auto.k_max`. Every later
segment (`auto.recheck_steps` steps) runs the candidate with the best score, where a candidate's score is what a
segment of it measured, else what the simulator predicts from the newest calibration times its mode's correction
(measured / predicted of the newest segment of that mode run on the same calibration: a calibration that overrated
one pipeline candidate is taken to overrate the others as much). So a prediction is tried at most once and a
measurement replaces it: a pipeline that the model overrates is measured and abandoned, and the run is slower than
sync for one segment at most per overrated calibration. Each decision (its candidates' predicted and measured
tokens/s, the one chosen) is appended to workdir/auto.json, which a resumed run reads back, and lands in summary.json.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl import config as config_lib
from jaxrl.controller import build as build_lib
from jaxrl.controller.summary import accuracy_change
from jaxrl.metrics import read_jsonl
from jaxrl.sim import runlog
from jaxrl.sim.calibrate import fit_calibration
from jaxrl.sim.planner import RunDescription
from jaxrl.sim.planner import predict as predict_run

SYNC = ("sync", 0, None)


def candidates(k_max: int, splits=()) -> list[tuple[str, int, int | None]]:
  """(mode, k, sampler devices) of every candidate: sync on the config's split, and the pipeline at each bound
  1..k_max on each split in `splits` (empty: the config's mesh.sampler_devices, written None)."""
  return [SYNC] + [("pipeline", k, s) for s in (tuple(splits) or (None,)) for k in range(1, k_max + 1)]


def name(candidate: tuple[str, int, int | None]) -> str:
  mode, k, split = candidate
  if mode == "sync":
    return "sync"
  return f"pipeline_k{k}" if split is None else f"pipeline_k{k}_s{split}"


def mode_of(candidate_name: str) -> str:
  """"sync" or "pipeline": the mode of a candidate named by name()."""
  return candidate_name.split("_")[0]


def explore(names: list[str], measured: dict[str, float]) -> str:
  """Without predictions: the first candidate not measured yet (so a measurement replaces the missing prediction),
  else the best measured one."""
  return next((n for n in names if n not in measured), None) or max(measured, key=measured.get)


def choose(predicted: dict[str, float], measured: dict[str, float]) -> str:
  """The candidate with the most trained tokens per second, each scored by its measurement where one exists, else
  by its prediction; ties go to the first listed (sync first: it needs no staleness correction)."""
  scores = {c: measured.get(c, p) for c, p in predicted.items()}
  scores.update({c: m for c, m in measured.items() if c not in scores})
  return max(scores, key=lambda c: (scores[c], -list(scores).index(c)))


@dataclasses.dataclass
class Segment:
  """One stretch of an auto run in one fixed mode: steps (start, end], what was predicted and measured."""

  start: int
  end: int
  choice: str
  predicted: dict[str, float]  # candidate -> predicted trained tokens/s (from the previous segment's calibration)
  measured_tokens_per_s: float | None = None  # this segment's own trained tokens/s (after its warm-up step)
  predicted_step_s: dict[str, float] = dataclasses.field(default_factory=dict)
  measured_step_s: float | None = None
  # why no prediction was made after this segment (its logs could not calibrate the model): the previous
  # predictions stand; without any, the next segment measures a candidate not measured yet (explore)
  no_prediction: str = ""
  # per mode, measured / predicted tokens/s of the newest earlier segment of that mode chosen on the same
  # predictions (AutoLog.corrections): the factor this segment's choice applied to that mode's unmeasured candidates
  corrections: dict[str, float] = dataclasses.field(default_factory=dict)


def segment_config(c, candidate: tuple[str, int, int | None], end: int):
  """The fixed-mode RunConfig of a segment ending at step `end` (on the candidate's split, if it names one): a copy
  of the run's RunConfig c, whose learning-rate schedule is the whole run's (it decays over c.num_steps, not to the
  segment's end)."""
  mode, k, split = candidate
  split = {} if split is None else {"mesh.sampler_devices": split}
  return config_lib.replace(c, mode=mode, rl__max_staleness=k, num_steps=end,
                            optimizer__decay_steps=c.optimizer.decay_steps or c.num_steps, **split)


def measure(records: list[dict], batch_size: int, warmup: int) -> tuple[float, float]:
  """(trained completion tokens per second, seconds per step) of a segment's records after its warm-up steps."""
  return 1.0 / runlog.seconds_per_token(records, warmup, batch_size), runlog.step_time_s(records, warmup)


def predict(c, records: list[dict], lengths: list[int], *, devices: int, prompt_len: int, weight_bytes: float,
            warmup: int, multi_process: bool = False,
            measured_split: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
  """Trained tokens/s and step seconds of every candidate, from a calibration of `records` (a segment's metrics, run
  on `measured_split` sampler devices, None: the config's) on the completion lengths its trained samples had;
  multi_process: a job of several processes (its hand-off between them is charged to the learner,
  jaxrl.sim.runlog). Another split is predicted from the same per-device costs, every candidate with the filter's
  pass fraction the segment's ledger counts (rl.filter_groups) and the run's rl.cancel_surplus."""
  sampler_devices = measured_split or c.mesh.sampler_devices
  m, _ = runlog.measurements(records, warmup=warmup, steps_per_call=c.sampler.steps_per_call,
                             max_batch=c.sampler.max_slots, learner_devices=devices - sampler_devices,
                             sampler_devices=sampler_devices, weight_bytes=weight_bytes, multi_process=multi_process)
  cal = fit_calibration(m)
  passed = runlog.run_pass_fraction(records, warmup, c.rl)  # dynamic sampling's cost, as the segment measured it
  tokens, step_s = {}, {}
  for cand in candidates(c.auto.k_max, c.auto.splits):
    split = cand[2] or c.mesh.sampler_devices
    run = RunDescription(sampler_devices=split, learner_devices=devices - split,
                         batch_size=c.rl.group_size * c.rl.groups_per_step, group_size=c.rl.group_size,
                         lengths=np.asarray(lengths), max_staleness=max(cand[1], 1), prompt_len=prompt_len,
                         steps=max(c.auto.recheck_steps, 4), seed=c.seed, queue_groups=c.rl.queue_groups,
                         seq_len=c.rl.seq_len, pack=c.rl.pack, max_segments=c.rl.max_segments,
                         num_minibatches=c.rl.num_minibatches,
                         steps_per_call=c.sampler.steps_per_call, overlap_calls=1, pass_fraction=passed,
                         cancel_surplus=c.rl.cancel_surplus)
    pred = predict_run(cal, run)
    result = pred.sync if cand == SYNC else pred.pipeline
    tokens[name(cand)], step_s[name(cand)] = float(result.tokens_per_s), float(result.step_time_s)
  return tokens, step_s


def metrics_records(workdir: Path, start: int, end: int) -> list[dict]:
  """The metrics.jsonl records of steps (start, end] of the run in workdir."""
  return [r for r in read_jsonl(Path(workdir) / "metrics.jsonl") if start < r["step"] <= end]


def run_context(c, devices: int, multi_process: bool = False) -> dict:
  """What predict() needs besides a segment's logs: the run's devices, prompt length and model bytes."""
  prompt_len, weight_bytes = build_lib.run_shapes(c)
  return dict(devices=devices, prompt_len=prompt_len, weight_bytes=weight_bytes, multi_process=multi_process)


class AutoLog:
  """workdir/auto.json: the segments decided so far (a resumed auto run continues from them)."""

  def __init__(self, workdir: Path):
    self.path = Path(workdir) / "auto.json"
    self.segments = [Segment(**s) for s in json.loads(self.path.read_text())] if self.path.exists() else []

  def append(self, segment: Segment) -> None:
    self.segments.append(segment)
    self.write()

  def write(self) -> None:
    self.path.write_text(json.dumps([dataclasses.asdict(s) for s in self.segments], indent=2))

  def measured(self) -> dict[str, float]:
    """The newest measurement of each candidate."""
    return {s.choice: s.measured_tokens_per_s for s in self.segments if s.measured_tokens_per_s is not None}

  def corrections(self, predicted: dict[str, float]) -> dict[str, float]:
    """Per mode ("sync", "pipeline"): measured / predicted tokens/s of the newest segment of that mode chosen on
    these same predictions, i.e. how far this calibration is off for that mode (on a 2-core CPU a calibration from
    a sync segment overrates the pipeline: its roles contend for the cores). A newer calibration, made from a
    later segment's logs, starts without corrections."""
    out = {}
    for s in self.segments:
      pred = s.predicted.get(s.choice)
      if s.measured_tokens_per_s and pred and s.predicted == predicted:
        out[mode_of(s.choice)] = s.measured_tokens_per_s / pred
    return out


def corrected(predicted: dict[str, float], corrections: dict[str, float]) -> dict[str, float]:
  """Each prediction times its mode's correction (jaxrl.controller.auto.AutoLog.corrections; 1 without one)."""
  return {c: p * corrections.get(mode_of(c), 1.0) for c, p in predicted.items()}


def supervise(c, workdir: Path, run_segment: Callable[..., tuple[dict[str, Any], Any]],
              segment_records: Callable[[int, int], list[dict]], context: Callable[[], dict]) -> dict[str, Any]:
  """Runs an auto RunConfig to c.num_steps as fixed-mode segments; returns the last segment's summary with `auto`.

  run_segment(config, first, last) trains one segment (first: evaluate before; last: evaluate after) and returns
  (its summary, its trained completion lengths); segment_records(start, end) reads the metrics of steps
  (start, end]; context() gives what a calibration needs besides them (devices, prompt_len, weight_bytes; see
  run_context), asked once."""
  log = AutoLog(workdir)
  warmup = c.auto.warmup_steps
  summary, before = None, None
  done, predicted, step_pred = _resume_point(log)
  sync_lengths = None  # the lengths a sync segment trained: every generated sample, no length bias
  shapes = None  # context(), once
  cands = {name(x): x for x in candidates(c.auto.k_max, c.auto.splits)}
  while done < c.num_steps:
    first = not log.segments
    if first:
      choice, length = "sync", c.auto.measure_steps
    else:
      factors = log.corrections(predicted)
      choice = (choose(corrected(predicted, factors), log.measured()) if predicted
                else explore(list(cands), log.measured()))
      length = c.auto.recheck_steps
    end = min(done + length, c.num_steps)
    if c.num_steps - end < warmup + 3:  # too short a tail to measure: fold it into this segment
      end = c.num_steps
    cand = cands[choice]
    seg = Segment(start=done, end=end, choice=choice, predicted=predicted, predicted_step_s=step_pred,
                  corrections={} if first else factors)
    log.append(seg)
    summary, lengths = run_segment(segment_config(c, cand, end), first, end == c.num_steps)
    before = summary.get("eval_before", before)
    if "stopped_by" in summary:
      break
    if choice == "sync":
      sync_lengths = lengths
    records = segment_records(max(done, summary.get("resumed_from") or 0), end)  # this process's steps only
    batch = c.rl.group_size * c.rl.groups_per_step
    if len(records) >= warmup + 3:
      seg.measured_tokens_per_s, seg.measured_step_s = measure(records, batch, warmup)
      if end < c.num_steps:
        shapes = shapes or context()
        try:
          predicted, step_pred = predict(c, records, sync_lengths or lengths, warmup=warmup,
                                         measured_split=cand[2], **shapes)
        except ValueError as e:  # e.g. too few steps with decode calls: the previous predictions stand
          seg.no_prediction = str(e)
    else:
      seg.measured_tokens_per_s = 0.0  # nothing to measure: recorded as run, never preferred
    log.write()
    done = end
  return _auto_summary(summary, before, log)


def _resume_point(log: AutoLog) -> tuple[int, dict, dict]:
  """(the step the next segment starts at, the predictions it decides from) of an auto run's log."""
  if not log.segments:
    return 0, {}, {}
  if log.segments[-1].measured_tokens_per_s is None:
    # A segment cut short: decided again from the same predictions, and run from the newest checkpoint on (its
    # start, or later: its steps before the cut are not trained again)
    cut = log.segments.pop()
    return cut.start, cut.predicted, cut.predicted_step_s
  last = log.segments[-1]
  return last.end, last.predicted, last.predicted_step_s


def _auto_summary(summary: dict | None, before: dict | None, log: AutoLog) -> dict[str, Any]:
  """The last segment's summary, with the first one's eval and every segment's decision (`auto`)."""
  summary = dict(summary or {})
  summary["mode"] = "auto"
  if before is not None:
    summary["eval_before"] = before
    if "accuracy" in before and "accuracy" in summary.get("eval_after", {}):
      summary["eval_accuracy_change"] = accuracy_change(before, summary["eval_after"])
  summary["auto"] = [dataclasses.asdict(s) for s in log.segments]
  return summary
