"""jaxrl-compile: a real model's every program compiled by the TPU compiler (libtpu, deviceless) for a v5e:2x2 slice
split 2 + 2, its per-chip memory and counts checked against the model; an oversized model exits 2 with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.models.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
SPLIT = ["--config.mesh.num_devices=-1", "--config.mesh.sampler_devices=2"]


def jaxrl_compile(*flags, cwd=REPO) -> subprocess.CompletedProcess:
  # As a user runs it: XLA's default optimisations (not the suite's CPU setting), no compilation cache.
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  return subprocess.run([sys.executable, "-m", "jaxrl.compile", "--config=configs/default.py", *flags], cwd=cwd,
                        env=env | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(600)  # 38 s on the quiet 2-core box, up to 330 s beside other jobs' compiles (docs/TPU.md)
def test_qwen25_05b_fits_v5e_2x2_every_program_compiled(tmp_path):
  out = tmp_path / "report.json"
  run = jaxrl_compile("--target=v5e:2x2", "--config.model.preset=qwen2.5-0.5b", *SPLIT, f"--out={out}")
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip().splitlines()[-1].startswith("fits: every program")
  report = json.loads(out.read_text())
  assert report["fits"] and report["split"]["learner"] == 2 and report["split"]["sampler"] == 2
  programs = {p["name"]: p for p in report["programs"]}
  # configs/default.py: dense KV of 80 positions, prompts of <= 56 tokens (bucket 64), in-flight recompute
  assert set(programs) == {"train_step", "publish_cast", "prefill[64]", "insert_group", "decode", "recompute[80]",
                           "publish_receive"}
  assert all(p["compiled"] and p["fits"] for name, p in programs.items() if name != "publish_receive")
  count = report["model"]["param_count"]
  assert abs(count / 0.494e9 - 1) < 0.01
  # FSDP over the 2 learner chips: each holds half of the float32 params, and twice that of Adam moments
  train = programs["train_step"]["memory"]
  assert train["params"] == pytest.approx(count * 4 / 2, rel=0.02)
  assert train["opt_state"] == pytest.approx(2 * count * 4 / 2, rel=0.02)
  # The sampler's 2 chips each hold the bf16 weights whole (data parallel over slots); a decode step's matmuls are
  # 2 FLOPs per weight (the tied head included, not the embedding lookup) for each of the chip's 8 of 16 slots
  assert programs["decode"]["memory"]["params"] == pytest.approx(count * 2, rel=0.02)
  embed = PRESETS["qwen2.5-0.5b"]["vocab_size"] * PRESETS["qwen2.5-0.5b"]["hidden_size"]
  per_step = programs["decode"]["flops"] / programs["decode"]["steps_per_call"]
  assert per_step == pytest.approx(2 * count * 8, rel=0.03)
  assert per_step > 2 * (count - embed) * 8
  efficiency = report["efficiency"]
  assert 1.0 <= efficiency["decode_bytes"]["ratio"] < 1.5  # never below the weights it must read
  assert 0.8 < efficiency["train_flops"]["ratio"] < 1.5


def test_llama_70b_on_v5e_2x2_exits_2_with_one_line_naming_hbm():
  run = jaxrl_compile("--target=v5e:2x2", "--config.model.preset=llama-3.1-70b", *SPLIT)
  assert run.returncode == 2
  lines = run.stderr.strip().splitlines()
  assert len(lines) == 1, run.stderr
  assert lines[0].startswith("jaxrl-compile: train_step needs ") and "over v5e:2x2's 16 GiB HBM" in lines[0]
  assert "learner chips" in lines[0] and "model.lora.enabled=True" in lines[0]


@pytest.mark.parametrize("target, error", [
    ("v4:2x2", "a TPU topology like 'v5e:2x2'"),
    ("v5e:two", "a TPU topology like 'v5e:2x2'"),
    ("gpu:h100x8", "needs a CUDA jaxlib plugin"),
])
def test_a_bad_target_is_one_line(target, error):
  run = jaxrl_compile(f"--target={target}", "--config.model.preset=qwen2.5-0.5b", *SPLIT)
  assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and error in run.stderr


def test_a_multi_host_slice_splits_as_jaxrl_distributed_does():
  """configs/tpu.py on v5p:4x4x2 (32 chips, 8 hosts of 4): half the hosts learn (one FSDP mesh over 16 chips), each
  of the other 4 hosts is one sampler replica; a split through a host is refused, as the launcher refuses it."""
  import importlib.util

  from jaxrl import compile as compile_lib
  from jaxrl import config as config_lib

  spec = importlib.util.spec_from_file_location("tpu", REPO / "configs" / "tpu.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  target = compile_lib.target("v5p:4x4x2")
  assert len(target.devices) == 32 and target.chip.name == "tpu_v5p"
  c = config_lib.validate(module.get_config(), num_devices=32)
  roles = compile_lib.split(c, target.devices)
  assert len(roles.learner_devices) == 16 and len({d.process_index for d in roles.learner_devices}) == 4
  assert [len(r) for r in roles.sampler_devices] == [4, 4, 4, 4]
  assert all(len({d.process_index for d in r}) == 1 for r in roles.sampler_devices)
  with pytest.raises(compile_lib.CompileError, match="6 on 32 chips of 8 hosts: .* cuts through a process"):
    compile_lib.split(config_lib.replace(c, mesh__sampler_devices=6), target.devices)
