"""Kernel isolation for sandboxed processes: a private size-capped scratch (a tmpfs in a mount namespace) and a
Landlock domain (reads only beneath the interpreter's import roots, system libraries and the scratch; writes only
beneath the scratch; no TCP; no signals or abstract sockets out of the domain).

Why Landlock: it checks the real inode hierarchy in the kernel, so `dir_fd`, `..`, /proc/self/fd walks, hard links
(REFER), renames and C code all meet the same rule, for root and a normal user alike, with no setuid helper. Why
a tmpfs: `size=` caps the whole scratch (RLIMIT_FSIZE caps one file only). Both need no privilege beyond an
unprivileged user + mount namespace. All of it is done through raw syscalls (ctypes) by the child itself, before
its audit hook refuses ctypes. `problem()` says what this kernel refuses, for the run's start-up check.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_CREATE_RULESET_VERSION = 1
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV  # the rights a rule on a file may hold
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
# Read-only beneath these (besides the import roots and the interpreter's prefixes): shared libraries a lazy import
# may load, and the devices a library may open.
SYSTEM_READS = ("/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/dev/null", "/dev/zero", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


class Unavailable(RuntimeError):
  """The kernel refuses an isolation the sandbox needs."""


class _PathBeneath(ctypes.Structure):
  _pack_ = 1
  _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class _RulesetAttr(ctypes.Structure):
  _fields_ = (("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
              ("scoped", ctypes.c_uint64))


def _check(ret: int, what: str) -> int:
  if ret < 0:
    err = ctypes.get_errno()
    raise Unavailable(f"{what}: {os.strerror(err)}")
  return ret


def landlock_abi() -> int:
  """The kernel's Landlock ABI version; 0 without Landlock."""
  ret = _libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
  return max(0, int(ret))


def _handled_fs(abi: int) -> int:
  return (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1


def open_rule_paths(paths) -> list[tuple[int, bool]]:
  """O_PATH descriptors of the existing paths (opened while the process can still reach them: before a uid drop),
  each with whether it is a directory."""
  fds = []
  for path in dict.fromkeys(paths):
    try:
      fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
      continue
    fds.append((fd, os.path.isdir(f"/proc/self/fd/{fd}")))
  return fds


def restrict(reads: list[tuple[int, bool]], writes: list[tuple[int, bool]], keep: bool = False) -> int | None:
  """Enters a Landlock domain: read (and execute) beneath `reads`, everything beneath `writes`, nothing else; no
  TCP bind or connect; no signal or abstract unix socket outside the domain. Applies to this thread and the
  threads and processes it starts afterwards (not to threads already running). Closes the descriptors. With
  `keep`, returns the ruleset's descriptor, for `enter_again` in a forked child."""
  abi = landlock_abi()
  if abi < 1:
    raise Unavailable("Landlock is not available in this kernel")
  handled = _handled_fs(abi)
  attr = _RulesetAttr(handled, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
  size = 24 if abi >= 6 else 16 if abi >= 4 else 8
  ruleset = _check(_libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
                   "landlock_create_ruleset")
  entered = False
  try:
    for fds, rights in ((reads, _READ), (writes, handled)):
      for fd, is_dir in fds:
        rule = _PathBeneath(rights & handled & (~0 if is_dir else _FILE_RIGHTS), fd)
        _check(_libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)),
               "landlock_add_rule")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _check(_libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
    entered = True
  finally:
    if not (keep and entered):
      os.close(ruleset)
    for fd, _ in (*reads, *writes):
      os.close(fd)
  return ruleset if keep else None


def enter_again(ruleset: int) -> None:
  """Enters a kept ruleset once more and closes it. In a forked child this is a domain nested in its parent's: the
  child can no longer ptrace the parent, open its /proc/<pid>/fd, or signal it."""
  try:
    _check(_libc.syscall(_SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)), "landlock_restrict_self")
  finally:
    os.close(ruleset)


def private_mounts(root: bool) -> None:
  """A mount namespace of this process's own (in a new user namespace too when not root), its mounts private.
  The process must still be single-threaded."""
  uid, gid = os.getuid(), os.getgid()
  flags = os.CLONE_NEWNS | os.CLONE_NEWNET
  try:
    os.unshare(flags if root else flags | os.CLONE_NEWUSER)
  except OSError as e:
    raise Unavailable(f"unshare (mount and network namespaces): {e.strerror}") from None
  if not root:  # the same ids inside: files keep their owners
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
  _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")


def mount_scratch(path: str, size_mb: int, uid: int, gid: int) -> None:
  """A fresh tmpfs of `size_mb` on `path` (in this process's mount namespace), owned by uid:gid, mode 0700."""
  options = f"size={size_mb}m,mode=0700,uid={uid},gid={gid}".encode()
  _check(_libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options), "mount tmpfs")


def drop_capabilities() -> None:
  """Drops the capabilities a new user namespace gave this (non-root) process."""
  header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
  data = (ctypes.c_uint32 * 6)()
  _check(_libc.capset(header, data), "capset")


_PROBE = """
import ctypes, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
try:
  os.unshare(os.CLONE_NEWNS | (0 if os.getuid() == 0 else os.CLONE_NEWUSER))
except OSError as e:
  sys.exit(f"the kernel refuses a private mount namespace ({e.strerror}): no size-capped scratch")
ok = libc.mount(b"none", b"/", None, (1 << 14) | (1 << 18), None) == 0 and libc.mount(
    b"tmpfs", tempfile.gettempdir().encode(), b"tmpfs", 6, b"size=1m") == 0  # over /tmp, in this namespace only
sys.exit(0 if ok else f"the kernel refuses a tmpfs in a private mount namespace ({os.strerror(ctypes.get_errno())})")
"""


def problem() -> str | None:
  """What this kernel refuses of the sandbox's isolation (Landlock, a private mount namespace with a tmpfs), or
  None. Runs a tiny child for the namespace part (it cannot be tried in the caller without changing it)."""
  abi = landlock_abi()
  if abi < 1:
    return "the kernel has no Landlock (Linux >= 5.13 with landlock in the LSM list): no file boundary"
  proc = subprocess.run([sys.executable, "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30)
  if proc.returncode != 0:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"namespace probe exited {proc.returncode}"
  return None


def require(allow_unsafe: bool) -> bool:
  """The run's start-up check, for a run with sandboxed rewards: raises Unavailable (one line) where the kernel
  refuses the isolation, unless `allow_unsafe` (task.allow_unsafe_sandbox), which says so on stderr and returns
  True (the sandboxes then go on with the Python-level guards alone)."""
  why = problem()
  if why is None:
    return False
  if not allow_unsafe:
    raise Unavailable(f"the sandbox for model-written code cannot isolate it: {why}; task.allow_unsafe_sandbox=True "
                      "runs without that isolation, unsafely (docs/SECURITY.md)")
  print(f"jaxrl: UNSAFE sandbox (task.allow_unsafe_sandbox): {why}; model-written code may write wherever this "
        "user can", file=sys.stderr)
  return True
