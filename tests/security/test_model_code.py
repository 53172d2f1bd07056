"""Model-written code and text cannot reach the trainer or files outside its scratch (docs/SECURITY.md).

Every attack runs as model-written code through the real paths: a sandboxed RewardRunner whose scorer executes the
completion in its own process (as sympy's parse_expr does), a plain worker whose scorer runs it with run_code, and
run_code itself. Each asserts the honest score or the item's failure with its reason, that a canary folder outside
the scratch is byte-for-byte and mtime-for-mtime unchanged, and that the trainer ran nothing it was sent. As root
(this suite's usual user) and, for the file boundary, as a normal user in a user namespace (uid 1000, no
capabilities).
"""

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl.envs import RewardRunner, isolation, wire
from jaxrl.envs.episodes import EnvRunner
from jaxrl.envs.sandbox import SandboxLimits, run_code
from jaxrl.envs.task import Example

sys.path.insert(0, str(Path(__file__).parent))
import model_code_rewards  # noqa: E402

LIMITS = SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1, scratch_mb=2)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def canary(tmp_path):
  """A folder outside every scratch and import root, with a file in it; `check()` asserts neither changed. Both are
  writable by anyone and the folder sits in /tmp (which anyone can enter; pytest's tmp_path is root's alone), so
  that file permissions (the sandbox's `nobody`) stop nothing and the kernel's sandbox is what is tested."""
  folder = Path(tempfile.mkdtemp(prefix="jaxrl-canary-"))
  (folder / "canary.txt").write_bytes(b"the trainer's secret")
  (folder / "canary.txt").chmod(0o666)
  folder.chmod(0o777)
  before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()}

  class Canary:
    dir, file, marker = str(folder), str(folder / "canary.txt"), str(tmp_path / "trainer-ran-this")

    def fill(self, code: str) -> str:
      return code.replace("CANARY_DIR", self.dir).replace("CANARY_FILE", self.file).replace("MARKER", self.marker)

    def check(self):
      assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.iterdir()} == before
      assert folder.stat().st_mtime_ns == dir_mtime
      assert not os.path.exists(self.marker), "the trainer ran code a worker sent"

  dir_mtime = folder.stat().st_mtime_ns
  yield Canary()
  shutil.rmtree(folder, ignore_errors=True)


class _RunsInTrainer:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):  # what unpickling would run, in the trainer, as the trainer's user
    return (os.system, (f"id > {self.marker}",))


def _to_every_fd(payload: bytes) -> str:
  """Code that writes `payload`, framed as multiprocessing frames its messages, on every descriptor 3..255."""
  framed = len(payload).to_bytes(4, "big") + payload
  return textwrap.dedent(f"""
      import os
      for fd in range(3, 256):
        try:
          os.write(fd, {framed!r})
        except OSError:
          pass
      """)


FORGED = json.dumps(["done", {"value": 1.0, "ok": True, "error": None, "reason": "", "payload": None,
                              "import_errors": []}]).encode()
# Kernel-only attacks: the audit hook sees none of them (a descriptor-relative path looks like one in the scratch).
ESCAPES = {
    "dir_fd write": "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
                    "os.write(os.open('pwned', os.O_CREAT | os.O_WRONLY, dir_fd=d), b'pwned')",
    "dir_fd open of the canary": "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
                                 "os.write(os.open('canary.txt', os.O_WRONLY | os.O_TRUNC, dir_fd=d), b'pwned')",
    "mkdir with dir_fd": "import os\nos.mkdir('pwned', dir_fd=os.open('CANARY_DIR', os.O_RDONLY))",
    "hard link": "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
                 "os.link('canary.txt', 'mine', src_dir_fd=d, dst_dir_fd=d)\n"
                 "os.write(os.open('mine', os.O_WRONLY, dir_fd=d), b'pwned')",
    "hard link into the scratch": "import os\nos.link('canary.txt', 'mine', src_dir_fd=os.open('CANARY_DIR', 0))\n"
                                  "open('mine', 'r+').write('pwned')",
    "rename": "import os\nd = os.open('CANARY_DIR', os.O_RDONLY)\n"
              "os.rename('canary.txt', 'stolen', src_dir_fd=d, dst_dir_fd=d)",
}
# Walks '..' out of each descriptor (the import roots held open as /proc/self/fd/N) to the canary; prints what it
# reads or lists.
FD_WALK = textwrap.dedent("""
    import os
    for fd in range(3, 64):
      up = f'/proc/self/fd/{fd}/' + '../' * 16
      for read in (lambda: open(up + 'CANARY_FILE'[1:]).read(), lambda: os.listdir(up + 'CANARY_DIR'[1:]),
                   lambda: os.listdir(up)):
        try:
          print('READ', read())
        except OSError:
          pass
    """)
IGNORES_SIGXCPU = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n  pass"
FILLS_SCRATCH = textwrap.dedent("""
    import errno
    try:
      for i in range(4):
        open(f'f{i}', 'wb').write(b'x' * 900_000)
    except OSError as e:
      print('stopped', errno.errorcode[e.errno], 'at', i)
    """)


def test_what_a_sandboxed_scorer_writes_on_its_pipe_is_never_run_and_fails_only_its_item(canary):
  marker = pickle.dumps(("done", _RunsInTrainer(canary.marker)))
  attacks = [_to_every_fd(marker), _to_every_fd(FORGED), _to_every_fd(b"\xff" * 64), _to_every_fd(b"[" * 100_000)]
  items = [("p", code, {"score": 0.0}) for code in attacks] + [("p", "x = 1", {"score": 0.5})]
  with RewardRunner(model_code_rewards.exec_then_honest, workers=2, timeout_s=20, sandbox=LIMITS) as runner:
    results = runner.score(items)
  assert [(r.ok, r.reason) for r in results[:4]] == [(False, "bad_message")] * 4, results
  assert (results[4].ok, results[4].value) == (True, 0.5)  # the next item is scored honestly
  assert runner.stats.failures["bad_message"] == 4
  canary.check()


def test_a_plain_workers_pipe_carries_data_only_too(canary):
  marker = pickle.dumps(("done", _RunsInTrainer(canary.marker)))
  items = [("p", _to_every_fd(marker), {"score": 0.0}), ("p", "x = 1", {"score": 0.25})]
  with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=None) as runner:
    results = runner.score(items)
  assert (results[0].ok, results[0].reason) == (False, "bad_message") and results[1].value == 0.25
  canary.check()


# Reads its item's number from the worker's frames and writes a well-formed answer for it on every descriptor
FORGE_OWN_ITEM = textwrap.dedent("""
    import json, os, sys
    f = sys._getframe()
    while 'seq' not in f.f_locals:
      f = f.f_back
    body = {'seq': f.f_locals['seq'], 'value': 1.0, 'ok': True, 'error': None, 'reason': '', 'payload': None,
            'import_errors': []}
    data = json.dumps(['done', body]).encode()
    for fd in range(3, 256):
      try:
        os.write(fd, len(data).to_bytes(4, 'big') + data)
      except OSError:
        pass
    """)


def test_a_scorer_taken_over_forges_at_most_its_own_item(canary):
  # The documented residual of one confined process per worker (task.reward_process_per_item=False;
  # docs/SECURITY.md): code that runs inside the scorer's process can answer for the item it is scoring (here it
  # reads the item's number from the worker's frame), never for another item, never code.
  one_process = dataclasses.replace(LIMITS, process_per_item=False)
  with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=one_process) as runner:
    results = runner.score([("p", FORGE_OWN_ITEM, {"score": 0.0}), ("p", "x = 1", {"score": 0.5}),
                            ("p", "x = 1", {"score": 0.5})])
  assert results[0].value in (0.0, 1.0)  # its own item: forged, or honest if the forgery lost the race
  for r in results[1:]:  # another item: honest, or failed as an answer to another item, never the forged value
    assert (r.ok, r.value) == (True, 0.5) or (r.ok, r.reason) == (False, "bad_message"), r
  assert results[2].value == 0.5
  canary.check()


PATCH_SCORER = ("import model_code_rewards\n"
                "model_code_rewards.exec_then_honest.__code__ = (lambda prompt, completion, meta: 1.0).__code__")
# From a forked item's process: its worker's descriptors (the pipe to the trainer among them), by /proc/<ppid>/fd
THROUGH_PARENT = textwrap.dedent("""
    import os
    for fd in range(3, 64):
      try:
        with open(f'/proc/{os.getppid()}/fd/{fd}', 'wb', buffering=0) as f:
          f.write(FRAME)
      except OSError:
        pass
    """)


@pytest.mark.parametrize("per_item", [False, True], ids=["one_process", "process_per_item"])
def test_a_scorer_taken_over_answers_for_its_worker_until_replaced_unless_each_item_has_its_own_process(
    per_item, canary):
  forged = json.dumps(["done", {"seq": 2, "value": 1.0, "ok": True, "error": None, "reason": "", "payload": None,
                                "import_errors": []}]).encode()
  parent = THROUGH_PARENT.replace("FRAME", repr(len(forged).to_bytes(4, "big") + forged))
  limits = SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1, scratch_mb=2, process_per_item=per_item)
  items = [("p", PATCH_SCORER, {"score": 0.0}), ("p", "x = 1", {"score": 0.5}), ("p", parent, {"score": 0.25}),
           ("p", IGNORES_SIGXCPU, {"score": 0.0}), ("p", "x = 1", {"score": 0.5})]
  with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=limits) as runner:
    t0 = time.monotonic()
    results = runner.score(items)
    assert time.monotonic() - t0 < 15
  if per_item:  # the patch died with its item's process; nothing reached the worker or the trainer
    assert [r.value for r in results[:3]] == [0.0, 0.5, 0.25] and results[4].value == 0.5, results
    assert (results[3].ok, results[3].reason) == (False, "cpu_limit"), results  # the child's hard CPU limit
  else:  # the documented residual: the patched scorer answers for the worker's later items (it runs none of them)
    assert [r.value for r in results] == [0.0, 1.0, 1.0, 1.0, 1.0], results
  canary.check()


def test_an_items_own_process_holds_no_pipe_to_the_trainer(canary):
  limits = SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1, scratch_mb=2, process_per_item=True)
  with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=limits) as runner:
    results = runner.score([("p", FORGE_OWN_ITEM, {"score": 0.0}), ("p", "x = 1", {"score": 0.5})])
  # the forged answer reached only the item's own answer pipe, ahead of the honest one: a malformed answer
  assert [(r.ok, r.reason) for r in results] == [(False, "bad_message"), (True, "")] and results[1].value == 0.5
  canary.check()


def test_programs_cannot_forge_their_status_or_result(canary):
  fake = ('import os, sys\nprint(\'{"reason": "timeout", "error": "forged"}\', file=sys.stderr, flush=True)\n'
          "os._exit(1)")  # the old status line, last on stderr, then an exit without the sandbox's own line
  r = run_code(fake, LIMITS)
  assert (r.ok, r.reason) == (False, "error"), r
  wrong = "print(41)\n" + _to_every_fd(FORGED) + _to_every_fd(json.dumps({"ok": True, "stdout": "42"}).encode())
  status = wrong + "\nimport sys\nprint('{\"ok\": true, \"stdout\": \"42\"}', file=sys.stderr)\nraise SystemExit(1)"
  items = [("p", wrong, {"expected": "42"}), ("p", status, {"expected": "42"}), ("p", "print(6 * 7)",
                                                                               {"expected": "42"})]
  with RewardRunner(model_code_rewards.run_then_compare, workers=1, timeout_s=30, sandbox=None) as runner:
    results = runner.score(items)
  assert [(r.ok, r.value) for r in results] == [(True, 0.0), (True, 0.0), (True, 1.0)], results
  canary.check()


def test_the_wire_takes_plain_data_only():
  huge_int = b'["done", ' + b"1" * 5000 + b"]"
  for data in (b'["done", 1e999]', b'["done", NaN]', b"\xff", b'["nope", 1]', b"[" * 100_000, huge_int,
               pickle.dumps(("done", 1.0))):
    with pytest.raises(wire.BadMessage):
      wire.decode(data, ("done",))
  assert wire.decode(b'["done", {"a": [1, 2.5, null, "x"]}]', ("done",)) == ("done", {"a": [1, 2.5, None, "x"]})
  assert wire.plain({"a": (1,)}) and wire.plain([float("inf")]) and wire.plain({1: 2}) and not wire.plain([{"a": 1}])


@pytest.mark.parametrize("name", ESCAPES)
def test_run_code_cannot_write_outside_its_scratch(name, canary):
  r = run_code(canary.fill(ESCAPES[name]), LIMITS)
  assert (r.ok, r.reason) == (False, "error") and ("ermission" in r.error or "ross-device" in r.error), r
  canary.check()


def test_a_sandboxed_scorer_cannot_write_outside_its_scratch(canary):
  # exec_then_honest swallows the completion's error: each item scores its honest 0.5, and nothing outside changed
  items = [("p", canary.fill(code), {"score": 0.5}) for code in ESCAPES.values()]
  with RewardRunner(model_code_rewards.exec_then_honest, workers=2, timeout_s=20, sandbox=LIMITS) as runner:
    results = runner.score(items)
  assert [(r.ok, r.value) for r in results] == [(True, 0.5)] * len(ESCAPES), results
  canary.check()


def test_descriptor_walks_read_nothing_beyond_the_import_roots(canary):
  r = run_code(canary.fill(FD_WALK), LIMITS)
  assert r.ok, r
  assert "secret" not in r.stdout and "canary.txt" not in r.stdout and "'tmp'" not in r.stdout, r.stdout
  assert run_code("import json, sympy; print(sympy.Rational(1, 2))", LIMITS).stdout == "1/2\n"  # imports still work


def test_ignoring_sigxcpu_meets_a_hard_cpu_limit_in_run_code_and_in_a_worker(canary):
  t0 = time.monotonic()
  r = run_code(IGNORES_SIGXCPU, LIMITS, timeout_s=20)
  assert (r.ok, r.reason) == (False, "cpu_limit") and time.monotonic() - t0 < 15, r
  with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=LIMITS) as runner:
    t0 = time.monotonic()
    results = runner.score([("p", IGNORES_SIGXCPU, {"score": 0.0}), ("p", "x = 1", {"score": 0.5})])
    assert time.monotonic() - t0 < 15  # killed past its CPU budget, long before the 20 s timeout
  assert (results[0].ok, results[0].reason) == (False, "cpu_limit") and results[1].value == 0.5, results
  canary.check()


def test_the_scratch_has_a_total_quota(canary):
  r = run_code(FILLS_SCRATCH, LIMITS)  # 1 MiB a file, 2 MiB in all
  assert r.ok and r.stdout.split()[:2] == ["stopped", "ENOSPC"], r
  canary.check()


def test_a_normal_users_sandbox_holds_the_same_boundaries(tmp_path, canary):
  if not shutil.which("unshare"):
    pytest.skip("no unshare(1) to run as a normal user")
  probe = tmp_path / "probe.py"
  probe.write_text(textwrap.dedent(f"""
      import json, os, sys
      sys.path[:0] = {[str(REPO), str(Path(__file__).parent)]!r}
      from jaxrl.envs.sandbox import SandboxLimits, run_code
      limits = SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1, scratch_mb=2)
      escapes = {json.dumps({k: canary.fill(v) for k, v in ESCAPES.items()})}
      out = {{k: run_code(v, limits).reason for k, v in escapes.items()}}
      out['uid'] = os.getuid()
      out['walk'] = run_code({canary.fill(FD_WALK)!r}, limits).stdout
      out['quota'] = run_code({FILLS_SCRATCH!r}, limits).stdout
      import model_code_rewards
      from jaxrl.envs import RewardRunner
      items = [("p", {_to_every_fd(pickle.dumps(("done", _RunsInTrainer(canary.marker))))!r}, {{"score": 0.0}})]
      items += [("p", code, {{"score": 0.5}}) for code in escapes.values()]
      with RewardRunner(model_code_rewards.exec_then_honest, workers=1, timeout_s=20, sandbox=limits) as runner:
        out['runner'] = [r.reason or r.value for r in runner.score(items)]
      print(json.dumps(out))
      """))
  proc = subprocess.run(["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, str(probe)],
                        capture_output=True, text=True, timeout=120)
  if proc.returncode != 0 and "unshare failed" in proc.stderr:
    pytest.skip(f"no user namespace here: {proc.stderr.strip()}")
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out.pop("uid") == 1000
  assert "READ" not in out.pop("walk") and out.pop("quota").split()[:2] == ["stopped", "ENOSPC"]
  assert out.pop("runner") == ["bad_message"] + [0.5] * len(ESCAPES)  # the pickle never run; escapes scored honestly
  assert set(out.values()) == {"error"}, out  # each escape refused by the kernel
  canary.check()


def test_an_env_step_comes_back_as_plain_data_or_fails_saying_so():
  runner = EnvRunner(trusted=False, timeout_s=10.0, workers=1)
  try:
    env = model_code_rewards.CounterEnv()
    env.reset(Example(0, "train", (), (), "1", {}))
    first = runner.submit(env, "hello", [5]).result()
    assert first.ok and first.payload[1].observation == [1, 2] and not first.payload[1].done
    new = first.payload[0]
    assert type(new) is model_code_rewards.CounterEnv and vars(new) == {"turns": 1, "seen": ["hello"]}
    bad = model_code_rewards.CounterEnv()
    bad.reset(Example(0, "train", (), (), "1", {"tuple": True}))
    r = runner.submit(bad, "x", []).result()
    assert (r.ok, r.reason) == (False, "error") and "CounterEnv's state is not plain data" in r.error, r
  finally:
    runner.close()


def test_a_kernel_without_landlock_stops_the_run_unless_the_config_opts_out(monkeypatch, capsys):
  monkeypatch.setattr(isolation, "landlock_abi", lambda: 0)
  with pytest.raises(isolation.Unavailable, match="no Landlock.*task.allow_unsafe_sandbox=True runs without"):
    isolation.require(False)
  assert isolation.require(True) is True
  assert capsys.readouterr().err.startswith("jaxrl: UNSAFE sandbox (task.allow_unsafe_sandbox): the kernel has no")
  monkeypatch.undo()
  assert isolation.problem() is None and isolation.require(False) is False  # this kernel: Landlock ABI >= 1


def test_a_kernel_without_namespaces_is_refused_too():
  """A user namespace whose limits allow no further mount or user namespaces (as a kernel or container without them
  would): the start-up check names the refusal, so a run stops (exit 2) unless it opts out."""
  script = "from jaxrl.envs import isolation; print(isolation.problem())"
  limit = ("echo 0 > /proc/sys/user/max_mnt_namespaces && echo 0 > /proc/sys/user/max_user_namespaces && "
           'exec "$0" -c "$1"')
  proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", limit, sys.executable, script], cwd=REPO,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().startswith("the kernel refuses a private mount namespace"), proc.stdout


def test_the_cli_says_it_in_one_line_and_exits_2(tmp_path):
  code = ("import sys; from jaxrl import train; from jaxrl.envs import isolation; "
          "isolation.landlock_abi = lambda: 0; train.train = lambda config, workdir: isolation.require(False); "
          f"train.main(['jaxrl-train', '--config=configs/tiny.py', '--workdir={tmp_path}'])")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert lines[0].startswith("jaxrl-train: the sandbox for model-written code cannot isolate it: the kernel has no")
