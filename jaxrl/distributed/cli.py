"""The command line of a multi-process job's processes (`python -m jaxrl.distributed.job`): its flags, declared
once, and the check the launcher makes of a job's command line before it starts any process. It touches no
device, so that a bad config costs the launcher no more than it costs jaxrl-train."""

from __future__ import annotations

from collections.abc import Sequence

from absl import flags

from jaxrl import config as config_lib
from jaxrl.settings import need
from jaxrl.sharding import resolve_axis_sizes, sampler_count


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
        validate_job(config_lib.replace(c, mode="pipeline", mesh__sampler_devices=split), devices_per_process)
    else:
      validate_job(c, devices_per_process)
    config_lib.validate_data_files(c)
  except config_lib.ConfigError as e:
    config_lib.cli_error(prog, str(e))
  return c, flag_values.workdir


def validate_job(c: config_lib.RunConfig, devices_per_process: Sequence[int]) -> None:
  """The rules of a multi-process job (jaxrl.distributed) whose processes have these device counts, in process
  order: the learner takes the first processes, every later process is one sampler replica (mesh.sampler_devices
  counts whole processes from the end; mesh.sampler_axes and sampler.max_slots are per replica)."""
  need(c.mode != "auto", "mode='auto' in a multi-process job runs through jaxrl.distributed.launch, which launches "
       "the job one segment (one fixed mode) at a time")
  total = sum(devices_per_process)
  n, s = c.mesh.num_devices, c.mesh.sampler_devices
  need(n in (-1, total), f"mesh.num_devices={n}: a multi-process run uses every device of the job ({total}); set it "
                         "to -1")
  sampler = sampler_count(s, total)
  replicas = []
  while sum(replicas) < sampler and len(replicas) < len(devices_per_process):
    replicas.append(devices_per_process[-1 - len(replicas)])
  need(sum(replicas) == sampler and len(replicas) < len(devices_per_process),
       f"mesh.sampler_devices={s} must be the devices of whole processes counted from the end, leaving a learner "
       f"process (devices per process: {list(devices_per_process)})")
  for size in sorted(set(replicas)):
    try:
      resolve_axis_sizes(c.mesh.sampler_axes.to_dict(), size)
    except (TypeError, ValueError) as e:
      raise config_lib.ConfigError(f"config: mesh.sampler_axes on a sampler replica of {size} device(s) (one process): "
                        f"{e}") from None
  need(c.rl.groups_per_step % len(replicas) == 0,
       f"rl.groups_per_step={c.rl.groups_per_step} does not split evenly over the {len(replicas)} sampler replicas "
       "(each admits its share of every step)")
