"""Configs load, validate, document their launch command; bad configs fail with one clear line before work starts."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl import config as config_lib

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = ["tiny", "default", "calculator", "guess", "reasoning"]


def _load(name):
  spec = importlib.util.spec_from_file_location(name, REPO / "configs" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name", TRAIN_CONFIGS)
def test_config_validates_and_documents_its_launch_command(name, tmp_path):
  module = _load(name)
  assert f"jaxrl-train --config=configs/{name}.py" in module.__doc__
  for arg in (None, "sync", "pipeline"):
    c = module.get_config(arg)
    config_lib.validate(c, tmp_path, num_devices=8)
    assert c.mode == (arg or "pipeline")


def test_the_long_reasoning_variant_gives_256_tokens_to_think_in_every_mode(tmp_path):
  module = _load("reasoning")
  base = module.get_config("sync")
  for arg, mode in (("long", "pipeline"), ("sync,long", "sync"), ("long,auto", "auto")):
    c = module.get_config(arg)
    config_lib.validate(c, tmp_path, num_devices=8)
    assert c.mode == mode and c.sampler.max_new_tokens == c.eval.max_new_tokens == 256
    assert c.sampler.max_len == c.rl.seq_len == 320 and c.task.kwargs.to_dict() == base.task.kwargs.to_dict()
  with pytest.raises(ValueError, match="unknown argument 'longer'"):
    module.get_config("sync,longer")


def test_every_base_field_is_commented():
  source = (REPO / "jaxrl" / "config.py").read_text()
  body = source[source.index("def base()") : source.index("def validate(")]
  for line in body.splitlines():
    if re.match(r"\s+c\.\w+(\.\w+)* = ", line) and "ConfigDict()" not in line and "ConfigDict(dict(" not in line:
      assert "#" in line or line.rstrip().endswith(("(", ",")), f"undocumented config field: {line.strip()}"


@pytest.mark.parametrize("override, message", [
    ({"num_steps": 0}, "num_steps"),
    ({"rl.max_staleness": -1}, "max_staleness"),
    ({"rl.group_size": 0}, "group_size"),
    ({"mesh.sampler_devices": 8}, "leaves no learner"),
    ({"mesh.num_devices": 16}, "devices exist"),
    ({"mode": "async"}, "mode"),
    ({"sampler.max_new_tokens": 48}, "no room for a prompt"),
    ({"model.source": "/no/such/model"}, "neither"),
    ({"sampler.dtype": "fp16"}, "sampler.dtype"),
    ({"rl.max_segments": 0}, "rl.max_segments must be an int >= 1"),
    ({"model.train_attention": "flash"}, "model.train_attention='flash'; allowed"),
    ({"model.remat_policy": "some"}, "model.remat_policy='some'; allowed"),
])
def test_bad_values_raise_config_error(override, message, tmp_path):
  c = _load("tiny").get_config()
  config_lib.override(c, **override)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(c, tmp_path, num_devices=8)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(config_lib.ConfigError, match="not writable"):
    config_lib.validate(_load("tiny").get_config(), blocker / "sub", num_devices=8)


@pytest.mark.parametrize("flag, message", [
    ("--config.no_such_key=1", "no_such_key"),
    ("--config.num_steps=abc", "num_steps"),
    ("--config.rl.max_staleness=-2", "max_staleness"),
    ("--config.rl.on_stale=keep", "--config.rl.on_stale was removed: batch assembly is deadline-based"),
    ("--config.rl.max_staleness=often", "max_staleness"),  # a string reaches validation: "auto" is the one allowed
])
def test_cli_rejects_bad_flags_with_one_clear_line(flag, message, tmp_path):
  cmd = [sys.executable, "-m", "jaxrl.train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'w'}", flag]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert message in out.stderr
  assert "Traceback" not in out.stderr
  assert not (tmp_path / "w" / "checkpoints").exists()  # nothing started


def test_override_sets_dotted_fields_and_names_a_missing_one():
  c = _load("tiny").get_config()
  assert config_lib.override(c, rl__max_staleness=3, **{"sampler.max_slots": 5}) is c
  assert (c.rl.max_staleness, c.sampler.max_slots) == (3, 5)
  with pytest.raises(config_lib.ConfigError, match="no field 'rl.max_stalenes'"):
    config_lib.override(c, rl__max_stalenes=2)
  with pytest.raises(config_lib.ConfigError, match="no field 'num_steps.x'"):
    config_lib.override(c, **{"num_steps.x": 2})
  with pytest.raises(TypeError):  # ConfigDict still checks the type
    config_lib.override(c, num_steps="many")


def test_a_removed_setting_is_an_error_that_says_what_replaced_it(tmp_path):
  c = _load("tiny").get_config()
  with pytest.raises(config_lib.ConfigError, match=r"rl.on_stale was removed: .* no group is dropped for staleness"):
    config_lib.override(c, rl__on_stale="drop")
  c.rl.on_stale = "keep"  # a config file that still sets it
  with pytest.raises(config_lib.ConfigError, match="rl.on_stale was removed: batch assembly is deadline-based"):
    config_lib.validate(c, tmp_path, num_devices=8)


def test_every_cli_module_imports_next_to_the_others():
  """Console scripts share absl's global FLAGS: importing them all in one process (a notebook, a test session) must
  define no flag twice."""
  import tomllib

  scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
  modules = sorted({t.split(":")[0] for t in scripts.values()} | {"bench.pipeline", "jaxrl.distributed.job"})
  code = ("import importlib, sys\nfor m in sys.argv[1:]:\n  importlib.import_module(m)\n"
          "print('imported', len(sys.argv) - 1)")
  out = subprocess.run([sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == f"imported {len(modules)}"


@pytest.mark.parametrize("name", ["default", "calculator", "guess", "reasoning"])
def test_config_has_the_held_out_examples_its_eval_asks_for(name):
  """A task too small for eval.num_examples is a ConfigError at build (build_task), before any params load."""
  from jaxrl.envs import make_task

  c = _load(name).get_config()
  task = make_task(c.task.name, c.seed, **c.task.kwargs.to_dict())
  assert len(task.eval_examples(c.eval.num_examples)) == c.eval.num_examples


def test_a_task_too_small_for_the_eval_is_a_config_error_at_build(smollm2_dir):
  from transformers import AutoTokenizer

  from jaxrl.controller import build as build_lib
  from jaxrl.models import ModelConfig

  c = _load("guess").get_config()
  c.task.kwargs.max_high = 8  # 8 problems (secret in 1..8), a quarter held out: 2 for an eval of 96
  message = r"task 'guess': guess: only \d+ distinct held-out problems found, 96 asked"
  with pytest.raises(config_lib.ConfigError, match=message):
    cfg = config_lib.validate(c)
    build_lib.build_task(cfg.task, cfg.seed, cfg.eval.num_examples, AutoTokenizer.from_pretrained(smollm2_dir),
                         ModelConfig.tiny())
