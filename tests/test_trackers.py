"""Experiment trackers: a run's every metric reaches metrics.jsonl, TensorBoard, wandb (offline, the real package)
and MLflow (a stand-in module: the package is too heavy for the test extra) under the same names."""

import os
import struct
import sys
import types

import pytest
import wandb
from tensorboardX.proto import event_pb2

from jaxrl.config import ConfigError, override, validate
from jaxrl.metrics import MetricsWriter, read_jsonl
from jaxrl.train import train

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402


def tensorboard_scalars(tb_dir) -> dict[int, dict[str, float]]:
  """{step: {tag: value}} from TensorBoard event files (TFRecord framing: length, its crc, data, its crc)."""
  out = {}
  for path in sorted(tb_dir.glob("events.out.tfevents.*")):
    data, pos = path.read_bytes(), 0
    while pos < len(data):
      (n,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 16 + n
      for v in event.summary.value:
        out.setdefault(event.step, {})[v.tag] = v.simple_value
  return out


class FakeMlflow(types.ModuleType):
  """What jaxrl.trackers.Mlflow calls, recorded."""

  def __init__(self):
    super().__init__("mlflow")
    self.calls, self.metrics = [], {}

  def set_tracking_uri(self, uri):
    self.calls.append(("set_tracking_uri", uri))

  def set_experiment(self, name):
    self.calls.append(("set_experiment", name))

  def start_run(self, run_name):
    self.calls.append(("start_run", run_name))

  def log_params(self, params):
    self.calls.append(("log_params", params))

  def log_metrics(self, metrics, step):
    self.metrics.setdefault(step, {}).update(metrics)

  def end_run(self):
    self.calls.append(("end_run",))


@pytest.fixture
def trackers(monkeypatch, tmp_path):
  """WANDB_MODE=offline with wandb's logged dicts recorded; a fake mlflow module."""
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
  monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
  logged = {}
  real_log = wandb.sdk.wandb_run.Run.log

  def log(self, data, step=None, **kw):
    logged.setdefault(step, {}).update(data)
    return real_log(self, data, step=step, **kw)

  monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", log)
  mlflow = FakeMlflow()
  monkeypatch.setitem(sys.modules, "mlflow", mlflow)
  return logged, mlflow


def test_a_run_sends_every_metric_to_every_backend_under_the_same_names(tmp_path, trackers, capfd):
  wandb_logged, mlflow = trackers
  c = override(tiny.get_config("sync"), num_steps=2, **{
      "mesh.num_devices": 2, "mesh.sampler_devices": 1, "log.progress": False, "log.project": "jaxrl-tests",
      "log.run_name": "tiny-sync", "log.backends": ("jsonl", "tensorboard", "wandb", "mlflow")})
  summary = train(c, tmp_path)
  assert summary["steps"] == 2
  assert "wandb" not in capfd.readouterr().err  # wandb's banner and run summary stay off the console
  jsonl = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time")}
           for r in read_jsonl(tmp_path / "metrics.jsonl")}
  assert sorted(jsonl) == [1, 2] and len(jsonl[1]) > 20
  tb = tensorboard_scalars(tmp_path / "tb")
  for step, record in jsonl.items():
    names = set(record)
    assert set(tb[step]) == names and set(mlflow.metrics[step]) == names
    assert set(wandb_logged[step]) == names
    assert mlflow.metrics[step]["reward_mean"] == wandb_logged[step]["reward_mean"] == record["reward_mean"]
    assert tb[step]["reward_mean"] == pytest.approx(record["reward_mean"])
  # wandb ran for real, offline, in the workdir; MLflow got its experiment, run name, settings and an end
  assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
  assert (tmp_path / "wandb_run_id").read_text() in next((tmp_path / "wandb").glob("offline-run-*")).name
  names = [call[0] for call in mlflow.calls]
  assert names == ["set_tracking_uri", "set_experiment", "start_run", "log_params", "end_run"]
  assert mlflow.calls[0][1] == (tmp_path / "mlruns").resolve().as_uri() and mlflow.calls[1][1] == "jaxrl-tests"
  assert mlflow.calls[2][1] == "tiny-sync" and mlflow.calls[3][1]["rl.group_size"] == "4"
  assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # MLflow 3 refuses a file store without it


def test_bad_backends_name_the_setting(tmp_path, monkeypatch):
  for backends, match in [(("jsonl", "comet"), r"log.backends has unknown \['comet'\]"),
                          (("tensorboard",), "log.backends must include 'jsonl'")]:
    with pytest.raises(ConfigError, match=match):
      validate(override(tiny.get_config(), **{"log.backends": backends}))
    with pytest.raises(ValueError, match=match):
      MetricsWriter(tmp_path, backends=backends)
  for backends in ("jsonl", None, ("jsonl", 1)):
    with pytest.raises(ValueError, match="log.backends must be a tuple of names"):
      MetricsWriter(tmp_path, backends=backends)
  monkeypatch.setitem(sys.modules, "mlflow", None)  # not installed
  with pytest.raises(ValueError, match=r"'mlflow', which needs the optional package mlflow \(pip install "
                                       r"'jaxrl\[trackers\]'\)"):
    MetricsWriter(tmp_path / "m", backends=("jsonl", "mlflow"))
