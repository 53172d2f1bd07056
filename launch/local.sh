#!/usr/bin/env bash
# Four CPU processes of one jax.distributed job on loopback (two learner processes, two sampler replicas), running
# configs/tiny.py (a random 2-layer model learns the target_token reward in 12 steps; reward goes from ~0.03 to ~0.95).
#
#   launch/local.sh                         # pipeline mode, workdir /tmp/jaxrl-mp
#   launch/local.sh --config=configs/tiny.py:sync --workdir=/tmp/jaxrl-mp-sync
#
# Each process gets 2 CPU devices, so the learner mesh is 4 devices over processes 0-1 and each sampler replica
# has 2 devices: the tiny config's mesh.sampler_devices=4 covers processes 2-3 exactly. Extra flags go to every
# process (python -m jaxrl.distributed.job); metrics and summary.json land in the workdir (written by process 0).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m jaxrl.distributed.launch --num_processes=4 --devices_per_process=2 -- \
  --config=configs/tiny.py --workdir=/tmp/jaxrl-mp --config.log.tensorboard=False "$@"
