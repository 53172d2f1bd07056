r"""jaxrl-profile: a short profiling run of jaxrl itself, fitted into a simulator calibration (jaxrl.sim).

  JAX_NUM_CPU_DEVICES=8 PYTHONPATH=. .venv/bin/python -m jaxrl.cost_profile --config=configs/bench_pipeline.py \
      --out=/tmp/cal.json
  PYTHONPATH=. .venv/bin/python -m jaxrl.cost_profile --config=configs/bench_headline.py --from-run=/tmp/h-pipe

--from-run fits the costs a finished run logged instead (jaxrl.sim.runlog: its decode calls, train steps, weight
publishes and updates) and prints the simulator's step time and trained tokens per second for that run against the
measured ones, and its pipeline/sync ratio per trained token. A natural-length run needs log.trace=True (its
per-group lengths); a forced-length run does not.

On the config's own meshes, model and shapes (built as jaxrl-train builds them) it measures:
- decode: seconds per decode step of the sampler engine (one generate call / steps_per_call) vs live batch and
  context. The engine computes every slot over its whole cache, so on it the curve is flat by construction;
- admission: a Sampler step that admits a pool of groups (prefills, inserts, host work) less a plain decode call,
  per sample (the simulator's prefill charge);
- train: the learner's train step on a full batch_size x seq_len batch (padded rows cost as much as real ones);
- weight transfer: the params moved onto the sampler shardings (jaxrl.sharding.transfer), as a bandwidth; and
  the KV recompute of the live slots an in-flight update costs the sampler (on_update="recompute");
- contention: decode calls and train steps at the same time from two threads, each against itself alone. Where
  sampler and learner share cores (CPU devices) both slow down; on separate chips the factors are ~1.
and fits them with jaxrl.sim.calibrate.fit_calibration. The pieces are plain functions of an Engine, a train step
and a state, so bench/pipeline.py profiles the very executables it then times.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxrl import config as config_lib
from jaxrl import platforms
from jaxrl.controller import build as build_lib
from jaxrl.metrics import read_jsonl
from jaxrl.rollout import Rollout, SamplingParams, make_batch
from jaxrl.sampler import Sampler
from jaxrl.sampler.forced import LognormalLengths
from jaxrl.sharding import Versioned, transfer
from jaxrl.sim import runlog
from jaxrl.sim.calibrate import Calibration, Measurements, fit_calibration
from jaxrl.sim.lengths import Replay
from jaxrl.sim.planner import RunDescription, predict
from jaxrl.train import build


def _ready(x):
  return jax.block_until_ready(x)


def _fill(engine, params: Versioned, batch: int, prompt_len: int, seed: int = 0):
  """A decode state with `batch` live slots holding one random prompt, allowed to run to the end of the cache."""
  rng = np.random.default_rng(seed)
  prefix = engine.prefill(params, rng.integers(0, engine.cfg.vocab_size, prompt_len))
  state = engine.init_decode_state()
  for slot in range(batch):
    settings = engine.slot_settings(jax.random.key(slot), SamplingParams(), engine.max_len)
    state = engine.insert(prefix, state, slot, settings)
  return _ready(state)


def decode_times(engine, params: Versioned, batches, prompt_len: int, calls: int,
                 per_row: int = 3) -> list[tuple[int, int, float]]:
  """(live batch, mean context per sequence, seconds per decode step) for each batch size and context window.

  The context grows by steps_per_call with every call, so one fill measures several contexts; each row is the
  median of `per_row` consecutive calls (a shared machine has bursts of load).
  """
  k = engine.steps_per_call
  per_row = min(per_row, calls)
  calls = min(calls, (engine.max_len - 1 - prompt_len) // k - 1) // per_row * per_row
  if calls < 1:
    raise ValueError(f"max_len={engine.max_len} leaves no room for {per_row} timed decode calls after a "
                     f"{prompt_len}-token prompt and one warm-up call of {k} steps")
  rows = []
  for b in batches:
    state = _fill(engine, params, b, prompt_len)
    state, _ = _ready(engine.generate(params, state))  # first call after a fill: not timed
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      state, out = engine.generate(params, state)
      jax.device_get(out)
      times.append((time.perf_counter() - t0) / k)
    for i in range(0, calls, per_row):
      context = prompt_len + k * (i + 1) + k * per_row / 2
      rows.append((int(b), int(round(context)), statistics.median(times[i: i + per_row])))
  return rows


def admission_step_s(engine, params: Versioned, prompt_len: int, group_size: int, reps: int) -> tuple[float, int]:
  """(median seconds to submit a full pool of groups and run the Sampler.step() that admits them, samples
  admitted per step).

  Each sample is allowed steps_per_call tokens, so the step's one decode call finishes them all and the next
  repetition finds every slot free. Minus a plain decode call this is the admission cost of the controller's path:
  submits, prefills, inserts and the host work around them.
  """
  n = min(group_size, engine.max_slots)
  groups = engine.max_slots // n
  sampler = Sampler(engine, params.params, params.version, overlap=False)  # read the call that admitted them
  prompt = np.arange(prompt_len) % engine.cfg.vocab_size
  times = []
  for r in range(reps + 1):
    t0 = time.perf_counter()
    for g in range(groups):
      sampler.submit(prompt, r * groups + g, n, max_tokens=engine.steps_per_call, ignore_eos=True)
    finished = sampler.step()
    times.append(time.perf_counter() - t0)
    if len(finished) != groups * n:
      raise RuntimeError(f"admission probe: {len(finished)} of {groups * n} samples finished in one call")
  return statistics.median(times[1:]), groups * n


def full_rollouts(batch_size: int, seq_len: int, group_size: int, vocab_size: int, prompt_len: int = 4,
                  seed: int = 0) -> list[Rollout]:
  """Rollouts that fill every row of a batch_size x seq_len batch (rewards vary within groups: every row has a
  gradient)."""
  rng = np.random.default_rng(seed)
  n = seq_len - prompt_len
  return [Rollout(prompt_tokens=rng.integers(0, vocab_size, prompt_len).astype(np.int32),
                  completion_tokens=rng.integers(0, vocab_size, n).astype(np.int32),
                  logprobs=np.full(n, -np.log(vocab_size), np.float32), versions=np.zeros(n, np.int32),
                  finish_reason="length", group_id=i // group_size, sample_index=i % group_size,
                  reward=float(i % 2)) for i in range(batch_size)]


def train_times(train_step: Callable, state, rollouts: list[Rollout], seq_len: int, reps: int,
                publish_to=None) -> tuple[list[float], list[float], object]:
  """(seconds of each of `reps` learner steps, seconds of each publish, the state after them); the step donates
  its state.

  Each step runs the controller's learner path: it reads the step counter, folds the step's key, assembles its
  batch from the rollouts, trains, and fetches the new version and the metrics. With `publish_to` (an Engine) each
  step's new params are then published as the controller publishes them: moved onto the sampler's shardings and
  placed there, timed apart (the weight transfer). A transfer right after a train step costs more than one
  repeated back to back on the same params (docs/BENCHMARKS.md, "Figures moved here from docstrings"), so it is
  timed where the run pays it.
  """
  times, publish = [], []
  base = jax.random.key(0)
  for _ in range(reps):
    t0 = time.perf_counter()
    key = jax.random.fold_in(base, int(jax.device_get(state.step)))
    state, metrics = train_step(state, make_batch(rollouts, len(rollouts), seq_len), key)
    version = int(jax.device_get(state.version))
    jax.device_get(metrics)
    times.append(time.perf_counter() - t0)
    if publish_to is not None:
      t0 = time.perf_counter()
      moved = transfer(state.params, version, publish_to.param_shardings, publish_to.dtype, publish_to.weight_dtype)
      _ready(publish_to.place(moved.params, version).params)
      publish.append(time.perf_counter() - t0)
  return times, publish, state


def transfer_s(params, engine, reps: int) -> tuple[float, float]:
  """(median seconds of a weight update's transfer, bytes moved): the publisher's move onto the sampler
  shardings, then the sampler's own placement of what it takes (a no-op move that still walks every leaf).

  Back to back on the same params, so a lower bound: `profile` times the transfer after each train step instead
  (train_times with publish_to), where a run pays it."""
  times = []
  for v in range(1, reps + 1):
    t0 = time.perf_counter()
    moved = transfer(params, v, engine.param_shardings, engine.dtype, engine.weight_dtype)
    placed = _ready(engine.place(moved.params, v).params)
    times.append(time.perf_counter() - t0)
  return statistics.median(times), float(sum(x.nbytes for x in jax.tree.leaves(placed)))


def rebuild_s(engine, params: Versioned, prompt_len: int, reps: int) -> float:
  """Median seconds of the KV recompute an in-flight weight update costs, every slot live at half the cache."""
  state = _fill(engine, params, engine.max_slots, prompt_len)
  times = []
  for _ in range(reps + 1):
    t0 = time.perf_counter()
    state = _ready(engine.rebuild(params, state, engine.max_len // 2))
    times.append(time.perf_counter() - t0)
  return statistics.median(times[1:])


def contention(decode_call: Callable[[], float], train_call: Callable[[], float], train_reps: int):
  """(decode slowdown, train slowdown) while both run at once from two threads, against each alone.

  decode_call / train_call run one decode call / train step and return its seconds. Alone times are taken before
  and after the concurrent window (the machine's load drifts); decode calls count as concurrent only while a
  train step is running, which the train thread keeps up from its first step to its last.
  """
  decode_alone = [decode_call() for _ in range(2 * train_reps)]
  train_alone = [train_call() for _ in range(train_reps)]
  window = threading.Event()
  done = threading.Event()
  both_decode: list[float] = []
  both_train: list[float] = []

  def sampler():
    while not done.is_set():
      t = decode_call()
      if window.is_set() and not done.is_set():
        both_decode.append(t)

  thread = threading.Thread(target=sampler, name="jaxrl-profile-sampler")
  thread.start()
  try:
    window.set()
    for _ in range(train_reps):
      both_train.append(train_call())
  finally:
    done.set()
    thread.join()
  decode_alone += [decode_call() for _ in range(2 * train_reps)]
  train_alone += [train_call() for _ in range(train_reps)]
  if not both_decode:
    raise RuntimeError("no decode call finished while the train steps ran; raise train_reps")
  d = statistics.median(both_decode) / statistics.median(decode_alone)
  t = statistics.median(both_train) / statistics.median(train_alone)
  return d, t, dict(decode_alone_s=statistics.median(decode_alone), decode_both_s=statistics.median(both_decode),
                    train_alone_s=statistics.median(train_alone), train_both_s=statistics.median(both_train),
                    decode_calls_both=len(both_decode))


def _batches(max_slots: int) -> list[int]:
  b, out = 1, []
  while b < max_slots:
    out.append(b)
    b *= 4
  return [*out, max_slots]


def profile(engine, train_step, state, *, batch_size: int, seq_len: int, group_size: int, prompt_len: int,
            learner_devices: int, decode_calls: int = 6, train_reps: int = 3, with_contention: bool = True):
  """Measurements of one engine and one learner; returns (Measurements, details, state after the train steps)."""
  params = engine.place(state.params, 0)
  decode = decode_times(engine, params, _batches(engine.max_slots), prompt_len, decode_calls)
  full_call_s = engine.steps_per_call * statistics.median(t for b, _, t in decode if b == engine.max_slots)
  admit_step, admitted = admission_step_s(engine, params, prompt_len, group_size, reps=3)
  admission = max(admit_step - full_call_s, 0.0) / admitted
  rollouts = full_rollouts(batch_size, seq_len, group_size, engine.cfg.vocab_size, prompt_len)
  times, publish, state = train_times(train_step, state, rollouts, seq_len, train_reps + 1, publish_to=engine)
  train_s = statistics.median(times[1:])
  move_s = statistics.median(publish[1:])
  weight_bytes = float(sum(x.nbytes for x in jax.tree.leaves(params.params)))
  update = rebuild_s(engine, params, prompt_len, reps=3)
  sampler_devices = engine.mesh.size
  details = dict(train_step_s=train_s, transfer_s=move_s, update_s=update, admission_s_per_sample=admission,
                 train_tokens_per_step=batch_size * seq_len)
  decode_x = train_x = 1.0
  if with_contention:
    live = _fill(engine, params, engine.max_slots, prompt_len)
    box = {"decode": live, "train": state}

    def decode_call():
      t0 = time.perf_counter()
      box["decode"], out = engine.generate(params, box["decode"])
      done = jax.device_get(out).done_S.any()
      seconds = time.perf_counter() - t0
      if done:  # the slots reached the end of the cache: start them again (untimed)
        box["decode"] = _fill(engine, params, engine.max_slots, prompt_len)
      return seconds

    def train_call():
      t, _, box["train"] = train_times(train_step, box["train"], rollouts, seq_len, 1)
      return t[0]

    decode_x, train_x, more = contention(decode_call, train_call, train_reps)
    state = box["train"]
    details.update(more)
  # The simulator moves W * copies / min(senders, receivers) bytes per device at link_bandwidth; one engine here.
  link = weight_bytes / (min(learner_devices, sampler_devices) * move_s)
  m = Measurements(decode=tuple(decode), train_tokens_per_s_per_device=batch_size * seq_len / (train_s *
                                                                                                 learner_devices),
                   max_batch=engine.max_slots, weight_bytes=weight_bytes, link_bandwidth=link,
                   devices_per_engine=sampler_devices, prefill_s_per_token=admission / prompt_len,
                   decode_contention=max(decode_x, 1.0), train_contention=max(train_x, 1.0), update_s=update)
  return m, details, state


def pooled(ms: list[Measurements]) -> Measurements:
  """Measurements of several profiling runs of one setup taken as one: every decode row, and the median of each
  other quantity (of times, not rates; robust to a load burst on a shared machine catching one profile)."""
  median_time = lambda rate: 1 / statistics.median(1 / rate(m) for m in ms)
  median = lambda f: statistics.median(f(m) for m in ms)
  return dataclasses.replace(ms[0], decode=tuple(r for m in ms for r in m.decode),
                             train_tokens_per_s_per_device=median_time(lambda m: m.train_tokens_per_s_per_device),
                             link_bandwidth=median_time(lambda m: m.link_bandwidth),
                             prefill_s_per_token=median(lambda m: m.prefill_s_per_token),
                             decode_contention=median(lambda m: m.decode_contention),
                             train_contention=median(lambda m: m.train_contention),
                             update_s=median(lambda m: m.update_s))


def calibrate_run(run, **kw) -> tuple[Calibration, dict]:
  """Profiles a built jaxrl.train.Run: the sampler engine and the learner's train step and state of its sides
  (controller.sides, as every topology builds them), and fits the calibration. The state the steps leave is the
  learner loop's again."""
  c, learner, sampler = run.config, run.learner_side, run.sampler_side
  ctl = run.controller.learner_loop
  prompt_len = len(sampler.prompts(0)[0])
  m, details, ctl.state = profile(sampler.engine, learner.train_step, ctl.state, batch_size=learner.spec.rl.batch_size,
                                  seq_len=c.rl.seq_len, group_size=c.rl.group_size, prompt_len=prompt_len,
                                  learner_devices=learner.mesh.size, **kw)
  details["prompt_len"] = prompt_len
  return fit_calibration(m), details


def from_run(c, workdir, *, devices: int, warmup: int) -> dict:
  """Calibration from the run in workdir (made with config c on `devices` devices): its costs fitted from
  metrics.jsonl (jaxrl.sim.runlog), the simulator's step time and trained tokens per second for both modes of it on
  its own lengths, its measured ones and the error of its own mode.

  Its own lengths: forced (sampler.forced_lengths) are redrawn from their seed; natural ones are read from its
  trace (log.trace=True logs every generated group's lengths) and replayed per sample, in group order, so the
  prediction carries the pipeline's length bias (it trains the short groups of a step first). Dynamic sampling: the
  filter's pass fraction its ledger counts (rl.filter_groups), and its rl.cancel_surplus. c: a RunConfig, or a
  config validated here (ConfigError, a ValueError, if bad)."""
  c = config_lib.validate(c)
  forced = c.sampler.forced_lengths
  sampler_devices = c.mesh.sampler_devices
  if not (isinstance(sampler_devices, int) and 1 <= sampler_devices < devices):
    raise ValueError(f"mesh.sampler_devices={sampler_devices} must be a device count below the run's {devices}")
  records = read_jsonl(f"{workdir}/metrics.jsonl")
  multi_process = json.loads(Path(workdir, "summary.json").read_text()).get("num_processes", 1) > 1
  prompt_len, weight_bytes = build_lib.run_shapes(c)
  m, details = runlog.measurements(records, warmup=warmup, steps_per_call=c.sampler.steps_per_call,
                                   max_batch=c.sampler.max_slots, learner_devices=devices - sampler_devices,
                                   sampler_devices=sampler_devices, weight_bytes=weight_bytes,
                                   multi_process=multi_process)
  cal = fit_calibration(m)
  gs = c.rl.group_size
  groups = (len(records) + 4 * c.rl.max_staleness + 8) * c.rl.groups_per_step  # more than the simulator draws
  if forced.median > 0:
    lengths = Replay(LognormalLengths(forced.median, forced.p99_ratio, c.sampler.max_new_tokens, c.seed).of(
        range(groups)), gs)
  else:
    trace = Path(workdir, "trace.jsonl")
    if not trace.exists():
      raise ValueError(f"{trace} is missing: a natural-length run logs its per-group lengths only with "
                       "log.trace=True (or force the lengths: sampler.forced_lengths.median > 0)")
    logged = runlog.group_lengths(read_jsonl(trace), gs)
    # Lengths drift as the policy learns: the simulated run of the run's own mode measures after k + 1 steps, so it
    # replays from the group that puts its window on the run's (after `warmup` steps); past the last logged group,
    # from the first again.
    k = 0 if c.mode == "sync" else c.rl.max_staleness
    skip = max(warmup - (k + 1), 0) * c.rl.groups_per_step
    lengths = Replay(np.resize(logged[skip:], (groups, gs)), gs)
  batch_size = gs * c.rl.groups_per_step
  pred = predict(cal, RunDescription(
      sampler_devices=sampler_devices, learner_devices=devices - sampler_devices, batch_size=batch_size,
      group_size=gs, lengths=lengths, max_staleness=c.rl.max_staleness, prompt_len=prompt_len,
      steps=len(records) - warmup, queue_groups=c.rl.queue_groups, seq_len=c.rl.seq_len, pack=c.rl.pack,
      max_segments=c.rl.max_segments, num_minibatches=c.rl.num_minibatches, steps_per_call=c.sampler.steps_per_call,
      overlap_calls=1,  # the run's Sampler overlaps (its default): a finished slot idles one call
      pass_fraction=runlog.run_pass_fraction(records, warmup, c.rl), cancel_surplus=c.rl.cancel_surplus))
  measured = runlog.step_time_s(records, warmup)
  predicted = pred.sync_step_s if c.mode == "sync" else pred.pipeline_step_s
  own = pred.sync if c.mode == "sync" else pred.pipeline
  measured_tps = 1 / runlog.seconds_per_token(records, warmup, batch_size)
  details.update(prompt_len=prompt_len)
  return dict(mode=c.mode, measured_step_s=measured, predicted_step_s=predicted, error=predicted / measured - 1,
              sync_step_s=pred.sync_step_s, pipeline_step_s=pred.pipeline_step_s,
              measured_tokens_per_s=measured_tps, predicted_tokens_per_s=own.tokens_per_s,
              sync_tokens_per_s=pred.sync.tokens_per_s, pipeline_tokens_per_s=pred.pipeline.tokens_per_s,
              token_ratio=pred.pipeline.tokens_per_s / pred.sync.tokens_per_s,
              sync_trained_len=_trained_len(pred.sync), pipeline_trained_len=_trained_len(pred.pipeline),
              prediction=pred, calibration=cal, details=details)


def _trained_len(sim) -> float:
  """Mean completion length of the samples a simulated run trained in its measured window."""
  lo = sim.spec.warmup - 1
  return float(sim.samples["length"][sim.samples["step"] > lo].mean())


def summary(cal: Calibration, details: dict) -> str:
  d = cal.decode
  m = cal.measurements
  lines = [
      f"decode step: {d.overhead_s * 1e3:.2f} ms overhead + {d.weights_s * 1e3:.2f} ms weights "
      f"+ {d.kv_s_per_token * 1e6:.3f} us/context token (knee at batch {d.knee_batch:.3g}); fit over "
      f"{cal.fit['n']} points, rms error {cal.fit['rms_rel_error']:.1%}, max {cal.fit['max_rel_error']:.1%}",
      f"admission: {details['admission_s_per_sample'] * 1e3:.2f} ms per sample",
      f"train: {details['train_step_s']:.3f} s per step of {details['train_tokens_per_step']:.0f} tokens = "
      f"{cal.train_tokens_per_s_per_device:,.0f} tokens/s per device",
      f"weights: {cal.weight_bytes / 1e6:.2f} MB moved in {details['transfer_s'] * 1e3:.2f} ms; KV recompute after "
      f"an in-flight update {cal.update_s * 1e3:.1f} ms",
  ]
  if m is not None and "decode_alone_s" in details:
    lines.append(f"contention (both at once vs alone): decode x{m.decode_contention:.2f} "
                 f"({details['decode_alone_s'] * 1e3:.1f} -> {details['decode_both_s'] * 1e3:.1f} ms per call), "
                 f"train x{m.train_contention:.2f} ({details['train_alone_s']:.3f} -> {details['train_both_s']:.3f} s)")
  return "\n".join(lines)


def main(argv=None):
  platforms.entry_point()
  from absl import app, flags
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", None, "run config, e.g. configs/bench_pipeline.py", lock_config=True)
  flags.DEFINE_string("out", None, "where to write the calibration JSON")
  flags.DEFINE_integer("decode_calls", 6, "timed generate calls per batch size")
  flags.DEFINE_integer("train_reps", 3, "timed train steps (alone; as many again with decode running)")
  flags.DEFINE_bool("contention", True, "measure the slowdown of sampler and learner running at once")
  flags.DEFINE_string("from-run", None, "fit the costs a finished run logged in this workdir (made with --config) "
                      "instead of profiling, and predict its step time")
  flags.DEFINE_integer("devices", 2, "--from-run: devices of the run (sampler + learner)")
  flags.DEFINE_integer("warmup", 3, "--from-run: first steps left out (compilation)")
  flags.mark_flags_as_required(["config"])
  fl = flags.FLAGS

  def _main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if fl["from-run"].value:
      try:
        r = from_run(fl.config, fl["from-run"].value, devices=fl.devices, warmup=fl.warmup)
      except (ValueError, FileNotFoundError) as e:
        print(f"jaxrl-profile: {e}", file=sys.stderr)
        sys.exit(2)
      print(summary(r["calibration"], r["details"]))
      print(f"{r['mode']} run: measured {r['measured_step_s']:.4f} s per step, simulator {r['predicted_step_s']:.4f} s "
            f"({r['error']:+.1%}); simulator for this run's costs: sync {r['sync_step_s']:.4f} s, pipeline "
            f"{r['pipeline_step_s']:.4f} s; hand-off {r['details']['handoff_s'] * 1e3:.1f} ms per step "
            "(multi-process runs)")
      print(f"trained tokens/s: measured {r['measured_tokens_per_s']:.1f}, simulator "
            f"{r['predicted_tokens_per_s']:.1f}; "
            f"pipeline over sync per trained token {r['token_ratio']:.3f}x (mean trained length: sync "
            f"{r['sync_trained_len']:.1f}, pipeline {r['pipeline_trained_len']:.1f} tokens)")
      if fl.out:
        r["calibration"].save(fl.out)
      return
    if not fl.out:
      raise app.UsageError("--out is required (unless --from-run)")
    with tempfile.TemporaryDirectory() as workdir:
      try:
        run = build(fl.config, workdir)
      except config_lib.ConfigError as e:
        print(f"jaxrl-profile: {e}", file=sys.stderr)
        sys.exit(2)
      try:
        cal, details = calibrate_run(run, decode_calls=fl.decode_calls, train_reps=fl.train_reps,
                                     with_contention=fl.contention)
      finally:
        run.controller.sampler_loop.score.close()
        run.checkpointer.close()
        run.metrics.close()
    cal.save(fl.out)
    print(summary(cal, details))
    print(f"wrote {fl.out}")

  app.run(_main, argv=argv)


if __name__ == "__main__":
  main()
