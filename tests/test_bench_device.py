"""bench/device.sh runs end to end in its --dry_run mode (tiny shapes on the CPU) and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_device_script_dry_run_writes_dense_vs_paged_against_the_roofline(tmp_path):
  out = tmp_path / "device.json"
  env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
  env.pop("JAX_NUM_CPU_DEVICES", None)
  run = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), "--dry_run", f"--out={out}"], env=env,
                       capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  report = json.loads(out.read_text())
  dense, paged = report["dense"], report["paged"]
  assert report["kv_budget_bytes"] == report["sizes"]["dense_slots"] * report["sizes"]["max_len"] * \
      report["kv_bytes_per_token"]
  assert paged["slots"] == report["paged_slots"] > dense["slots"] == report["sizes"]["dense_slots"]
  for r in (dense, paged):
    assert r["live"] == r["slots"] and r["tokens_per_s"] > 0
    assert 0 < r["of_roofline"] == round(r["tokens_per_s"] / r["roofline_tokens_per_s"], 3)
  assert "paged / dense tokens/s" in run.stdout
  # The paged engine's attention on the CPU is the XLA path either way (on a GPU, "auto" is the Pallas kernel).
  assert paged["attention"] == report["paged_xla"]["attention"] == "xla" and report["kernel_over_xla"] > 0


def test_device_script_refuses_to_run_full_size_without_a_gpu(tmp_path):
  env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
  run = subprocess.run(["bash", str(ROOT / "bench" / "device.sh"), f"--out={tmp_path / 'x.json'}"], env=env,
                       capture_output=True, text=True, timeout=120)
  assert run.returncode != 0 and "needs a GPU" in run.stderr
