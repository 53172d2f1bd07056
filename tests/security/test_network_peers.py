"""Hostile network peers against the learner's rpc port (jaxrl.distributed.rpc, hub, follow, weight_service), in
process on loopback (127.0.0.1 only), each beside an honest sampler: a peer without the run's secret gets nothing
and is counted nowhere; a replayed handshake is refused; a peer with the secret that forges groups has each refused
under its own reason (the honest groups never are); a flood of idle connections, oversized frames and headers costs
bounded threads and memory while honest calls are served; weight describes are capped. Every loop is bounded in
count and time."""

import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import secret_util
from secret_util import SECRET

from jaxrl import settings
from jaxrl.controller.rollouts import Stopped
from jaxrl.controller.spec import RunRecord, RunSpec
from jaxrl.distributed import follow, learner_main, packets, remote, rpc
from jaxrl.distributed.launch import free_ports
from jaxrl.distributed.weight_service import WeightServer
from jaxrl.rollout import Rollout, SamplingParams, check_sampling

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN, GROUP, VOCAB = 12, 2, 64
LIMITS = rpc.Limits(handshake_s=1.0, read_timeout_s=2.0, max_header_bytes=64 << 10,
                    max_frame_bytes=(64 << 10) + 4 * 4 * GROUP * packets.packet_width(MAX_LEN))


def _prompt(gid):
  return np.array([1, 2, 3 + gid % 7], np.int32)


def _group(gid, version=0, **change):
  """An honest group of `gid` (the data's prompt, log-probs < 0, versions the learner published), `change`d."""
  group = [Rollout(_prompt(gid), np.array([5, 6 + i], np.int32), np.array([-0.5, -1.0], np.float32),
                   np.full(2, version, np.int32), "eos", gid, i, reward=float(i)) for i in range(GROUP)]
  return [dataclasses.replace(r, **change) for r in group]


@pytest.fixture
def lead():
  """The lead learner's rpc server (learner_main.lead_handlers) over a hub and a follow log, as jaxrl-learner serves
  it; `described`: the describes that reached the weights."""
  rl = settings.RL(group_size=GROUP, groups_per_step=2, seq_len=MAX_LEN, queue_groups=4)
  spec = RunSpec(rl=rl, sampler=settings.Sampler(), task=settings.Task(), num_steps=10, max_staleness=1)
  log = follow.FollowLog([1], MAX_LEN, hold_s=0.1)
  hub = follow.LeadHub(RunRecord(), spec, MAX_LEN, log=log, lease_s=5.0, hold_s=0.1, orphan_s=5.0, prompt_of=_prompt,
                       vocab_size=VOCAB)
  described = []
  handlers = learner_main.lead_handlers(hub, lambda r: described.append(r) or {"version": 0}, log)
  server = secret_util.server(handlers, limits=LIMITS)
  hub.go_on(0)
  hub.ask()
  yield hub, log, server, described
  hub.stop.set()
  server.close()


def _join(server):
  return remote.register(server.address, secret=SECRET, timeout_s=5, reconnect_s=1)


def _admit(coord, n):
  got = []
  for _ in range(n):
    assert coord.admit(lambda gid, again: got.append(gid))
  return got


def _deliver(coord, groups, max_len=MAX_LEN, **request):
  tokens = [[g[0].group_id, coord.tokens.get(g[0].group_id)] for g in groups]
  return coord.call("deliver", allow_expired=True, packet=packets.encode(groups, max_len), tokens=tokens, **request)


def _port(server):
  return int(server.address.rpartition(":")[2])


def _authenticated(server, secret=SECRET) -> socket.socket:
  """A raw connection past the handshake: what it sends next is read as a frame."""
  sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
  hello = rpc._read_exactly(sock, len(rpc.HELLO) + rpc.NONCE)
  mine = b"c" * rpc.NONCE
  sock.sendall(mine + rpc.mac(secret, b"client", hello[len(rpc.HELLO):], mine))
  assert rpc._read_exactly(sock, 32) == rpc.mac(SECRET, b"server", hello[len(rpc.HELLO):], mine)
  return sock


def _closed(sock: socket.socket, timeout_s: float = 5.0, said: bytes = b"") -> bool:
  """The server closed the connection (within timeout_s) having sent exactly `said` (nothing, or its REFUSED)."""
  sock.settimeout(timeout_s)
  got = b""
  try:
    while chunk := sock.recv(64):
      got += chunk
  except ConnectionResetError:
    pass
  finally:
    sock.close()
  return got == said


def _send(sock: socket.socket, data: bytes) -> socket.socket:
  try:
    sock.sendall(data)
  except OSError:  # the server closed it before reading everything: what is asserted next
    pass
  return sock


def _rss_mb() -> float:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_peer_without_the_secret_gets_nothing_and_is_counted_nowhere(lead):
  hub, log, server, described = lead
  packet = packets.encode([_group(0, reward=1e6)], MAX_LEN)
  requests = {"register": {}, "heartbeat": {"sampler": "s0"}, "admit": {"sampler": "s0"},
              "skipped": {"group": 0, "token": 1, "reason": "x", "set_aside": False},
              "deliver": {"sampler": "s0", "packet": packet, "tokens": [[0, 1]]}, "goodbye": {},
              "weights": {"sampler": "s0", "have": -1}, "follow": {"follower": 1, "next": 10**9},
              "stop": {"reason": "SIGTERM", "process": 1}}
  for method, request in requests.items():
    for wrong in (b"w" * 64, SECRET[:-1] + b"x"):
      with pytest.raises(rpc.RpcError, match="does not hold the run's secret") as e:
        secret_util.call(server.address, method, request, timeout_s=5, secret=wrong)
      assert e.value.waited_for == "auth"
  sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)  # no handshake: the frame at once
  sock.recv(len(rpc.HELLO) + rpc.NONCE)
  sock.sendall(rpc.encode({"method": "stop", "request": requests["stop"]}))
  assert _closed(sock, said=rpc.REFUSED)
  assert server.refused["secret"] == 2 * len(requests) + 1
  assert hub.samplers["joined"] == 0 and hub.ledger.samples_generated == 0 and not hub.stop.is_set()
  assert described == [] and log.first == 0 and log._fetched == {1: 0} and hub.depth() == 0
  honest = _join(server)  # beside it, an honest sampler is served
  gids = _admit(honest, 2)
  assert _deliver(honest, [_group(g) for g in gids])["accepted"] == 2 and hub.depth() == 2
  with pytest.raises(rpc.RpcError, match="the server did not prove the run's secret"):  # a learner without it
    _fake_learner_call()


def _fake_learner_call():
  """A server that does not hold the secret answers the handshake with garbage: the client refuses it."""
  listener = socket.create_server(("127.0.0.1", 0))

  def serve():
    conn, _ = listener.accept()
    conn.sendall(rpc.HELLO + b"n" * rpc.NONCE)
    conn.recv(2 * rpc.NONCE)
    conn.sendall(b"p" * 32)
    conn.close()

  threading.Thread(target=serve, daemon=True).start()
  try:
    secret_util.call(f"127.0.0.1:{listener.getsockname()[1]}", "register", {}, timeout_s=5)
  finally:
    listener.close()


def test_a_replayed_handshake_is_refused(lead):
  hub, _, server, _ = lead
  first = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
  nonce = rpc._read_exactly(first, len(rpc.HELLO) + rpc.NONCE)[len(rpc.HELLO):]
  answer = b"c" * rpc.NONCE + rpc.mac(SECRET, b"client", nonce, b"c" * rpc.NONCE)  # an honest answer, overheard
  first.sendall(answer)
  assert len(rpc._read_exactly(first, 32)) == 32  # proved: the server proves itself
  first.close()
  again = socket.create_connection(("127.0.0.1", _port(server)), timeout=5)
  assert rpc._read_exactly(again, len(rpc.HELLO) + rpc.NONCE)[len(rpc.HELLO):] != nonce  # a fresh nonce
  again.sendall(answer)
  assert _closed(again, said=rpc.REFUSED) and server.refused["secret"] == 1


def test_forged_groups_from_a_peer_with_the_secret_are_refused_under_their_reasons(lead):
  hub, _, server, _ = lead
  honest, hostile = _join(server), _join(server)
  forged = {"bad_values": [dict(reward=float("inf")), dict(logprobs=np.zeros(2, np.float32) + 1.0),
                           dict(logprobs=np.array([np.nan, -1], np.float32)),
                           dict(versions=np.full(2, 10**6, np.int32)),
                           dict(completion_tokens=np.array([5, VOCAB], np.int32))],
            "sampling_mismatch": [dict(sampling=SamplingParams(temperature=0.5))],
            "wrong_prompt": [dict(prompt_tokens=np.array([9, 9, 9], np.int32))]}
  cases = [(reason, change) for reason, changes in forged.items() for change in changes]
  gids = _admit(hostile, len(cases) + 1)
  for gid, (reason, change) in zip(gids, cases, strict=False):
    before = hub.ledger.samples_refused[reason]
    assert _deliver(hostile, [_group(gid, **change)])["accepted"] == 0, reason
    assert hub.ledger.samples_refused[reason] == before + GROUP, reason
  assert _deliver(hostile, [_group(gids[-1])[:1]])["accepted"] == 0  # half a group
  mine = _admit(honest, 2)
  stolen = _deliver(hostile, [_group(mine[0])])  # another sampler's group: fenced
  forger = secret_util.call(server.address, "deliver", {"sampler": "s9-000000", "incarnation": hub.incarnation,
                                                        "packet": packets.encode([_group(mine[1])], MAX_LEN),
                                                        "tokens": [[mine[1], 1]]}, timeout_s=5)
  assert stolen["accepted"] == forger["accepted"] == 0
  assert _deliver(honest, [_group(g) for g in mine])["accepted"] == 2  # the honest groups: never refused
  refused = dict(hub.ledger.samples_refused)
  assert refused == {"bad_values": 5 * GROUP + 1, "sampling_mismatch": GROUP, "wrong_prompt": GROUP,
                     "fenced": GROUP, "forged": GROUP}
  again = dict(hub.ledger.groups_generated_again)
  assert again == {"bad_values": 6, "sampling_mismatch": 1, "wrong_prompt": 1}
  taken = [hub.get(0), hub.get(0)]  # the learner gets the honest groups, whose sampling it scores
  assert sorted(g[0].group_id for g in taken) == sorted(mine) and hub.depth() == 0
  check_sampling([r for g in taken for r in g], hub.spec.sampler.sampling)
  hub.settle(taken)
  led = hub.ledger  # nothing is lost: every sample generated is trained or refused, counted
  assert led.samples_generated == led.samples_trained + sum(led.samples_refused.values()) == 2 * GROUP + 19
  # each group refused goes back to be generated again (the honest sampler took two of them first), none is lost
  assert set(mine) <= set(gids) and hub.checkpoint_record()["pending_group_ids"] == sorted(set(gids) - set(mine))
  assert sorted(_admit(honest, len(gids) - 2)) == sorted(set(gids) - set(mine))


def test_a_failed_reward_and_a_version_published_before_the_learner_goes_on_are_no_forgery(lead):
  hub, _, server, _ = lead
  honest = _join(server)
  gids = _admit(honest, 3)
  assert _deliver(honest, [_group(gids[0], reward=float("nan"))])["accepted"] == 1  # the learner drops it, counted
  hub.published(1)  # the loop publishes version 1 after step 0, then saves, logs and goes on: a sampler can be faster
  assert _deliver(honest, [_group(gids[1], version=1)])["accepted"] == 1
  assert _deliver(honest, [_group(gids[2], version=2)])["accepted"] == 0  # never published
  assert dict(hub.ledger.samples_refused) == {"bad_values": GROUP}


def test_the_follow_log_and_a_sampler_s_hold_are_bounded_for_a_peer_with_the_secret(lead):
  hub, log, server, _ = lead
  with pytest.raises(rpc.RpcError, match="past the lead's last"):
    secret_util.call(server.address, "follow", {"follower": 1, "next": 10**9}, timeout_s=5)
  assert secret_util.call(server.address, "follow", {"follower": 1, "next": 0}, timeout_s=5)["entries"] == [
      ["go_on", [0, True]]]  # the follower goes on: the lead's go_on at version 0
  greedy = _join(server)
  hub.max_held = 3
  _admit(greedy, 3)
  with pytest.raises(Stopped):  # past its cap the hoarder is dropped, its groups go back
    _admit(greedy, 1)
  assert greedy.ended == "expired" and dict(hub.ledger.groups_generated_again) == {"sampler_lost": 3}


def test_a_flood_of_idle_connections_and_oversized_frames_costs_bounded_threads_and_memory(lead):
  hub, _, server, _ = lead
  honest = _join(server)
  rss, threads, t0 = _rss_mb(), threading.active_count(), time.monotonic()
  idle = []
  try:
    while len(idle) < 1000 and time.monotonic() - t0 < 20:  # bounded in count and time
      idle.append(socket.create_connection(("127.0.0.1", _port(server)), timeout=5))
    assert len(idle) == 1000
    big = []
    for _ in range(3):  # three 64 MB headers at once, then an array of 2**40 bytes and a frame left unfinished
      big.append(_send(_authenticated(server), struct.pack(">Q", 64 << 20) + b"[" * (32 << 10)))
    header = json.dumps({"body": {"method": "deliver", "request": {"packet": {"__array__": 0}}},
                         "arrays": [["<i4", [1 << 18, 1 << 20]]]}).encode()
    huge = _send(_authenticated(server), struct.pack(">Q", len(header)) + header + b"\0" * (1 << 20))
    slow = _send(_authenticated(server), b"\0\0\0")  # then silent
    served = []
    for _ in range(20):  # the honest sampler is served all along
      start = time.monotonic()
      honest.call("heartbeat", seen=None, book_step=None, pending=None)
      served.append(time.monotonic() - start)
    assert max(served) < 2.0
    assert threading.active_count() - threads <= 8  # no thread per connection
    # refused before reading (closed well within the read timeout); the silent one at the read timeout
    assert all(_closed(s, LIMITS.read_timeout_s / 2) for s in [*big, huge]) and _closed(slow)
    assert _rss_mb() - rss <= 100
    gids = _admit(honest, 2)
    assert _deliver(honest, [_group(g) for g in gids])["accepted"] == 2
  finally:
    for sock in idle:
      sock.close()
  assert server.refused["handshakes_full"] >= 1000 - LIMITS.max_handshakes and server.refused["frame"] >= 5
  assert hub.ledger.samples_generated == 2 * GROUP and not hub.stop.is_set()


def test_authenticated_connections_past_the_cap_are_closed_at_once():
  server = secret_util.server({"ping": lambda r: {}}, limits=dataclasses.replace(LIMITS, max_connections=2))
  try:
    held = [_send(_authenticated(server), b"\0") for _ in range(2)]  # two requests that never finish
    assert _closed(_authenticated(server), LIMITS.read_timeout_s / 2) and server.refused["busy"] == 1
    assert all(_closed(s) for s in held)  # at the read timeout: the slots are free again
    assert secret_util.call(server.address, "ping", {}, timeout_s=5) == {}
  finally:
    server.close()


def test_weights_are_described_to_registered_samplers_and_pending_describes_are_capped(lead):
  hub, log, _, _ = lead
  weights = WeightServer(serve_s=30.0)
  server = secret_util.server(learner_main.lead_handlers(hub, weights.describe, log), limits=LIMITS)
  try:
    hoarder, other = _join(server), _join(server)
    for version in range(4):
      weights.publish({"w": jnp.full((256,), version, jnp.float32)}, version)
      reply = hoarder.call("weights", have=-1)  # describes, never pulls
      assert ("uuid" in reply) == (version < weights.max_pending) and reply["version"] == version
    assert hoarder.call("weights", have=-1)["busy"] and weights.busy == 3
    assert "uuid" in other.call("weights", have=-1)  # another sampler is served
    stranger = secret_util.call(server.address, "weights", {"sampler": "s9-000000", "have": -1}, timeout_s=5)
    assert "uuid" not in stranger and weights.served == 3
    assert "uuid" in hoarder.call("weights", have=1)  # it has (pulled or gave up) the older ones: room again
  finally:
    server.close()
    weights.close()


@pytest.mark.timeout(400)
def test_a_real_learner_trains_beside_hostile_peers_and_counts_their_groups_refused(tmp_path):
  """The one end to end run: jaxrl-learner (its secret made in its workdir) and an honest jaxrl-sampler given the
  secret file, while peers without the secret call every kind of method and hold idle connections, and a peer with
  it delivers a group of another prompt and one of another temperature: the run trains every step and counts both."""
  workdir, (port,) = tmp_path / "run", free_ports(1)
  address = f"127.0.0.1:{port}"
  env = {**{k: v for k, v in os.environ.items() if k != "JAXRL_RUN_SECRET"}, "JAX_NUM_CPU_DEVICES": "2",
         "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  config = ["--config=configs/tiny.py", "--config.num_steps=4", "--config.mesh.num_devices=2",
            "--config.mesh.sampler_devices=1", "--config.checkpoint.every_steps=4", "--config.log.tensorboard=False",
            "--config.log.progress=False"]
  start = lambda args, log: subprocess.Popen([sys.executable, "-m", *args], env=env, cwd=ROOT,  # noqa: E731
                                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / log, "wb"))
  learner = start(["jaxrl.distributed.learner_main", *config, f"--workdir={workdir}", f"--port={port}",
                   "--host=127.0.0.1", "--bind=127.0.0.1", "--lease_s=8"], "learner.log")
  sampler = idle = None
  try:
    secret_file = workdir / "run.secret"
    _until(lambda: secret_file.exists() and secret_file.read_text().strip(), learner, "the learner's run.secret")
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip().encode()
    sampler = start(["jaxrl.distributed.sampler_main", *config, f"--learner={address}",
                     f"--secret_file={secret_file}"], "sampler.log")
    _until(lambda: _refused_without_the_secret(address, "register"), learner, "the learner's rpc port")
    for method in ("stop", "weights", "follow", "deliver", "admit"):
      assert _refused_without_the_secret(address, method)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    hostile = remote.register(address, secret=secret, timeout_s=10, reconnect_s=10)
    gids = _admit(hostile, 2)
    wrong_prompt = _group(gids[0], reward=1e6, prompt_tokens=np.array([7, 7, 7], np.int32))
    hotter = _group(gids[1], sampling=SamplingParams(temperature=0.5))
    for group in (wrong_prompt, hotter):  # tiny's group size is 4
      assert _deliver(hostile, [group + [dataclasses.replace(r, sample_index=r.sample_index + GROUP)
                                         for r in group]], max_len=32)["accepted"] == 0
    hostile.call("goodbye")
    assert learner.wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    assert sampler.wait(60) == 0
  finally:
    for proc in (learner, sampler):
      if proc is not None and proc.poll() is None:
        proc.kill()
    for sock in idle or []:
      sock.close()
  summary = json.loads((workdir / "summary.json").read_text())
  led = summary["ledger"]
  assert summary["version"] == 4 and led["samples_refused"] == {"wrong_prompt": 4, "sampling_mismatch": 4}
  assert led["groups_generated_again"]["wrong_prompt"] == led["groups_generated_again"]["sampling_mismatch"] == 1
  assert summary["samplers"]["joined"] == 2
  assert led["samples_generated"] >= led["samples_trained"] + sum(led["dropped"].values()) + 8


def _refused_without_the_secret(address: str, method: str) -> bool:
  try:
    rpc.call(address, method, {}, timeout_s=5, secret=b"w" * 64)
  except rpc.RpcError as e:
    return e.waited_for == "auth"
  raise AssertionError(f"{method} answered a caller without the secret")


def _until(cond, proc, what: str, timeout_s: float = 180.0) -> None:
  end = time.monotonic() + timeout_s
  while not cond():
    assert proc.poll() is None, f"the learner ended while waiting for {what}"
    assert time.monotonic() < end, f"no {what} within {timeout_s:g}s"
    time.sleep(0.2)
