"""Request / response between independent programs over TCP (stdlib only): the channel between a learner and the
sampler programs that join and leave it (distributed.hub, distributed.sampler_main).

A message is one frame: an 8-byte big-endian length, a JSON header of that many bytes, then the raw bytes of the
numpy arrays the message carries, in order. An array anywhere in a request or reply (a dict, list or tuple value)
travels as {"__array__": i} in the JSON and as its C-order bytes after it, described in the header's "arrays" by
(dtype, shape); only numeric and bool dtypes are accepted, nothing is ever unpickled. A rollout packet
(distributed.packets, int32) costs its own bytes plus a few hundred of JSON.

Every call opens a connection, sends one request, reads one reply and closes (loopback or a datacenter network:
the connect is small beside a share of rollouts); every call has a timeout, and every failure raises RpcError
whose one-line message names the peer, the method and what the caller waited for.
"""

from __future__ import annotations

import json
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

_LEN = struct.Struct(">Q")
MAX_HEADER_BYTES = 64 << 20  # a header past this is a corrupt or hostile frame, not a message
_KINDS = "biufc"  # numeric dtypes (bool, int, uint, float, complex): no object arrays from the network


class RpcError(Exception):
  """A call that did not get its reply: the peer could not be reached, did not answer in time, closed the
  connection, or its handler failed (`waited_for`: "connect", "reply" or "handler")."""

  def __init__(self, address: str, method: str, waited_for: str, detail: str):
    super().__init__(f"rpc {method!r} to {address}: {detail}")
    self.address, self.method, self.waited_for = address, method, waited_for


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


def read_message(sock: socket.socket) -> dict:
  (size,) = _LEN.unpack(_read_exactly(sock, _LEN.size))
  if size > MAX_HEADER_BYTES:
    raise ValueError(f"frame header of {size} bytes (more than {MAX_HEADER_BYTES}): not an rpc peer")
  header = json.loads(_read_exactly(sock, size))
  arrays = []
  for dtype_str, shape in header["arrays"]:
    dtype = np.dtype(dtype_str)
    if dtype.kind not in _KINDS:
      raise ValueError(f"array of dtype {dtype} refused (numeric and bool dtypes only)")
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    arrays.append(np.frombuffer(_read_exactly(sock, nbytes), dtype).reshape(shape))
  return _restore(header["body"], arrays)


class Server:
  """Serves `handlers` (method name -> request dict -> reply dict), one thread per connection. A handler's
  exception is sent back as the caller's RpcError (its type and first line), and the server goes on."""

  def __init__(self, handlers: dict[str, Callable[[dict], dict]], host: str = "127.0.0.1", port: int = 0):
    self.handlers = dict(handlers)
    outer = self

    class Handler(socketserver.BaseRequestHandler):
      def handle(self):
        outer._serve(self.request)

    class TCPServer(socketserver.ThreadingTCPServer):
      daemon_threads = True
      allow_reuse_address = True  # a restarted learner binds its port again at once

    self._server = TCPServer((host, port), Handler)
    self.address = f"{host}:{self._server.server_address[1]}"
    self._thread = threading.Thread(target=self._server.serve_forever, name="jaxrl-rpc", daemon=True)
    self._thread.start()

  def _serve(self, sock: socket.socket) -> None:
    try:
      request = read_message(sock)
      method = request.get("method")
      handler = self.handlers.get(method)
      if handler is None:
        reply = {"__error__": f"no method {method!r} (this server has {sorted(self.handlers)})"}
      else:
        try:
          reply = handler(request.get("request", {}))
        except Exception as e:  # noqa: BLE001 - the caller gets it as its RpcError
          reply = {"__error__": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
      sock.sendall(encode({"reply": reply}))
    except (OSError, ValueError):
      pass  # the caller went away or sent garbage: its own call reports what it waited for

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()
    self._thread.join(5.0)


def call(address: str, method: str, request: dict, *, timeout_s: float) -> dict:
  """`method`'s reply to `request` from the server at address ("host:port"); RpcError if there is none within
  timeout_s (for the connect, then again for the reply)."""
  host, _, port = address.rpartition(":")
  try:
    sock = socket.create_connection((host, int(port)), timeout=timeout_s)
  except TimeoutError:
    raise RpcError(address, method, "connect", f"no connection within {timeout_s:g}s") from None
  except OSError as e:
    raise RpcError(address, method, "connect", f"cannot connect: {e.strerror or e}") from None
  with sock:
    try:
      sock.sendall(encode({"method": method, "request": request}))
      reply: Any = read_message(sock)["reply"]
    except TimeoutError:
      raise RpcError(address, method, "reply", f"no reply within {timeout_s:g}s") from None
    except (OSError, ValueError, KeyError) as e:
      raise RpcError(address, method, "reply", f"no reply: {e}") from None
  if isinstance(reply, dict) and "__error__" in reply:
    raise RpcError(address, method, "handler", f"the handler failed: {reply['__error__']}")
  return reply
