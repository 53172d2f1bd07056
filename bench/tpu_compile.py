"""docs/TPU.md's table: configs/tpu.py compiled by jaxrl-compile for TPU slices (deviceless: no TPU runs any of it),
then planned by jaxrl-plan on the compiled costs and on the model shape's roofline (configs/plan_tpu.py).

  python -m bench.tpu_compile            # compiles the rows whose report is missing, one at a time (RAM), then tables
  python -m bench.tpu_compile --table    # the table from the saved reports only
  python -m bench.tpu_compile --recount --hlo_root=DIR   # counted again from the HLO a run kept (--hlo_root=DIR)

Each row's report is bench/results/compile_<preset>_<target>.json (its command is in the table); the table is
bench/results/tpu_table.json. A compile of a 7B-70B model's programs takes 5-15 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# (preset, target, extra flags, name of a variant): configs/tpu.py's run, half of each slice sampling (whole hosts)
ROWS = [
    ("qwen2.5-0.5b", "v5e:2x2", ["--config.mesh.sampler_devices=2"], ""),
    ("qwen2.5-7b", "v5p:4x4x2", [], ""),
    ("qwen2.5-7b", "v5p:4x4x4", ["--config.mesh.sampler_devices=32"], ""),
    ("qwen3-32b", "v5p:8x8x2", ["--config.mesh.sampler_devices=64", "--config.mesh.sampler_axes.tensor=4"], ""),
    ("llama-3.1-70b", "v5p:4x4x2", ["--config.mesh.sampler_axes.tensor=4"], ""),
    ("llama-3.1-70b", "v5p:4x4x4", ["--config.mesh.sampler_devices=32", "--config.mesh.sampler_axes.tensor=4"], ""),
    ("qwen2.5-0.5b", "v5e:2x2", ["--config.mesh.sampler_devices=2", "--config.sampler.max_slots=32"], "32 slots"),
    ("qwen2.5-7b", "v5p:4x4x2", ["--config.sampler.kv=dense"], "dense KV"),
    ("qwen2.5-7b", "v5p:4x4x2", ["--config.model.train_attention=splash", "--config.sampler.kv=dense"],
     "splash, dense KV"),
]
GiB = 2**30


def report_path(preset: str, target: str, tag: str = "") -> Path:
  suffix = "_" + tag.replace(", ", "_").replace(" ", "-") if tag else ""
  return RESULTS / f"compile_{preset}_{target.replace(':', '-')}{suffix}.json"


def command(preset: str, target: str, extra: list[str], tag: str) -> list[str]:
  return ["jaxrl-compile", f"--config=configs/tpu.py:{preset}", f"--target={target}", *extra,
          f"--out={report_path(preset, target, tag).relative_to(REPO)}"]


def compile_row(preset: str, target: str, extra: list[str], tag: str, hlo_root: str | None) -> None:
  cmd = command(preset, target, extra, tag)
  print(" ".join(cmd), flush=True)
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  hlo = [f"--hlo_dir={hlo_root}/{report_path(preset, target, tag).stem}"] if hlo_root else []
  run = subprocess.run(["nice", "-n", "19", sys.executable, "-m", "jaxrl.compile", *cmd[1:], *hlo], cwd=REPO, env=env,
                       capture_output=True, text=True)
  print(run.stdout[-4000:], run.stderr.strip().splitlines()[-1] if run.returncode else "", flush=True)


def plan_row(path: Path, roofline: bool) -> dict:
  """jaxrl-plan's recommendation for the report's slice: the mode and its trained-token speedup over sync."""
  import importlib.util

  from jaxrl.sim import plan

  spec = importlib.util.spec_from_file_location("plan_tpu", REPO / "configs" / "plan_tpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  b = plan.build(module.get_config(f"{path.relative_to(REPO)}{',roofline' if roofline else ''}"))
  p = plan.run_plan(b)
  rec, best, costs = p.recommended, p.best, b["costs"]
  return dict(mode=rec.mode, pipeline_over_sync=rec.ratio,  # the best pipeline's trained tokens/s over sync's
              split=None if best is None else [best.sampler_devices, best.learner_devices],
              decode_weights_ms=1e3 * costs.decode.weights_s, engine_slots=costs.max_batch,
              train_tokens_per_s_per_chip=costs.train_tokens_per_s_per_device)


def row(preset: str, target: str, extra: list[str], tag: str) -> dict | None:
  path = report_path(preset, target, tag)
  if not path.exists():
    return None
  r = json.loads(path.read_text())
  programs = {p["name"]: p for p in r["programs"]}
  side = lambda s: max(p["memory"]["total"] for p in r["programs"] if p["side"] == s) / GiB  # noqa: E731
  sp = r["split"]
  out = dict(model=preset, target=target, chips=r["chips"],
             split=f"{sp['learner']}+{sp['sampler'] * sp['sampler_replicas']}",
             sampler_replicas=sp["sampler_replicas"], replica_chips=sp["sampler"], fits=r["fits"],
             learner_gib=side("learner"), sampler_gib=side("sampler"), variant=tag,
             command=" ".join(command(preset, target, extra, tag)))
  if r["fits"]:
    train = next(p for n, p in programs.items() if n.startswith("train_step"))
    decode = next(p for n, p in programs.items() if n.startswith("decode"))
    out.update(kernel_calls=train.get("kernel_calls", 0),
               kv_sequences={k: r["kv_capacity"][k] for k in ("4096", "16384", "32768")},
               learner_step_s=train["roofline"]["bound_s"],
               decode_step_s=decode["roofline"]["bound_s"] / decode["steps_per_call"],
               efficiency={k: v["ratio"] for k, v in r["efficiency"].items()},
               plan_compiled=plan_row(path, False), plan_roofline=plan_row(path, True))
  else:
    out["over"] = r["over"]
  return out


def label(r: dict) -> str:
  return r["model"] + (f" ({r['variant']})" if r["variant"] else "")


def recommendation(p: dict) -> str:
  if p["mode"] == "pipeline":
    return f"pipeline {p['pipeline_over_sync']:.2f}x at {p['split'][0]}+{p['split'][1]}"
  return f"sync (pipeline {p['pipeline_over_sync']:.2f}x)"


def markdown(rows: list[dict]) -> str:
  head = ("| model | target (chips) | learner + sampler chips | learner GiB/chip | sampler GiB/chip | KV sequences "
          "4k / 16k / 32k (per replica) | learner step s | decode step ms | planner: compiled costs | planner: "
          "roofline |\n|---|---|---|---|---|---|---|---|---|---|")
  lines = [head]
  for r in rows:
    name = label(r)
    if not r["fits"]:
      lines.append(f"| {name} | {r['target']} ({r['chips']}) | {r['split']} | {r['learner_gib']:.1f} | "
                   f"{r['sampler_gib']:.1f} | does not fit: {r['over']['program']} | | | | |")
      continue
    kv = " / ".join(str(r["kv_sequences"][k]) for k in ("4096", "16384", "32768"))
    n = r["sampler_replicas"]
    replicas = f"{n} replica{'s' if n > 1 else ''} of {r['replica_chips']}"
    kernel = " (without the kernel's own work)" if r["kernel_calls"] else ""
    lines.append(f"| {name} | {r['target']} ({r['chips']}) | {r['split']} ({replicas}) | "
                 f"{r['learner_gib']:.1f} | {r['sampler_gib']:.1f} | {kv} | {r['learner_step_s']:.2f}{kernel} | "
                 f"{1e3 * r['decode_step_s']:.1f} | {recommendation(r['plan_compiled'])} | "
                 f"{recommendation(r['plan_roofline'])} |")
  return "\n".join(lines)


def plan_markdown(rows: list[dict]) -> str:
  """docs/SIMULATOR.md's side by side: what the planner charges and recommends from the compiled programs and from
  the model shape's roofline, on the same chips and workload."""
  lines = ["| model | target | decode step, weight-read part ms (compiled / roofline) | slots per engine (compiled / "
           "roofline) | learner tokens/s per chip (compiled / roofline) | planner: compiled | planner: roofline |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    if not r["fits"]:
      continue
    c, f = r["plan_compiled"], r["plan_roofline"]
    lines.append(f"| {label(r)} | {r['target']} | {c['decode_weights_ms']:.1f} / "
                 f"{f['decode_weights_ms']:.1f} | {c['engine_slots']} / {f['engine_slots']} | "
                 f"{c['train_tokens_per_s_per_chip']:.0f} / {f['train_tokens_per_s_per_chip']:.0f} | "
                 f"{recommendation(c)} | {recommendation(f)} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="bench.tpu_compile")
  parser.add_argument("--table", action="store_true", help="only the table, from the saved reports")
  parser.add_argument("--hlo_root", help="keep each row's optimized HLO under this folder")
  parser.add_argument("--recount", action="store_true", help="count each saved report's programs again from the HLO "
                      "under --hlo_root (jaxrl.compile.recount), e.g. after a change to jaxrl.hlo")
  args = parser.parse_args(argv)
  if not args.table and not args.recount:
    for preset, target, extra, tag in ROWS:
      if not report_path(preset, target, tag).exists():
        compile_row(preset, target, extra, tag, args.hlo_root)
  if args.recount:
    from jaxrl.compile import recount

    for preset, target, _, tag in ROWS:
      path = report_path(preset, target, tag)
      if path.exists() and os.path.isdir(f"{args.hlo_root}/{path.stem}"):
        path.write_text(json.dumps(recount(json.loads(path.read_text()), f"{args.hlo_root}/{path.stem}"), indent=1,
                                   default=float))
  rows = [r for r in (row(*spec) for spec in ROWS) if r is not None]
  (RESULTS / "tpu_table.json").write_text(json.dumps(rows, indent=1))
  print(markdown(rows))
  print(plan_markdown(rows))
  for r in rows:
    print(f"{r['model']} {r['target']}: {r['command']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
