"""The run's secret: what every rpc peer of a learner must prove (distributed.rpc's handshake).

One secret per run, 32 random bytes as 64 hex characters. The learner takes it, in order, from --secret_file, from
the environment (JAXRL_RUN_SECRET), or from workdir/run.secret, and makes a new one there (mode 0600) when there
is none, so that a resumed learner keeps its samplers' secret. Samplers and follower learner processes take it
from --secret_file or JAXRL_RUN_SECRET (the launcher and the launch/ scripts hand them one). It never crosses the
network: the handshake sends an HMAC of fresh nonces.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV = "JAXRL_RUN_SECRET"
FILE = "run.secret"
_MIN_CHARS = 32  # 128 bits of hex at least


class SecretError(ValueError):
  """No usable secret: one line saying where it was looked for."""


def new() -> str:
  return secrets.token_hex(32)


def _checked(text: str, where: str) -> bytes:
  text = text.strip()
  if len(text) < _MIN_CHARS:
    raise SecretError(f"the run's secret from {where} has {len(text)} characters; at least {_MIN_CHARS} are needed "
                     "(python -c 'import secrets; print(secrets.token_hex(32))')")
  return text.encode()


def write(path: str | Path, text: str) -> Path:
  """Writes the secret to path, readable by its owner only (created 0600, never world-readable in between)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(text + "\n")
  os.chmod(path, 0o600)
  return path


def read(secret_file: str | None = None) -> bytes | None:
  """The secret of --secret_file, else of JAXRL_RUN_SECRET, else None."""
  if secret_file:
    try:
      return _checked(Path(secret_file).read_text(), secret_file)
    except OSError as e:
      raise SecretError(f"cannot read the run's secret from {secret_file}: {e.strerror or e}") from None
  if os.environ.get(ENV):
    return _checked(os.environ[ENV], ENV)
  return None


def for_learner(workdir: str | Path, secret_file: str | None = None) -> bytes:
  """The lead learner's secret: given (read), else workdir/run.secret, made there (0600) on a run's first start."""
  given = read(secret_file)
  if given is not None:
    return given
  path = Path(workdir) / FILE
  if not path.exists():
    write(path, new())
  return _checked(path.read_text(), str(path))


def required(secret_file: str | None, program: str) -> bytes:
  """A sampler's or follower learner's secret; ValueError (one line) when it was given none."""
  got = read(secret_file)
  if got is None:
    raise SecretError(f"{program}: no run secret: pass --secret_file=PATH (the learner's workdir/{FILE}) or set "
                     f"{ENV}")
  return got
