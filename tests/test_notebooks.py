"""Notebooks: in sync with notebooks/build.py, and each runs top to bottom on CPU in a fresh kernel (small settings),
drawing its plots without an error output."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from jaxrl.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def _build_module():
  spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "build.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _kernel_manager(tmp_path: Path) -> AsyncKernelManager:
  """A python3 kernel on this interpreter, whatever `python` a user-level kernelspec would name."""
  spec_dir = tmp_path / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
  (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "jaxrl", "language": "python"}))
  return AsyncKernelManager(kernel_name="python3",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]))


def _inject(nb, **params):
  """Papermill-style: a cell after the one tagged "parameters" overrides its values."""
  index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
  nb.cells.insert(index + 1, nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]}))


def run_notebook(name: str, tmp_path: Path, timeout: int = 600, **params):
  """Executes notebooks/<name> from the repo root (`timeout` seconds a cell) with `params` injected.

  Returns the executed notebook, the text it printed to stdout and how many image/png outputs it has.
  """
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  if params:
    _inject(nb, **params)
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3",
         "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
         "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
  client = NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=timeout, allow_errors=False,
                          resources={"metadata": {"path": str(REPO)}})
  client.execute(env=env, cwd=str(REPO))
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, f"{name}: {errors[0].ename}: {errors[0].evalue}"
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
  pngs = sum("image/png" in o.get("data", {}) for o in outputs)
  return nb, text, pngs


def test_notebooks_are_built_from_build_py_without_outputs():
  build = _build_module()
  assert build.main(["build.py", "--check"]) == 0, "run: .venv/bin/python notebooks/build.py"
  assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(build.NOTEBOOKS)
  for name in build.NOTEBOOKS:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), name
    assert code[0].metadata.get("tags") == ["parameters"], f"{name}: first code cell is not tagged parameters"


def test_small_is_the_default_of_the_user_facing_notebooks():
  for name in ("quickstart.ipynb", "planner.ipynb"):
    cells = nbformat.read(NOTEBOOKS / name, as_version=4).cells
    params = next(c.source for c in cells if "parameters" in c.metadata.get("tags", []))
    assert params.splitlines()[0].startswith("SMALL = True  #"), name


@pytest.mark.slow  # the whole trainer: compiles the sampler engine and the train step on 8 CPU devices
def test_quickstart_trains_and_plots(tmp_path):
  workdir = tmp_path / "run"
  nb, text, pngs = run_notebook("quickstart.ipynb", tmp_path, WORKDIR=str(workdir))
  assert pngs == 1
  assert f"jaxrl from {REPO / 'jaxrl'}" in text  # the install cell was a no-op: jaxrl came from the checkout
  assert "8 devices" in text
  records = read_jsonl(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, 9))
  assert all(r["staleness_max"] <= 1 for r in records)
  assert any(r["staleness_max"] == 1 for r in records)  # the pipeline really overlapped
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["mode"] == "pipeline" and summary["steps"] == 8


def test_planner_sweeps_and_plots(tmp_path):
  outdir = tmp_path / "plots"
  nb, text, pngs = run_notebook("planner.ipynb", tmp_path, OUTDIR=str(outdir))
  pictures = ["speedup_vs_split.png", "staleness_vs_split.png", "timeline_sync.png", "timeline.png",
              "speedup_vs_length.png"]
  assert sorted(p.name for p in outdir.iterdir()) == sorted(pictures)
  assert pngs == 1 + len(pictures)  # the cost-model figure, then every planner picture
  assert "<- best" in text and "best speedup" in text and "pipeline" in text


@pytest.mark.slow  # compiles the train step
def test_train_step_is_pure_and_learns_on_stale_batches(tmp_path):
  nb, text, pngs = run_notebook("train_step.ipynb", tmp_path, NUM_STEPS=6)
  assert pngs == 1
  assert "identical:" in text and "version 0 -> 1" in text  # the notebook asserts bitwise equality itself
  steps = [line.split() for line in text.splitlines() if line.startswith("step ")]  # "step s: version s+1 reward r"
  assert [int(words[3]) for words in steps] == list(range(1, 7))
  rewards = [float(words[5]) for words in steps]
  assert rewards[-1] > rewards[0] + 0.2, rewards  # the policy moves toward the rewarded token despite the lag
