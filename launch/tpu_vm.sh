#!/usr/bin/env bash
# One jaxrl job over every host of a Cloud TPU VM slice: the same command runs on each worker (--worker=all), and
# jax.distributed.initialize() finds the coordinator, the process count and the host's index by itself.
#
#   TPU_NAME=my-v5e-16 ZONE=us-west4-a launch/tpu_vm.sh setup    # copy this checkout to every host, make its venv
#   TPU_NAME=my-v5e-16 ZONE=us-west4-a launch/tpu_vm.sh run      # run the job (extra args go to every process)
#
# What it runs: configs/default.py (pipeline RL of SmolLM2-135M-Instruct on two-digit addition), sized for the
# slice instead of a laptop: every chip is used (mesh.num_devices=-1), the last SAMPLER_CHIPS chips (whole hosts:
# 4 per v5e/v4 host) are sampler replicas, one per host, and the rest is one FSDP learner mesh; the first sampler
# replica scores the 64 held-out problems before and after training (summary.json). On a v5e-16 (4 hosts x 4 chips) the defaults give a learner on hosts 0-1 (8 chips) and two
# sampler replicas of 4 chips on hosts 2-3, with 4 GRPO groups per step (2 per replica).
# Cross-host copies use the TPU runtime's own transfers; if yours lacks them, set TRANSFER_PORT to use JAX's
# socket transfers instead (each host then listens on <its IP>:TRANSFER_PORT).
# The lead learner (worker 0) writes metrics.jsonl and summary.json under WORKDIR on its own disk. To stop a run
# early with a checkpoint, send SIGTERM to any one of its processes (a preempted host gets one): every process
# stops after the learners' current step and exits 143; `run` again resumes. A process that dies (SIGKILL, crash)
# makes the watchdog stop all the others within --heartbeat_timeout_s; the job resumes from its last checkpoint.
# Its processes are one jax.distributed job: they talk over the job's coordination service and transfers, a
# trusted network (docs/SECURITY.md). Sampler programs outside a job (jaxrl-sampler) prove the run's secret instead
# (--secret_file / JAXRL_RUN_SECRET; launch/README.md, "Sampler programs that come and go").
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}"
REMOTE_DIR=${REMOTE_DIR:-jaxrl}
CONFIG=${CONFIG:-configs/default.py}
WORKDIR=${WORKDIR:-runs/tpu-default}
SAMPLER_CHIPS=${SAMPLER_CHIPS:-8}
GROUPS_PER_STEP=${GROUPS_PER_STEP:-4}  # must split evenly over the sampler replicas
TRANSFER_PORT=${TRANSFER_PORT:-}

gcloud_tpu() {
  local verb=$1
  shift
  gcloud compute tpus tpu-vm "$verb" ${PROJECT:+--project="$PROJECT"} --zone="$ZONE" --worker=all "$@"
}

case "${1:-}" in
  setup)
    tar czf /tmp/jaxrl-src.tgz --exclude=.venv --exclude=.git --exclude=runs -C "$(dirname "$0")/.." .
    gcloud_tpu scp /tmp/jaxrl-src.tgz "$TPU_NAME":/tmp/jaxrl-src.tgz
    gcloud_tpu ssh "$TPU_NAME" --command="mkdir -p $REMOTE_DIR && tar xzf /tmp/jaxrl-src.tgz -C $REMOTE_DIR && \
      cd $REMOTE_DIR && python3.12 -m venv .venv && .venv/bin/pip install -q -e . 'jax[tpu]==0.12.0.1' && \
      .venv/bin/jaxrl-assets smollm2"
    ;;
  run)
    shift
    env_prefix=""
    if [[ -n "$TRANSFER_PORT" ]]; then
      env_prefix="JAXRL_TRANSFER_ADDRESS=\$(hostname -I | awk '{print \$1}'):$TRANSFER_PORT"
    fi
    gcloud_tpu ssh "$TPU_NAME" --command="cd $REMOTE_DIR && $env_prefix .venv/bin/python -m jaxrl.distributed.job \
      --config=$CONFIG --workdir=$WORKDIR --config.mesh.num_devices=-1 --config.mesh.sampler_devices=$SAMPLER_CHIPS \
      --config.rl.groups_per_step=$GROUPS_PER_STEP $*"
    ;;
  *)
    echo "usage: TPU_NAME=... ZONE=... $0 setup|run [extra flags for run]" >&2
    exit 2
    ;;
esac
