"""The command line of a multi-process job's processes (`python -m jaxrl.distributed.job`): its flags, declared
once, and the check the launcher makes of a job's command line before it starts any process. It touches no
device, so that a bad config costs the launcher no more than it costs jaxrl-train."""

from __future__ import annotations

from absl import flags

from jaxrl import config as config_lib


def define_flags(flag_values: flags.FlagValues) -> None:
  from ml_collections import config_flags

  config_flags.DEFINE_config_file("config", None, "config file, e.g. configs/tiny.py[:arg]", lock_config=True,
                                  flag_values=flag_values)
  flags.DEFINE_string("workdir", None, "run folder (shared by all processes, or the lead's): metrics, summary",
                      flag_values=flag_values)
  flags.DEFINE_float("heartbeat_timeout_s", 10.0, "a process silent this long stops the job, on every process",
                     flag_values=flag_values)
  flags.DEFINE_bool("dump_weights", False, "save every version's params, as sent by the learner and as received "
                    "by each sampler, to workdir/weights (for bitwise checks)", flag_values=flag_values)
  flags.mark_flags_as_required(["config", "workdir"], flag_values=flag_values)


def has_config(args: list[str]) -> bool:
  return any(a == "--config" or a.startswith("--config=") for a in args)


def preflight(prog: str, args: list[str], devices_per_process: list[int]):
  """Parses a job's process arguments and validates its config for processes with these device counts, as each
  process would; a bad one ends this process with one line `prog: ...` naming the key, and exit status 2. Returns
  (the RunConfig, the workdir). mode="auto" is checked as each of its segments' modes will run."""
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  config_lib.parse_cli(prog, [prog, *args], flag_values)
  try:
    c = config_lib.validate(flag_values.config, flag_values.workdir, num_devices=sum(devices_per_process))
    if c.mode == "auto":  # each segment's job: the config's split and every split it may try
      for split in (c.mesh.sampler_devices, *c.auto.splits):
        config_lib.validate_job(config_lib.replace(c, mode="pipeline", mesh__sampler_devices=split),
                                devices_per_process)
    else:
      config_lib.validate_job(c, devices_per_process)
    config_lib.validate_data_files(c)
  except config_lib.ConfigError as e:
    config_lib.cli_error(prog, str(e))
  return c, flag_values.workdir
