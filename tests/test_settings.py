"""jaxrl.settings: every setting declared once, base() made of exactly those, each one's check."""

import re

import ml_collections
import pytest

from jaxrl import config as config_lib
from jaxrl.settings import SETTINGS, Setting


def _leaves(c, prefix=""):
  out = {}
  for k in c.keys():
    v = c[k]
    path = prefix + k
    if isinstance(v, ml_collections.ConfigDict) and path not in {s.name for s in SETTINGS}:
      out.update(_leaves(v, path + "."))
    else:
      out[path] = v
  return out


def test_every_setting_is_declared_once_and_base_holds_exactly_them_at_their_defaults():
  names = [s.name for s in SETTINGS]
  assert len(names) == len(set(names))
  leaves = _leaves(config_lib.base())
  assert sorted(leaves) == sorted(names)
  for s in SETTINGS:
    value = leaves[s.name]
    assert (value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value) == s.default, s.name
    assert s.error(s.default) is None, s.name


def test_each_kind_names_the_setting_and_what_it_must_be():
  assert Setting("a.n", 1, "", "int", lo=1).error(0) == "a.n must be an int >= 1 (got 0)"
  assert Setting("a.n", 1, "", "int", lo=1).error(True) == "a.n must be an int >= 1 (got True)"
  positive = Setting("a.x", 1.0, "", "real", ok=lambda v: v > 0, what="> 0")
  assert positive.error(float("nan")) == "a.x must be a number > 0 (got nan)"
  assert Setting("a.b", True, "", "bool").error(1) == "a.b must be True or False (got 1)"
  assert Setting("a.c", "x", "", "choice", choices=("x", "y")).error("z") == "a.c='z'; allowed: ('x', 'y')"
  assert Setting("a.c", "x", "", "choice", choices=("x", "y")).error("y") is None


@pytest.mark.parametrize("name, value, message", [
    ("sampler.on_update", "drop", "sampler.on_update='drop'; allowed: ('recompute', 'finish', 'keep_kv')"),
    ("rl.queue_groups", 0, "rl.queue_groups must be an int >= 1 (got 0)"),
    ("sampler.top_p", 1.5, "sampler.top_p must be a number in (0, 1] (got 1.5)"),
])
def test_validate_reports_the_schema_error(name, value, message):
  c = config_lib.override(config_lib.base(), **{name: value})
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    config_lib.validate(c)


def test_config_help_lists_every_setting_with_its_default_values_and_meaning(capsys):
  from absl import flags

  with pytest.raises(SystemExit) as exit_:
    config_lib.parse_cli("jaxrl-train", ["jaxrl-train", "--config_help"], flags.FlagValues())
  assert exit_.value.code == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == len(SETTINGS)
  for line, s in zip(lines, SETTINGS, strict=True):
    assert line == f"--config.{s.name}={s.default!r}  [{s.allowed()}]  {s.doc}"
  assert "--config.rl.max_staleness=1  [" in "\n".join(lines)



def _fields(section, prefix=""):
  """Every leaf of the typed declaration, by dotted name, walking the dataclasses themselves (a field holding a
  dataclass, LossConfig.sampling, is filled from other settings)."""
  import dataclasses

  out = []
  for f in dataclasses.fields(section):
    if "section" in f.metadata:
      out += _fields(f.metadata["section"], f"{prefix}{f.name}.")
    elif not dataclasses.is_dataclass(f.default):
      out.append(prefix + f.name)
  return out


def test_settings_are_the_typed_declaration_and_base_has_exactly_their_keys():
  from jaxrl.settings import RunConfig

  assert [s.name for s in SETTINGS] == _fields(RunConfig)
  assert sorted(_leaves(config_lib.base())) == sorted(_fields(RunConfig))
  assert config_lib.help_text().splitlines()[0].startswith("--config.seed=0  [an int >= 0]")


def test_validate_returns_a_frozen_typed_run_config_at_the_defaults():
  import dataclasses
  import pickle

  from jaxrl.learner.config import LossConfig
  from jaxrl.settings import RL, RunConfig

  cfg = config_lib.validate(config_lib.base())
  assert cfg == RunConfig()
  assert type(cfg.rl) is RL and cfg.rl.group_size == 4
  assert isinstance(cfg.loss, LossConfig) and cfg.loss.proximal == "recompute" and cfg.loss.dual_clip == 3.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.rl.group_size = 8
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.seed = 1
  with pytest.raises(TypeError, match="read-only"):
    cfg.mesh.learner_axes["fsdp"] = 2
  assert pickle.loads(pickle.dumps(cfg)) == cfg
  assert config_lib.validate(cfg) == cfg  # a RunConfig is checked again and comes back the same


def test_validate_carries_the_configs_values_into_the_typed_sections():
  c = config_lib.override(config_lib.base(), seed=3, rl__group_size=2, sampler__temperature=0.5,
                          **{"loss.clip_high": 0.3, "log.backends": ["jsonl"], "task.kwargs": {"digits": 2}})
  cfg = config_lib.validate(c)
  assert (cfg.seed, cfg.rl.group_size, cfg.loss.clip_high, cfg.log.backends) == (3, 2, 0.3, ("jsonl",))
  assert cfg.loss.sampling.temperature == 0.5  # the learner scores at the sampler's temperature
  assert dict(cfg.task.kwargs) == {"digits": 2}


def test_replace_changes_dotted_fields_of_a_copy_and_names_an_unknown_one():
  cfg = config_lib.validate(config_lib.base())
  seg = config_lib.replace(cfg, mode="sync", rl__max_staleness=0, **{"mesh.sampler_devices": 2})
  assert (seg.mode, seg.rl.max_staleness, seg.mesh.sampler_devices) == ("sync", 0, 2)
  assert (cfg.mode, cfg.rl.max_staleness, cfg.mesh.sampler_devices) == ("pipeline", 1, 4)
  assert seg.rl.group_size == cfg.rl.group_size
  with pytest.raises(config_lib.ConfigError, match=re.escape("no field 'rl.staleness' (setting rl.staleness)")):
    config_lib.replace(cfg, rl__staleness=0)
  with pytest.raises(config_lib.ConfigError, match=re.escape("rl.group_size must be an int >= 1 (got 0)")):
    config_lib.validate(config_lib.replace(cfg, rl__group_size=0))


def test_a_dict_valued_setting_is_read_only_and_reads_by_key_or_attribute():
  import copy
  import pickle

  from jaxrl.settings import Frozen

  cfg = config_lib.validate(config_lib.base())
  tiny = cfg.model.tiny
  assert isinstance(tiny, Frozen) and tiny["num_layers"] == tiny.num_layers == 2
  assert cfg.rl.auto_staleness.k_max == 4
  for write in (lambda: tiny.update(num_layers=3), lambda: tiny.pop("num_layers"), lambda: tiny.clear()):
    with pytest.raises(TypeError, match="read-only"):
      write()
  plain = tiny.to_dict()
  plain["num_layers"] = 3  # a writable copy; the config keeps its own
  assert type(plain) is dict and tiny.num_layers == 2
  assert copy.deepcopy(tiny) == tiny and type(pickle.loads(pickle.dumps(tiny))) is Frozen
  with pytest.raises(AttributeError, match="no 'depth'"):
    tiny.depth  # noqa: B018


def test_a_fraction_of_sampler_devices_survives_the_round_trip_of_a_run_config():
  cfg = config_lib.replace(config_lib.validate(config_lib.base()), mode="auto", mesh__sampler_devices=0.5,
                           auto__splits=(4,))
  assert config_lib.validate(cfg, num_devices=8).mesh.sampler_devices == 0.5  # split 4 checked as an int count
  with pytest.raises(config_lib.ConfigError, match="auto.splits has 8: .*leaves no learner device"):
    config_lib.validate(config_lib.replace(cfg, auto__splits=(8,)), num_devices=8)


def test_keys_a_config_file_adds_for_its_own_script_are_left_to_it():
  c = config_lib.base()
  c.bench = ml_collections.ConfigDict(dict(rounds=2))  # read by bench/ from the config file's ConfigDict
  cfg = config_lib.validate(c)
  assert not hasattr(cfg, "bench") and "bench" not in config_lib.as_dict(cfg) and c.bench.rounds == 2
