"""A calibration from a run's own logs (jaxrl-profile --from-run): no profiling run, the costs the run paid.

Every learner step's record in workdir/metrics.jsonl carries (jaxrl.controller.learner_loop):
- `train_s`, `train_tokens`: the learner's wall time for the step (batch assembly, train step, metrics fetch) and
  the tokens its batch held (rows x seq_len, padding included: what it computed over); `wait_s`: its wait for the
  step's groups; the rest of `step_time_s` is the learner's per-step overhead (coordination, hand-off, logging);
- `publish_s`: the learner's weight publish after the step;
- `sampler/<field>`: the samplers' cumulative jaxrl.sampler.SamplerStats (summed over replicas): decode calls,
  live rows and context positions at dispatch, seconds inside update_params(); and `sampler/busy_s`, the sampler
  loop's busy time (SamplerLoop.busy: admissions, decode calls, rewards, batch assembly, sending; not its waits).
With log.trace, workdir/trace.jsonl also holds every generated group's completion lengths ("generated" events,
jaxrl.controller.sampler_loop) and each train step's ("train" events): group_lengths reads the first, so that a
natural-length run's own lengths are replayed.
Between two records the deltas give one decode row (mean live batch, mean context, busy seconds less updates, and
less the weight take where samplers pull each version inside their loop, per decode step); the fit is
calibrate.fit_decode's. The ledger's cumulative counts (`samples_trained`, `samples_dropped`, `filtered_groups`) give
the filter's pass fraction (dynamic sampling). Everything the sampler loop does per call is folded into the decode
rows (prefill_s_per_token is 0). Sampler and learner of the headline run on disjoint cores or one after the other:
no contention is charged.
"""

from __future__ import annotations

import numpy as np

from jaxrl.sim.calibrate import Measurements

_CALLS, _ROWS, _CONTEXT = "sampler/decode_calls", "sampler/live_rows", "sampler/context_tokens"
_BUSY, _UPDATE = "sampler/busy_s", "sampler/update_seconds"


def steady(records: list[dict], warmup: int) -> list[dict]:
  """The records from the last warm-up step on (its end is where the measured window starts)."""
  if warmup < 1:
    raise ValueError(f"warmup must be >= 1 step (the first one compiles; got {warmup})")
  if len(records) < warmup + 3:
    raise ValueError(f"the run logged {len(records)} steps: need warmup={warmup} + at least 3 to fit its costs")
  window = records[warmup - 1:]
  keys = ("step_time_s", "train_s", "wait_s", "train_tokens", "publish_s", _CALLS, _ROWS, _CONTEXT, _BUSY, _UPDATE)
  missing = [k for k in keys if any(k not in r for r in window)]
  if missing:
    raise ValueError(f"metrics.jsonl lacks {missing} after warm-up: the run predates cost logging (or no sampler "
                     "stats had arrived yet: raise warmup)")
  return window


def step_time_s(records: list[dict], warmup: int) -> float:
  """Seconds per step: least-squares slope of the steps' log times after warm-up (the simulator's measure)."""
  t = np.array([r["time"] for r in steady(records, warmup)])
  return float(np.polyfit(np.arange(t.size), t, 1)[0])


def seconds_per_token(records: list[dict], warmup: int, batch_size: int) -> float:
  """Wall seconds per trained completion token over the steps after warm-up."""
  rs = steady(records, warmup)
  return (rs[-1]["time"] - rs[0]["time"]) / sum(r["completion_len"] * batch_size for r in rs[1:])


def idle_fractions(records: list[dict], warmup: int) -> dict[str, float]:
  """Sampler and learner idle fractions of the measured window (1 - busy / wall)."""
  rs = steady(records, warmup)
  wall = rs[-1]["time"] - rs[0]["time"]
  sampler = rs[-1][_BUSY] - rs[0][_BUSY]
  return dict(sampler_idle=1 - sampler / wall, learner_idle=1 - sum(r["train_s"] for r in rs[1:]) / wall)


def pass_fraction(records: list[dict], warmup: int, group_size: int) -> float:
  """The fraction of the groups settled over the window (trained, or dropped with a reason) that the filter kept:
  1 - filtered / settled, from the ledger's cumulative counts (1 where the run filters nothing)."""
  rs = steady(records, warmup)
  missing = [k for k in ("samples_trained", "samples_dropped", "filtered_groups") if k not in rs[-1]]
  if missing:
    raise ValueError(f"metrics.jsonl lacks the ledger's {missing}: the run predates them")
  a, b = rs[0], rs[-1]
  settled = (b["samples_trained"] - a["samples_trained"] + b["samples_dropped"] - a["samples_dropped"]) / group_size
  if settled <= 0:
    raise ValueError("no group was settled over the window: raise the steps after warm-up")
  return 1.0 - (b["filtered_groups"] - a["filtered_groups"]) / settled


def decode_rows(records: list[dict], warmup: int, steps_per_call: int,
                take_s: float = 0.0) -> list[tuple[float, float, float]]:
  """(mean live batch, mean context, seconds per decode step) between consecutive records with decode calls;
  take_s: a weight take inside the loop's busy time (one version a step), charged apart as updates are. Sampler
  stats reach the learner when the sampler sends: a record with no news leaves its step's take to the next row."""
  rows, steps = [], 0
  rs = steady(records, warmup)
  for a, b in zip(rs[:-1], rs[1:], strict=True):
    calls, live = b[_CALLS] - a[_CALLS], b[_ROWS] - a[_ROWS]
    steps += 1
    if calls >= 1 and live >= 1:
      busy = b[_BUSY] - a[_BUSY] - (b[_UPDATE] - a[_UPDATE]) - take_s * steps  # charged apart (update_s, takes)
      rows.append((live / calls, (b[_CONTEXT] - a[_CONTEXT]) / live, busy / (calls * steps_per_call)))
      steps = 0
  return rows


def handoff_s(records: list[dict], warmup: int) -> float:
  """A multi-process run's per-step hand-off: after the learner asks, the sampler sends the share's groups one
  cross-process copy each, which the learner waits for even when every group had finished. The least wait of the
  window is that floor (a longer wait also waited for generation, which the simulator models)."""
  return float(min(r["wait_s"] for r in steady(records, warmup)[1:]))


def measurements(records: list[dict], *, warmup: int, steps_per_call: int, max_batch: int, learner_devices: int,
                 sampler_devices: int, weight_bytes: float, multi_process: bool = False,
                 take_s: float = 0.0) -> tuple[Measurements, dict]:
  """The Measurements a run's records imply, with the per-step figures they come from. multi_process: the run's
  learner and sampler were separate processes; its hand-off (handoff_s) is charged as learner overhead. take_s:
  seconds of the weight take per version inside the sampler loop (independent samplers pull each version; the
  planner charges it apart, Costs.pull_bandwidth), left out of the decode rows."""
  rs = steady(records, warmup)
  rows = decode_rows(records, warmup, steps_per_call, take_s)
  if len(rows) < 3:
    raise ValueError(f"only {len(rows)} steps after warm-up saw decode calls: need 3 to fit the decode curve")
  # Means over the window, as the step time measured over it is: a load burst the run paid is a cost it paid.
  steps = len(rs) - 1
  train_s = sum(r["train_s"] for r in rs[1:]) / steps
  tokens = sum(r["train_tokens"] for r in rs[1:]) / steps
  publish_s = sum(r["publish_s"] for r in rs[1:]) / steps
  update_s = (rs[-1][_UPDATE] - rs[0][_UPDATE]) / steps  # one update reaches the sampler per step
  # A step's log time runs from the previous train step's end: its publish, then coordination, the wait for data
  # and the train step. What is left is the learner's per-step overhead.
  overhead_s = sum(max(b["step_time_s"] - b["train_s"] - b["wait_s"] - a["publish_s"], 0.0)
                   for a, b in zip(rs[:-1], rs[1:], strict=True)) / steps
  handoff = handoff_s(records, warmup) if multi_process else 0.0
  m = Measurements(decode=tuple(rows), train_tokens_per_s_per_device=tokens / (train_s * learner_devices),
                   max_batch=max_batch, weight_bytes=weight_bytes,
                   link_bandwidth=weight_bytes / (min(learner_devices, sampler_devices) * publish_s),
                   devices_per_engine=sampler_devices, update_s=update_s, train_overhead_s=overhead_s + handoff)
  details = dict(train_step_s=train_s, train_tokens_per_step=tokens, transfer_s=publish_s, update_s=update_s,
                 learner_overhead_s=overhead_s, handoff_s=handoff, admission_s_per_sample=0.0, steps=steps)
  return m, details


def group_lengths(events: list[dict], group_size: int) -> np.ndarray:
  """[groups, group_size] completion lengths of the generated groups, in group order, from a run's trace events
  (a group generated twice, across a resume, keeps its last lengths)."""
  by_group = {e["group"]: e["lengths"] for e in events if e.get("event") == "generated"}
  if not by_group:
    raise ValueError("the run's trace.jsonl has no \"generated\" events: run with log.trace=True (from this version "
                     "on) so that its per-group lengths are logged")
  bad = [g for g, n in by_group.items() if len(n) != group_size]
  if bad:
    raise ValueError(f"groups {bad[:4]} logged {len(by_group[bad[0]])} lengths, not group_size={group_size}")
  return np.array([by_group[g] for g in sorted(by_group)], np.int64)
