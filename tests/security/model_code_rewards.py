"""Reward fns and an env for tests/security/test_model_code.py, importable by the runner's worker processes: each
runs what a model wrote the way a real scorer or tool does, and scores it honestly from what trusted code knows."""

import sys

from jaxrl.envs.env import Env, Turn
from jaxrl.envs.sandbox import SandboxLimits, run_code


def exec_then_honest(prompt, completion, meta):
  """Runs the completion inside the scorer's own process (as sympy's parse_expr runs a model's text), then scores
  meta["score"]: what an honest scorer says, whatever the completion did or tried."""
  try:
    exec(completion, {"__name__": "completion"})
  except Exception as e:  # noqa: BLE001 - the completion's failure is not the scorer's
    print(f"completion failed: {type(e).__name__}: {e}", file=sys.stderr)
  return float(meta["score"])


def run_then_compare(prompt, completion, meta):
  """Runs the completion as a program (run_code: a fresh sandboxed process) and scores 1 if it exited cleanly and
  printed meta["expected"]: trusted code reads its output and decides."""
  r = run_code(completion, SandboxLimits(cpu_s=1, memory_mb=256, file_mb=1), timeout_s=10.0)
  return float(r.ok and r.stdout.strip() == meta["expected"])


class CounterEnv(Env):
  """An untrusted env whose state is plain data, or, with meta {"tuple": True}, holds a tuple (not plain data)."""

  max_turns = 3

  def reset(self, example):
    self.turns, self.seen = 0, ((),) if example.meta.get("tuple") else []
    return ()

  def step(self, text, ids):
    self.turns += 1
    self.seen = self.seen + [text] if isinstance(self.seen, list) else self.seen
    return Turn(observation=[1, 2], done=self.turns == 2, reward=1.0 if self.turns == 2 else None)
