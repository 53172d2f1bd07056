"""jaxrl.settings: every setting declared once, base() made of exactly those, each one's check."""

import re

import ml_collections
import pytest

from jaxrl import config as config_lib
from jaxrl.settings import SETTINGS, Bool, Choice, Int, Real


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
  assert Int("a.n", 1, 1, "").error(0) == "a.n must be an int >= 1 (got 0)"
  assert Int("a.n", 1, 1, "").error(True) == "a.n must be an int >= 1 (got True)"
  assert Real("a.x", 1.0, lambda v: v > 0, "> 0", "").error(float("nan")) == "a.x must be a number > 0 (got nan)"
  assert Bool("a.b", True, "").error(1) == "a.b must be True or False (got 1)"
  assert Choice("a.c", "x", ("x", "y"), "").error("z") == "a.c='z'; allowed: ('x', 'y')"
  assert Choice("a.c", "x", ("x", "y"), "").error("y") is None


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

