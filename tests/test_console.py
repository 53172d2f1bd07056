"""A clean console: an entry point that loads a tokenizer (transformers) and the optional task packages prints only
its own lines; transformers' "PyTorch was not found" notice is silenced at its source (jaxrl/__init__.py)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_cli_error_after_loading_the_tokenizer_is_its_one_line(tmp_path, smollm2_dir):
  env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}  # as a user's shell
  args = [sys.executable, "-m", "jaxrl.train", "--config=configs/reasoning.py", f"--workdir={tmp_path / 'w'}",
          f"--config.model.source={smollm2_dir}", "--config.task.kwargs.dataset=no_such_generator"]
  out = subprocess.run(args, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 2
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, out.stderr
  assert lines[0].startswith("jaxrl-train: task 'reasoning_gym': reasoning_gym: unknown generator(s) "
                             "['no_such_generator'] in task.kwargs.dataset; known: ")


def test_importing_transformers_after_jaxrl_prints_nothing():
  env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
  code = "import jaxrl.envs, transformers; transformers.AutoTokenizer; import math_verify, reasoning_gym, datasets"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stderr == "" and out.stdout == ""
  without = subprocess.run([sys.executable, "-c", "import transformers; transformers.AutoTokenizer"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300)
  assert "PyTorch was not found" in without.stderr  # what the switch silences: the test would see a regression
