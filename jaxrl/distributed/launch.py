"""Local launcher: N CPU processes of one jax.distributed job on loopback, for tests and demos.

  python -m jaxrl.distributed.launch --num_processes=4 -- --config=configs/tiny.py --workdir=/tmp/jaxrl-mp
  python -m jaxrl.distributed.launch --independent_samplers=2 -- --config=configs/tiny.py \
      --config.mesh.num_devices=2 --config.mesh.sampler_devices=1 --workdir=/tmp/jaxrl-ind

--independent_samplers=N starts no jax.distributed job: a jaxrl-learner and N jaxrl-sampler programs
(distributed.learner_main, distributed.sampler_main), each with its own JAX runtime, on loopback (launch_independent);
with --learner_processes=M, M jaxrl-learner processes joined by jax.distributed among themselves (one learner mesh
over all their devices), the samplers outside that job. Every program gets the run's secret in JAXRL_RUN_SECRET (the
launcher's own if set, else a new one).

Every process runs `python -m jaxrl.distributed.job` (or --module) with the arguments after `--`, with
JAX_NUM_CPU_DEVICES=--devices_per_process and its own cross-host transfer port; its output is prefixed by
[pN <seconds since launch>].
When a process fails, the others get --grace_s to stop on their own (their watchdog does it within its heartbeat
timeout), then are killed; the launcher exits with the first failure's status (128 + signal if it was killed).
A job whose arguments name a --config is checked first, as each process would check it (jaxrl.distributed.cli): a
bad flag or config ends the launcher with one line naming the key and exit status 2, before any process starts.
A SIGTERM to the launcher is passed on to every process, as a cluster's preemption would signal each host: the job
stops after the learners' current step with a checkpoint, and the launcher exits 143.

--cpu_affinity pins each process to its own cores, so that a learner process and a sampler process run on disjoint
hardware as on a TPU slice or a GPU node (virtual CPU devices of one process share its cores): "split" divides the
cores this launcher may use into contiguous, equal shares in process order; "0-3;4,5;6-7" names each process's
cores. XLA sizes its CPU thread pools from the process's affinity mask, so each process computes with its own
cores only.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxrl import config as config_lib
from jaxrl.controller import auto
from jaxrl.controller import summary as summary_lib
from jaxrl.distributed import cli
from jaxrl.distributed import secret as secret_lib
from jaxrl.metrics import read_jsonl


def free_ports(n: int) -> list[int]:
  """n distinct ports that were free a moment ago on 127.0.0.1."""
  socks = [socket.socket() for _ in range(n)]
  try:
    for s in socks:
      s.bind(("127.0.0.1", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _parse_cores(text: str) -> set[int]:
  cores = set()
  for part in text.split(","):
    lo, _, hi = part.strip().partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
      raise ValueError(f"bad core list {text!r}: use numbers and ranges like 0-3,6")
    cores.update(range(int(lo), int(hi or lo) + 1))
  return cores


def cpu_sets(spec: str, num_processes: int, available: set[int]) -> list[set[int]] | None:
  """The cores of each process for a --cpu_affinity spec ("" or "none": no pinning, "split", or "a;b;..")."""
  if spec in ("", "none"):
    return None
  if spec == "split":
    cores = sorted(available)
    if len(cores) < num_processes:
      raise ValueError(f"--cpu_affinity=split: {len(cores)} cores for {num_processes} processes; each needs one")
    share = len(cores) // num_processes
    return [set(cores[i * share:(i + 1) * share]) for i in range(num_processes)]
  sets = [_parse_cores(part) for part in spec.split(";")]
  if len(sets) != num_processes:
    raise ValueError(f"--cpu_affinity names {len(sets)} core sets for {num_processes} processes")
  for i, cores in enumerate(sets):
    if not cores <= available:
      raise ValueError(f"--cpu_affinity: process {i} asks for cores {sorted(cores - available)}, not available "
                       f"to this launcher (it may use {sorted(available)})")
  for i in range(num_processes):
    for j in range(i):
      if sets[i] & sets[j]:
        raise ValueError(f"--cpu_affinity: processes {j} and {i} share cores {sorted(sets[i] & sets[j])}")
  return sets


def _describe(code: int) -> str:
  return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _pump(proc: subprocess.Popen, name: str, start: float) -> None:
  for line in proc.stdout:
    sys.stdout.write(f"[{name} {time.monotonic() - start:6.1f}s] {line}")
    sys.stdout.flush()


def launch(num_processes: int, args: list[str], *, devices_per_process: int = 2,
           module: str = "jaxrl.distributed.job", grace_s: float = 30.0, timeout_s: float = 0.0,
           cpu_affinity: str = "") -> int:
  """Runs the job; returns 0 if every process succeeded, else the first failure's status."""
  if num_processes < 2:
    raise ValueError(f"a multi-process job needs at least 2 processes (got {num_processes})")
  pinned = cpu_sets(cpu_affinity, num_processes, os.sched_getaffinity(0))
  coordinator, *transfer = free_ports(num_processes + 1)
  start = time.monotonic()
  procs = []
  for i in range(num_processes):
    env = {"JAX_NUM_CPU_DEVICES": str(devices_per_process), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{coordinator}",
           "JAXRL_NUM_PROCESSES": str(num_processes), "JAXRL_PROCESS_ID": str(i),
           "JAXRL_TRANSFER_ADDRESS": f"127.0.0.1:{transfer[i]}"}
    procs.append(_start(f"p{i}", [module, *args], env, pinned[i] if pinned else None, start))
  return _supervise(procs, start, grace_s, timeout_s)


def launch_colocated(args: list[str], devices: int, *, grace_s: float = 30.0, timeout_s: float = 0.0) -> int:
  """Runs a job's config as one process holding all `devices` and every core of this launcher (`python -m
  jaxrl.train`, the single-host build): colocated sync, where sampling and training each use the whole machine.
  `args` are the job's process arguments; only --config* and --workdir are passed on."""
  own = [a for a in args if a.startswith(("--config", "--workdir"))]
  start = time.monotonic()
  proc = _start("p0", ["jaxrl.train", *own], {"JAX_NUM_CPU_DEVICES": str(devices)}, None, start)
  return _supervise([proc], start, grace_s, timeout_s)


def launch_independent(num_samplers: int, args: list[str], *, devices_per_process: int = 2, grace_s: float = 30.0,
                       timeout_s: float = 0.0, cpu_affinity: str = "", learner_processes: int = 1) -> int:
  """learner_processes jaxrl-learner processes (jax.distributed among themselves when more than one; the first is
  the lead, which the samplers call) and num_samplers independent sampler programs (jaxrl-sampler) on loopback,
  outside the learners' job. A sampler that fails or is killed stops nothing (the learner generates its groups
  again with the others); the learners' exit ends the launch (the samplers get grace_s to hear the run is done)
  and is its status."""
  if learner_processes < 1:
    raise ValueError(f"--learner_processes must be at least 1 (got {learner_processes})")
  pinned = cpu_sets(cpu_affinity, learner_processes + num_samplers, os.sched_getaffinity(0))
  port, coordinator = free_ports(2)
  # the run's secret, handed to every program of the run (distributed.secret): the learners' rpc ports take no call
  # without it
  env = {"JAX_NUM_CPU_DEVICES": str(devices_per_process),
         secret_lib.ENV: os.environ.get(secret_lib.ENV) or secret_lib.new()}
  start = time.monotonic()
  joined = [] if learner_processes == 1 else [f"--num_processes={learner_processes}",
                                              f"--coordinator_address=127.0.0.1:{coordinator}"]
  learners = [_start(f"p{i}", ["jaxrl.distributed.learner_main", *args, *joined, f"--process_id={i}",
                               f"--port={port if i == 0 else 0}"], env, pinned[i] if pinned else None, start)
              for i in range(learner_processes)]
  own = [a for a in args if not a.startswith("--workdir")]  # a sampler writes nothing
  samplers = [_start(f"p{learner_processes + i}", ["jaxrl.distributed.sampler_main", *own,
                                                   f"--learner=127.0.0.1:{port}"], env,
                     pinned[learner_processes + i] if pinned else None, start) for i in range(num_samplers)]
  code = _supervise(learners, start, grace_s, timeout_s)
  end = time.monotonic() + grace_s
  for i, p in enumerate(samplers):
    try:
      p.wait(max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
      print(f"jaxrl.launch: killing sampler process {learner_processes + i}, still running {grace_s:.0f}s after the "
            "learner ended", flush=True)
      p.kill()
  return code


def _start(name: str, module_args: list[str], env: dict[str, str], cores: set[int] | None,
           start: float) -> subprocess.Popen:
  """One process of the job (`python -m <module_args>`), its output prefixed by [name seconds]."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **env}
  proc = subprocess.Popen([sys.executable, "-m", *module_args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          preexec_fn=(lambda c=cores: os.sched_setaffinity(0, c)) if cores else None)
  where = f" on cores {_format(cores)}" if cores else ""
  print(f"jaxrl.launch: process {name[1:]} pid {proc.pid}{where}", flush=True)
  threading.Thread(target=_pump, args=(proc, name, start), daemon=True).start()
  return proc


def _supervise(procs: list[subprocess.Popen], start: float, grace_s: float, timeout_s: float) -> int:
  """Waits for every process, passing a SIGTERM on to each; after a failure (or past timeout_s) the others get
  grace_s to stop, then are killed. Returns 0, or the first failure's status (128 + signal if killed)."""

  def forward(signum, frame):
    print(f"jaxrl.launch: {signal.Signals(signum).name}: passing it on to every process", flush=True)
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = None
  if threading.current_thread() is threading.main_thread():
    previous = signal.signal(signal.SIGTERM, forward)
  failed, failed_at, killed = None, None, set()
  try:
    while None in [p.poll() for p in procs]:  # a list, not any(): every process must be polled
      now = time.monotonic()
      for i, p in enumerate(procs):
        if failed is None and p.returncode not in (None, 0):
          failed, failed_at = i, now
          print(f"jaxrl.launch: process {i} failed ({_describe(p.returncode)}); waiting up to {grace_s:.0f}s "
                f"for the others to stop", flush=True)
      if timeout_s and now - start > timeout_s and failed is None:
        print(f"jaxrl.launch: the job ran past {timeout_s:.0f}s; killing it", flush=True)
        failed, failed_at = -1, now - grace_s
      if failed is not None and now - failed_at > grace_s:
        for i, p in enumerate(procs):
          if p.poll() is None and i not in killed:
            print(f"jaxrl.launch: killing process {i}, still running {grace_s:.0f}s after the failure", flush=True)
            p.kill()
            killed.add(i)
      time.sleep(0.1)
  except KeyboardInterrupt:
    for p in procs:
      if p.poll() is None:
        p.kill()
    raise
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
  codes = [p.wait() for p in procs]
  if failed is None:
    failed = next((i for i, c in enumerate(codes) if c != 0), None)
  if failed is None:
    print(f"jaxrl.launch: all {len(procs)} processes finished" if len(procs) > 1 else "jaxrl.launch: the process "
          "finished", flush=True)
    return 0
  print("jaxrl.launch: " + ", ".join(f"process {i}: {_describe(c)}" for i, c in enumerate(codes)), flush=True)
  code = codes[failed] if failed >= 0 else 124
  return 128 - code if code < 0 else code


def _format(cores: set[int]) -> str:
  return ",".join(str(c) for c in sorted(cores))


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print("usage: python -m jaxrl.distributed.launch --num_processes=N | --independent_samplers=N [options] -- "
          "<job args>", file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="jaxrl.distributed.launch")
  parser.add_argument("--num_processes", type=int, default=0, help="processes of one jax.distributed job")
  parser.add_argument("--independent_samplers", type=int, default=0,
                      help="instead: a jaxrl-learner and this many independent jaxrl-sampler programs")
  parser.add_argument("--learner_processes", type=int, default=1,
                      help="with --independent_samplers: learner processes (jax.distributed among themselves)")
  parser.add_argument("--devices_per_process", type=int, default=2,
                      help="CPU devices of each process (2: configs/tiny.py's split fits 4 processes as is)")
  parser.add_argument("--module", default="jaxrl.distributed.job", help="what every process runs (python -m)")
  parser.add_argument("--grace_s", type=float, default=30.0, help="after a failure, time for the others to stop")
  parser.add_argument("--timeout_s", type=float, default=0.0, help="kill the job after this long (0: never)")
  parser.add_argument("--cpu_affinity", default="",
                      help='pin processes to cores: "split" (equal shares in process order) or "0-3;4-7" (per process)')
  parser.add_argument("--auto_sync", choices=("colocated", "processes"), default="colocated",
                      help='mode=auto: a sync segment runs as one process with every device and core of the job '
                      '("colocated": each phase on the whole machine, the synchronous baseline) or as the job\'s '
                      'processes taking turns ("processes")')
  opts = parser.parse_args(argv[:split])
  job = argv[split + 1 :]
  if opts.independent_samplers:
    try:
      return launch_independent(opts.independent_samplers, job, devices_per_process=opts.devices_per_process,
                                grace_s=opts.grace_s, timeout_s=opts.timeout_s, cpu_affinity=opts.cpu_affinity,
                                learner_processes=opts.learner_processes)
    except ValueError as e:
      print(f"jaxrl.launch: {e}", file=sys.stderr)
      return 2
  run_job = functools.partial(launch, opts.num_processes, devices_per_process=opts.devices_per_process,
                              module=opts.module, grace_s=opts.grace_s, timeout_s=opts.timeout_s,
                              cpu_affinity=opts.cpu_affinity)
  if cli.has_config(job) or "--config_help" in argv:  # a bad config: one line, exit 2, no process
    c, workdir = cli.preflight("jaxrl.launch", job, [opts.devices_per_process] * opts.num_processes)
    if c.mode == "auto":
      devices = opts.num_processes * opts.devices_per_process
      colocated = (functools.partial(launch_colocated, devices=devices, grace_s=opts.grace_s,
                                     timeout_s=opts.timeout_s) if opts.auto_sync == "colocated" else None)
      return launch_auto(c, Path(workdir), job, run_job, devices, colocated)
  try:  # bad options raise before any process starts
    return run_job(job)
  except ValueError as e:
    print(f"jaxrl.launch: {e}", file=sys.stderr)
    return 2


class _SegmentFailed(Exception):
  def __init__(self, code: int):
    super().__init__(f"exit status {code}")
    self.code = code


def segment_flags(seg_c, first: bool, last: bool) -> list[str]:
  """The command-line flags that make the job's config into an auto segment's (jaxrl.controller.auto.segment_config),
  with the trace on; held-out evaluations before the first segment and after the last only."""
  flags = [f"--config.mode={seg_c.mode}", f"--config.rl.max_staleness={seg_c.rl.max_staleness}",
           f"--config.num_steps={seg_c.num_steps}", f"--config.optimizer.decay_steps={seg_c.optimizer.decay_steps}",
           "--config.log.trace=True", f"--config.mesh.sampler_devices={seg_c.mesh.sampler_devices}"]
  if not (first or last):
    flags.append("--config.eval.num_examples=0")
  return flags


def launch_auto(c: config_lib.RunConfig, workdir: Path, job: list[str], run_job, devices: int,
                run_colocated=None) -> int:
  """mode="auto" over processes: the job is launched once per segment (jaxrl.controller.auto), in the mode and
  staleness bound chosen for it, each launch resuming the last one's checkpoint (the checkpoint and the run record
  are the same in every topology); the trace is on (the segments' trained lengths calibrate the model). A sync
  segment runs through `run_colocated` where given (one process with every device: the colocated baseline, whose
  phases each get every core), else as the job's processes. Writes the whole run's summary.json; returns the failed
  launch's status."""
  def run_segment(seg_c, first: bool, last: bool):
    flags = segment_flags(seg_c, first, last)
    colocated = seg_c.mode == "sync" and run_colocated is not None
    where = f"one process of {devices} devices (colocated)" if colocated else "the job's processes"
    print(f"jaxrl.launch: mode=auto: steps to {seg_c.num_steps} as {seg_c.mode}, k={seg_c.rl.max_staleness}, "
          f"{seg_c.mesh.sampler_devices} sampler device(s), on {where}", flush=True)
    code = (run_colocated if colocated else run_job)([*job, *flags])
    summary = json.loads((workdir / "summary.json").read_text()) if (workdir / "summary.json").exists() else {}
    if code != 0 and "stopped_by" not in summary:
      raise _SegmentFailed(code)
    start = max([0, *(s.end for s in auto.AutoLog(workdir).segments[:-1])])
    trained = [e for e in read_jsonl(workdir / "trace.jsonl") if e.get("event") == "train" and e.get("applied")]
    lengths = [n for e in trained if start < e["version"] for n in e.get("lengths", [])]
    return summary, lengths

  try:
    summary = auto.supervise(c, workdir, run_segment, functools.partial(auto.metrics_records, workdir),
                             lambda: auto.run_context(c, devices, multi_process=True))
  except _SegmentFailed as e:
    print(f"jaxrl.launch: mode=auto: a segment failed ({e}); the same command resumes it", file=sys.stderr)
    return e.code
  summary_lib.write_summary(workdir, summary)
  if "stopped_by" in summary:
    return summary_lib.exit_status(summary["stopped_by"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
