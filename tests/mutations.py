"""Wiring proof for the learner's objective: cut each wire in turn and show that a test fails.

    JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m tests.mutations [--only NAME ...] [--out bench/results/mutations.json]

Each mutation below replaces one snippet of jaxrl/learner/ (each LossConfig field that reaches the loss, prox vs mu,
the reference, every mask, the IS cap, the aggregation weights) in a copy of the repository, then runs the learner
tests there (its `first` files, then all of tests/test_learner_*.py if those pass). A mutation is killed when a test
fails. The script prints one row per mutation and exits 1 if any survives. tests/test_mutations.py checks that every
snippet is still in the code, once, so the table cannot silently go stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LEARNER_TESTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_learner_*.py"))


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str  # what the cut does
  path: str  # the file, relative to the repository root
  old: str  # the snippet cut (must occur exactly once)
  new: str
  first: tuple[str, ...] = ()  # tests to run first (all the learner tests only if these pass)


L, S, C = "jaxrl/learner/losses.py", "jaxrl/learner/step.py", "jaxrl/learner/packing.py"


def T(*names: str) -> tuple[str, ...]:
  """Test files or node ids under tests/test_learner_<name>."""
  return tuple(f"tests/test_learner_{n}" if "::" in n else f"tests/test_learner_{n}.py" for n in names)


OFF, STEP, SUP = "offpolicy.py::test_", "step.py::test_", "supports.py::test_"
DECOUPLED = OFF + "decoupled_ppo_two_minibatches_on_stale_data_is_the_exact_update"
MUTATIONS = (
    Mutation("advantage: always grpo", S, "batch.sample_mask_B.reshape(-1),\n                           cfg)",
             "batch.sample_mask_B.reshape(-1),\n                           cfg.replace(advantage='grpo'))",
             T("bandit.py::test_single_step_bandit_gradient_direction")),
    Mutation("adv_eps: ignored", "jaxrl/learner/advantages.py", "cfg.adv_eps", "1e-6",
             T("losses.py::test_advantages_ignore_padding_nan_and_dispatch")),
    Mutation("aggregation: always token_mean", S, "config.loss.aggregation, config.loss.norm_length",
             "'token_mean', config.loss.norm_length", T("bandit")),
    Mutation("norm_length: ignored", S, "config.loss.aggregation, config.loss.norm_length",
             "config.loss.aggregation, 0", T("bandit.py::test_two_step_bandit_needs_sequence_level_weights")),
    Mutation("policy_loss: gspo scored as ppo", L, 'elif cfg.policy_loss == "ppo":',
             'elif cfg.policy_loss in ("ppo", "gspo"):', T(OFF + "gspo_averages_over_sequences_not_tokens")),
    Mutation("policy_loss: pg scored as ppo", L, 'if cfg.policy_loss == "pg":', 'if cfg.policy_loss == "none":',
             T("losses")),
    Mutation("clip_low: ignored", L, "ppo_surrogate(log_ratio, adv_BxL, cfg.clip_low, cfg.clip_high)",
             "ppo_surrogate(log_ratio, adv_BxL, 0.999999, cfg.clip_high)", T("losses")),
    Mutation("clip_high: ignored", L, "ppo_surrogate(log_ratio, adv_BxL, cfg.clip_low, cfg.clip_high)",
             "ppo_surrogate(log_ratio, adv_BxL, cfg.clip_low, 1e9)", T("losses")),
    Mutation("dual_clip: not applied", L, "if cfg.dual_clip is not None:", "if False:",
             T(OFF + "dual_clip_acts_on_a_stale_token_at_the_default_settings")),
    Mutation("dual_clip: on u alone (the old rule)", L, "dual_clip(token_loss, adv_BxL, cfg.dual_clip)",
             "(lambda held: (w * held[0], held[1]))(dual_clip(surrogate, adv_BxL, cfg.dual_clip))",
             T(OFF + "dual_clip_acts_on_a_stale_token_at_the_default_settings")),
    Mutation("proximal: anchor at mu instead of prox", L,
             "prox_logp_BxL = anchor = jax.lax.stop_gradient(jnp.where(anchored_BxL, prox_logp_BxL, 0.0))",
             "prox_logp_BxL = jax.lax.stop_gradient(jnp.where(anchored_BxL, prox_logp_BxL, 0.0))\n"
             "    anchor = behavior_logp_BxL", T(DECOUPLED)),
    Mutation("proximal: no pre-step pass (prox = current)", S,
             'prox = x["prox"] if config.prox_pass else jax.lax.stop_gradient(logp)',
             "prox = jax.lax.stop_gradient(logp)", T(DECOUPLED)),
    Mutation("proximal: interpolate as recompute", S,
             "alpha = jnp.where(v_now > v_t, (v0 - v_t) / jnp.maximum(v_now - v_t, 1e-6), 1.0).clip(0.0, 1.0)",
             "alpha = jnp.ones_like(v_t, jnp.float32)",
             T(STEP + "interpolated_proximal_lies_between_behavior_and_current")),
    Mutation("is_level: no IS weights", L, 'if cfg.is_level == "none":', "if True:", T("losses")),
    Mutation("is_level: sequence as token", L, 'if cfg.is_level == "sequence":', "if False:", T("losses")),
    Mutation("is_level: sequence_mean as token", L, 'elif cfg.is_level == "sequence_mean":', "elif False:",
             T(OFF + "length_normalised_sequence_weights")),
    Mutation("IS weights: not applied to the surrogate", L, "token_loss, dual = w * surrogate, no",
             "token_loss, dual = surrogate, no", T("losses")),
    Mutation("is_cap: ignored", L, "cap = jnp.float32(jnp.inf if cfg.is_cap is None else cfg.is_cap)",
             "cap = jnp.float32(jnp.inf)", T("losses")),
    Mutation("is_ess_min: ignored", L, "if cfg.is_ess_min is not None:", "if False:",
             T(OFF + "ess_cap_reaches_the_target_and_is_applied")),
    Mutation("is_mask_low: ignored", L, "if cfg.is_mask_low is not None:", "if False:", T("losses")),
    Mutation("is_mask_high: ignored", L, "if cfg.is_mask_high is not None:", "if False:", T("losses")),
    Mutation("IS mask: masked tokens kept", L, "active = anchored_BxL & keep", "active = anchored_BxL",
             T("losses")),
    Mutation("kl_coef: k2 term dropped", L, "kl_loss = cfg.kl_coef * jnp.sum(", "kl_loss = 0.0 * jnp.sum(",
             T(OFF + "k2_gradient_is_the_reverse_kl_gradient_under_stale_samples")),
    Mutation("KL: weight pi/mu truncated at 2 (the old rule)", L, "ratio_BxL * kl_k2(logp_BxL, ref_logp_BxL)",
             "jnp.minimum(ratio_BxL, 2.0) * kl_k2(logp_BxL, ref_logp_BxL)",
             T(OFF + "k2_gradient_is_the_reverse_kl_gradient_under_stale_samples")),
    Mutation("KL: weight pi/mu dropped", L, "ratio_BxL * kl_k2(logp_BxL, ref_logp_BxL)",
             "kl_k2(logp_BxL, ref_logp_BxL)", T(OFF + "k2_gradient_is_the_reverse_kl_gradient_under_stale_samples")),
    Mutation("kl_estimator: k1_reward not in the reward", S,
             "return rewards_B - cfg.kl_coef * kl_reward_B, kl_reward_B", "return rewards_B, kl_reward_B",
             T(OFF + "k1_in_the_reward_equals_training_on_shaped_rewards")),
    Mutation("ref: the current params instead of ref_params", S,
             "token_logprobs_of(config, state.ref_params, x, state.frozen)",
             "token_logprobs_of(config, state.params, x, state.frozen)",
             T(STEP + "kl_to_reference_params")),
    Mutation("entropy_coef: ignored", L, "ent_loss = -cfg.entropy_coef * jnp.sum(", "ent_loss = -0.0 * jnp.sum(",
             T("losses")),
    Mutation("sampling: learner scores plain softmax", S,
             'return token_logprobs(logits, x["tokens"], config.loss.sampling)',
             'return token_logprobs(logits, x["tokens"])',
             T("onpolicy.py::test_train_step_on_policy_top_p_ratios_one_and_no_clip")),
    Mutation("log_ratio_clamp: ignored", L,
             "log_ratio = jnp.clip(logp_BxL - anchor, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)",
             "log_ratio = logp_BxL - anchor", T("losses.py::test_log_ratio_clamp_bounds_the_ratio")),
    Mutation("mask: pi's support dropped", L, "if in_support_BxL is not None:\n    counted &= in_support_BxL",
             "if False:\n    counted &= in_support_BxL", T(STEP + "out_of_support_tokens_are_dropped_and_counted")),
    Mutation("mask: prox's support dropped", L,
             "anchored = counted if prox_in_support_BxL is None else counted & prox_in_support_BxL",
             "anchored = counted", T(SUP + "a_token_that_left_the_pre_step_support_gets_no_weight_and_is_counted")),
    Mutation("mask: ref's support dropped", L,
             "on_ref = counted if ref_in_support_BxL is None else counted & ref_in_support_BxL",
             "on_ref = counted", T(SUP + "a_token_outside_the_reference_support_has_no_kl_term_and_is_counted")),
    Mutation("mask: loss mask dropped (observations trained)", S,
             '"loss_mask": batch.loss_mask_BxL.astype(jnp.float32)',
             '"loss_mask": (batch.segment_ids_BxL > 0).astype(jnp.float32)',
             T(SUP + "observation_tokens_get_exactly_zero_gradient_and_no_length")),
    Mutation("mask: sample mask dropped (padding trained)", S,
             '"sample_mask": batch.sample_mask_B.astype(jnp.float32).reshape(b, -1)',
             '"sample_mask": jnp.ones_like(batch.sample_mask_B, jnp.float32).reshape(b, -1)',
             T(STEP + "garbage_in_padding_is_ignored")),
    Mutation("aggregation weights: token_mean not normalised", L,
             "return mask / jnp.maximum(mask.sum(), 1.0)", "return mask", T("losses.py::test_aggregation_weights")),
    Mutation("aggregation weights: seq_mean not over samples", L,
             "return mask / jnp.maximum(segment_sums(mask, segment_ids_BxL), 1.0) / num_samples",
             "return mask / jnp.maximum(segment_sums(mask, segment_ids_BxL), 1.0)",
             T("losses.py::test_aggregation_weights")),
    Mutation("aggregation weights: seq_mean over rows, not segments", L,
             "return mask / jnp.maximum(segment_sums(mask, segment_ids_BxL), 1.0) / num_samples",
             "return mask / jnp.maximum(segment_sums(mask, None), 1.0) / num_samples",
             T("packing.py::test_packed_step_equals_unpacked[rloo_seqmean_seqIS-1-1]")),
    Mutation("packing: mini-batches over rows, not samples", C, "layout[i * m + j] = row",
             "layout[j * len(pack) + i] = row", T("packing.py::test_packed_minibatches_hold_their_own_samples")),
)


def apply(mutation: Mutation, root: pathlib.Path) -> None:
  """Cuts the wire in the copy at `root`; ValueError if the snippet is not there exactly once."""
  path = root / mutation.path
  text = path.read_text()
  if text.count(mutation.old) != 1:
    raise ValueError(f"{mutation.name}: the snippet occurs {text.count(mutation.old)} times in {mutation.path}")
  path.write_text(text.replace(mutation.old, mutation.new))


def _pytest(root: pathlib.Path, files: list[str], timeout: int) -> tuple[bool, str]:
  """(all passed, the first failure's name or the summary line) of pytest -x over `files` in `root`."""
  # The checkout's compilation cache: the copy's unmutated programs compile once, not once per mutation.
  env = dict(os.environ, PYTHONPATH=str(root), JAX_NUM_CPU_DEVICES=os.environ.get("JAX_NUM_CPU_DEVICES", "8"),
             JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache")))
  run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files], cwd=root,
                       env=env, capture_output=True, text=True, timeout=timeout)
  failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in run.stdout.splitlines()
            if line.startswith("FAILED ")]
  summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip()[-200:]
  return run.returncode == 0, failed[0] if failed else summary


def run_one(mutation: Mutation, timeout: int) -> dict:
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jaxrl-mutant-") as tmp:
    root = pathlib.Path(tmp)
    for part in ("jaxrl", "tests", "configs", "pyproject.toml"):
      src = ROOT / part
      (shutil.copytree if src.is_dir() else shutil.copy)(src, root / part)
    apply(mutation, root)
    passed, detail = _pytest(root, list(mutation.first), timeout) if mutation.first else (True, "")
    if passed:
      passed, detail = _pytest(root, LEARNER_TESTS, timeout)
  return {"mutation": mutation.name, "file": mutation.path, "killed": not passed, "by": detail,
          "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", nargs="*", default=None, help="mutation names to run (default: all)")
  parser.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
  parser.add_argument("--out", default="bench/results/mutations.json")
  args = parser.parse_args(argv)
  chosen = [m for m in MUTATIONS if args.only is None or m.name in args.only]
  rows = []
  print("| mutation | killed | by |\n|---|---|---|", flush=True)
  for mutation in chosen:
    row = run_one(mutation, args.timeout)
    rows.append(row)
    print(f"| {row['mutation']} | {'yes' if row['killed'] else 'NO'} | {row['by']} |", flush=True)
  pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))
  survivors = [r["mutation"] for r in rows if not r["killed"]]
  print(f"{len(rows) - len(survivors)} of {len(rows)} mutations killed" + (f"; survived: {survivors}" if survivors
                                                                            else ""))
  return 1 if survivors else 0


if __name__ == "__main__":
  sys.exit(main())
