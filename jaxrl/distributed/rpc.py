"""Request / response between independent programs over TCP (stdlib only): the channel between a learner and the
sampler programs that join and leave it (distributed.hub, distributed.sampler_main).

Every connection starts with a fixed-size handshake that proves the run's secret (distributed.secret) without
sending it: the server sends HELLO and a fresh 32-byte nonce; the client answers its own nonce and
HMAC-SHA256(secret, "client" | server nonce | client nonce); the server checks it (hmac.compare_digest) and proves
itself with HMAC-SHA256(secret, "server" | server nonce | client nonce). Nothing else is read from a peer that has
not answered: a wrong, missing or replayed answer (the server's nonce is new on every connection) gets REFUSED
(32 zero bytes, never a server's proof) and the connection closed. Only that marker is an "auth" failure for the
client: a connection that closes in the handshake without it (a server killed, restarting, or one that timed the
client out or had too many handshakes waiting) is a "connect" failure, which a sampler survives by reconnecting.
Handshakes run in one selector thread (no thread per unauthenticated connection); past Limits.max_handshakes
waiting, the oldest is closed, and a handshake not answered in handshake_s is closed.

Then a message is one frame: an 8-byte big-endian length, a JSON header of that many bytes, then the raw bytes of
the numpy arrays the message carries, in order. An array anywhere in a request or reply (a dict, list or tuple
value) travels as {"__array__": i} in the JSON and as its C-order bytes after it, described in the header's
"arrays" by (dtype, shape); only numeric and bool dtypes are accepted, nothing is ever unpickled. A server refuses
a header past Limits.max_header_bytes and a frame whose header declares more than max_frame_bytes in all, before
reading it; a peer silent for read_timeout_s is closed. Each refused peer costs one logged line (rate-limited).
A rollout packet (distributed.packets, int32) costs its own bytes plus a few hundred of JSON.

Every call opens a connection, sends one request, reads one reply and closes (loopback or a datacenter network:
the connect is small beside a share of rollouts); every call has a timeout, and every failure raises RpcError
whose one-line message names the peer, the method and what the caller waited for.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_LEN = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 20  # what a client reads of a server that proved the secret: a corrupt frame past it
_KINDS = "biufc"  # numeric dtypes (bool, int, uint, float, complex): no object arrays from the network
HELLO = b"JAXRLRPC"  # then the server's nonce
NONCE = 32
_MAC = 32
REFUSED = bytes(_MAC)  # the server's answer to a wrong secret: no HMAC output is all zeros in practice


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one peer may cost a server. A learner derives max_frame_bytes from its run's packets (frame_limit)."""

  max_connections: int = 64  # authenticated connections served at once (a thread each); past it, closed
  max_handshakes: int = 256  # connections waiting for their handshake answer (no thread); past it, the oldest closed
  handshake_s: float = 5.0  # to answer the handshake
  read_timeout_s: float = 30.0  # an authenticated peer silent this long in a frame is closed
  max_header_bytes: int = 1 << 20
  max_frame_bytes: int = 64 << 20  # header and arrays


class RpcError(Exception):
  """A call that did not get its reply: the peer could not be reached, did not answer in time, closed the
  connection, refused this program's secret, or its handler failed (`waited_for`: "connect", "auth", "reply" or
  "handler")."""

  def __init__(self, address: str, method: str, waited_for: str, detail: str):
    super().__init__(f"rpc {method!r} to {address}: {detail}")
    self.address, self.method, self.waited_for, self.detail = address, method, waited_for, detail


def mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
  """HMAC-SHA256 of the handshake: label says who proves (b"client" or b"server"), so one answer is never the
  other's."""
  return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def _flatten(obj, arrays: list[np.ndarray]):
  if isinstance(obj, np.ndarray):
    if obj.dtype.kind not in _KINDS:
      raise TypeError(f"array of dtype {obj.dtype} cannot travel (numeric and bool dtypes only)")
    arrays.append(np.ascontiguousarray(obj))
    return {"__array__": len(arrays) - 1}
  if isinstance(obj, dict):
    return {k: _flatten(v, arrays) for k, v in obj.items()}
  if isinstance(obj, list | tuple):
    return [_flatten(v, arrays) for v in obj]
  return obj


def _restore(obj, arrays: list[np.ndarray]):
  if isinstance(obj, dict):
    if set(obj) == {"__array__"}:
      return arrays[obj["__array__"]]
    return {k: _restore(v, arrays) for k, v in obj.items()}
  if isinstance(obj, list):
    return [_restore(v, arrays) for v in obj]
  return obj


def encode(message: dict) -> bytes:
  """One frame: length, JSON header (the message with its arrays replaced by references), the arrays' bytes."""
  arrays: list[np.ndarray] = []
  body = _flatten(message, arrays)
  header = json.dumps({"body": body, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
  return b"".join([_LEN.pack(len(header)), header, *(a.tobytes() for a in arrays)])


def _read_exactly(sock: socket.socket, n: int) -> bytes:
  chunks, left = [], n
  while left:
    chunk = sock.recv(min(left, 1 << 20))
    if not chunk:
      raise ConnectionError(f"the peer closed the connection with {left} of {n} bytes unread")
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def _described(header) -> list[tuple[np.dtype, tuple[int, ...], int]]:
  """(dtype, shape, bytes) of each array a header declares; ValueError for anything but numeric arrays."""
  if not isinstance(header, dict) or not isinstance(header.get("arrays"), list) or "body" not in header:
    raise ValueError("malformed frame header (not {body, arrays})")
  out = []
  for entry in header["arrays"]:
    try:
      dtype_str, shape = entry
      dtype = np.dtype(dtype_str)
      shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as e:
      raise ValueError(f"malformed array description {str(entry)[:80]!r}: {e}") from None
    if dtype.kind not in _KINDS:
      raise ValueError(f"array of dtype {dtype} refused (numeric and bool dtypes only)")
    if any(d < 0 for d in shape):
      raise ValueError(f"array of shape {shape} refused")
    out.append((dtype, shape, dtype.itemsize * int(np.prod(shape, dtype=object))))
  return out


def read_message(sock: socket.socket, *, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_frame_bytes: int | None = None) -> dict:
  """One frame's message; ValueError (before reading them) for a header or a frame larger than allowed."""
  (size,) = _LEN.unpack(_read_exactly(sock, _LEN.size))
  if size > max_header_bytes:
    raise ValueError(f"frame header of {size} bytes (more than {max_header_bytes}): not an rpc peer")
  try:
    header = json.loads(_read_exactly(sock, size))
  except RecursionError:
    raise ValueError("frame header nested too deep") from None
  described = _described(header)
  total = size + sum(n for _, _, n in described)
  if max_frame_bytes is not None and total > max_frame_bytes:
    raise ValueError(f"frame of {total} bytes declared (more than {max_frame_bytes})")
  arrays = [np.frombuffer(_read_exactly(sock, n), dtype).reshape(shape) for dtype, shape, n in described]
  try:
    return _restore(header["body"], arrays)
  except (IndexError, TypeError, KeyError) as e:
    raise ValueError(f"malformed frame body: {type(e).__name__}") from None


class _Log:
  """One line per refused peer, at most `per_window` lines a window (then one line counting those left out): a
  flood of hostile connections must not become a flood of log."""

  def __init__(self, where: str, per_window: int = 20, window_s: float = 10.0):
    self.where, self.per_window, self.window_s = where, per_window, window_s
    self._lock = threading.Lock()
    self._start, self._lines, self._left_out = time.monotonic(), 0, 0

  def __call__(self, peer, what: str) -> None:
    with self._lock:
      now = time.monotonic()
      if now - self._start > self.window_s:
        if self._left_out:
          print(f"jaxrl rpc {self.where}: {self._left_out} more refused connections not logged", file=sys.stderr,
                flush=True)
        self._start, self._lines, self._left_out = now, 0, 0
      if self._lines >= self.per_window:
        self._left_out += 1
        return
      self._lines += 1
    print(f"jaxrl rpc {self.where}: {peer}: {what}; connection closed", file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Waiting:
  """A connection waiting for its handshake answer."""

  peer: Any
  nonce: bytes
  deadline: float
  got: bytes = b""


class Server:
  """Serves `handlers` (method name -> request dict -> reply dict) to peers that prove `secret`, a thread per
  authenticated connection (at most limits.max_connections). A handler's exception is sent back as the caller's
  RpcError (its type and first line), and the server goes on; so does it past any peer's bad frame."""

  def __init__(self, handlers: dict[str, Callable[[dict], dict]], host: str = "127.0.0.1", port: int = 0, *,
               secret: bytes, limits: Limits = Limits()):
    if not secret:
      raise ValueError("an rpc server needs the run's secret (distributed.secret)")
    self.handlers, self.secret, self.limits = dict(handlers), bytes(secret), limits
    # SO_REUSEADDR (create_server's default): a restarted learner binds its port again at once
    self._listener = socket.create_server((host, port), backlog=1024)  # a burst waits in the kernel, not refused
    self._listener.setblocking(False)
    self.address = f"{host}:{self._listener.getsockname()[1]}"
    self.advertised = self.address  # what peers are told (a learner listening on 0.0.0.0 tells its --host)
    self._log = _Log(self.address)
    self._slots = threading.BoundedSemaphore(limits.max_connections)
    self.refused: collections.Counter = collections.Counter()  # why connections were closed unserved
    self._closing = threading.Event()
    self._thread = threading.Thread(target=self._accepting, name="jaxrl-rpc", daemon=True)
    self._thread.start()

  # handshakes: one selector thread
  def _accepting(self) -> None:
    selector = selectors.DefaultSelector()
    selector.register(self._listener, selectors.EVENT_READ)
    waiting: collections.OrderedDict[socket.socket, _Waiting] = collections.OrderedDict()
    try:
      while not self._closing.is_set():
        for key, _ in selector.select(0.1):
          if key.fileobj is self._listener:
            self._accept(selector, waiting)
          elif key.fileobj in waiting:
            self._answer(selector, waiting, key.fileobj)
        now = time.monotonic()  # deadlines come in the order of the connections (one handshake_s after each)
        while waiting and (first := next(iter(waiting))) and waiting[first].deadline < now:
          self._close(selector, waiting, first, "handshake_timeout",
                      f"no handshake within {self.limits.handshake_s:g}s")
    finally:
      for sock in list(waiting):
        sock.close()
      selector.close()

  def _accept(self, selector, waiting) -> None:
    for _ in range(64):  # a burst at a time: the waiting connections get their turn
      try:
        sock, peer = self._listener.accept()
      except (BlockingIOError, InterruptedError):
        return
      except OSError as e:  # out of file descriptors: the listener stays, the peer is not taken
        self._log("?", f"accept failed: {e}")
        return
      if len(waiting) >= self.limits.max_handshakes:  # the oldest goes: an honest answer takes a round trip
        oldest = next(iter(waiting))
        self._close(selector, waiting, oldest, "handshakes_full", f"more than {self.limits.max_handshakes} handshakes "
                    "waiting (the oldest closed)")
      nonce = secrets.token_bytes(NONCE)
      try:
        sock.setblocking(False)
        sock.send(HELLO + nonce)  # 40 bytes into a fresh socket's buffer
      except OSError:
        sock.close()
        continue
      waiting[sock] = _Waiting(peer, nonce, time.monotonic() + self.limits.handshake_s)
      selector.register(sock, selectors.EVENT_READ)

  def _answer(self, selector, waiting, sock: socket.socket) -> None:
    w = waiting[sock]
    try:
      data = sock.recv(NONCE + _MAC - len(w.got))
    except (BlockingIOError, InterruptedError):
      return
    except OSError:
      data = b""
    if not data:
      self._close(selector, waiting, sock, "closed", "closed in the handshake")
      return
    w.got += data
    if len(w.got) < NONCE + _MAC:
      return
    client_nonce, answer = w.got[:NONCE], w.got[NONCE:]
    if not hmac.compare_digest(answer, mac(self.secret, b"client", w.nonce, client_nonce)):
      try:
        sock.send(REFUSED)  # an explicit no: the client tells a wrong secret from a server gone mid-handshake
      except OSError:
        pass
      self._close(selector, waiting, sock, "secret", "did not prove the run's secret")
      return
    selector.unregister(sock)
    del waiting[sock]
    try:
      sock.setblocking(True)
      sock.settimeout(self.limits.read_timeout_s)
      sock.sendall(mac(self.secret, b"server", w.nonce, client_nonce))
    except OSError:
      sock.close()
      return
    if not self._slots.acquire(blocking=False):
      self.refused["busy"] += 1
      self._log(w.peer, f"{self.limits.max_connections} connections served already")
      sock.close()
      return
    threading.Thread(target=self._serve, args=(sock, w.peer), name="jaxrl-rpc-call", daemon=True).start()

  def _close(self, selector, waiting, sock: socket.socket, reason: str, what: str) -> None:
    w = waiting.pop(sock)
    selector.unregister(sock)
    self.refused[reason] += 1  # counted before the peer can see the close
    self._log(w.peer, what)
    sock.close()

  # authenticated connections: a thread each
  def _serve(self, sock: socket.socket, peer) -> None:
    try:
      with sock:
        try:
          request = read_message(sock, max_header_bytes=self.limits.max_header_bytes,
                                 max_frame_bytes=self.limits.max_frame_bytes)
          if not isinstance(request, dict):
            raise ValueError("the request is not a JSON object")
        except (OSError, ValueError) as e:  # a timeout is an OSError
          self.refused["frame"] += 1
          self._log(peer, f"bad frame: {(str(e).splitlines() or [''])[0] or type(e).__name__}")
          return
        method = request.get("method")
        handler = self.handlers.get(method) if isinstance(method, str) else None
        if handler is None:
          reply = {"__error__": f"no method {str(method)[:80]!r} (this server has {sorted(self.handlers)})"}
        else:
          try:
            req = request.get("request", {})
            reply = handler(req if isinstance(req, dict) else {})
          except Exception as e:  # noqa: BLE001 - the caller gets it as its RpcError
            reply = {"__error__": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
        try:
          sock.sendall(encode({"reply": reply}))
        except OSError:
          pass  # the caller went away: its own call reports what it waited for
    finally:
      self._slots.release()

  def close(self) -> None:
    self._closing.set()
    self._thread.join(5.0)
    self._listener.close()


class _Dropped(RpcError):
  """The server closed the connection in the handshake without its REFUSED: busy, restarting or gone."""


HANDSHAKE_TRIES = 3  # a dropped handshake is tried again (nothing was sent yet), 0.1 s then 0.2 s later


def _handshake(sock: socket.socket, secret: bytes, address: str, method: str) -> None:
  """The client's side: answers the server's nonce and checks the server's proof (RpcError "auth")."""
  try:
    hello = _read_exactly(sock, len(HELLO) + NONCE)
  except ConnectionError:
    raise _Dropped(address, method, "connect", "the server closed the connection before its handshake") from None
  if not hello.startswith(HELLO):
    raise RpcError(address, method, "auth", "not a jaxrl rpc server (no handshake)")
  server_nonce, client_nonce = hello[len(HELLO):], secrets.token_bytes(NONCE)
  sock.sendall(client_nonce + mac(secret, b"client", server_nonce, client_nonce))
  try:
    proof = _read_exactly(sock, _MAC)
  except ConnectionError:  # no answer at all: the server went away or dropped the handshake (busy, timed out)
    raise _Dropped(address, method, "connect", "the server closed the connection in the handshake") from None
  if proof == REFUSED:
    raise RpcError(address, method, "auth", "the server refused the handshake: this program does not hold the "
                   "run's secret (--secret_file or JAXRL_RUN_SECRET)")
  if not hmac.compare_digest(proof, mac(secret, b"server", server_nonce, client_nonce)):
    raise RpcError(address, method, "auth", "the server did not prove the run's secret")


def _connect(address: str, method: str, timeout_s: float, secret: bytes) -> socket.socket:
  """A connection to address past its handshake. A handshake the server dropped (its queue full under a flood, a
  learner restarting) is tried again up to HANDSHAKE_TRIES times within timeout_s; a refusal or no connection is
  not."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  for attempt in range(HANDSHAKE_TRIES):
    try:
      sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except TimeoutError:
      raise RpcError(address, method, "connect", f"no connection within {timeout_s:g}s") from None
    except OSError as e:
      raise RpcError(address, method, "connect", f"cannot connect: {e.strerror or e}") from None
    try:
      _handshake(sock, secret, address, method)
      return sock
    except _Dropped as e:
      sock.close()
      pause = 0.1 * 2**attempt
      if attempt + 1 == HANDSHAKE_TRIES or time.monotonic() + pause >= deadline:
        raise RpcError(address, method, "connect", f"{e.detail} ({attempt + 1} tries)") from None
      time.sleep(pause)
    except TimeoutError:
      sock.close()
      raise RpcError(address, method, "connect", f"no handshake within {timeout_s:g}s") from None
    except BaseException:
      sock.close()
      raise


def call(address: str, method: str, request: dict, *, timeout_s: float, secret: bytes) -> dict:
  """`method`'s reply to `request` from the server at address ("host:port"), which must prove `secret` as this
  call does; RpcError if there is none within timeout_s (for the connect, then again for the reply)."""
  sock = _connect(address, method, timeout_s, secret)
  with sock:
    try:
      sock.sendall(encode({"method": method, "request": request}))
      reply: Any = read_message(sock)["reply"]
    except TimeoutError:
      raise RpcError(address, method, "reply", f"no reply within {timeout_s:g}s") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise RpcError(address, method, "reply", f"no reply: {e}") from None
  if isinstance(reply, dict) and "__error__" in reply:
    raise RpcError(address, method, "handler", f"the handler failed: {reply['__error__']}")
  return reply
