"""Multi-process pipeline RL on JAX's multi-controller runtime (`jax.distributed`): the learner mesh on some
processes, one sampler replica on each other process, weights and rollouts moved as JAX cross-host copies.

  runtime    joining the job, process roles (Topology), the coordination service's key-value store
  transfer   the transfer log (one order of copies for every process), weight and packet copies
  packets    rollout groups <-> one int32 array, bit for bit
  cross_process  the role loops' three channels across processes (Inbox/Outbox, publishers, StoreCoordinator, Ferry)
  roles      one process's role: the learner loop or a sampler loop, with its Ferry
  watchdog   heartbeats; a dead process stops every process with a message naming it
  job        one process of a job: its entry point (`python -m jaxrl.distributed.job`)
  launch     local launcher: N CPU processes on loopback
"""
