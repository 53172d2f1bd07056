"""No TPU probe on a host without a TPU: libtpu (the `tpu` extra, in the test extra) stays quiet on CPU and GPU
hosts, and a TPU host or an explicit JAX_PLATFORMS is left alone."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl import platforms

REPO = Path(__file__).resolve().parents[1]


def touch(root: Path, path: str, text: str = "") -> None:
  (root / path).parent.mkdir(parents=True, exist_ok=True)
  (root / path).write_text(text)


@pytest.mark.parametrize("path, text, attached", [
    ("dev/accel0", "", True),  # v4 / v5e VMs
    ("dev/vfio/0", "", True),  # v5p / v6e VMs
    ("dev/vfio/vfio", "", False),  # the VFIO container node alone is not a TPU
    ("sys/bus/pci/devices/0000:00:04.0/vendor", "0x1ae0\n", True),  # Google's PCI vendor id
    ("sys/bus/pci/devices/0000:00:04.0/vendor", "0x10de\n", False),  # an NVIDIA GPU
])
def test_tpu_attached_reads_device_nodes_and_pci(tmp_path, path, text, attached):
  touch(tmp_path, path, text)
  assert platforms.tpu_attached(str(tmp_path)) is attached
  assert platforms.host_platforms(str(tmp_path)) == (None if attached else "cpu")


def test_a_gpu_host_keeps_its_gpu(tmp_path, monkeypatch):
  plugins = [importlib.metadata.EntryPoint("xla_cuda12", "jax_cuda12_plugin", "jax_plugins")]
  monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: plugins)
  assert platforms.host_platforms(str(tmp_path)) == "cpu"  # the plugin without a device node: no GPU here
  touch(tmp_path, "dev/nvidiactl")
  assert platforms.host_platforms(str(tmp_path)) == "cuda,cpu"
  plugins[:] = [importlib.metadata.EntryPoint("xla_rocm", "jax_rocm7_plugin", "jax_plugins")]
  touch(tmp_path, "dev/kfd")
  assert platforms.host_platforms(str(tmp_path)) == "rocm,cpu"


def test_an_explicit_jax_platforms_is_left_alone(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu,tpu")
  platforms.skip_tpu_probe()
  assert os.environ["JAX_PLATFORMS"] == "cpu,tpu"


def _start_jax(skip: bool) -> subprocess.CompletedProcess:
  # TPU_*: jax (TPU_SKIP_MDS_QUERY) and a compile for a TPU target (jaxrl.platforms.tpu_compiler_env) set them in
  # this process. ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu gives up quietly while another process on the host holds its
  # lock file (e.g. a jax started before without the skip): probe anyway.
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL") and not k.startswith("TPU_")}
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  code = ("from jaxrl import platforms; platforms.skip_tpu_probe(); " if skip else "") + \
      "import jax; print(jax.devices()[0].platform)"
  return subprocess.run([sys.executable, "-c", code], env=env | {"PYTHONPATH": str(REPO)}, capture_output=True,
                        text=True, timeout=120, cwd=REPO)


@pytest.mark.skipif(platforms.tpu_attached(), reason="a TPU host is probed, as it should be")
def test_libtpu_installed_but_not_probed_on_this_host():
  assert importlib.util.find_spec("libtpu") is not None, "the test extra installs libtpu (the `tpu` extra)"
  probed = _start_jax(skip=False)
  assert "TPU" in probed.stderr  # what every jax start printed before: libtpu asking for a TPU that is not there
  quiet = _start_jax(skip=True)
  assert quiet.returncode == 0 and quiet.stdout.strip() == "cpu"
  assert "TPU" not in quiet.stderr, quiet.stderr


def test_startup_objects_are_frozen_once_per_process(monkeypatch):
  """The entry points' freeze moves what is alive to the permanent generation, once: objects made after the first
  call (a second main() in one process) stay collectable."""
  import gc

  monkeypatch.setattr(platforms, "_frozen", False)
  gc.unfreeze()
  try:
    platforms.freeze_startup_objects()
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # the imports at least
    later = [[i] for i in range(5000)]
    platforms.freeze_startup_objects()
    assert gc.get_freeze_count() == frozen and len(later) == 5000
  finally:
    gc.unfreeze()
