#!/usr/bin/env bash
# Engine decode tokens/s at Qwen2.5-1.5B shapes (random bf16 weights), dense vs paged KV cache at one KV memory
# budget, against the HBM roofline measured in the same run, on one GPU; under 8 minutes. JSON to
# bench/results/device.json (or --out).
#
#   bash bench/device.sh               # on a machine with one NVIDIA GPU
#   bash bench/device.sh --dry_run     # tiny shapes on any backend (the CPU test runs this)
#
# Python: $PYTHON if set; else python3 if it already has this project's jax; else a fresh .venv-device with the
# project installed from its own pyproject.toml plus CUDA jax (pip; an offline machine reads wheels from .whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if python3 -c "import jax, flax, jaxrl; assert jax.__version__ == '0.12.0.1'" 2>/dev/null; then
    py=python3
  else
    python3 -m venv .venv-device
    py=.venv-device/bin/python
    links=()
    if [ -d .whl ]; then links=(--find-links .whl); fi
    "$py" -m pip install -q "${links[@]}" -e . "jax[cuda12]==0.12.0.1"
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
exec timeout 470 "$py" -m bench.device "$@"
