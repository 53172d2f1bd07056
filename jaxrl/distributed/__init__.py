"""Multi-process pipeline RL on JAX's multi-controller runtime (`jax.distributed`): the learner mesh on some
processes, one sampler replica on each other process, weights and rollouts moved as JAX cross-host copies.

  runtime    joining the job, process roles (Topology), the coordination service's key-value store
  transfer   the transfer log (one order of copies for every process), weight and packet copies
  packets    rollout groups <-> one int32 array, bit for bit
  pipeline   the single-host Controller wired across processes (Inbox, Outbox, publishers, Ferry)
  watchdog   heartbeats; a dead process stops every process with a message naming it
  train      the per-process entry point (`python -m jaxrl.distributed.train`)
  launch     local launcher: N CPU processes on loopback
"""
