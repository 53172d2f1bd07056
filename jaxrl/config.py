"""The run configuration: `base()` (every setting of jaxrl.settings at its default) and `validate`, the checks made
before any work starts, which returns the typed, read-only RunConfig that every component reads from.

Config files under configs/ start from `base()` and override what they need; `--config.key=value` on the
command line overrides further (ml_collections rejects unknown keys and wrong types).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import ml_collections

from jaxrl.envs import TASKS
from jaxrl.envs.dataset import data_files
from jaxrl.settings import SETTINGS, ConfigError, RunConfig, from_tree, help_text, need
from jaxrl.sharding import resolve_axis_sizes, sampler_count

# Settings that no longer exist, with what replaced them: a config, an override or a flag that sets one is an error
# that says so (rather than "no such field").
REMOVED = {"rl.on_stale": "batch assembly is deadline-based: no group is dropped for staleness and every trained "
                          "token's staleness is <= rl.max_staleness; delete the setting"}


def base() -> ml_collections.ConfigDict:
  """Every setting at its default (jaxrl.settings declares each one, with what it means)."""
  c = ml_collections.ConfigDict()
  for setting in SETTINGS:
    *parents, leaf = setting.name.split(".")
    node = c
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    value = setting.default
    if isinstance(value, dict):  # a section of options (model sizes, mesh axes, loss, ...)
      value = ml_collections.ConfigDict(value)
    elif setting.any_type:  # several types (an int or "auto"; a float or None): the CLI parses each as written
      value = ml_collections.FieldReference(value, field_type=object)
    node[leaf] = value
  return c


def override(c: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
  """Sets dotted fields in place, as `--config.a.b=v` does on the command line; `__` also stands for a dot, for
  keyword arguments: `override(c, rl__max_staleness=2, **{"sampler.max_slots": 8})`. Returns c.

  A field the config does not have is a ConfigError naming it (ConfigDict's types are still checked on set)."""
  for key, value in fields.items():
    node, path = c, key.replace("__", ".").split(".")
    if ".".join(path) in REMOVED:
      raise ConfigError(f"config: {'.'.join(path)} was removed: {REMOVED['.'.join(path)]}")
    for i, part in enumerate(path):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        raise ConfigError(f"config: no field {'.'.join(path[:i + 1])!r} (setting {'.'.join(path)})")
      if i < len(path) - 1:
        node = node[part]
    node[path[-1]] = value
  return c


def parse_cli(prog: str, argv=None, flag_values=None) -> None:
  """Parses a CLI's absl flags, ml_collections config overrides (--config.<key>=...) included. A bad flag (unknown
  config key, wrong type, missing value) or a stray argument ends the process with one line `prog: ...` and exit
  status 2, before any work. --config_help prints every setting with its default, values and meaning; --help (-h)
  prints the program's own flags and exits 0."""
  from absl import flags

  flag_values = flags.FLAGS if flag_values is None else flag_values
  argv = list(sys.argv if argv is None else argv)
  if {"--help", "-h", "--helpfull", "-help"} & set(argv[1:]):
    print(usage(prog, flag_values))
    sys.exit(0)
  if "--config_help" in argv:  # every setting from its one declaration (jaxrl.settings), then nothing else
    print(help_text())
    sys.exit(0)
  saved, sys.argv = sys.argv, argv  # ml_collections reads the --config.* overrides from sys.argv
  try:
    rest = flag_values(argv)
  except (AttributeError, KeyError) as e:  # ml_collections: a --config.<key> the config does not have
    removed = [f"--config.{k} was removed: {why}" for k, why in REMOVED.items() if f"--config.{k}" in " ".join(argv)]
    cli_error(prog, removed[0] if removed else f"unknown config key {str(e).strip(chr(34))}")
  except (flags.Error, TypeError, ValueError) as e:
    cli_error(prog, f"bad flag: {e}")
  finally:
    sys.argv = saved
  if len(rest) > 1:
    cli_error(prog, f"unexpected arguments: {rest[1:]}")


def usage(prog: str, flag_values) -> str:
  """The program's usage: the flags jaxrl defines for it (not those of the libraries it imports)."""
  # absl files a flag under its module's name, or under the script's path when that module runs as __main__ (-m)
  mine = sorted(m for m in flag_values.flags_by_module_dict()
                if m.split(".")[0] in ("jaxrl", "__main__") or m == sys.argv[0] or f"{os.sep}jaxrl{os.sep}" in m)
  lines = [f"usage: {prog} [--flag=value ...]", "",
           "  --config_help: every --config.<setting> with its default, allowed values and meaning", ""]
  return "\n".join(lines + [flag_values.module_help(m) for m in mine])


def cli_error(prog: str, message: str):
  print(f"{prog}: {message}", file=sys.stderr)
  sys.exit(2)


def validate(c: ml_collections.ConfigDict | RunConfig, workdir: str | os.PathLike | None = None,
             num_devices: int | None = None) -> RunConfig:
  """The typed, read-only RunConfig of config c, checked: every value, every section's rules (settings.from_tree),
  then the rules across sections (check_run). A bad one raises ConfigError with one line naming the first bad field
  (before any model or data is loaded). c may be a RunConfig already (a copy changed by `replace`): it is checked
  again, e.g. against the devices there are."""
  if isinstance(c, RunConfig):
    c = ml_collections.ConfigDict(as_dict(c))
  for path, why in REMOVED.items():
    head, _, leaf = path.rpartition(".")
    need(head not in c or leaf not in c[head], f"{path} was removed: {why}")
  cfg = check_run(from_tree(c), num_devices)
  if workdir is not None:
    _check_writable(Path(workdir))
  return cfg


def check_run(cfg: RunConfig, num_devices: int | None = None) -> RunConfig:
  """The rules that tie sections together (each section has checked its own), against num_devices if given; returns
  cfg with its loss scoring the sampler's distribution."""
  s, rl = cfg.sampler, cfg.rl
  need(s.max_len <= rl.seq_len, f"sampler.max_len={s.max_len} exceeds rl.seq_len={rl.seq_len}: samples would not fit "
                                "the batch")
  need(cfg.mode != "auto" or rl.max_staleness != "auto", "mode='auto' chooses the staleness bound itself (sync or the "
       "pipeline at k = 1..auto.k_max): leave rl.max_staleness an int")
  need(not (cfg.model.lora.enabled and s.weight_dtype == "int8"), "sampler.weight_dtype='int8' with model.lora.enabled "
       "is not supported: an int8 publish quantizes every weight, a LoRA publish moves the adapters alone onto a float "
       "base")
  need(not (cfg.model.source == "tiny" and TASKS[cfg.task.name].text_prompts),
       f"task {cfg.task.name!r} has text prompts and the 'tiny' model has no tokenizer; use model.source='smollm2' or "
       "a HF folder, or a token-level task (target_token)")
  if num_devices is not None:
    _check_mesh(cfg, num_devices)
  for split in cfg.auto.splits if cfg.mode == "auto" else ():  # each split as its segments will run it
    try:
      check_run(replace(cfg, mode="pipeline", mesh__sampler_devices=split, auto__splits=()), num_devices)
    except ConfigError as e:
      raise ConfigError(f"config: auto.splits has {split}: {str(e).removeprefix('config: ')}") from None
  return dataclasses.replace(cfg, loss=cfg.loss.replace(sampling=s.sampling))


def replace(cfg: RunConfig, **fields) -> RunConfig:
  """A copy of cfg with dotted fields changed, named as `override` names them: `replace(cfg, mode="sync",
  rl__max_staleness=0)`. A field the config does not have is a ConfigError naming it. The copy is not checked:
  `validate` it where it will run (jaxrl.train.build does)."""
  for key, value in fields.items():
    path = key.replace("__", ".").split(".")
    nodes = [cfg]
    for i, part in enumerate(path):
      if not (dataclasses.is_dataclass(nodes[-1]) and part in {f.name for f in dataclasses.fields(nodes[-1])}):
        raise ConfigError(f"config: no field {'.'.join(path[:i + 1])!r} (setting {'.'.join(path)})")
      nodes.append(getattr(nodes[-1], part))
    for node, part in zip(reversed(nodes[:-1]), reversed(path), strict=True):
      value = dataclasses.replace(node, **{part: value})
    cfg = value
  return cfg


def as_dict(cfg: RunConfig) -> dict:
  """cfg as nested plain dicts with base()'s keys (loss: every LossConfig option but its sampling, which the sampler
  settings give): what the experiment trackers record, and what a ConfigDict of it is made from."""

  def plain(v):
    if dataclasses.is_dataclass(v):
      return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v) if f.name != "sampling"}
    if isinstance(v, dict):
      return {k: plain(x) for k, x in v.items()}
    return v

  return plain(cfg)


def validate_data_files(c: RunConfig) -> None:
  """Raises ConfigError naming the key if a local data file of task.name="dataset" is missing or of an unknown kind.
  Checked by jaxrl-train and by a job's launcher, once for the processes it starts on its filesystem, before any
  of them starts (each would report it); not by the job's processes themselves (a multi-host job's learner hosts
  need not hold the data)."""
  if c.task.name != "dataset":
    return
  for key in ("train_files", "eval_files"):
    if c.task.kwargs.get(key):
      try:
        data_files(c.task.kwargs[key], key)
      except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"config: {e}") from None


def _check_mesh(cfg: RunConfig, num_devices: int) -> None:
  n, s = cfg.mesh.num_devices, cfg.mesh.sampler_devices
  pool = num_devices if n == -1 else n
  need(pool <= num_devices, f"mesh.num_devices={n} but {num_devices} devices exist")
  need(pool >= 2, f"a pool of {pool} device(s) cannot hold a sampler and a learner")
  sampler = sampler_count(s, pool)
  need(sampler < pool, f"mesh.sampler_devices={s} leaves no learner device in a pool of {pool}")
  sizes = {}
  for role, count in (("learner", pool - sampler), ("sampler", sampler)):
    try:
      sizes[role] = resolve_axis_sizes(getattr(cfg.mesh, f"{role}_axes").to_dict(), count)
    except (AttributeError, TypeError, ValueError) as e:
      raise ConfigError(f"config: mesh.{role}_axes on {count} {role} device(s): {e}") from None
  shards = sizes["learner"].get("data", 1) * sizes["learner"].get("fsdp", 1) * sizes["learner"].get("expert", 1)
  batch, m = cfg.rl.batch_size, cfg.rl.num_minibatches
  need(batch % shards == 0, f"the batch of rl.group_size * rl.groups_per_step = {batch} rows is not divisible by "
                            f"the {shards} learner devices it is split over (mesh.learner_axes)")
  need(batch % (shards * m) == 0, f"each of rl.num_minibatches={m} mini-batches of the {batch}-row batch must split "
                                  f"evenly over the {shards} learner devices (mesh.learner_axes)")


def _check_writable(workdir: Path) -> None:
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / ".write_test"
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"workdir {workdir} is not writable: {e.strerror or e}") from e
