"""What a worker process may send the trainer: plain data as length-prefixed JSON, size-capped, checked before use.

A worker runs code that handles a model's text; code that takes it over can write anything on the worker's pipe.
So nothing a worker sends is unpickled, imported or executed: a message is JSON of plain data (None, bool, int,
finite float, str, list, dict with str keys), at most MAX_BYTES, and each field is checked by its reader. A message
that fails a check is the `BadMessage` of the item it was for, never a score.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_BYTES = 4 << 20  # one message; an env's state travels in it
MAX_DEPTH = 32


class BadMessage(ValueError):
  """A message that is not plain data of the expected shape."""


def _no_constant(name: str):
  raise BadMessage(f"{name} is not plain data")


def plain(value: Any, depth: int = 0) -> str | None:
  """Why `value` is not plain data (what JSON round-trips exactly: no tuples, no NaN), or None."""
  if depth > MAX_DEPTH:
    return f"nested deeper than {MAX_DEPTH}"
  if value is None or isinstance(value, bool | int | str):
    return None
  if isinstance(value, float):
    return None if math.isfinite(value) else f"{value} is not a finite number"
  if isinstance(value, list):
    return next((why for why in (plain(v, depth + 1) for v in value) if why), None)
  if isinstance(value, dict):
    if not all(isinstance(k, str) for k in value):
      return "a dict key is not a str"
    return next((why for why in (plain(v, depth + 1) for v in value.values()) if why), None)
  return f"{type(value).__name__} is not plain data (None, bool, int, float, str, list, dict)"


def _finite(text: str) -> float:
  value = float(text)
  if not math.isfinite(value):  # "1e999" parses to inf
    raise BadMessage(f"{text} is not a finite number")
  return value


# Built once: json.dumps / json.loads with options build a new coder per call, which is most of a small message's cost
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def encode(kind: str, body: Any) -> bytes:
  """One message; ValueError if the body is not JSON data (a tuple goes as a list: check `plain` first where the
  reader needs it back exactly) or too large."""
  try:
    data = _ENCODER.encode([kind, body]).encode()
  except (TypeError, RecursionError) as e:
    raise ValueError(str(e)) from None
  if len(data) > MAX_BYTES:
    raise ValueError(f"message of {len(data)} bytes is over {MAX_BYTES}")
  return data


def decode(data: bytes, kinds: tuple[str, ...]) -> tuple[str, Any]:
  """(kind, body) of one message whose kind is one of `kinds`; BadMessage for anything else. What json.loads
  builds is plain data by construction once NaN and infinities are refused."""
  if len(data) > MAX_BYTES:
    raise BadMessage(f"message of {len(data)} bytes is over {MAX_BYTES}")
  try:
    message = _DECODER.decode(data.decode("utf-8"))
  except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an int of over 4300 digits
    raise BadMessage(f"not JSON ({type(e).__name__})") from None
  if not (isinstance(message, list) and len(message) == 2 and message[0] in kinds):
    raise BadMessage(f"not a [kind, body] pair with kind in {kinds}")
  return message[0], message[1]

