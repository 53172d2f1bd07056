"""Kill campaign: SIGKILLs tiny runs at random points (inside sampling, training, weight publish, checkpoint save or
held-out eval, as tests/faults/kill_probe.py reports them) in each topology asked for, resumes each run with the
same command until it finishes, and checks that every run finished its steps and accounts for every rollout
(generated = trained + counted drops + discarded at resume + in flight at the end; no sample trained twice, every
group trained, dropped, skipped or pending, from the trace, in every topology) and that every step trained the
groups of an uninterrupted run of the same seed and topology. Sync runs must equal an uninterrupted run bit for bit
(the final checkpoint's array checksums). Writes the tally as JSON and, with --docs, into docs/RELIABILITY.md.

  JAX_NUM_CPU_DEVICES=8 python tests/faults/kill_campaign.py --topologies=sync,pipeline,mp2+2 --kills=20 --docs

Topologies: sync, pipeline (one process, one CPU device per role), mpL+S (a multi-process job of L learner and
S sampler processes, one CPU device each, through jaxrl.distributed.launch) and indS (a jaxrl-learner and S
independent jaxrl-sampler programs: --kills sampler kills, each replaced by a sampler joining mid-run, and
--learner_kills learner kills, each resumed while the samplers run on; independent_campaign.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]
import independent_campaign  # noqa: E402
from faults_util import CHILD_ENV, check_history, groups_per_step, read_trace  # noqa: E402

from jaxrl.distributed.launch import free_ports  # noqa: E402
from jaxrl.integrity import MARKER  # noqa: E402

STEPS = 8
SINGLE = {"num_steps": STEPS, "mesh.num_devices": 2, "mesh.sampler_devices": 1, "checkpoint.every_steps": 2,
          "checkpoint.max_to_keep": 2, "eval.num_examples": 4, "log.tensorboard": False, "log.progress": False}
LEARNER_PHASES = ("training", "publish", "checkpoint")
SAMPLER_PHASES = ("sampling", "publish")
ATTEMPT_TIMEOUT_S = 600


@dataclasses.dataclass
class Topology:
  name: str
  learners: int = 0  # 0: single-host
  samplers: int = 0

  @property
  def multi(self) -> bool:
    return self.learners > 0

  @classmethod
  def parse(cls, name: str) -> Topology:
    if name in ("sync", "pipeline"):
      return cls(name)
    m = re.fullmatch(r"mp(\d+)\+(\d+)", name)
    if not m:
      raise SystemExit(f"kill_campaign: unknown topology {name!r} (sync, pipeline or mpL+S, e.g. mp2+2)")
    return cls(name, int(m[1]), int(m[2]))

  def phases(self, process: int) -> tuple[str, ...]:
    """What `process` does (single-host: one process does all)."""
    if not self.multi:
      return ("sampling", "training", "publish", "checkpoint", "eval")
    if process < self.learners:
      return LEARNER_PHASES
    return SAMPLER_PHASES + (("eval",) if process == self.learners else ())

  def command(self, workdir: Path, overrides: dict) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in {**SINGLE, **overrides}.items() if k not in self._dropped()]
    if not self.multi:
      return [sys.executable, "-m", "kill_probe", f"--config=configs/tiny.py:{self.name}", f"--workdir={workdir}",
              *flags, "--config.log.trace=True"]
    return [sys.executable, "-m", "jaxrl.distributed.launch", f"--num_processes={self.learners + self.samplers}",
            "--devices_per_process=1", "--module=kill_probe", "--grace_s=60", "--",
            "--config=configs/tiny.py", f"--workdir={workdir}", *flags, "--config.log.trace=True",
            f"--config.mesh.sampler_devices={self.samplers}", "--heartbeat_timeout_s=5"]

  def _dropped(self) -> tuple[str, ...]:
    return ("mesh.num_devices", "mesh.sampler_devices") if self.multi else ()


def _env(probe_dir: Path, cache: Path, multi: bool) -> dict:
  return {**os.environ, **CHILD_ENV, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAXRL_PROBE_DIR": str(probe_dir),
          "JAXRL_PROBE": "distributed" if multi else "single",
          "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}


def _probe(probe_dir: Path, process: int) -> dict | None:
  try:
    return json.loads((probe_dir / f"{process}.json").read_text())
  except (FileNotFoundError, ValueError):
    return None


def _committed(workdir: Path) -> list[int]:
  d = workdir / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / MARKER).exists()) if d.is_dir() else []


def _attempt(topo: Topology, workdir: Path, log: Path, env: dict, probe_dir: Path,
             target: tuple[int, str, int] | None, overrides: dict) -> dict:
  """One attempt of a run; with a target (process, phase, n), SIGKILLs that process once it is inside the phase for
  the n-th time (or lets it finish if it never is). The outcome."""
  shutil.rmtree(probe_dir, ignore_errors=True)
  probe_dir.mkdir(parents=True)
  logged = log.stat().st_size if log.exists() else 0
  with open(log, "ab") as f:
    proc = subprocess.Popen(topo.command(workdir, overrides), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
  start = time.monotonic()
  out = {"committed_before": (_committed(workdir) or [None])[-1]}
  if target is not None:
    process, phase, nth = target
    out.update(process=process, phase=phase, nth=nth)
    while proc.poll() is None and time.monotonic() - start < ATTEMPT_TIMEOUT_S:
      probe = _probe(probe_dir, process)
      # The held-out eval samples too: a "sampling" kill waits for the training-time sampler (outside the eval).
      inside = probe and phase in probe["active"] and (phase != "sampling" or "eval" not in probe["active"])
      if inside and probe["entered"].get(phase, 0) >= nth:
        os.kill(probe["pid"], signal.SIGKILL)
        out.update(killed=True, seconds=round(time.monotonic() - start, 1))
        break
      time.sleep(0.005)
  try:
    out["code"] = proc.wait(timeout=max(1.0, ATTEMPT_TIMEOUT_S - (time.monotonic() - start)))
  except subprocess.TimeoutExpired:
    proc.kill()
    out["code"] = proc.wait()
    out["hung"] = True
  out["committed_after"] = (_committed(workdir) or [None])[-1]
  with open(log, "rb") as f:
    f.seek(logged)
    # The launcher's ports were free when it picked them, then taken (by another job, or a socket the kill left):
    # the job could not start; the campaign starts it again.
    out["port_taken"] = out["code"] != 0 and not out.get("killed") and b"Address already in use" in f.read()
  return out


def _check_run(topo: Topology, workdir: Path, reference: dict) -> dict:
  """Asserts a finished run's counts and history (every topology writes the trace); returns them, with whether
  each step trained the groups of the uninterrupted run and (sync) its final arrays equal that run's."""
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["steps"] == STEPS, f"{workdir}: {summary['steps']} steps of {STEPS}"
  led = summary["ledger"]
  dropped = sum(led["dropped"].values())
  unaccounted = (led["samples_generated"] - led["samples_trained"] - dropped - led["samples_discarded_at_resume"]
                 - summary["samples_in_flight"])
  counts = {"trained": led["samples_trained"], "dropped": dropped, "in_flight": summary["samples_in_flight"],
            "discarded_at_resume": led["samples_discarded_at_resume"], "unaccounted": unaccounted}
  events = read_trace(workdir / "trace.jsonl")
  counts.update(check_history(events, summary, group_size=4))
  counts["same_steps_as_uninterrupted"] = groups_per_step(events) == reference["steps"]
  if topo.name == "sync":
    final = json.loads((workdir / "checkpoints" / str(STEPS) / MARKER).read_text())["arrays"]
    counts["equals_uninterrupted"] = final == reference["arrays"]
  return counts


def campaign(topo: Topology, kills: int, out: Path, seed: int = 0, per_run: int = 4, log=print,
             cache: Path | None = None) -> dict:
  """Kills `kills` times (at most `per_run` kills per run, then the run finishes); returns the tally."""
  rng = random.Random(f"{topo.name}-{seed}")
  deck: list[tuple[int, str]] = []

  def next_target() -> tuple[int, str, int]:
    """Every (process, phase) pair once, in random order, then again: each phase is hit about as often."""
    if not deck:
      processes = range(topo.learners + topo.samplers) if topo.multi else [0]
      deck.extend((p, phase) for p in processes for phase in topo.phases(p))
      rng.shuffle(deck)
    process, phase = deck.pop()
    return process, phase, 1 if phase == "eval" else rng.randint(1, 3)  # eval: at a fresh start, at the end

  base = out / topo.name
  shutil.rmtree(base, ignore_errors=True)
  base.mkdir(parents=True)
  env = _env(base / "probe", cache or out / "xla_cache", topo.multi)
  # The uninterrupted run the killed ones must equal: the groups of every step (and in sync mode every array).
  ref = _attempt(topo, base / "reference", base / "reference.log", env, base / "probe", None, {})
  assert ref["code"] == 0, (base / "reference.log").read_text()[-3000:]
  reference = {"steps": groups_per_step(read_trace(base / "reference" / "trace.jsonl")),
               "arrays": json.loads((base / "reference" / "checkpoints" / str(STEPS) / MARKER).read_text())["arrays"]}
  tally = {"topology": topo.name, "kills": 0, "resumes": 0, "runs": 0, "attempts": [], "runs_checked": [],
           "phases": {}, "unaccounted": 0, "failures": [], "ports_taken": 0}
  t0 = time.monotonic()
  while tally["kills"] < kills:
    workdir = base / f"run{tally['runs']}"
    in_run = 0
    while True:
      kill = in_run < per_run and tally["kills"] < kills
      a = _attempt(topo, workdir, base / f"run{tally['runs']}.log", env, base / "probe",
                   next_target() if kill else None, {})
      tally["attempts"].append({"run": tally["runs"], **a})
      log(f"{topo.name} run {tally['runs']}: {a}")
      if a.get("killed"):
        tally["kills"] += 1
        tally["phases"][a["phase"]] = tally["phases"].get(a["phase"], 0) + 1
        in_run += 1
        continue
      if a["port_taken"]:
        tally["ports_taken"] += 1
        continue
      if a["code"] != 0:
        tally["failures"].append({"run": tally["runs"], **a})
        log(f"{topo.name} run {tally['runs']}: attempt failed with status {a['code']}; see {base}")
        return _finish(tally, t0)
      break
    try:
      counts = _check_run(topo, workdir, reference)
    except AssertionError as e:
      tally["failures"].append({"run": tally["runs"], "check": str(e)[:2000]})
      log(f"{topo.name} run {tally['runs']}: check failed: {e}")
      return _finish(tally, t0)
    tally["runs_checked"].append(counts)
    tally["unaccounted"] += counts["unaccounted"]
    tally["runs"] += 1
  return _finish(tally, t0)


def _finish(tally: dict, t0: float) -> dict:
  attempts = tally["attempts"]
  tally["resumes"] = sum(1 for a, b in itertools.pairwise(attempts) if a.get("killed") and a["run"] == b["run"])
  tally["seconds"] = round(time.monotonic() - t0)
  if any("equals_uninterrupted" in r for r in tally["runs_checked"]):
    tally["equal_to_uninterrupted"] = sum(r["equals_uninterrupted"] for r in tally["runs_checked"])
  tally["same_steps_as_uninterrupted"] = sum(r["same_steps_as_uninterrupted"] for r in tally["runs_checked"])
  return tally


def _docs_table(tallies: list[dict], load: str) -> str:
  rows = ["| topology | kills (by phase) | resumes | runs finished | rollouts unaccounted | samples discarded at "
          "resume (regenerated) | every step's groups as uninterrupted | arrays equal to uninterrupted | failures "
          "| minutes |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for t in tallies:
    phases = ", ".join(f"{k} {v}" for k, v in sorted(t["phases"].items()))
    equal = f"{t['equal_to_uninterrupted']} of {t['runs']}" if "equal_to_uninterrupted" in t else "n/a (scheduling)"
    same = "n/a (scheduling)" if t["same_steps_as_uninterrupted"] is None else (
        f"{t['same_steps_as_uninterrupted']} of {t['runs']}")
    discarded = sum(r["discarded_at_resume"] for r in t["runs_checked"])
    regenerated = sum(r["regenerated_groups"] for r in t["runs_checked"])
    rows.append(f"| {t['topology']} | {t['kills']} ({phases}) | {t['resumes']} | {t['runs']} | {t['unaccounted']} | "
                f"{discarded} ({regenerated} groups) | {same} | {equal} | "
                f"{len(t['failures'])} | {t['seconds'] / 60:.1f} |")
  return "\n".join(rows) + f"\n\nLoad when measured (`uptime`): {load}\n"


def write_docs(tallies: list[dict], load: str, path: Path = REPO / "docs" / "RELIABILITY.md") -> None:
  """Replaces the text between the campaign markers of docs/RELIABILITY.md with the tally."""
  text = path.read_text()
  begin, end = "<!-- kill-campaign:begin -->", "<!-- kill-campaign:end -->"
  if begin not in text:
    raise SystemExit(f"{path} has no {begin} ... {end} block")
  head, rest = text.split(begin, 1)
  _, tail = rest.split(end, 1)
  path.write_text(f"{head}{begin}\n{_docs_table(tallies, load)}{end}{tail}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--topologies", default="sync,pipeline,mp1+1,mp1+2,mp2+2")
  parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per topology")
  parser.add_argument("--per_run", type=int, default=4, help="kills per run before it may finish")
  parser.add_argument("--learner_kills", type=int, default=5, help="indS: learner kills (--kills: sampler kills)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="/tmp/jaxrl-kill-campaign", help="work folder (runs, logs, XLA cache)")
  parser.add_argument("--json", default=str(REPO / "bench" / "results" / "kill_campaign.json"))
  parser.add_argument("--docs", action="store_true", help="write the tally into docs/RELIABILITY.md")
  opts = parser.parse_args(argv)
  names = opts.topologies.split(",")
  topologies = [None if re.fullmatch(r"ind\d+", n) else Topology.parse(n) for n in names]
  out = Path(opts.out)
  out.mkdir(parents=True, exist_ok=True)
  tallies = []
  for name, topo in zip(names, topologies, strict=True):
    say = lambda s: print(s, flush=True)  # noqa: E731
    if topo is None:
      env = _env(out / "probe", out / "xla_cache", multi=False)
      tally = independent_campaign.campaign(int(name[3:]), opts.kills, opts.learner_kills, out, env, REPO,
                                            free_ports(1)[0], opts.seed, log=say)
    else:
      tally = campaign(topo, opts.kills, out, opts.seed, opts.per_run, log=say)
    tallies.append(tally)
    print(json.dumps({k: v for k, v in tally.items() if k != "attempts"}), flush=True)
    Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    Path(opts.json).write_text(json.dumps({"load": load, "tallies": tallies}, indent=1))
    if opts.docs:
      write_docs(tallies, load)
  differ = lambda t: t["same_steps_as_uninterrupted"] is not None and t["same_steps_as_uninterrupted"] < t["runs"]  # noqa: E731
  return 1 if any(t["failures"] or t["unaccounted"] or differ(t) for t in tallies) else 0


if __name__ == "__main__":
  sys.exit(main())
