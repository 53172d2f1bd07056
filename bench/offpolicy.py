"""Learning under forced staleness: decoupled PPO (the default objective) against plain PPO anchored at mu.

    JAX_NUM_CPU_DEVICES=8 PYTHONPATH=. .venv/bin/python bench/offpolicy.py          # ~3-4 min on 2 loaded cores
    JAX_NUM_CPU_DEVICES=8 PYTHONPATH=. .venv/bin/python bench/offpolicy.py --steps=8 --seeds=1 --auto_steps=6

The tiny config (random 2-layer decoder, target_token: reward = fraction of completion tokens equal to the
target id, optimum 1.0). Forced staleness k: at learner step s the real Sampler draws the step's batch with the
params of version max(0, s - k), so every trained token has staleness exactly k once s >= k. Each objective
and k trains the same number of samples from the same initial params; reported per (objective, k), as the mean
over seeds: the reward of the final policy on fresh samples (64 per seed, its sampling settings) and the mean
reward of the trained samples. Then the real pipeline (threads, rl.max_staleness = 0, 2, "auto") on the
same config: samples trained per second after warm-up, the final reward, and the k "auto" chose.
Writes bench/results/offpolicy.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxrl.config import override
from jaxrl.controller.adaptive import AdaptiveStaleness
from jaxrl.rollout import make_batch
from jaxrl.sampler import Sampler
from jaxrl.train import build

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 20, "learner steps per forced-staleness run")
_SEEDS = flags.DEFINE_integer("seeds", 2, "seeds (sampling and prompt streams) per objective and k")
_KS = flags.DEFINE_list("ks", ["0", "2", "4", "auto"], "forced staleness values; auto: AdaptiveStaleness "
                        "(rl.auto_staleness, k_max 4) picks k each step from the step's measured drift")
_AUTO_STEPS = flags.DEFINE_integer("auto_steps", 16, "learner steps of each real-pipeline run (0: skip)")
_OUT = flags.DEFINE_string("out", str(pathlib.Path(__file__).parent / "results" / "offpolicy.json"), "JSON path.")

# Decoupled PPO is the run config's default loss; "ppo_mu" anchors the ratio at mu and has no IS weight.
OBJECTIVES = {
    "decoupled": {},
    "ppo_mu": {"loss.proximal": "behavior", "loss.is_level": "none", "loss.is_cap": None},
}
EVAL_GROUPS = 16


def _config(**fields):
  c = tiny.get_config()
  return override(c, **{"log.tensorboard": False, "log.progress": False, "checkpoint.every_steps": 10**6,
                        **fields})


def _copy(tree):
  def leaf(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(jnp.copy(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    return jnp.copy(x)
  return jax.tree.map(leaf, tree)


def _sample(prompts, score, spec, sampler, group_ids):
  """Every group of `group_ids` drawn by `sampler` and scored; the samples in group order."""
  for gid in group_ids:
    prompt, meta = prompts(gid)
    sampler.submit(prompt, gid, spec.rl.group_size, meta=meta, sampling=spec.sampler.sampling,
                   max_tokens=spec.sampler.max_new_tokens)
  out = []
  while sampler.num_active or sampler.num_waiting:
    out += sampler.step()
  groups = {}
  for r in out:
    groups.setdefault(r.group_id, []).append(r)
  for g in groups.values():
    score(g)
  return [r for gid in group_ids for r in sorted(groups[gid], key=lambda r: r.sample_index)]


def forced_runs(objective: str, ks: list[int], steps: int, seeds: int) -> dict:
  """Per k: final-policy reward and trained-sample reward (means over seeds) of one objective."""
  with tempfile.TemporaryDirectory() as workdir:
    # The learning-rate schedule decays over num_steps: the run's length.
    run = build(_config(**OBJECTIVES[objective], num_steps=steps), workdir)
    ctl = run.controller.learner_loop
    prompts, score = run.controller.sampler_loop.prompts, run.controller.sampler_loop.score
    init = _copy(ctl.state)  # the train step donates its state: every run starts from a fresh copy
    spec, out = ctl.spec, {}
    for k in ks:
      finals, trained, wall = [], [], 0.0
      mean_ks = []
      for seed in range(seeds):
        adaptive = AdaptiveStaleness(run.config.rl.auto_staleness) if k == "auto" else None
        ctl.state = _copy(init)
        history = [jax.tree.map(jnp.copy, ctl.state.params)]
        sampler = Sampler(run.sampler_side.engine, history[0], 0, seed=1000 + seed)
        rewards = []
        start = time.perf_counter()
        used_ks = []
        for s in range(steps):
          k_now = adaptive.k if adaptive else k
          used_ks.append(k_now)
          v = max(0, s - k_now, sampler.version)  # versions never go back (k may fall by one)
          if v > sampler.version:
            sampler.update_params(history[v], v)
          gids = [seed * 10**6 + s * spec.rl.groups_per_step + i for i in range(spec.rl.groups_per_step)]
          batch = make_batch(_sample(prompts, score, spec, sampler, gids), spec.rl.batch_size, spec.rl.seq_len)
          ctl.state, m = ctl.train_step(ctl.state, batch, jax.random.fold_in(jax.random.key(seed), s))
          rewards.append(float(m["reward_mean"]))
          if adaptive:
            adaptive.observe(m["ess_applied_frac"], m["kl_behavior"])
          history.append(jax.tree.map(jnp.copy, ctl.state.params))
        wall += time.perf_counter() - start
        sampler.update_params(history[-1], len(history) - 1)
        fresh = _sample(prompts, score, spec, sampler, [seed * 10**6 + 900_000 + i for i in range(EVAL_GROUPS)])
        finals.append(float(np.mean([r.reward for r in fresh])))
        trained.append(float(np.mean(rewards)))
        mean_ks.append(float(np.mean(used_ks)))
      out[k] = {"final_reward": float(np.mean(finals)), "final_reward_per_seed": finals,
                "trained_reward": float(np.mean(trained)), "mean_k": float(np.mean(mean_ks)), "seconds": wall}
      print(f"{objective:>10} k={k}: final reward {out[k]['final_reward']:.3f} (per seed "
            f"{', '.join(f'{x:.3f}' for x in finals)}), trained-sample reward {out[k]['trained_reward']:.3f}, "
            f"mean k {out[k]['mean_k']:.2f}",
            flush=True)
    score.close()
  return out


def pipeline_run(max_staleness, steps: int) -> dict:
  """The real threaded pipeline: samples trained per second after 3 warm-up steps, rewards, chosen k."""
  with tempfile.TemporaryDirectory() as workdir:
    c = _config(**{"rl.max_staleness": max_staleness, "num_steps": steps})
    run = build(c, workdir)
    ctl = run.controller.learner_loop
    marks = []
    ctl.on_step = lambda version, metrics: marks.append((time.perf_counter(), metrics))
    ctl.checkpointer = None  # nothing to resume here
    run.controller.run()
    run.controller.sampler_loop.score.close()
  warm = 3
  seconds = marks[-1][0] - marks[warm - 1][0]
  rewards = [m["reward_mean"] for _, m in marks]
  return {"samples_per_s": (len(marks) - warm) * ctl.spec.rl.batch_size / seconds,
          "reward_last3": float(np.mean(rewards[-3:])), "staleness_mean": float(np.mean(ctl.trained_staleness)),
          "admit_staleness": [m.get("admit_staleness") for _, m in marks],
          "ess_applied_frac": [float(m["ess_applied_frac"]) for _, m in marks]}


def main(_):
  ks = [k if k == "auto" else int(k) for k in _KS.value]
  load = os.getloadavg()
  result = {"steps": _STEPS.value, "seeds": _SEEDS.value, "eval_samples_per_seed": EVAL_GROUPS * 4,
            "loadavg_before": load, "forced": {}, "pipeline": {}}
  for objective in OBJECTIVES:
    result["forced"][objective] = forced_runs(objective, ks, _STEPS.value, _SEEDS.value)
  base = result["forced"]["decoupled"][ks[0]]["final_reward"]
  for objective, per_k in result["forced"].items():
    for k, r in per_k.items():
      r["final_vs_decoupled_k0"] = r["final_reward"] / base
      print(f"{objective:>10} k={k}: final reward / decoupled k={ks[0]}: {r['final_vs_decoupled_k0']:.3f}")
  if _AUTO_STEPS.value:
    for k in (0, 2, "auto"):
      result["pipeline"][str(k)] = r = pipeline_run(k, _AUTO_STEPS.value)
      print(f"pipeline max_staleness={k}: {r['samples_per_s']:.1f} samples/s, reward (last 3 steps) "
            f"{r['reward_last3']:.3f}, mean staleness {r['staleness_mean']:.2f}, k chosen {r['admit_staleness']}",
            flush=True)
    ref = result["pipeline"]["0"]["samples_per_s"]
    for r in result["pipeline"].values():
      r["throughput_vs_k0"] = r["samples_per_s"] / ref
  result["loadavg_after"] = os.getloadavg()
  out = pathlib.Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2, default=str) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
