"""What the hardened reward runner costs: scoring throughput of this tree's RewardRunner (data-only results,
Landlock + private tmpfs sandbox, the parent's CPU watchdog) against the runner of an older commit (pickled
results, the audit-hook-only sandbox), on the same items.

    .venv/bin/python -m bench.reward_runner                     # against 00ea827 (before issue 52)
    .venv/bin/python -m bench.reward_runner --rounds 3 --items 300

Two package trees cannot share one process (both are `jaxrl`), so each measurement is a fresh child process
importing one tree (`git archive` of the old commit, or this checkout); each round runs old and new back to back,
alternating which goes first, and the figure is the median of the rounds' new/old ratios (other load on the box
moves it least). Rewards: countdown and math_verify (sandboxed workers, varied items so no cache answers), and
exact_answer (the main job's reward, configs/default.py: inline, the same code path in both: its ratio shows the
noise). The sandboxed two run in this tree both ways: "new", every item in the worker's one confined process
(task.reward_process_per_item=False), and "per_item", a fork of the worker per item that holds no pipe to the trainer
(the default since issue 52), on a quarter of the items. Writes bench/results/reward_runner.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
REWARDS = ("countdown", "math_verify", "exact_answer")
SANDBOXED = ("countdown", "math_verify")  # also measured with SandboxLimits(process_per_item=True)


def items(reward: str, n: int) -> list:
  out = []
  for i in range(n):
    a, b, c = 2 + i % 7, 3 + i % 11, 5 + i % 13
    if reward == "countdown":
      out.append(("p", f"<answer>{a} * {b} + {c}</answer>", {"numbers": [a, b, c], "target": a * b + c - i % 2}))
    elif reward == "math_verify":
      out.append(("p", f"The answer is $\\frac{{{a * b}}}{{{b * c}}}$", {"answer": f"\\frac{{{a}}}{{{c + i % 2}}}"}))
    else:
      out.append(("p", f"So the answer is <answer>{a * b + i}</answer>.", {"answer": str(a * b + i - i % 2)}))
  return out


def child(reward: str, n: int, workers: int, per_item: bool | None = None) -> None:
  """Runs in a fresh process whose sys.path starts with the tree to measure: items scored per second. per_item:
  None, the tree's own default (the old tree has no such choice); else the sandbox scores each item in a process of
  its own (True, this tree's default) or every item in the worker's one confined process (False)."""
  import jaxrl
  from jaxrl.envs import RewardRunner

  work = items(reward, n)
  kw = {}
  if per_item is not None:
    from jaxrl.envs.sandbox import SandboxLimits

    kw = {"sandbox": SandboxLimits(process_per_item=per_item)}
  with RewardRunner(reward, workers=workers, **kw) as runner:
    runner.score(work[:20])  # warm: imports, first parses
    t0 = time.perf_counter()
    results = runner.score(work)
    seconds = time.perf_counter() - t0
  values = [r.value for r in results]
  print(json.dumps({"items_per_s": n / seconds, "ok": sum(r.ok for r in results), "mean": sum(values) / n,
                    "tree": str(pathlib.Path(jaxrl.__file__).parents[1])}))


def measure(tree: pathlib.Path, reward: str, n: int, workers: int, per_item: bool | None = None) -> dict:
  code = (f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT)!r}); "
          f"from bench.reward_runner import child; child({reward!r}, {n}, {workers}, {per_item})")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tree, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--old", default="00ea827", help="the commit to compare against")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--items", type=int, default=400)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--out", default=str(ROOT / "bench/results/reward_runner.json"))
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as tmp:
    old = pathlib.Path(tmp)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "jaxrl"], capture_output=True, check=True)
    with tarfile.open(fileobj=__import__("io").BytesIO(archive.stdout)) as tar:
      tar.extractall(old, filter="data")
    report = {"old": args.old, "items": args.items, "workers": args.workers, "rounds": args.rounds, "rewards": {}}
    for reward in REWARDS:
      names = ("old", "new", "per_item") if reward in SANDBOXED else ("old", "new")
      runs = {name: [] for name in names}
      for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
          n = args.items * (20 if reward == "exact_answer" else 1)  # inline: microseconds an item
          n = n // 4 if name == "per_item" else n  # a fork an item: slower
          per_item = None if name == "old" or reward not in SANDBOXED else name == "per_item"
          m = measure(old if name == "old" else ROOT, reward, n, args.workers, per_item)
          assert m["tree"] == str(old if name == "old" else ROOT), m
          runs[name].append(m)
      med = {k: statistics.median(m["items_per_s"] for m in v) for k, v in runs.items()}
      # Each round's runs ran back to back: the median of the rounds' ratios is what other load on the box moves least
      paired = {k: statistics.median(m["items_per_s"] / o["items_per_s"] for o, m in zip(runs["old"], v, strict=True))
                for k, v in runs.items() if k != "old"}
      assert runs["old"][0]["mean"] == runs["new"][0]["mean"], "the two runners score differently"
      report["rewards"][reward] = {"old_items_per_s": med["old"], "new_items_per_s": med["new"],
                                   "new_over_old": paired["new"], "ratio_of_medians": med["new"] / med["old"],
                                   "all": {k: [m["items_per_s"] for m in v] for k, v in runs.items()}}
      line = (f"{reward:>13}: old {med['old']:8.0f} items/s  new {med['new']:8.0f} items/s  "
              f"new/old {paired['new']:.3f}")
      if "per_item" in paired:
        report["rewards"][reward].update(per_item_items_per_s=med["per_item"], per_item_over_old=paired["per_item"])
        line += f"  process_per_item/old {paired['per_item']:.3f}"
      print(f"{line} (median of {args.rounds} rounds)", flush=True)
  from bench.common import write_json
  write_json(args.out, report)


if __name__ == "__main__":
  main()
