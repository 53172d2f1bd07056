"""Defaults of the configs/plan_*.py files (each field documented here once)."""

import math

import ml_collections


def base() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # ModelSpec.from_dims keyword arguments (name + decoder sizes; MoE: num_experts, experts_per_token,
  # moe_intermediate_size, with intermediate_size the shared expert's, 0 for none)
  c.model = ml_collections.ConfigDict()
  # a jaxrl.sim.hardware preset: tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, a100, h100, h800, h20, h200, b200, mi300x, cpu
  c.hardware = "h100"
  c.hardware_overrides = ml_collections.ConfigDict()  # Hardware fields to replace, e.g. link_bandwidth
  c.calibration = ""  # a Calibration JSON (jaxrl-profile output); when set it replaces the roofline costs
  # a jaxrl-compile report (JSON): costs from its compiled programs on its chip (jaxrl/sim/compiled.py), with mem_eff,
  # flop_eff, mfu and the overheads below; it replaces the roofline (hardware and model are then the report's)
  c.compiled = ""
  c.pool = 8  # devices to split between sampler and learner
  c.devices_per_engine = 1  # devices of one sampler engine (its tensor-parallel degree)
  c.slot_tokens = 4096  # KV-cache tokens reserved per live sequence; sets the slots per engine
  c.kv_mem_fraction = 0.9  # share of device memory usable for weights + KV cache
  c.max_batch_cap = 1024  # most live sequences per engine, whatever the memory allows
  c.mem_eff = 0.8  # achieved / peak memory bandwidth in decode
  c.flop_eff = 0.5  # achieved / peak FLOP/s in decode and prefill matmuls
  c.mfu = 0.4  # learner model-FLOPs utilisation (6 N FLOPs per trained token; N active for an MoE)
  c.mfu_by_devices = ()  # ((devices, mfu), ...) measured at several learner sizes; replaces mfu (log-interpolated)
  c.sync_mfu_by_devices = ()  # the same for the colocated sync baseline's learner; empty: as mfu_by_devices
  c.train_tps_by_devices = ()  # ((devices, tokens/s per device), ...) measured; replaces the MFU tables
  c.sync_train_tps_by_devices = ()  # the same for the colocated sync baseline's learner
  c.extra_forward_passes = 0  # learner forward passes besides the trained one (old log-probs, reference model)
  c.overhead_s = 0.005  # fixed cost of one decode step (sampling, host loop, launch)
  c.knee_sharpness = math.inf  # smoothing of the roofline knee (inf: hard max)
  c.train_overhead_s = 0.0  # fixed cost of one learner step
  c.sync_overhead_s = 0.5  # fixed cost of one weight publish (latency, re-layout)
  c.learner_bytes_per_param = 16.0  # training state: bf16 params + grads, fp32 master + Adam moments
  c.lengths = ml_collections.ConfigDict()  # jaxrl.sim.lengths.from_config: lognormal | mixture | empirical
  c.prompt_len = 256
  c.group_size = 8
  c.batch_sizes = (64,)  # samples per learner step to sweep
  c.ks = (1,)  # staleness bounds to sweep (admission="deadline")
  c.admission = "deadline"  # "deadline": per-group deadline v + k; "budget": admission budget, FIFO learner
  c.admission_budget = 0.0  # with "budget": steps of groups admitted ahead of the learner (fractional allowed)
  c.partial_rollouts = True  # live samples continue on new weights; False: engines drain before each update
  c.queue_groups = 0  # finished groups the rollout queue holds (0: bounded by admission only)
  c.pass_fraction = 1.0  # dynamic sampling: the finished groups the filter keeps (runlog.pass_fraction); 1: no filter
  c.staleness_bound = 1  # configurations with k above this are dropped
  c.splits = ()  # sampler device counts to sweep; empty: every whole-engine split
  c.steps = 6  # learner steps measured per simulation (after max_staleness + 1 warmup steps)
  c.seed = 0
  c.seeds = 1  # > 1: also print the best configuration's step time as an interval over this many seeds
  c.length_factors = ()  # scale every length by these for the speedup-vs-length plot; empty: skip
  # A published run to compare with (jaxrl-plan prints the errors; bench/sim_published.py fits the lengths and
  # learner rates from the phase times): step times of its synchronous baseline (colocated on the whole pool)
  # and of its pipeline at `sampler_devices`; the sync generation phase and the learner phases per mode.
  c.published = ml_collections.ConfigDict(dict(
      source="", sync_step_s=0.0, pipeline_step_s=0.0, sampler_devices=0, sync_gen_s=0.0, sync_train_s=0.0,
      pipeline_train_s=0.0))
  c.outdir = "/tmp/jaxrl-plan"
  return c
