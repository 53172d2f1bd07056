"""RewardRunner: scores completions so that a reward fn that raises, hangs or crashes never stops the run.

A failure is a result (value NaN, ok False, a reason), counted in `stats`. Untrusted fns run in worker processes
(fresh interpreters, one item at a time per worker); a worker past its deadline is killed and replaced, which a
thread could not be. Trusted builtin fns (registered inline=True) skip the pipes and run in the calling thread, where
exceptions are still caught but a hang cannot be stopped.

Each item waits at most `timeout_s` once a worker holds it, so a batch of n items takes at most about
ceil(n / workers) * timeout_s, plus worker restarts.

Trust runs one way. The trainer sends a worker the pickled fn and items (the worker trusts the trainer); a worker
sends back plain data only (jaxrl.envs.wire: length-prefixed JSON, size-capped, each field type- and range-checked,
the item's number echoed), because code that handles a model's text may take the worker over and write anything on
its pipe. Nothing a worker sends is unpickled, imported or executed; a malformed message, or an answer for another
item, is that item's failure ("bad_message") and the worker is replaced. A sandboxed worker scores each item in a
fork of itself that holds no pipe to the trainer (SandboxLimits.process_per_item, the default), so what such code
can still do is answer for the item it is scoring (a value the checks accept: a finite float); in one process per
worker (process_per_item=False) also for that worker's later items until it is replaced; never code in the
trainer (docs/SECURITY.md).

Fns that handle text as code (registered with sandbox=True, e.g. the countdown expression reward), or any fn given
`sandbox=SandboxLimits(...)`, run in sandboxed workers (jaxrl.envs.sandbox): Landlock (reads of the import roots
only, writes beneath a private size-capped tmpfs scratch only), CPU time per item (soft RLIMIT_CPU, and the parent
kills a worker one second past it), memory, no processes, no network. What the sandbox refuses is a failed item
("blocked", "memory", "cpu_limit", or "error" for a call the kernel refused), counted like any other, and the
worker goes on or is replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import multiprocessing
import numbers
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

from jaxrl.envs import sandbox as sandbox_lib
from jaxrl.envs import wire
from jaxrl.envs.rewards import RewardFn, registered_spec, reward_spec
from jaxrl.envs.sandbox import SandboxLimits, SandboxViolation

REASONS = ("error", "bad_value", "timeout", "crash", "unsendable", "blocked", "memory", "cpu_limit", "bad_message")
_KINDS = ("ready", "init_error", "done")  # what a worker sends (jaxrl.envs.wire)
_MAX_ERROR = 2000  # characters of a worker's error text kept
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True)
class RewardResult:
  value: float  # NaN when not ok
  ok: bool
  error: str | None = None  # what went wrong, for logs
  reason: str = ""  # one of REASONS when not ok
  payload: Any = None  # what a `call` other than call_reward returns with the value (an env step's new state)
  import_errors: tuple[str, ...] = ()  # modules a worker failed to import while scoring (a library may swallow it)


def _failed(reason: str, error: str) -> RewardResult:
  return RewardResult(math.nan, False, error, reason)


def _result_body(r: RewardResult) -> dict:
  """A result as plain data for the pipe (jaxrl.envs.wire)."""
  return {"value": r.value if math.isfinite(r.value) else None, "ok": r.ok, "error": r.error, "reason": r.reason,
          "payload": r.payload, "import_errors": list(r.import_errors)}


def _result_from(body: Any) -> RewardResult:
  """The result a worker's message states, checked field by field: wire.BadMessage unless each has its type and
  range (an ok result has a finite value and no reason; a failed one a known reason)."""
  try:
    ok, value, error, reason, missed = (body["ok"], body["value"], body["error"], body["reason"],
                                        body["import_errors"])
  except (TypeError, KeyError):
    raise wire.BadMessage("a result lacks a field") from None
  if type(ok) is not bool or type(reason) is not str or not (error is None or type(error) is str):
    raise wire.BadMessage("a result field of the wrong type")
  if error is not None and len(error) > _MAX_ERROR:
    raise wire.BadMessage(f"an error text over {_MAX_ERROR} characters")
  if type(missed) is not list or len(missed) > 64 or not all(type(m) is str and len(m) <= 200 for m in missed):
    raise wire.BadMessage("import_errors are not module names")
  if ok:
    if reason or type(value) not in (int, float):
      raise wire.BadMessage(f"an ok result with reason {reason!r} and value {value!r}")
    try:
      value = float(value)  # an int past a float's range overflows
    except OverflowError:
      raise wire.BadMessage("the value is not a finite number") from None
  elif value is not None or reason not in REASONS:
    raise wire.BadMessage(f"a failed result with value {value!r} and reason {reason!r}")
  else:
    value = math.nan
  return RewardResult(value, ok, error, reason, body.get("payload"), tuple(missed))


def call_reward(fn: Callable, prompt: str, completion: str, meta: Mapping[str, Any]) -> RewardResult:
  """Calls fn and turns an exception or a value that is not a finite number into a failed result."""
  try:
    v = fn(prompt, completion, meta)
  except Exception as e:
    reason = "blocked" if isinstance(e, SandboxViolation) else "memory" if isinstance(e, MemoryError) else "error"
    return _failed(reason, f"{type(e).__name__}: {e}")
  if not isinstance(v, numbers.Real):
    return _failed("bad_value", f"returned {type(v).__name__}, not a number")
  v = float(v)
  return RewardResult(v, True) if math.isfinite(v) else _failed("bad_value", f"returned {v}")


# The worker is a fresh interpreter started with subprocess (spawn semantics, but the parent's __main__ is not
# re-run, so scripts without a main guard and notebooks work). It takes sys.path, then the pickled fn, over the pipe.
_BOOT = ("import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
         "sys.path[:] = c.recv(); from jaxrl.envs.runner import _serve; _serve(c, c.recv())")
# call(fn, *item) -> RewardResult: how a worker applies the fn to an item (an env step is a different call).
Call = Callable[..., RewardResult]


def _exit_with_parent(parent: int) -> None:
  """A worker stuck in a user's fn still exits once the parent is gone (even killed with SIGKILL)."""
  while os.getppid() == parent:
    time.sleep(1.0)
  os._exit(1)


class _MissedImports:
  """The last finder on sys.meta_path: asked only for a module no other finder found, it records the name. A
  library that catches the ImportError (math-verify scores an unparsable answer 0) hides the cause from the
  result; the start-up self-check reports what the worker could not import."""

  def __init__(self):
    self.names: list[str] = []

  def find_spec(self, name, path=None, target=None):
    self.names.append(name)
    return None

  def since(self, n: int) -> tuple[str, ...]:
    return tuple(dict.fromkeys(self.names[n:]))


def _send(conn, kind: str, body: Any) -> None:
  conn.send_bytes(wire.encode(kind, body))


def _score(call: Call, fn, item, missed: _MissedImports) -> RewardResult:
  """Applies the fn to one item, whatever it raises; names the modules it failed to import."""
  before = len(missed.names)
  try:
    result = call(fn, *item)
  except BaseException as e:  # SystemExit and the like from user code
    result = _failed("error", f"{type(e).__name__}: {e}")
  if len(missed.names) > before:
    result = dataclasses.replace(result, import_errors=missed.since(before))
  if result.error and len(result.error) > _MAX_ERROR:
    result = dataclasses.replace(result, error=result.error[:_MAX_ERROR])
  return result


def _answer(result: RewardResult, seq: int | None = None) -> bytes:
  body = _result_body(result) if seq is None else {"seq": seq, **_result_body(result)}
  try:
    return wire.encode("done", body)
  except ValueError as e:  # a payload that is not plain data (an env's state)
    return _answer(_failed("error", f"not plain data: {e}"), seq)


def _score_in_child(conn, confine_child, call: Call, fn, item, missed: _MissedImports) -> RewardResult:
  """Scores one item in a fork of this worker that holds no pipe to the trainer (SandboxLimits.process_per_item):
  the child enters a nested Landlock domain (it cannot reach this process), answers on a pipe of its own and
  exits; this worker checks the one answer, so code that took the child over answers for this item only."""
  read_end, write_end = os.pipe()
  pid = os.fork()
  if pid == 0:  # the child: whatever happens, it ends here and never returns into the worker's loop
    try:
      try:
        os.close(read_end)
        os.close(conn.fileno())
        confine_child()
        data = _answer(_score(call, fn, item, missed))
      except BaseException as e:  # noqa: BLE001 - told to the worker, which decides
        data = _answer(_failed("error", f"{type(e).__name__}: {e}"))
      view = memoryview(data)
      while view:
        view = view[os.write(write_end, view):]
    finally:
      os._exit(0)
  os.close(write_end)
  data, size = [], 0
  try:
    while chunk := os.read(read_end, 1 << 16):
      size += len(chunk)
      if size > wire.MAX_BYTES:
        os.kill(pid, signal.SIGKILL)
        break
      data.append(chunk)
  finally:
    os.close(read_end)
  _, status = os.waitpid(pid, 0)
  if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) and size <= wire.MAX_BYTES:
    return _failed("cpu_limit", "reward fn used more CPU time than its sandbox allows")
  if status != 0 or not data:
    return _failed("crash", f"the item's process ended with status {status} and {size} bytes")
  try:
    return _result_from(wire.decode(b"".join(data), ("done",))[1])
  except wire.BadMessage as e:
    return _failed("bad_message", f"the item's process answered a malformed message: {e}")


def _serve(conn, sandbox: tuple[dict, str, bool] | None) -> None:
  """Worker process: loads the fn, confines itself if asked (limits, scratch directory), then answers
  (prompt, completion, meta) items until told to stop. It sends plain data only (jaxrl.envs.wire)."""
  watch = threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start
  missed = _MissedImports()
  try:
    call, fn, warm = conn.recv()
    score = lambda item: _score(call, fn, item, missed)  # noqa: E731
    if sandbox is not None and sandbox[0]["process_per_item"]:
      for item in warm:  # lazy imports and caches, made once here rather than in every item's process
        score(item)
    if sandbox is not None:  # after the fn's imports; the watcher thread starts inside the Landlock domain
      limits = SandboxLimits(**sandbox[0])
      per_item = limits.process_per_item
      _, ready = sandbox_lib.confine(limits, sandbox[1], before_nproc=watch, unsafe=sandbox[2], per_item=per_item)
      if per_item:
        score = lambda item: _score_in_child(conn, ready, call, fn, item, missed)  # noqa: E731
      else:
        score = lambda item: (ready(limits.cpu_s), _score(call, fn, item, missed))[1]  # noqa: E731
    else:
      watch()
  except BaseException as e:  # whatever importing a user's module does is reported, not raised
    _send(conn, "init_error", f"{type(e).__name__}: {e}"[:_MAX_ERROR])
    return
  _send(conn, "ready", None)
  sys.meta_path.append(missed)
  while True:
    try:
      item = conn.recv()
    except EOFError:  # the parent went away
      return
    if item is None:
      return
    seq, item = item
    conn.send_bytes(_answer(score(item), seq))


class _Worker:
  def __init__(self, fn_bytes: bytes, sandbox: SandboxLimits | None, unsafe: bool = False):
    self.conn, child = multiprocessing.Pipe()
    fd = child.fileno()
    self.scratch = sandbox_lib.scratch_dir() if sandbox else None
    self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(fd)], pass_fds=(fd,), cwd=self.scratch,
                                 stdin=subprocess.DEVNULL, start_new_session=sandbox is not None,
                                 env=sandbox_lib.child_env() if sandbox else None)
    child.close()
    self.conn.send(list(sys.path))
    self.conn.send((dataclasses.asdict(sandbox), self.scratch, unsafe) if sandbox else None)
    self.conn.send_bytes(fn_bytes)
    self.started, self.ready = time.monotonic(), False
    self.job: tuple[int, float, int] | None = None  # (item index, deadline, the number its answer must carry)
    self.cpu_check, self.cpu_at_job = math.inf, 0.0  # when to look at its CPU time again; its CPU time at the job
    self._stat: int | None = None

  def cpu_seconds(self) -> float:
    """CPU time the worker has used (user + system), from the kernel's accounting; 0 once it is gone."""
    try:
      if self._stat is None:  # held open: a pread costs a few microseconds an item
        self._stat = os.open(f"/proc/{self.proc.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
      fields = os.pread(self._stat, 4096, 0).rsplit(b")", 1)[1].split()
    except OSError:
      return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

  def close_stat(self) -> None:
    if self._stat is not None:
      os.close(self._stat)
      self._stat = None

  @property
  def exitcode(self) -> int | None:
    try:  # called once its pipe is closed: the process is exiting
      return self.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
      return None

  def kill(self) -> None:
    self.close_stat()
    if self.scratch is not None:  # the sandboxed worker leads a session: whatever it started goes too
      sandbox_lib.kill_group(self.proc)
    else:
      self.proc.kill()
      self.proc.wait()
    self.conn.close()
    self.remove_scratch()

  def remove_scratch(self) -> None:
    if self.scratch is not None:
      shutil.rmtree(self.scratch, ignore_errors=True)


@dataclasses.dataclass
class RewardStats:
  calls: int = 0
  failures: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(REASONS, 0))
  worker_starts: int = 0
  seconds: float = 0.0  # wall time spent in score()

  @property
  def failed(self) -> int:
    return sum(self.failures.values())

  def to_json(self) -> dict:
    return {"calls": self.calls, "failed": self.failed, "failures": dict(self.failures),
            "worker_starts": self.worker_starts, "seconds": self.seconds}


class RewardRunner:
  """Scores batches of (prompt, completion, meta) with one reward fn (a registered name or a callable).

  isolation: "auto" (inline for fns registered inline=True, else "process"), "inline" or "process".
  sandbox: limits for sandboxed workers, None for plain ones, or "auto" (sandboxed if registered sandbox=True).
  call: a module-level function applying the fn to an item (call_reward; jaxrl.envs.env.call_env_step_data: its
    result's payload must be plain data, jaxrl.envs.wire).
  unsafe_sandbox: a sandboxed worker goes on with the Python-level guards alone where the kernel refuses Landlock or
    the namespaces (task.allow_unsafe_sandbox; unsafe: model code may then write where the trainer's user can).
  """

  def __init__(self, reward: str | RewardFn, *, timeout_s: float = 5.0, workers: int = 2,
               isolation: str = "auto", startup_timeout_s: float = 120.0,
               sandbox: SandboxLimits | None | str = "auto", call: Call = call_reward, unsafe_sandbox: bool = False):
    if isolation not in ("auto", "inline", "process"):
      raise ValueError(f"isolation must be 'auto', 'inline' or 'process' (got {isolation!r})")
    if not timeout_s > 0 or workers < 1:
      raise ValueError(f"need timeout_s > 0 and workers >= 1 (got {timeout_s}, {workers})")
    spec = reward_spec(reward) if isinstance(reward, str) else registered_spec(reward)
    self.fn = spec.fn if spec else reward
    self.name = spec.name if spec else getattr(reward, "__name__", repr(reward))
    if isolation == "auto":
      isolation = "inline" if spec is not None and spec.inline else "process"
    if sandbox == "auto":
      sandbox = SandboxLimits() if spec is not None and spec.sandbox else None
    if sandbox is not None and isolation != "process":
      raise ValueError(f"reward {self.name!r}: a sandbox needs isolation='process' (got {isolation!r})")
    self.sandbox, self.call, self.unsafe_sandbox = sandbox, call, unsafe_sandbox
    self.isolation, self.timeout_s, self.startup_timeout_s = isolation, timeout_s, startup_timeout_s
    self.stats = RewardStats()
    self._lock = threading.Lock()  # one batch at a time: workers hold one item each
    self._workers: list[_Worker] = []
    self._seq = 0  # items sent: each answer names its item's number, so no answer is taken for another item's
    if isolation == "process":
      if getattr(self.fn, "__module__", None) == "__main__":
        raise ValueError(f"reward {self.name!r} is defined in __main__, which a worker process cannot import; move "
                         "it to a module, or use isolation='inline'")
      try:
        # The reward's own known cases (trusted inputs) warm a worker that forks a process per item
        warm = [("", c.completion, c.meta) for c in spec.checks] if spec is not None and call is call_reward else []
        self._fn_bytes = pickle.dumps((call, self.fn, warm))
      except Exception as e:
        raise ValueError(f"reward {self.name!r} cannot be sent to a worker process ({type(e).__name__}: {e}); "
                         "define it at module level of an importable module, or use isolation='inline'") from None
      self._workers = [self._start() for _ in range(workers)]
      try:
        self._wait_ready()
      except BaseException:
        self.close()
        raise

  def _start(self) -> _Worker:
    self.stats.worker_starts += 1
    return _Worker(self._fn_bytes, self.sandbox, self.unsafe_sandbox)

  def _on_message(self, w: _Worker, results: list) -> None:
    """Reads one message of w (plain data, checked: jaxrl.envs.wire); wire.BadMessage if it is not one."""
    try:
      kind, body = wire.decode(w.conn.recv_bytes(wire.MAX_BYTES), _KINDS)
    except OSError as e:
      if "bad message length" in str(e):  # over MAX_BYTES: multiprocessing refuses it before reading it
        raise wire.BadMessage(f"a message over {wire.MAX_BYTES} bytes") from None
      raise
    if kind == "init_error":
      raise RuntimeError(f"reward {self.name!r} cannot be loaded in a worker process: {str(body)[:_MAX_ERROR]}")
    if kind == "ready" and not w.ready and w.job is None:
      w.ready = True
    elif kind == "done" and w.job is not None:
      if not isinstance(body, dict) or body.get("seq") != w.job[2]:  # a stale or forged answer: not this item's
        raise wire.BadMessage("an answer to another item")
      results[w.job[0]], w.job = _result_from(body), None
    else:
      raise wire.BadMessage(f"{kind!r} out of turn")

  def _wait_ready(self) -> None:
    while not all(w.ready for w in self._workers):
      pending = [w for w in self._workers if not w.ready]
      left = self.startup_timeout_s - (time.monotonic() - min(w.started for w in pending))
      if left <= 0:
        raise RuntimeError(f"reward workers did not start within {self.startup_timeout_s}s")
      for conn in wait([w.conn for w in pending], timeout=left):
        w = next(w for w in pending if w.conn is conn)
        try:
          self._on_message(w, [])
        except EOFError:
          raise RuntimeError(f"reward worker exited while starting (exit code {w.exitcode})") from None
        except wire.BadMessage as e:
          raise RuntimeError(f"reward worker sent a malformed message while starting: {e}") from None

  def score(self, items: Sequence[tuple[str, str, Mapping[str, Any]]], count: bool = True) -> list[RewardResult]:
    """One result per item, in order; never raises for a failing fn. `count` False leaves them out of the stats
    (a self-check's known cases)."""
    with self._lock:
      t0 = time.perf_counter()
      if self.isolation == "inline":
        results = [self.call(self.fn, *item) for item in items]
      else:
        results = self._score_in_workers(list(items))
      if not count:
        return results
      self.stats.calls += len(results)
      for r in results:
        if not r.ok:
          self.stats.failures[r.reason] += 1
      self.stats.seconds += time.perf_counter() - t0
      return results

  def _replace(self, i: int) -> None:
    self._workers[i].kill()
    self._workers[i] = self._start()

  def _score_in_workers(self, items: list) -> list[RewardResult]:
    if not self._workers:
      raise RuntimeError(f"reward runner for {self.name!r} is closed")
    results: list[RewardResult | None] = [None] * len(items)
    todo = collections.deque(range(len(items)))
    while todo or any(w.job for w in self._workers):
      for w in self._workers:
        while w.ready and w.job is None and todo:
          i = todo.popleft()
          try:
            self._seq += 1
            w.conn.send((self._seq, items[i]))  # pickles before writing: a failure leaves the pipe clean
          except Exception as e:
            results[i] = _failed("unsendable", f"item cannot be sent to a worker: {type(e).__name__}: {e}")
            continue
          w.job = (i, time.monotonic() + self.timeout_s, self._seq)
          if self.sandbox:
            w.cpu_at_job, w.cpu_check = w.cpu_seconds(), time.monotonic() + self.sandbox.cpu_s + 1
      deadlines = [w.job[1] if w.job else w.started + self.startup_timeout_s for w in self._workers
                   if w.job or not w.ready]
      deadlines += [w.cpu_check for w in self._workers if w.job and self.sandbox]
      ready = wait([w.conn for w in self._workers if w.job or not w.ready],
                   timeout=max(0.0, min(deadlines) - time.monotonic()) if deadlines else 0.0)
      now = time.monotonic()
      for k, w in enumerate(self._workers):
        if w.conn in ready:
          try:
            self._on_message(w, results)
          except wire.BadMessage as e:  # what code running in the worker wrote on its pipe: that item's failure
            if w.job:
              results[w.job[0]] = _failed("bad_message", f"reward worker sent a malformed message: {e}")
            self._replace(k)
          except (EOFError, OSError):
            if w.job:
              code = w.exitcode
              results[w.job[0]] = (_failed("cpu_limit", "reward fn used more CPU time than its sandbox allows")
                                   if self.sandbox and code == -signal.SIGXCPU
                                   else _failed("crash", f"reward worker died (exit code {code})"))
            self._replace(k)
        elif w.job and now >= w.job[1]:
          results[w.job[0]] = _failed("timeout", f"reward fn took longer than {self.timeout_s}s; worker killed")
          self._replace(k)
        elif w.job and self.sandbox and now >= w.cpu_check:
          # The hard CPU limit of a long-lived worker: its soft RLIMIT_CPU is raised per item and a hard one could
          # never be raised again (nor by the parent, without CAP_SYS_RESOURCE), so the parent kills it once the item
          # has used its budget + 1 s of CPU, whatever it did with SIGXCPU.
          if w.cpu_seconds() - w.cpu_at_job > self.sandbox.cpu_s + 1:
            results[w.job[0]] = _failed("cpu_limit", "reward fn ignored its CPU limit; worker killed")
            self._replace(k)
          else:
            w.cpu_check = now + 0.25
        elif not w.ready and now >= w.started + self.startup_timeout_s:
          raise RuntimeError(f"a replacement reward worker did not start within {self.startup_timeout_s}s")
    return results

  def close(self) -> None:
    for w in self._workers:
      try:
        w.conn.send(None)
      except OSError:
        pass
    for w in self._workers:
      try:
        w.proc.wait(timeout=1.0)
      except subprocess.TimeoutExpired:
        w.kill()
      w.conn.close()
      w.close_stat()
      w.remove_scratch()
    self._workers = []

  def __enter__(self) -> RewardRunner:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
