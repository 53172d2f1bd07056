"""A clean console: an entry point that loads a tokenizer (transformers) and the optional task packages prints only
its own lines; transformers' "PyTorch was not found" notice is silenced at its source (jaxrl/__init__.py)."""

import io
import os
import subprocess
import sys
from pathlib import Path

from jaxrl import console

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


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_the_first_minute_is_said_only_where_shown_with_a_bar_for_counts(capsys, monkeypatch):
  monkeypatch.setattr(console.time, "monotonic", iter(range(100)).__next__)  # each reading one second later
  buf = _Terminal()
  with console.shown(buf):
    with console.phase("loading"):
      pass
    tick = console.count("eval", 4)
    tick(1)
    tick(1)  # unchanged: not drawn again
    tick(4)
    console.note("training")
  assert buf.getvalue() == ("jaxrl: loading ... 1.0 s\n"
                            f"\rjaxrl: eval [{'.' * 24}] 0/4\rjaxrl: eval [{'#' * 6}{'.' * 18}] 1/4"
                            f"\rjaxrl: eval [{'#' * 24}] 4/4 1.0 s\njaxrl: training\n")
  with console.phase("loading"):  # not shown: a library call, a test
    console.count("eval", 4)(4)
    console.note("training")
  assert capsys.readouterr() == ("", "")
  assert console.for_terminal(True, buf) is buf
  assert console.for_terminal(False, buf) is None and console.for_terminal(True, io.StringIO()) is None


def test_a_shown_run_says_what_it_does_before_its_first_step(tmp_path):
  """Build, compile and the held-out eval, through the real run: one line or bar each."""
  from configs import tiny
  from jaxrl.config import override
  from jaxrl.train import train

  c = override(tiny.get_config("pipeline"), num_steps=1, **{"eval.num_examples": 4, "log.progress": False,
                                                            "log.tensorboard": False})
  buf = _Terminal()
  with console.shown(buf):
    train(c, tmp_path / "run")
  said = [line.rpartition("\r")[2] for line in buf.getvalue().split("\n")[:-1]]
  assert [line.split(" [")[0].split(" ...")[0] for line in said] == [
      "jaxrl: preparing task 'target_token' (prompts, the reward's self-check)",
      "jaxrl: compiling the train step for each batch shape",
      "jaxrl: held-out eval of version 0: greedy answers",
      "jaxrl: training to step 1 from step 0 (the first step includes compiling)",
      "jaxrl: held-out eval of version 1: greedy answers"], said
  assert said[2].endswith("] 4/4 " + said[2].rsplit(" ", 2)[1] + " s")
