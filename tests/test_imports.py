"""Importing any jaxrl module leaves the process environment as it was (settings belong to the entry points)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
import importlib, json, os, pkgutil, sys
import jax  # its own import is not jaxrl's doing
import jaxrl
before = dict(os.environ)
names = sorted(m.name for m in pkgutil.walk_packages(jaxrl.__path__, "jaxrl."))
changed = {}
for name in names:
  importlib.import_module(name)
  now = dict(os.environ)
  if now != before:
    changed[name] = sorted(k for k in {*now, *before} if now.get(k) != before.get(k))
    before = now
print(json.dumps({"modules": names, "changed": changed}))
"""


def test_importing_any_jaxrl_module_leaves_the_environment_alone():
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # unset: what jaxrl.train used to set
  env["PYTHONPATH"] = str(REPO)
  proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert {"jaxrl.train", "jaxrl.sampler.sampler", "jaxrl.sim.simulate"} <= set(out["modules"])
  assert out["changed"] == {}
