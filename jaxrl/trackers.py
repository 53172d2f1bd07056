"""Experiment trackers: where MetricsWriter sends each step's scalars besides metrics.jsonl (log.backends).

Every tracker gets the same scalars under the same names as metrics.jsonl (arrays already split into name/i).
wandb and mlflow are optional (`pip install 'jaxrl[trackers]'`) and imported only when a run names them; their
own settings (WANDB_MODE=offline, WANDB_API_KEY, MLFLOW_TRACKING_URI, ...) come from the environment as usual.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")  # jsonl: workdir/metrics.jsonl, always written
EXTRA = "pip install 'jaxrl[trackers]'"


def _import(module: str, backend: str):
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"log.backends has {backend!r}, which needs the optional package {module} ({EXTRA}): "
                     f"{e}") from None


def flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
  """A nested config as {"a.b": "value"} (what MLflow's params hold)."""
  out = {}
  for k, v in config.items():
    if isinstance(v, Mapping):
      out.update(flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = str(v)[:250]
  return out


class TensorBoard:
  def __init__(self, workdir: Path, project: str, run_name: str, config: Mapping[str, Any]):
    from tensorboardX import SummaryWriter

    self._writer = SummaryWriter(str(workdir / "tb"))

  def log(self, step: int, scalars: dict[str, float]) -> None:
    for k, v in scalars.items():
      self._writer.add_scalar(k, v, step)

  def close(self) -> None:
    self._writer.close()


class Wandb:
  """A wandb run in workdir/wandb; a resumed jaxrl run continues the same wandb run (its id is kept in the
  workdir)."""

  def __init__(self, workdir: Path, project: str, run_name: str, config: Mapping[str, Any]):
    wandb = _import("wandb", "wandb")
    id_file = workdir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    # silent: wandb's banner and run summary would fill the console between jaxrl's progress lines
    self._run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(workdir),
                           config=dict(config), settings=wandb.Settings(silent=True, console="off"))
    self._wandb = wandb

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self._run.log(scalars, step=step)

  def close(self) -> None:
    self._run.finish()


class Mlflow:
  """An MLflow run in experiment `project`; without MLFLOW_TRACKING_URI it is stored in workdir/mlruns."""

  def __init__(self, workdir: Path, project: str, run_name: str, config: Mapping[str, Any]):
    mlflow = _import("mlflow", "mlflow")
    if not os.environ.get("MLFLOW_TRACKING_URI"):
      # No server named: the run's folder is the store. MLflow 3 keeps its file store (the only local store
      # mlflow-skinny has; sqlite needs the full package) behind this opt-in.
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
      mlflow.set_tracking_uri((workdir / "mlruns").resolve().as_uri())
    logging.getLogger("mlflow.tracking.fluent").setLevel(logging.WARNING)  # "Creating a new experiment" at INFO
    mlflow.set_experiment(project)
    self._run = mlflow.start_run(run_name=run_name)
    mlflow.log_params(flat(config))
    self._mlflow = mlflow

  def log(self, step: int, scalars: dict[str, float]) -> None:
    self._mlflow.log_metrics(scalars, step=step)

  def close(self) -> None:
    self._mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}


def check_backends(backends) -> tuple[str, ...]:
  """The backends as a tuple; a ValueError naming log.backends when they are not a subset of BACKENDS with
  "jsonl" (the run's own record: resuming and the summary read it)."""
  if not isinstance(backends, (tuple, list)) or not all(isinstance(b, str) for b in backends):
    raise ValueError(f"log.backends must be a tuple of names from {BACKENDS} (got {backends!r})")
  unknown = sorted(set(backends) - set(BACKENDS))
  if unknown:
    raise ValueError(f"log.backends has unknown {unknown}; known: {BACKENDS}")
  if "jsonl" not in backends:
    raise ValueError(f"log.backends must include 'jsonl' (workdir/metrics.jsonl: resuming reads it) (got {backends})")
  return tuple(dict.fromkeys(backends))
