"""docs/TPU.md's paged decode figures: only the sampler's decode program of configs/tpu.py compiled for a TPU slice
(deviceless: no TPU runs it; jaxrl.compile.compile_decode), its bytes per step against its weights and KV read once,
beside the same figure of the whole run's report in bench/results (compiled before the paged pool's fix).

  python -m bench.tpu_decode                  # every row below; bench/results/tpu_decode_<preset>_<target>.json
  python -m bench.tpu_decode --row=1          # one row

A row compiles in 1-10 minutes on the shared 2-core box (the whole run's compile: 5-15).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.tpu_compile import report_path
from jaxrl import platforms

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# (preset, target, config overrides, variant): the paged rows of bench/tpu_compile.py's table
DECODE_ROWS = [
    ("qwen2.5-0.5b", "v5e:2x2", {"mesh.sampler_devices": 2, "sampler.max_slots": 32}, "32 slots"),
    ("qwen2.5-0.5b", "v5e:2x2", {"mesh.sampler_devices": 2}, ""),
    ("qwen2.5-7b", "v5p:4x4x2", {}, ""),
]


def decode_row(preset: str, target: str, overrides: dict, tag: str) -> dict:
  import importlib.util

  from jaxrl import compile as compile_lib
  from jaxrl import config as config_lib

  spec = importlib.util.spec_from_file_location("tpu", REPO / "configs" / "tpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  out = compile_lib.compile_decode(config_lib.override(module.get_config(preset), **overrides), target)
  before = json.loads(report_path(preset, target, tag).read_text()).get("efficiency", {}).get("decode_bytes")
  out.update(preset=preset, variant=tag, overrides=overrides, before=before)
  name = f"tpu_decode_{preset}_{target.replace(':', '-')}{'_' + tag.replace(' ', '-') if tag else ''}.json"
  (RESULTS / name).write_text(json.dumps(out, indent=1, default=float))
  was = f"{before['ratio']:.2f}x" if before else "no figure: the run did not fit"
  print(f"{preset} {target} {tag}: decode bytes per step {out['decode_bytes']['per_step']:.3e} = "
        f"{out['decode_bytes']['ratio']:.2f}x the ideal (whole-run report before the fix: {was}); decode "
        f"{out['program']['memory']['total'] / 2**30:.2f} GiB per chip, fits: {out['program']['fits']}", flush=True)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--row", type=int, default=None, help="index into DECODE_ROWS (default: all)")
  args = parser.parse_args()
  platforms.skip_tpu_probe()
  for i, row in enumerate(DECODE_ROWS):
    if args.row is None or args.row == i:
      decode_row(*row)


if __name__ == "__main__":
  main()
