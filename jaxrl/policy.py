r"""A config's policy: the model a run starts from, or the newest version a run trained (its workdir's checkpoint).

  jaxrl-export --config=configs/default.py --workdir=runs/smollm2 --out=runs/smollm2/hf

`load_policy` is what jaxrl-generate uses to generate with (and evaluate) a trained policy; `jaxrl-export` writes
one as a Hugging Face folder (config.json, model.safetensors, the base model's tokenizer files and chat template)
that transformers and vLLM open. A checkpoint is read, never written: a run may still be training in that workdir.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import jax

from jaxrl import config as config_lib
from jaxrl import platforms, sharding
from jaxrl.checkpoint import Checkpointer
from jaxrl.controller.build import abstract_train_state, base_params, model_source, run_optimizer
from jaxrl.models import ModelConfig, hf, lora


@dataclasses.dataclass
class Policy:
  model_cfg: ModelConfig
  graphdef: Any
  params: Any  # nnx.State on `mesh`
  version: int  # learner updates in these params (0: the base model)
  tokenizer: Any  # transformers tokenizer, or None (a random tiny model)
  source_dir: Path | None  # the base model's HF folder (tokenizer files), None for a tiny model
  mesh: Any
  checkpoint_step: int | None = None  # the checkpoint the params came from


def load_policy(c, workdir: str | os.PathLike | None = None, devices=None, step: int | None = None) -> Policy:
  """The base model of the RunConfig `c` (config.validate's), or with `workdir` the params of its
  newest checkpoint (or of checkpoint `step`), sharded FSDP-style over `devices` (default: all). A workdir without
  that checkpoint is an error (FileNotFoundError naming it and the steps it has)."""
  devices = list(jax.devices() if devices is None else devices)
  mesh = sharding.make_mesh({"data": len(devices)}, devices)
  shardings_fn = lambda params: sharding.param_shardings(params, mesh, sharding.LEARNER_RULES)
  cfg, tokenizer, path = model_source(c.model, c.sampler.max_len)
  if workdir is None:
    cfg, graphdef, params = base_params(c.seed, cfg, path, shardings_fn)
    return Policy(cfg, graphdef, params, 0, tokenizer, path, mesh)
  directory = Path(workdir).expanduser() / "checkpoints"
  if not directory.is_dir():
    raise FileNotFoundError(f"no checkpoint in {Path(workdir).expanduser()}: {directory} does not exist")
  checkpointer = Checkpointer(directory, read_only=True)
  try:
    if step is None:
      step = checkpointer.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {directory}")
    elif step not in checkpointer.all_steps():
      raise FileNotFoundError(f"no checkpoint of step {step} in {directory} (it has {checkpointer.all_steps()})")
    graphdef, abstract_params = hf.abstract_params(cfg)
    # The saved TrainState holds the optimizer moments too: restored as the run saved them, then dropped.
    optimizer = run_optimizer(c.optimizer, c.rl, c.num_steps)
    abstract = abstract_train_state(c.seed, c.loss, optimizer, abstract_params, mesh, adapters=cfg.lora is not None)
    try:
      state, _ = checkpointer.restore(abstract, step)
    except (ValueError, KeyError, TypeError) as e:  # a checkpoint of another model or optimizer
      raise hf.CheckpointError(f"checkpoint {directory / str(step)} does not match config model "
                               f"{c.model.source!r} and its optimizer: {e}") from e
  finally:
    checkpointer.close()
  params = state.params
  if cfg.lora is not None:  # the checkpoint holds the adapters; the base is the config's model
    params = lora.merge(lora.split(base_params(c.seed, cfg, path, shardings_fn)[2])[1], params)
  return Policy(cfg, graphdef, params, int(jax.device_get(state.version)), tokenizer, path, mesh, step)


def export(policy: Policy, out: str | os.PathLike) -> Path:
  """Writes the policy as a Hugging Face folder (atomically); the base model's tokenizer files go with it. A LoRA
  policy is written merged (W + scale * A @ B: a plain model) and its adapters alone beside it (lora.ADAPTERS_FILE,
  named by the base model they apply to)."""
  cfg, params = policy.model_cfg, policy.params
  if cfg.lora is not None:
    params = lora.merged(policy.params, cfg.lora)
    cfg = cfg.replace(lora=None)
  path = hf.save_params(Path(out).expanduser(), cfg, params, tokenizer_dir=policy.source_dir)
  if policy.model_cfg.lora is not None:
    base = str(policy.source_dir) if policy.source_dir is not None else "tiny"
    lora.save_adapters(path / lora.ADAPTERS_FILE, lora.split(policy.params)[0], policy.model_cfg.lora, base)
  return path


def export_main(argv=None):
  """Console entry point (jaxrl-export)."""
  platforms.entry_point()
  from absl import flags
  from ml_collections import config_flags

  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "the run's config, e.g. configs/default.py[:arg]",
                                  flag_values=flag_values, lock_config=True)
  flags.DEFINE_string("workdir", None, "the run's folder (its newest checkpoint is exported)", flag_values=flag_values)
  flags.DEFINE_string("out", None, "Hugging Face folder to write (replaced atomically if it exists)",
                      flag_values=flag_values)
  config_lib.parse_cli("jaxrl-export", argv, flag_values)
  missing = [name for name in ("config", "workdir", "out") if flag_values[name].value is None]
  if missing:
    print(f"jaxrl-export: bad flag: --{', --'.join(missing)} required", file=sys.stderr)
    sys.exit(2)
  try:
    policy = load_policy(config_lib.validate(flag_values.config), flag_values.workdir)
    path = export(policy, flag_values.out)
  except (config_lib.ConfigError, hf.CheckpointError, FileNotFoundError) as e:
    print(f"jaxrl-export: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"jaxrl-export: version {policy.version} (checkpoint step {policy.checkpoint_step}) -> {path}")


if __name__ == "__main__":
  export_main()
