r"""Weight pull between independent programs (issue 43): SmolLM2-135M-Instruct's weights from a learner process to a
separate sampler process on loopback over jax.experimental.transfer (jaxrl.distributed.weight_service), against
the loopback copy limit measured in the same run between the same two processes.

  PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.weight_pull      # JSON: bench/results/weight_pull.json

The learner (this process, 1 CPU device) loads the model (jaxrl-assets smollm2) and serves three payloads, each
exactly what a sampler engine takes: the float32 params, the LoRA adapters alone at the default model.lora config
(rank 8, alpha 16, every projection), and int8 weights (quantized on the learner). The sampler (a subprocess, its
own JAX runtime, 1 CPU device, no jax.distributed) pulls each with WeightClient.take_newer onto the shardings of an
engine of that payload and reports describe / pull / checksum / place seconds. The float32 payload is pulled a
second time through transfer servers at the server's own piece size (256 MiB; weight_service.CHUNK_BYTES otherwise).
Against it, in the same rep: the same number of bytes over a plain TCP socket between the two processes (host bytes
to host bytes, recv_into a buffer), and a memcpy of that many bytes in the sampler. describe travels over the
sampler's stdin/stdout (the hub's rpc in a run). The payloads and the methods alternate --reps times; medians;
ratios against TCP and memcpy.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from bench.common import write_json
from jaxrl import settings
from jaxrl.assets import smollm2_path
from jaxrl.distributed.weight_service import CHUNK_BYTES, WeightClient, WeightServer
from jaxrl.models import Decoder, hf, lora
from jaxrl.sampler import make_engine
from jaxrl.sharding import SAMPLER_RULES, make_mesh, param_shardings

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("float32", "float32_256MiB", "lora", "int8")
# Each payload's transfer-server piece size: the module's, and the server's own default (256 MiB) side by side.
CHUNK = {k: 256 << 20 if k.endswith("_256MiB") else CHUNK_BYTES for k in KINDS}


def _lora_config():
  d = settings.LoRA()
  return lora.LoRAConfig(d.rank, d.alpha, d.targets)


def _send(stream, kind: str, body) -> None:
  stream.write(f"{kind} {json.dumps(body)}\n")
  stream.flush()


def _read(stream) -> tuple[str, dict]:
  """The next protocol line (another line a library printed is passed over)."""
  while line := stream.readline():
    kind, _, body = line.partition(" ")
    if kind in ("PULL", "TCP", "END", "DESCRIBE", "REPLY", "RESULT"):
      return kind, json.loads(body)
  raise RuntimeError("the other process ended")


def sampler_main(port: int) -> None:
  """The sampler program: a WeightClient per payload on that payload's engine shardings; answers the learner's
  commands on stdin with one RESULT line each on stdout."""
  path = smollm2_path()
  cfg = hf.load_config(path)
  mesh = make_mesh({"data": 1}, jax.devices()[:1])
  adapters = lora.split(hf.abstract_params(cfg.replace(lora=_lora_config()))[1])[0]
  shardings = {"float32": make_engine(cfg, mesh, max_slots=1, max_len=16).publish_shardings,
               "int8": make_engine(cfg, mesh, max_slots=1, max_len=16, weight_dtype="int8").publish_shardings,
               "lora": param_shardings(adapters, mesh, SAMPLER_RULES)}  # Engine.hold_base's publish_shardings

  def describe(request):
    _send(sys.stdout, "DESCRIBE", request)
    return _read(sys.stdin)[1]

  shardings["float32_256MiB"] = shardings["float32"]
  clients = {k: WeightClient(describe, s, sampler=k, timeout_s=300, chunk_bytes=CHUNK[k]) for k, s in shardings.items()}
  have = dict.fromkeys(clients, -1)
  tcp = socket.create_connection(("127.0.0.1", port))
  while True:
    kind, cmd = _read(sys.stdin)
    if kind == "PULL":
      client = clients[cmd["kind"]]
      start = time.perf_counter()
      got = client.take_newer(have[cmd["kind"]])
      take_s = time.perf_counter() - start
      have[cmd["kind"]] = got.version
      _send(sys.stdout, "RESULT", dict(client.timings, take_s=take_s, version=got.version,
                                       bytes=sum(x.nbytes for x in jax.tree.leaves(got.params))))
    elif kind == "TCP":
      buf = bytearray(cmd["bytes"])
      view, got = memoryview(buf), 0
      start = time.perf_counter()
      tcp.sendall(b"g")
      while got < len(buf):
        got += tcp.recv_into(view[got:], len(buf) - got)
      tcp_s = time.perf_counter() - start
      src, dst = np.frombuffer(buf, np.uint8), np.ones(len(buf), np.uint8)  # pages touched: the copy alone
      start = time.perf_counter()
      np.copyto(dst, src)
      _send(sys.stdout, "RESULT", dict(tcp_s=tcp_s, memcpy_s=time.perf_counter() - start))
    else:
      return


def _host_bytes(leaves) -> bytes:
  return b"".join(np.asarray(x).tobytes() for x in leaves)


def learner_main(reps: int) -> dict:
  path = smollm2_path()
  cfg = hf.load_config(path)
  params = hf.load_params(path, cfg)[2]
  adapters = lora.split(lora.init_adapters(lambda: Decoder(cfg.replace(lora=_lora_config()), nnx.Rngs(0)))[1])[0]
  # B factors drawn (init makes them zero): the bytes sent are not all alike.
  adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), adapters)
  payloads = {kind: (WeightServer(dtype=jnp.float32, weight_dtype="int8" if kind == "int8" else "float",
                                  chunk_bytes=CHUNK[kind]), adapters if kind == "lora" else params) for kind in KINDS}
  listener = socket.create_server(("127.0.0.1", 0))
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_NUM_CPU_DEVICES": "1"}
  child = subprocess.Popen([sys.executable, "-m", "bench.weight_pull", f"--sampler_port={listener.getsockname()[1]}"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
  tcp, _ = listener.accept()
  rows: dict[str, list[dict]] = {k: [] for k in KINDS}

  def ask(kind: str, body: dict) -> dict:
    _send(child.stdin, kind, body)
    while True:
      what, reply = _read(child.stdout)
      if what == "RESULT":
        return reply
      _send(child.stdin, "REPLY", payloads[reply["sampler"]][0].describe(reply))

  try:
    for rep in range(reps):
      for kind in KINDS:
        server, tree = payloads[kind]
        server.publish(tree, rep)
        host = _host_bytes(server._newest[1])  # the very bytes served, on the host for the socket
        row = dict(ask("PULL", {"kind": kind}), **{f"publish_{k}": v for k, v in server.timings.items()})
        _send(child.stdin, "TCP", {"bytes": len(host)})
        tcp.recv(1)
        tcp.sendall(host)
        row.update(_read(child.stdout)[1])
        rows[kind].append(row)
        print(f"rep {rep} {kind}: {row['bytes'] / 2**20:.1f} MiB pull {row['pull_s'] * 1e3:.1f} ms, tcp "
              f"{row['tcp_s'] * 1e3:.1f} ms, memcpy {row['memcpy_s'] * 1e3:.1f} ms", file=sys.stderr)
    _send(child.stdin, "END", {})
    child.wait(60)
  finally:
    child.kill()
  return {kind: _summary(r) for kind, r in rows.items()}


def _summary(rows: list[dict]) -> dict:
  med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
  gb = rows[0]["bytes"] / 1e9
  return dict(bytes=rows[0]["bytes"], reps=len(rows), **med, pull_gb_s=gb / med["pull_s"],
              take_gb_s=gb / med["take_s"], tcp_gb_s=gb / med["tcp_s"], memcpy_gb_s=gb / med["memcpy_s"],
              pull_over_tcp=med["pull_s"] / med["tcp_s"], pull_over_memcpy=med["pull_s"] / med["memcpy_s"],
              take_over_tcp=med["take_s"] / med["tcp_s"], all=rows)


def main(argv=None):
  flags.DEFINE_integer("reps", 5, "rounds of (float32, LoRA, int8) pulls, each with its TCP and memcpy copies")
  flags.DEFINE_integer("sampler_port", 0, "internal: run as the sampler process, the learner's TCP port")
  flags.DEFINE_string("out", str(ROOT / "bench" / "results" / "weight_pull.json"), "JSON report")

  def _main(argv):
    fl = flags.FLAGS
    if fl.sampler_port:
      return sampler_main(fl.sampler_port)
    report = dict(load_average_start=os.getloadavg(), cpu_count=os.cpu_count(), model="SmolLM2-135M-Instruct",
                  jax=jax.__version__, platform=jax.devices()[0].platform, chunk_bytes=CHUNK)
    report.update(learner_main(fl.reps))
    report["load_average_end"] = os.getloadavg()
    for kind in KINDS:
      r = report[kind]
      print(f"{kind}: {r['bytes'] / 2**20:.1f} MiB, pull {r['pull_s'] * 1e3:.1f} ms ({r['pull_gb_s']:.2f} GB/s), "
            f"take_newer {r['take_s'] * 1e3:.1f} ms (check {r['check_s'] * 1e3:.1f}, place {r['place_s'] * 1e3:.1f}); "
            f"TCP {r['tcp_gb_s']:.2f} GB/s, memcpy {r['memcpy_gb_s']:.2f} GB/s: pull / TCP x{r['pull_over_tcp']:.2f}, "
            f"pull / memcpy x{r['pull_over_memcpy']:.1f}; learner publish: stage {r['publish_stage_s'] * 1e3:.1f} "
            f"ms, checksum {r['publish_checksum_s'] * 1e3:.1f} ms")
    write_json(fl.out, report)

  app.run(_main, argv)


if __name__ == "__main__":
  main()
