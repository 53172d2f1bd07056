"""Sandbox for code and text a model wrote: a separate process with CPU-time, memory, process and file limits, no
network, a private size-capped scratch as its working directory and only writable place, and reads only of what
the interpreter needs; killed on timeout. docs/SECURITY.md states what each boundary enforces and how it is tested.

How each limit is enforced (`confine`, called in the child before any untrusted input is handled):
- Files, by the kernel (jaxrl.envs.isolation): a Landlock domain lets the process read only beneath its import
  roots, the interpreter's prefixes, the system's library folders and its scratch, and write only beneath its
  scratch. Landlock checks the real inode hierarchy, so descriptor-relative calls (`dir_fd`), `..`, /proc/self/fd
  walks, hard links, renames and C code all meet the same rule. The scratch is a fresh tmpfs of
  `scratch_mb` in a mount namespace of the process's own (and a user namespace when not root): `size=` caps all it
  writes together; RLIMIT_FSIZE caps one file. Landlock binds the calling thread and what it starts, not threads
  already running: `confine` refuses to run beside another thread (child_env keeps numerical libraries' pools
  from starting one at import). Where the kernel refuses Landlock or the namespaces, `confine` raises
  isolation.Unavailable, unless `unsafe` (task.allow_unsafe_sandbox) leaves the Python-level guards alone.
- CPU time: RLIMIT_CPU (the kernel sends SIGXCPU, which kills the process). A fresh process per program
  (run_code) also gets a hard limit one second above, which kills it even if it ignores SIGXCPU; a long-lived
  reward worker cannot (its limit is raised per item, and a hard limit is never raised again), so its parent kills
  it once an item has used its budget + 1 s (jaxrl.envs.runner). Wall time: the parent kills the whole process
  group (`start_new_session`) at its deadline.
- Memory: RLIMIT_AS, the address space the process has at confinement plus `memory_mb`; an allocation past it
  raises MemoryError (or kills the process, if it happens in C).
- Processes (fork bombs): RLIMIT_NPROC = 0, enforced by the kernel for any uid but root; a root parent's child
  therefore first becomes `nobody` (uid 65534). Python-level fork, exec, spawn, system and subprocess are also
  refused by an audit hook.
- Imports after the uid change: a library may import a module lazily, while scoring (math-verify's LaTeX parser
  imports antlr4's analyser on first use), from a directory `nobody` cannot reach (a venv under a mode-700 home,
  the usual container layout). Before the uid changes, each import root (sys.path entry) that `nobody` cannot
  reach is opened as a directory and replaced, in sys.path and in every imported package's __path__, by
  /proc/self/fd/N: the kernel lets a process walk its own descriptors, and a walk from an open directory checks
  only the permissions below it. Landlock then checks the real folder each walk reaches, so `..` out of a root
  reads nothing the rules do not name. (A file that is itself unreadable to others, e.g. installed under umask 077,
  stays unreadable: the reward's start-up self-check reports it.)
- Network: a new network namespace (no interface but a down loopback); Landlock (ABI >= 4) also refuses TCP bind
  and connect; socket creation is refused by the audit hook in any case.
- Channels: run_code's child inherits stdin (read, then /dev/null), stdout and stderr (files outside its scratch)
  and no other descriptor; its outcome is its exit status, never a line it printed. A reward worker holds its pipe
  to the trainer, which accepts plain data only (jaxrl.envs.wire). Landlock (ABI >= 6) also keeps the process from
  signalling or reaching abstract unix sockets outside its domain.
The audit hook (writes outside the scratch, sockets, processes, ctypes) is a Python-level guard, not a boundary
against an attacker who can corrupt the interpreter; the kernel-enforced limits above hold regardless.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxrl.envs import isolation

NOBODY = 65534
_REFUSED = ("socket.__new__", "socket.socketpair", "socket.getaddrinfo", "socket.gethostbyname", "os.fork",
            "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen", "os.kill",
            "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
            "ctypes.call_function", "resource.setrlimit", "resource.prlimit", "os.setuid", "os.setgid", "os.chroot",
            "os.unshare")
_PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,), "os.chmod": (0,),
                "os.chown": (0,), "os.link": (0, 1), "os.symlink": (1,), "os.truncate": (0,), "os.utime": (0,),
                "os.setxattr": (0,), "os.removexattr": (0,), "os.mkfifo": (0,), "os.mknod": (0,)}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# Imported before the uid changes: what expression rewards and short programs use.
PRELOAD = ("ast", "collections", "decimal", "encodings.idna", "fractions", "functools", "itertools", "json", "math",
           "operator", "random", "re", "statistics", "string")


class SandboxViolation(PermissionError):
  """Something the sandbox does not allow (a socket, a process, a write outside the scratch directory)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  cpu_s: int = 2  # CPU seconds per item (reward) or per run (code)
  memory_mb: int = 512  # address space on top of what the interpreter holds when confined
  file_mb: int = 16  # the largest file it may write
  open_files: int = 64
  scratch_mb: int = 64  # everything the process may write, in all (the size of its private tmpfs)
  # A reward worker scores each item in a fork of itself that holds no pipe to the trainer, in a nested Landlock
  # domain: code that takes a scorer over answers for its own item only, never through the trainer's pipe nor for
  # the worker's later items. Costs a fork an item (bench/reward_runner.py; docs/SECURITY.md, "Boundary 2"); False
  # (the run's task.reward_process_per_item) keeps one confined process per worker, faster, with that residual
  process_per_item: bool = True


@dataclasses.dataclass(frozen=True)
class Confinement:
  """What `confine` achieved (the tests and docs report it)."""
  network: str  # "namespace" (no interfaces) or "hook" (socket creation refused in Python only)
  uid: int
  scratch: str
  files: str = "landlock"  # "landlock" (kernel) or "hook" (Python only: an unsafe sandbox)


def _address_space() -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmSize:"):
      return int(line.split()[1]) * 1024
  return 0


def _no_network() -> str:
  for flags in (os.CLONE_NEWNET, os.CLONE_NEWUSER | os.CLONE_NEWNET):
    try:
      os.unshare(flags)
      return "namespace"
    except OSError:
      continue
  return "hook"


def _inside(path, scratch: str) -> bool:
  if isinstance(path, int):  # an open descriptor: opened under the rules already
    return True
  full = os.path.realpath(os.path.join(os.getcwd(), os.fsdecode(path)))
  return full == scratch or full.startswith(scratch + os.sep)


def _hook(scratch: str, armed: list):
  busy = []  # realpath can raise events of its own

  def hook(event: str, args) -> None:
    if busy:
      return
    if event in _REFUSED and not (armed and event == "resource.setrlimit"):
      raise SandboxViolation(f"sandbox: {event} is not allowed")
    paths = None
    if event == "open":
      path, mode, flags = args
      writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
      paths = [path] if writing and path is not None else None
    elif event in _PATH_EVENTS:
      paths = [args[i] for i in _PATH_EVENTS[event]]
    if paths:
      busy.append(1)
      try:
        outside = [p for p in paths if not _inside(p, scratch)]
      finally:
        busy.pop()
      if outside:
        raise SandboxViolation(f"sandbox: writing {os.fsdecode(outside[0])!r} outside the scratch directory")

  return hook


def _reachable_by_others(path: str) -> bool:
  """Whether a user that is neither owner nor group member can list `path` (search on every ancestor, read and
  search on the directory itself)."""
  parts = Path(path).resolve().parts
  try:
    if any(not os.stat(os.path.join(*parts[:i])).st_mode & stat.S_IXOTH for i in range(1, len(parts))):
      return False
    return os.stat(path).st_mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH
  except OSError:
    return False


def keep_imports_reachable() -> dict[str, str]:
  """Before a root process becomes `nobody`: every import root `nobody` cannot reach is held open and named by
  its descriptor in sys.path and in the imported packages' __path__ (module docstring). Returns old -> new roots."""
  roots: dict[str, str] = {}
  for entry in sys.path:
    if entry in roots or not entry or not os.path.isdir(entry) or _reachable_by_others(entry):
      continue
    fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)  # inherited only by a per-item worker's forks, which need it
    roots[entry] = roots[os.path.realpath(entry)] = f"/proc/self/fd/{fd}"
  if not roots:
    return roots
  ordered = sorted(roots, key=len, reverse=True)  # the deepest root first: a venv inside another root

  def moved(path):
    if isinstance(path, str):
      for root in ordered:
        if path == root or path.startswith(root + os.sep):
          return roots[root] + path[len(root):]
    return path

  sys.path[:] = [moved(p) for p in sys.path]
  for module in list(sys.modules.values()):
    search = getattr(module, "__path__", None)
    if isinstance(search, list):  # a regular package (namespace packages recompute theirs from sys.path)
      search[:] = [moved(p) for p in search]
  sys.path_importer_cache.clear()
  return roots


def _read_roots() -> list[str]:
  """Where a confined interpreter may read: its import roots and prefixes, and the system's libraries."""
  return [*(p for p in sys.path if p and os.path.isdir(p)), sys.prefix, sys.base_prefix, sys.exec_prefix,
          sys.base_exec_prefix, *isolation.SYSTEM_READS]


def confine(limits: SandboxLimits, scratch: str | os.PathLike, before_nproc=None, *, fresh: bool = False,
            unsafe: bool = False, per_item: bool = False):
  """Confines this process (see the module docstring); returns (Confinement, set_cpu_budget). `before_nproc` runs
  just before processes are limited (e.g. to start a thread). set_cpu_budget(s) lets the process use s more CPU
  seconds from now (the only setrlimit the hook lets through). `fresh`: the process runs one program and exits
  (run_code), so its CPU limit also gets a hard limit one second above. `unsafe`: go on, with the Python-level
  guards only, where the kernel refuses Landlock or the namespaces (task.allow_unsafe_sandbox). `per_item`: the
  process forks a child per item (SandboxLimits.process_per_item), so it keeps its processes and no audit hook, and
  returns confine_child instead of set_cpu_budget: called in each forked child, it enters a nested Landlock domain
  and sets what this process did not (no processes, a CPU limit with a hard one a second above, the audit hook)."""
  for name in PRELOAD:
    __import__(name)
  scratch = os.path.realpath(scratch)
  uid, root = os.getuid(), os.getuid() == 0
  memory = _address_space() + (limits.memory_mb << 20)  # read while /proc is still readable
  if len(os.listdir("/proc/self/task")) > 1 and not unsafe:  # Landlock binds only the calling thread and its heirs
    raise isolation.Unavailable("a thread runs already: it would stay outside the Landlock domain")
  try:
    isolation.private_mounts(root)
    isolation.mount_scratch(scratch, limits.scratch_mb, NOBODY if root else uid, NOBODY if root else os.getgid())
    network = "namespace"
  except (isolation.Unavailable, OSError):
    if not unsafe:
      raise
    network = _no_network()
  os.chdir(scratch)  # after the mount: the cwd is the tmpfs
  os.environ["TMPDIR"] = tempfile.tempdir = scratch
  if root:
    keep_imports_reachable()
  reads = isolation.open_rule_paths([*_read_roots(), scratch])  # before the uid drop: as root it reaches them all
  writes = isolation.open_rule_paths([scratch, "/dev/null"])
  if root:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
  elif network == "namespace":
    isolation.drop_capabilities()
  ruleset = None
  try:
    ruleset = isolation.restrict(reads, writes, keep=per_item)
    files = "landlock"
  except isolation.Unavailable:
    if not unsafe:
      raise
    files = "hook"
  if before_nproc is not None:
    before_nproc()
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past its limit: an OSError rather than a dead process
  file_bytes = limits.file_mb << 20
  rlimits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_CORE, 0),
             (resource.RLIMIT_NOFILE, limits.open_files)]
  for kind, value in rlimits if per_item else [*rlimits, (resource.RLIMIT_NPROC, 0)]:
    resource.setrlimit(kind, (value, value))
  confinement = Confinement(network, os.getuid(), scratch, files)
  if per_item:

    def confine_child() -> None:
      if ruleset is not None:
        isolation.enter_again(ruleset)
      for kind, value in ((resource.RLIMIT_NPROC, (0, 0)), (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))):
        resource.setrlimit(kind, value)  # a fresh process: its CPU time starts at 0
      sys.addaudithook(_hook(scratch, []))

    return confinement, confine_child
  armed: list = []

  def set_cpu_budget(seconds: float) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + seconds) + 1
    armed.append(1)
    try:  # a hard limit cannot be raised again: a long-lived worker's is enforced by its parent (runner.py)
      resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1 if fresh else resource.RLIM_INFINITY))
    finally:
      armed.pop()

  set_cpu_budget(limits.cpu_s)
  sys.addaudithook(_hook(scratch, armed))
  return confinement, set_cpu_budget


def child_env() -> dict[str, str]:
  """The environment of a sandboxed process: numerical libraries start no thread pools at import (a thread started
  before confinement would stay outside the Landlock domain, and `confine` refuses to run beside one)."""
  return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def scratch_dir() -> str:
  return tempfile.mkdtemp(prefix="jaxrl-sandbox-")


def kill_group(proc: subprocess.Popen) -> None:
  """Kills the process and everything it started (it leads its own session)."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


# ---- running code --------------------------------------------------------------------------------------------

REASONS = ("error", "blocked", "memory", "cpu_limit", "timeout", "crash")


@dataclasses.dataclass(frozen=True)
class CodeResult:
  ok: bool
  stdout: str
  error: str | None = None
  reason: str = ""  # one of REASONS when not ok


_CODE_BOOT = ("import json, os, sys; spec = json.loads(sys.stdin.readline()); code = sys.stdin.read(); "
              "os.dup2(os.open(os.devnull, os.O_RDONLY), 0); sys.path[:] = spec['path']; "
              "from jaxrl.envs.sandbox import _run_child; _run_child(spec, code)")
# The child's exit status says how the program ended; nothing it prints is parsed. A program can exit with one of
# these codes itself: that changes the reason of its failure, never its success or its output.
_EXIT_REASONS = {1: "error", 3: "blocked", 4: "memory", 5: "sandbox"}


def _run_child(spec: dict, code: str) -> None:
  try:
    confine(SandboxLimits(**spec["limits"]), spec["scratch"], fresh=True, unsafe=spec["unsafe"])
  except BaseException as e:  # noqa: BLE001 - the code never runs unconfined
    print(f"sandbox: {type(e).__name__}: {e}", file=sys.stderr)
    os._exit(5)
  try:
    exec(compile(code, "<sandboxed>", "exec"), {"__name__": "__sandbox__"})
  except BaseException as e:  # noqa: BLE001 - the outcome, told to the parent by the exit status
    code = 3 if isinstance(e, SandboxViolation) else 4 if isinstance(e, MemoryError) else 1
    sys.stdout.flush()
    print(f"{type(e).__name__}: {e}"[:500], file=sys.stderr)
    os._exit(code)
  sys.stdout.flush()
  os._exit(0)


def _tail(f, n: int = 500) -> str:
  f.seek(max(0, os.fstat(f.fileno()).st_size - n))
  return f.read().decode(errors="replace").strip().rsplit("\n", 1)[-1]


def run_code(code: str, limits: SandboxLimits = SandboxLimits(), timeout_s: float = 5.0, *,
             unsafe: bool = False) -> CodeResult:
  """Runs Python source a model wrote in a fresh sandboxed process; its stdout (at most limits.file_mb) comes back.
  The child inherits stdin (read, then /dev/null), stdout and stderr (files outside its scratch) and no other
  descriptor; ok and the reason come from its exit status alone. Never raises for anything the code does."""
  scratch, outputs = scratch_dir(), tempfile.mkdtemp(prefix="jaxrl-sandbox-out-")
  try:
    with open(Path(outputs) / "stdout", "w+b") as out, open(Path(outputs) / "stderr", "w+b") as err:
      proc = subprocess.Popen([sys.executable, "-I", "-c", _CODE_BOOT], stdin=subprocess.PIPE, stdout=out,
                              stderr=err, cwd=scratch, start_new_session=True, env=child_env())
      spec = {"path": sys.path, "limits": dataclasses.asdict(limits), "scratch": scratch, "unsafe": unsafe}
      try:
        proc.communicate((json.dumps(spec) + "\n" + code).encode(), timeout=timeout_s)
      except subprocess.TimeoutExpired:
        return CodeResult(False, "", f"took longer than {timeout_s}s; killed", "timeout")
      finally:
        kill_group(proc)  # anything it left behind
      out.seek(0)
      stdout = out.read(limits.file_mb << 20).decode(errors="replace")
      status = proc.returncode
      if status == 0:
        return CodeResult(True, stdout)
      if status in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft CPU limit, or the hard one past an ignored SIGXCPU
        return CodeResult(False, stdout, f"used more than {limits.cpu_s}s of CPU; killed", "cpu_limit")
      if status == 5:
        raise isolation.Unavailable(f"run_code: {_tail(err)} (task.allow_unsafe_sandbox opts out, unsafely)")
      reason = _EXIT_REASONS.get(status, "crash")
      return CodeResult(False, stdout, _tail(err) or f"exited with status {status}", reason)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(outputs, ignore_errors=True)
