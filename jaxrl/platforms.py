"""Which jax platforms a host starts: no TPU probe where there is no TPU.

With libtpu installed (the `tpu` extra, for jaxrl-compile), every jax start asks the cloud metadata server what TPU
it is on and prints the failures (worker hostnames, accelerator type) on a host without one. The entry points call
`entry_point()` first, which calls `skip_tpu_probe()`: where no TPU is attached and JAX_PLATFORMS is not set, it names
the platforms the host has (a GPU's when its device node and jax plugin are there, and the CPU), so the TPU runtime is
not started; a compile for a TPU target still loads libtpu for its topology (jaxrl.compile). Then
`freeze_startup_objects()`: what the imports made is set aside from the garbage collector's walks.
"""

from __future__ import annotations

import gc
import glob
import importlib.metadata
import math
import os
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips attached through PCI (what libtpu itself looks for)


def tpu_attached(root: str = "/") -> bool:
  """A TPU's device node (/dev/accel* on v4/v5e VMs, /dev/vfio/<n> on v5p/v6e) or a Google PCI device."""
  r = Path(root)
  if glob.glob(str(r / "dev/accel*")) or [p for p in glob.glob(str(r / "dev/vfio/*")) if Path(p).name.isdigit()]:
    return True
  vendors = glob.glob(str(r / "sys/bus/pci/devices/*/vendor"))
  return any(Path(v).read_text().strip() == _GOOGLE_PCI_VENDOR for v in vendors)


def _gpu_platform(root: str = "/") -> str | None:
  """"cuda" or "rocm" when this host has that GPU's device node and jax's plugin for it, else None."""
  plugins = " ".join(e.name for e in importlib.metadata.entry_points(group="jax_plugins"))
  r = Path(root)
  if "cuda" in plugins and any((r / d).exists() for d in ("dev/nvidiactl", "dev/nvidia0", "dev/dxg")):
    return "cuda"
  if "rocm" in plugins and (r / "dev/kfd").exists():
    return "rocm"
  return None


def host_platforms(root: str = "/") -> str | None:
  """JAX_PLATFORMS for this host without a TPU probe ("cuda,cpu", "rocm,cpu" or "cpu"); None where a TPU is attached
  (jax then finds it itself)."""
  if tpu_attached(root):
    return None
  gpu = _gpu_platform(root)
  return f"{gpu},cpu" if gpu else "cpu"


def skip_tpu_probe() -> None:
  """Sets JAX_PLATFORMS (the environment, for child processes, and jax's config) to host_platforms() unless it is
  set already or a TPU is attached. Call before anything starts a jax backend."""
  if os.environ.get("JAX_PLATFORMS"):
    return
  platforms = host_platforms()
  if platforms is None:
    return
  os.environ["JAX_PLATFORMS"] = platforms
  import jax

  jax.config.update("jax_platforms", platforms)


def tpu_compiler_env(chip: str, topology: str) -> None:
  """The environment of libtpu compiling deviceless for `chip` ("v5e", "v5p", "v6e") at `topology` ("2x2", ...): no
  lock file (compiles may run side by side, and beside a run), and on a host without a TPU the slice's accelerator
  type and a local worker named, so libtpu does not probe the metadata server and print its failures (the type
  does not change the topology libtpu describes). Call before the first topology is made."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if tpu_attached():
    return
  chips = math.prod(int(x) for x in topology.split("x"))
  accelerator = {"v5e": f"v5litepod-{chips}", "v5p": f"v5p-{2 * chips}", "v6e": f"v6e-{chips}"}[chip]  # v5p: cores
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def entry_point() -> None:
  """What every entry point's main() does first, once its module's imports are done."""
  skip_tpu_probe()
  freeze_startup_objects()


def freeze_startup_objects() -> None:
  """Moves every object alive now (the imported modules: jax, flax, optax, orbax, and their caches) to the garbage
  collector's permanent generation: a collection no longer walks them. Entry points call it once their imports are
  done; tracing and the host loops make many short-lived objects, and each full collection walked the imports too
  (a warm tiny run: 5.5 -> 5.0 s of CPU; docs/RELIABILITY.md "The suite's time"). Once per process: a program that
  calls main() again (a notebook, a test) freezes no later objects, which would then never be collected."""
  global _frozen
  if not _frozen:
    gc.freeze()
    _frozen = True


_frozen = False
