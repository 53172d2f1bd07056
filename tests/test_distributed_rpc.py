"""jaxrl.distributed.rpc: round trips with arrays, a handler's error at the caller, a server that never answers,
a dead peer, frames that are refused."""

import socket
import struct
import threading
import time

import numpy as np
import pytest
import secret_util
from secret_util import SECRET

from jaxrl.distributed import packets, rpc


def test_round_trip_carries_arrays_bit_for_bit():
  server = secret_util.server({"echo": lambda req: {"got": req, "n": len(req["rows"])}})
  try:
    packet = np.arange(2 * packets.packet_width(4), dtype=np.int32).reshape(2, -1)
    floats = np.array([[1.5, np.nan], [-0.0, 3e38]], np.float32)
    reply = secret_util.call(server.address, "echo", {"rows": [packet, packet[:1]], "f": floats, "s": "x", "t": (1, 2)},
                     timeout_s=5)
    assert reply["n"] == 2
    np.testing.assert_array_equal(reply["got"]["rows"][0], packet)
    assert reply["got"]["rows"][1].shape == (1, packet.shape[1])
    assert reply["got"]["f"].tobytes() == floats.tobytes()  # NaN and -0.0 kept exactly
    assert reply["got"]["s"] == "x" and reply["got"]["t"] == [1, 2]
  finally:
    server.close()


def test_handler_error_and_unknown_method_reach_the_caller():
  def broken(req):
    raise RuntimeError("no sampler 7\nsecond line")

  server = secret_util.server({"broken": broken})
  try:
    failed = r"rpc 'broken' to 127\.0\.0\.1:\d+: the handler failed: RuntimeError: no sampler 7$"
    with pytest.raises(rpc.RpcError, match=failed) as e:
      secret_util.call(server.address, "broken", {}, timeout_s=5)
    assert e.value.waited_for == "handler" and "second line" not in str(e.value)
    with pytest.raises(rpc.RpcError, match="no method 'nope'"):
      secret_util.call(server.address, "nope", {}, timeout_s=5)
    with pytest.raises(rpc.RpcError, match="RuntimeError"):  # the server goes on serving
      secret_util.call(server.address, "broken", {}, timeout_s=5)
  finally:
    server.close()


def test_a_server_that_never_answers_times_out_naming_the_peer_and_the_wait():
  release = threading.Event()
  server = secret_util.server({"slow": lambda req: release.wait(30) and {}})
  try:
    t0 = time.monotonic()
    with pytest.raises(rpc.RpcError, match=r"rpc 'slow' to 127\.0\.0\.1:\d+: no reply within 0\.3s") as e:
      secret_util.call(server.address, "slow", {}, timeout_s=0.3)
    assert e.value.waited_for == "reply" and time.monotonic() - t0 < 5
  finally:
    release.set()
    server.close()


def test_a_dead_peer_is_a_connect_error():
  server = secret_util.server({"ping": lambda req: {}})
  address = server.address
  server.close()
  with pytest.raises(rpc.RpcError, match=rf"rpc 'ping' to {address}: cannot connect") as e:
    secret_util.call(address, "ping", {}, timeout_s=2)
  assert e.value.waited_for == "connect"


def test_a_server_gone_in_the_handshake_is_a_connect_error_and_only_its_no_is_auth():
  """A learner killed (or busy) while a sampler answers its nonce closes without a word: the sampler must take that
  as a connection lost (it reconnects), not as a wrong secret (it would exit: seen when a lead learner was killed)."""
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(4)
  address = f"127.0.0.1:{listener.getsockname()[1]}"

  def serve(answer: bytes, connections: int) -> None:
    for _ in range(connections):
      sock, _ = listener.accept()
      with sock:
        sock.sendall(rpc.HELLO + bytes(rpc.NONCE))
        _ = sock.recv(rpc.NONCE + 32)
        sock.sendall(answer)

  # a dropped handshake is tried again (nothing was sent yet), a refusal is final
  for answer, tries, waited_for, message in (
      (b"", rpc.HANDSHAKE_TRIES, "connect", rf"closed the connection in the handshake \({rpc.HANDSHAKE_TRIES} tries\)"),
      (rpc.REFUSED, 1, "auth", "does not hold the run's secret")):
    thread = threading.Thread(target=serve, args=(answer, tries))
    thread.start()
    with pytest.raises(rpc.RpcError, match=message) as e:
      secret_util.call(address, "ping", {}, timeout_s=5)
    thread.join()
    assert e.value.waited_for == waited_for
  listener.close()


def test_a_peer_that_closes_mid_reply_and_hostile_frames():
  listener = socket.socket()
  listener.bind(("127.0.0.1", 0))
  listener.listen(1)
  address = f"127.0.0.1:{listener.getsockname()[1]}"

  def half_reply():  # a server that proves the secret, then cuts its reply short
    conn, _ = listener.accept()
    nonce = b"n" * rpc.NONCE
    conn.sendall(rpc.HELLO + nonce)
    answer = conn.recv(2 * rpc.NONCE)
    conn.sendall(rpc.mac(SECRET, b"server", nonce, answer[: rpc.NONCE]))
    conn.recv(1 << 16)
    conn.sendall(struct.pack(">Q", 100) + b"{")  # a frame cut short
    conn.close()

  threading.Thread(target=half_reply, daemon=True).start()
  with pytest.raises(rpc.RpcError, match="no reply: the peer closed the connection"):
    secret_util.call(address, "x", {}, timeout_s=5)
  listener.close()
  with pytest.raises(TypeError, match="dtype object cannot travel"):
    rpc.encode({"a": np.array([object()])})
  frame = rpc.encode({"a": np.zeros(2)}).replace(b"<f8", b"|O8")
  a, b = socket.socketpair()
  a.sendall(frame)
  with pytest.raises(ValueError, match="dtype object refused"):
    rpc.read_message(b)
