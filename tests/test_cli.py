"""The command line takes every setting in each type it declares (jaxrl.settings), and --help on every entry point
prints its flags and exits 0."""

import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
from absl import flags
from ml_collections import config_flags

from jaxrl import config as config_lib
from jaxrl import settings

REPO = Path(__file__).resolve().parents[1]


def _declared(section=settings.RunConfig, prefix=""):
  """(dotted name, declared type) of every setting (sections walked, the loss's fields included)."""
  hints = typing.get_type_hints(section)
  for f in dataclasses.fields(section):
    t = hints[f.name]
    if dataclasses.is_dataclass(t):
      yield from _declared(t, f"{prefix}{f.name}.")
    else:
      yield prefix + f.name, t


def _samples(t, default):
  """A value of each type `t` declares (its default where it is of that type), as (python value, flag text)."""
  members = typing.get_args(t) if isinstance(t, types.UnionType) else (t,)
  out = []
  for m in members:
    if m is type(None):
      out.append((None, "None"))
    elif m is bool:
      out.append((not default, str(not default)))
    elif m is int:
      v = default if type(default) is int else 2
      out.append((v, str(v)))
    elif m is float:
      v = default if type(default) is float else 0.5
      out.append((v, repr(v)))
    elif m is str:
      v = default if isinstance(default, str) else "auto"
      out.append((v, v))
    elif typing.get_origin(m) is tuple:
      v = tuple(default) if default else ((1,) if typing.get_args(m)[0] is int else ("jsonl",))
      out.append((v, repr(v)))
  return out


def _parsed(flag_text: str, name: str):
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=values)
  config_lib.parse_cli("test", ["test", "--config=configs/tiny.py", f"--config.{name}={flag_text}"], values)
  node = values.config
  for part in name.split("."):
    node = node[part]
  return node


def test_every_setting_takes_each_declared_type_on_the_command_line(monkeypatch):
  monkeypatch.chdir(REPO)
  defaults = {s.name: s.default for s in settings.SETTINGS}
  checked = 0
  for name, declared in _declared():
    if declared is settings.Frozen or name not in defaults:  # a section of options: its keys are set one by one
      continue
    for value, text in _samples(declared, defaults[name]):
      got = _parsed(text, name)
      assert got == value and type(got) is type(value), (name, declared, text, got)
      checked += 1
  assert checked >= len(settings.SETTINGS)  # a union's every member counted
  assert _parsed("0.5", "mesh.sampler_devices") == 0.5  # a fraction of the pool, as declared (refused before)
  assert _parsed("3", "mesh.learner_axes.fsdp") == 3  # a key of an options section


@pytest.mark.parametrize("module, prog, flag", [
    ("jaxrl.train", "jaxrl-train", "--workdir"), ("jaxrl.distributed.learner_main", "jaxrl-learner", "--bind"),
    ("jaxrl.distributed.sampler_main", "jaxrl-sampler", "--learner"), ("jaxrl.compile", "jaxrl-compile", "--target")])
def test_help_prints_the_programs_flags_and_exits_0(module, prog, flag):
  out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith(f"usage: {prog} ") and f"  {flag}: " in out.stdout and "--config_help" in out.stdout
