"""The run's secret for tests that serve and call rpc in-process (jaxrl.distributed.rpc takes no call without it)."""

from jaxrl.distributed import rpc

SECRET = b"0123456789abcdef" * 4


def server(handlers: dict, host: str = "127.0.0.1", port: int = 0, **kw) -> rpc.Server:
  return rpc.Server(handlers, host, port, secret=SECRET, **kw)


def call(address: str, method: str, request: dict, *, timeout_s: float, secret: bytes = SECRET) -> dict:
  return rpc.call(address, method, request, timeout_s=timeout_s, secret=secret)
