r"""What hostile network peers cost an honest run: trained groups per minute with and without a flood, side by side
in one process, on loopback (127.0.0.1 only).

  PYTHONPATH=. .venv/bin/python -m bench.hostile_peers                      # 3 rounds of 2 x 10 s, ~1 min
  PYTHONPATH=. .venv/bin/python -m bench.hostile_peers --rounds=1 --phase_s=5 --out=/tmp/hostile.json   # smoke

The learner's side is the lead's real rpc server (learner_main.lead_handlers over a Hub, rpc.Limits with the frame
cap of the run's packets); the honest sampler is a real remote registration (distributed.remote) that admits,
"generates" (sleeps --generate_s per group) and delivers real packets; the learner loop takes each step's groups
from the hub, settles them and "trains" (sleeps --train_s). So what is measured is the channel and the hub under
attack with the compute simulated: the work a flood takes from an honest run is its CPU and the honest calls it
delays or breaks. The flood comes from a child process (an attacker is another program; on this machine it still
takes cores from the learner's): --idle connections held open without a handshake
(re-opened as the server closes them), handshakes with a wrong secret in a loop, and, every 50 ms, peers holding the
secret that declare a 64 MB header or a 2**40-byte array. Rounds alternate a quiet phase and a flooded one; reported
per phase: trained groups per minute, the server's refusals by reason, this process's peak RSS growth and thread
count; the headline is flooded / quiet groups per minute (target >= 0.9). JSON to bench/results/hostile_peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from bench.common import write_json
from jaxrl import settings
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.distributed import learner_main, packets, remote, rpc
from jaxrl.distributed.hub import Hub
from jaxrl.rollout import Rollout

SECRET = b"b" * 64
# With --pin, the learner's process and the flood run on disjoint cores: an attacker is another machine, whose CPU
# is not the learner's; what is measured is what the flood costs the learner's own process.
FLOOD_CORES: set[int] = set()
MAX_LEN, GROUP, GROUPS_PER_STEP = 64, 4, 4


def _prompt(gid: int) -> np.ndarray:
  return np.arange(1, 9, dtype=np.int32) + gid % 11


def _group(gid: int, version: int) -> list[Rollout]:
  rng = np.random.default_rng(gid)
  return [Rollout(_prompt(gid), rng.integers(0, 500, 40).astype(np.int32), -rng.random(40).astype(np.float32),
                  np.full(40, version, np.int32), "eos", gid, i, reward=float(i % 2)) for i in range(GROUP)]


def _rss_mb() -> float:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Honest:
  """The learner loop and one honest sampler over the lead's rpc server; counts the groups trained."""

  def __init__(self, address: str, hub: Hub, generate_s: float, train_s: float):
    self.address, self.hub, self.generate_s, self.train_s = address, hub, generate_s, train_s
    self.trained = 0
    self.errors: list[str] = []
    self.done = threading.Event()

  def sample(self) -> None:
    while not self.done.is_set():
      try:
        coord = remote.register(self.address, secret=SECRET, timeout_s=10, reconnect_s=30)
        while not self.done.is_set():
          got: list[int] = []
          coord.admit(lambda gid, again, got=got: got.append(gid))
          time.sleep(self.generate_s)
          out = remote.RemoteRollouts(coord, 4, MAX_LEN)
          out.put_all([_group(gid, self.hub._version) for gid in got])  # the version it generated at
      except (Stopped, rpc.RpcError) as e:  # a call the flood broke: counted, then the sampler registers again
        self.errors.append(str(e) or type(e).__name__)

  def learn(self) -> None:
    version = 0
    while not self.done.is_set():
      self.hub.go_on(version)
      self.hub.ask()
      try:
        groups = [self.hub.get() for _ in range(GROUPS_PER_STEP)]
      except (Stopped, TimeoutError):
        return
      self.hub.settle(groups)
      time.sleep(self.train_s)
      self.trained += len(groups)
      version += 1


class Flood:
  """Hostile peers on loopback until stopped; every loop bounded by the stop and by --idle."""

  def __init__(self, port: int, idle: int):
    self.port, self.idle, self.stop = port, idle, threading.Event()
    self.sent = {"idle_opened": 0, "wrong_secret": 0, "oversized": 0}

  def _connect(self) -> socket.socket | None:
    try:
      return socket.create_connection(("127.0.0.1", self.port), timeout=2)
    except OSError:
      return None

  def hold_idle(self) -> None:
    held: list[socket.socket] = []
    while not self.stop.is_set():
      held = [s for s in held if _open(s)]
      while len(held) < self.idle and not self.stop.is_set():
        sock = self._connect()
        if sock is None:
          break
        held.append(sock)
        self.sent["idle_opened"] += 1
      self.stop.wait(0.2)
    for s in held:
      s.close()

  def wrong_secret(self) -> None:
    while not self.stop.is_set():
      try:
        rpc.call(f"127.0.0.1:{self.port}", "stop", {"reason": "x", "process": 1}, timeout_s=2, secret=b"w" * 64)
      except rpc.RpcError:
        pass
      self.sent["wrong_secret"] += 1

  def oversized(self) -> None:
    header = json.dumps({"body": {"method": "deliver", "request": {"packet": {"__array__": 0}}},
                         "arrays": [["<i4", [1 << 18, 1 << 20]]]}).encode()
    frames = [struct.pack(">Q", 64 << 20) + b"[" * (1 << 16),  # a 64 MB header, then an array of 2**40 bytes
              struct.pack(">Q", len(header)) + header + b"\0" * (1 << 16)]
    while not self.stop.is_set():
      for frame in frames:
        sock = self._connect()
        if sock is None:
          continue
        try:
          hello = rpc._read_exactly(sock, len(rpc.HELLO) + rpc.NONCE)
          mine = b"c" * rpc.NONCE
          sock.sendall(mine + rpc.mac(SECRET, b"client", hello[len(rpc.HELLO):], mine))
          sock.sendall(frame)
        except OSError:
          pass
        finally:
          sock.close()
        self.sent["oversized"] += 1
      self.stop.wait(0.05)

  def start(self) -> list[threading.Thread]:
    threads = [threading.Thread(target=f, daemon=True) for f in (self.hold_idle, self.wrong_secret, self.oversized)]
    for t in threads:
      t.start()
    return threads


def _open(sock: socket.socket) -> bool:
  """Still open from the server's side (a closed one is closed here too)."""
  sock.setblocking(False)
  try:
    closed = sock.recv(64) == b""
  except BlockingIOError:
    closed = False
  except OSError:
    closed = True
  sock.setblocking(True)
  if closed:
    sock.close()
  return not closed


def flood_main(port: int, idle: int, seconds: float) -> None:
  """The child process: floods 127.0.0.1:port for `seconds`, then prints what it sent."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * idle + 256)), hard))
  flood = Flood(port, idle)
  threads = flood.start()
  time.sleep(seconds)
  flood.stop.set()
  for t in threads:
    t.join(5)
  print(json.dumps(flood.sent), flush=True)


def phase(honest: Honest, server: rpc.Server, seconds: float, flood: bool, idle: int) -> dict:
  refused, trained, errors = dict(server.refused), honest.trained, len(honest.errors)
  child = None
  if flood:
    port = server.address.rpartition(":")[2]
    child = subprocess.Popen([sys.executable, "-m", "bench.hostile_peers", f"--flood_port={port}", f"--idle={idle}",
                              f"--phase_s={seconds}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             preexec_fn=(lambda: os.sched_setaffinity(0, FLOOD_CORES)) if FLOOD_CORES else None)
  rss0, peak_rss, peak_threads = _rss_mb(), _rss_mb(), threading.active_count()
  start = time.monotonic()
  while time.monotonic() - start < seconds:
    time.sleep(0.1)
    peak_rss, peak_threads = max(peak_rss, _rss_mb()), max(peak_threads, threading.active_count())
  elapsed = time.monotonic() - start
  out = {"flood": flood, "seconds": round(elapsed, 2),
         "groups_per_minute": 60 * (honest.trained - trained) / elapsed,
         "honest_call_errors": len(honest.errors) - errors, "rss_growth_mb": round(peak_rss - rss0, 1),
         "peak_threads": peak_threads,
         "refused": {k: v - refused.get(k, 0) for k, v in server.refused.items() if v - refused.get(k, 0)}}
  if child is not None:
    sent, _ = child.communicate(timeout=30)
    out["sent"] = json.loads(sent.strip().splitlines()[-1]) if sent.strip() else None
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--phase_s", type=float, default=10.0)
  parser.add_argument("--idle", type=int, default=1000, help="idle connections the flood holds open")
  parser.add_argument("--generate_s", type=float, default=0.02, help="simulated generation per admitted group")
  parser.add_argument("--train_s", type=float, default=0.05, help="simulated train step")
  parser.add_argument("--out", default="bench/results/hostile_peers.json")
  parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                      help="the learner's process on the first half of this process's cores, the flood on the rest")
  parser.add_argument("--flood_port", type=int, default=0, help="(the flooding child process's own flag)")
  args = parser.parse_args(argv)
  if args.flood_port:
    flood_main(args.flood_port, args.idle, args.phase_s)
    return 0
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.idle + 256)), hard))
  cores = sorted(os.sched_getaffinity(0))
  if args.pin and len(cores) > 1:
    os.sched_setaffinity(0, set(cores[: len(cores) // 2]))
    FLOOD_CORES.update(cores[len(cores) // 2 :])
  rl = settings.RL(group_size=GROUP, groups_per_step=GROUPS_PER_STEP, seq_len=MAX_LEN, queue_groups=8)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=1 << 30, max_staleness=2)
  hub = Hub(RunRecord(), spec, MAX_LEN, lease_s=10.0, hold_s=0.2, orphan_s=60.0, prompt_of=_prompt, vocab_size=512)
  limits = rpc.Limits(max_frame_bytes=rpc.Limits().max_header_bytes + 4 * rl.queue_groups * GROUP
                      * packets.packet_width(MAX_LEN))
  server = rpc.Server(learner_main.lead_handlers(hub, lambda r: {"version": 0}), secret=SECRET, limits=limits)
  honest = Honest(server.address, hub, args.generate_s, args.train_s)
  workers = [threading.Thread(target=honest.sample, daemon=True), threading.Thread(target=honest.learn, daemon=True)]
  for w in workers:
    w.start()
  time.sleep(2.0)  # warm: the first steps
  phases = []
  for r in range(args.rounds):
    for flooded in (False, True):
      phases.append({"round": r, **phase(honest, server, args.phase_s, flooded, args.idle)})
      print(json.dumps(phases[-1]), flush=True)
  honest.done.set()
  hub.stop.set()
  server.close()
  quiet = [p["groups_per_minute"] for p in phases if not p["flood"]]
  flooded = [p["groups_per_minute"] for p in phases if p["flood"]]
  report = {"what": "honest trained groups per minute, flooded / quiet, side by side in one process (loopback)",
            "args": vars(args), "learner_cores": sorted(os.sched_getaffinity(0)), "flood_cores": sorted(FLOOD_CORES),
            "phases": phases,
            "ratio_per_round": [f / q for q, f in zip(quiet, flooded, strict=True)],
            "ratio": sum(flooded) / sum(quiet), "max_rss_growth_mb": max(p["rss_growth_mb"] for p in phases),
            "ledger_refused": dict(hub.ledger.samples_refused), "honest_call_errors": honest.errors[:5]}
  print(f"flooded / quiet trained groups per minute: {report['ratio']:.3f} (per round "
        f"{', '.join(f'{x:.3f}' for x in report['ratio_per_round'])}); peak RSS growth "
        f"{report['max_rss_growth_mb']} MB", file=sys.stderr)
  write_json(args.out, report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
