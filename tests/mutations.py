"""Wiring proof: cut each wire in turn and show that a test fails.

    JAX_NUM_CPU_DEVICES=8 .venv/bin/python -m tests.mutations [--only NAME ...] [--area PATH ...] [--first-only]
        [--out bench/results/mutations.json]

Each mutation below replaces one snippet of the code in a copy of the repository: the learner's objective (each
LossConfig field that reaches the loss, prox vs mu, the reference, every mask, the IS cap, the aggregation weights),
then the wiring around it: the sampler (behaviour logprobs, versions, stops, sampling filters, slot refill, the page
allocator), the controller (deadline assembly, the learner loop's own checks, skipped updates, published versions,
the ledger), the reward runner (what a timeout or a crash scores), checkpoints and resume (the newest restored and
kept, rng, data position, pending groups) and packing. It then runs, there, the mutation's `first` tests, then every
test of its area (GROUPS; not with --first-only). A mutation is killed when a test fails; a test that hangs (the run
past --timeout, or a pytest-timeout failure) is not a kill. The script prints one row per mutation and exits 1 if any
survives. tests/test_mutations.py checks that every snippet is still in the code, once, so the table cannot silently
go stale.
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
# Each area's test group (tests/ globs), by the path prefix of the code it tests: what a cut there must fail.
GROUPS = {"jaxrl/learner/": ("test_learner_*.py",), "jaxrl/sampler/": ("test_sampler_*.py",),
          "jaxrl/controller/": ("test_controller_*.py", "test_checkpoint*.py"),
          "jaxrl/envs/runner.py": ("test_envs_runner.py", "security/test_model_code.py"),
          "jaxrl/checkpoint.py": ("test_checkpoint*.py",),
          "jaxrl/envs/sandbox.py": ("test_envs_sandbox.py", "test_envs_guard.py", "security/test_model_code.py"),
          "jaxrl/envs/wire.py": ("test_envs_runner.py", "security/test_model_code.py"),
          "jaxrl/envs/isolation.py": ("test_envs_sandbox.py", "security/test_model_code.py"),
          "jaxrl/envs/guard.py": ("test_envs_guard.py",),
          "jaxrl/models/moe.py": ("test_moe.py", "test_learner_moe.py"), "jaxrl/rollout.py": ("test_learner_*.py",),
          "jaxrl/distributed/cross_process.py": ("test_distributed.py",),
          "jaxrl/distributed/packets.py": ("test_distributed.py",),
          "jaxrl/distributed/hub.py": ("test_distributed_hub.py", "security/test_network_peers.py"),
          "jaxrl/distributed/follow.py": ("test_distributed_follow.py", "security/test_network_peers.py"),
          "jaxrl/distributed/rpc.py": ("test_distributed_rpc.py", "security/test_network_peers.py"),
          "jaxrl/distributed/weight_service.py": ("test_weight_service.py", "security/test_network_peers.py"),
          "jaxrl/distributed/learner_main.py": ("security/test_network_peers.py",)}


def group_tests(path: str) -> list[str]:
  """The test files of the area of `path` (GROUPS); ValueError for code outside every area."""
  prefix = next((p for p in GROUPS if path.startswith(p)), None)
  if prefix is None:
    raise ValueError(f"{path} is in no test group of tests/mutations.py (GROUPS)")
  return sorted(str(p.relative_to(ROOT)) for pattern in GROUPS[prefix] for p in (ROOT / "tests").glob(pattern))


@dataclasses.dataclass(frozen=True)
class Mutation:
  name: str  # what the cut does
  path: str  # the file, relative to the repository root
  old: str  # the snippet cut (must occur exactly once)
  new: str
  first: tuple[str, ...] = ()  # tests to run first (then, if these pass, every test of the area: group_tests)


L, S, C = "jaxrl/learner/losses.py", "jaxrl/learner/step.py", "jaxrl/learner/packing.py"


def T(*names: str) -> tuple[str, ...]:
  """Test files or node ids under tests/test_learner_<name>."""
  return tuple(f"tests/test_learner_{n}" if "::" in n else f"tests/test_learner_{n}.py" for n in names)


OFF, STEP, SUP = "offpolicy.py::test_", "step.py::test_", "supports.py::test_"
DECOUPLED = OFF + "decoupled_ppo_two_minibatches_on_stale_data_is_the_exact_update"
OBJECTIVE = (
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
    # packing, beyond the mini-batches
    Mutation("packing: a row past max_segments", C, "if free >= lengths[i] and len(rows[r]) < max_segments:",
             "if free >= lengths[i]:", T("packing.py::test_first_fit_decreasing_respects_budget_and_slots")),
    Mutation("packing: every segment starts at column 0", C, "      start += rollouts[i].num_tokens\n", "",
             T("packing.py::test_pack_batch_layout")),
    Mutation("packing: segment sums across rows", C,
             "ids = (jnp.arange(b)[:, None] * (l + 1) + segment_ids_BxL).reshape(-1)",
             "ids = segment_ids_BxL.reshape(-1)", T("packing.py::test_segment_sums_and_to_tokens")),
    Mutation("packing: padding takes a sample's value", C,
             "return jnp.where(segment_ids_BxL > 0, jnp.take_along_axis(values_BxG, slot, axis=1), fill)",
             "return jnp.take_along_axis(values_BxG, slot, axis=1)", T("packing.py::test_segment_sums_and_to_tokens")),
)

SP, SD, SE = "jaxrl/sampler/sampling.py", "jaxrl/sampler/decode.py", "jaxrl/sampler/sampler.py"
PA, AD = "jaxrl/sampler/page_allocator.py", "jaxrl/sampler/admission.py"
SAMPLING = "tests/test_sampler_sampling.py::test_filtered_logprobs_match_numpy_reference"
ENGINE = "tests/test_sampler_engine.py::test_"
ALLOC = "tests/test_sampler_page_allocator.py"
SAMPLER = (
    Mutation("sampling: temperature ignored", SP,
             "scaled_NxV = logits_NxV / jnp.where(greedy_N, 1.0, temperature_N)[:, None]",
             "scaled_NxV = logits_NxV", (SAMPLING,)),
    Mutation("sampling: top-p drops the token that crosses p", SP,
             "mass_before_NxV = jnp.cumsum(probs_NxV, axis=-1) - probs_NxV",
             "mass_before_NxV = jnp.cumsum(probs_NxV, axis=-1)", (SAMPLING,)),
    Mutation("sampling: top-p alone skips the filter", SP,
             "needs_filter = jnp.any(~greedy_N & (((top_k_N > 0) & (top_k_N < v)) | (top_p_N < 1.0)))",
             "needs_filter = jnp.any(~greedy_N & (top_k_N > 0) & (top_k_N < v))", (SAMPLING,)),
    Mutation("sampling: ties at the cut-off dropped", SP,
             "return jnp.where(scaled_NxV >= threshold_N, scaled_NxV, _NEG_INF)",
             "return jnp.where(scaled_NxV > threshold_N, scaled_NxV, _NEG_INF)", (SAMPLING,)),
    Mutation("behaviour logprobs: the raw softmax, not the filtered distribution", SP,
             "return tokens_N, jnp.take_along_axis(lp_NxV, tokens_N[:, None], axis=-1)[:, 0]",
             "return tokens_N, jnp.take_along_axis(jax.nn.log_softmax(logits_NxV.astype(jnp.float32)), "
             "tokens_N[:, None], axis=-1)[:, 0]", (ENGINE + "behavior_logprobs_equal_full_forward",)),
    Mutation("versions: tagged with the sampler's current version, not the call's", SE,
             "sample.versions += [version] * n", "sample.versions += [self.version] * n",
             (ENGINE + "in_flight_update_tags_each_token_with_its_version",)),
    Mutation("stop strings: the cut leaves logprobs and versions behind", SE,
             "del sample.tokens[cut:], sample.logprobs[cut:], sample.versions[cut:]", "del sample.tokens[cut:]",
             (ENGINE + "stop_string_found_late_in_a_long_completion",)),
    Mutation("slot refill: a refilled slot reads its old occupant's call", SE,
             "if sample is None or self._slots[slot] is not sample or call.turns[slot] != sample.turn:",
             "if sample is None or call.turns[slot] != sample.turn:",
             (ENGINE + "stop_strings_end_the_sample_and_free_the_slot",
              ENGINE + "greedy_continuous_batching_equals_one_at_a_time")),
    Mutation("decode: one token past max_new", SD, "(num_generated >= s.max_new)", "(num_generated > s.max_new)",
             (ENGINE + "stop_tokens_eos_and_lengths",)),
    Mutation("decode: stop tokens ignored on the device", SD,
             "stop = jnp.any(new_S[:, None] == s.stop_ids, axis=-1)", "stop = jnp.zeros_like(active)",
             (ENGINE + "stop_tokens_eos_and_lengths",)),
    Mutation("pages: the last prompt token's page shared", PA, "return (prompt_len - 1) // page_size",
             "return prompt_len // page_size",
             (ALLOC, "tests/test_sampler_paged.py::test_samples_never_write_the_shared_prompt_pages")),
    Mutation("pages: a slot takes no reference to its shared pages", PA,
             "    self.refs_P[list(shared)] += 1\n", "", (ALLOC,)),
    Mutation("pages: freed while still referenced", PA, "if self.refs_P[p] == 0:", "if self.refs_P[p] <= 1:",
             (ALLOC,)),
    Mutation("pages: preemption takes the oldest slot", PA, "victims.append(live.pop())",
             "victims.append(live.pop(0))", (ALLOC,)),
    Mutation("admission: a group's prompt keys reused across an update", AD,
             "if g.prefix is None or g.prefix.version != params.version:", "if g.prefix is None:",
             (ENGINE + "a_group_admitted_across_an_update_prefills_its_prompt_again_with_the_new_params",)),
    Mutation("admission: a resumed sample's draws start over", AD, "self.policy.insert(slot, prefix, settings, drawn)",
             "self.policy.insert(slot, prefix, settings, 0)",
             ("tests/test_sampler_paged.py::test_out_of_pages_preempts_and_keeps_every_sample",)),
)

AS, LL, LE, WP = ("jaxrl/controller/assembly.py", "jaxrl/controller/learner_loop.py", "jaxrl/controller/ledger.py",
                  "jaxrl/controller/weights.py")
BOOK = "tests/test_controller_assembly.py::test_"
HUB, HUB_T = "jaxrl/distributed/hub.py", "tests/test_distributed_hub.py::test_"
LOOP = "tests/test_controller_learner_loop.py::test_"
LOCAL = "tests/test_controller_channels_local.py::test_"
REJECT = BOOK + "reject_reason_names_failed_rewards_and_overlong_groups"
SKIP = LOOP + "a_skipped_update_drops_its_groups_tells_the_samplers_and_publishes_nothing"
CONTROLLER = (
    Mutation("assembly: deadline one step late", AS, "self.deadline[group_id] = version + self.admit_bound",
             "self.deadline[group_id] = version + self.admit_bound + 1",
             (BOOK + "out_of_order_completion_drops_nothing_and_keeps_the_bound",)),
    Mutation("assembly: room for one step too many", AS,
             "places = max(0, last - self.step + 1) * self.gb", "places = max(0, last - self.step + 2) * self.gb",
             (BOOK + "a_share_waits_for_a_group_due_now_and_fills_in_completion_order",)),
    Mutation("assembly: skipped updates not in the book's step", AS, "return self.base + self.shares - self.skipped",
             "return self.base + self.shares", (BOOK + "skipped_updates_and_discards_give_the_room_back",)),
    Mutation("learner loop: the filter ignored", LL,
             "reject_reason(group, self.spec.rl.seq_len, self.spec.rl.filter_groups)",
             "reject_reason(group, self.spec.rl.seq_len)",
             (LOOP + "filtered_and_cancelled_groups_are_dropped_under_their_reasons_never_trained",)),
    Mutation("assembly: a group the sampler left out (cancelled) trained", AS, "    return group[0].left_out\n",
             "    pass\n", (LOOP + "filtered_and_cancelled_groups_are_dropped_under_their_reasons_never_trained",)),
    Mutation("sampler loop: the learner's skipped updates ignored", "jaxrl/controller/sampler_loop.py",
             "self.book.skipped = asks.updates_skipped - skipped_at_start", "self.book.skipped = 0",
             (BOOK + "the_sampler_loop_counts_the_learners_skipped_updates_in_its_book",)),
    Mutation("assembly: deadlines ignored (completion order)", AS, "due = set(order[:need])", "due = set()",
             (BOOK + "a_share_waits_for_a_group_due_now_and_fills_in_completion_order",)),
    Mutation("assembly: a share formed while a due group generates", AS,
             "if not due <= done:\n      return None", "if False:\n      return None",
             (BOOK + "a_share_waits_for_a_group_due_now_and_fills_in_completion_order",)),
    Mutation("assembly: back-pressure one group late", AS, "len(self.finished) >= self.max_finished",
             "len(self.finished) > self.max_finished",
             (BOOK + "finished_groups_waiting_for_the_learner_stop_admission",)),
    Mutation("dynamic sampling: surplus groups never cancelled", "jaxrl/controller/sampler_loop.py",
             "        self._finish(self._complete_groups(self._cancel_doomed()))\n", "",
             ("tests/faults/test_faults_filter.py::test_only_groups_with_signal_are_trained_and_every_filtered_"
              "group_is_counted[sync]",)),
    Mutation("sampler: a cancelled slot left running", "jaxrl/sampler/sampler.py",
             "        self.cache.state = self.engine.release(self.cache.state, slot)  # results in flight for it are "
             "dropped\n        self._free(slot)\n", "",
             ("tests/test_sampler_paged.py::test_cancel_ends_a_group_and_frees_its_slots_and_pages_for_the_others",)),
    Mutation("assembly: back-pressure off (a run's finished groups pile up)", AS,
             "if self.max_finished is not None and len(self.finished) >= self.max_finished:",
             "if False:", ("tests/faults/test_faults_load.py::test_finished_groups_waiting_stop_admission",)),
    Mutation("assembly: an infinite reward trained", AS, "if any(not np.isfinite(r.reward) for r in group):",
             "if any(np.isnan(r.reward) for r in group):", (REJECT,)),
    Mutation("assembly: a group that fills seq_len exactly is too long", AS,
             "if any(r.num_tokens > seq_len for r in group):", "if any(r.num_tokens >= seq_len for r in group):",
             (REJECT,)),
    Mutation("learner loop: staleness guard off", LL, "    if over:\n", "    if False:\n",
             (LOOP + "a_group_at_the_staleness_bound_trains_and_one_past_it_stops_the_step",)),
    Mutation("learner loop: staleness guard one step strict", LL,
             "if len(r.versions) and step - r.min_version > self.spec.max_staleness]",
             "if len(r.versions) and step - r.min_version >= self.spec.max_staleness]",
             (LOOP + "a_group_at_the_staleness_bound_trains_and_one_past_it_stops_the_step",)),
    Mutation("learner loop: sampling settings not checked", LL,
             "    check_sampling(samples, self.spec.sampler.sampling)\n", "",
             (LOOP + "a_group_drawn_with_other_sampling_settings_stops_the_step",)),
    Mutation("learner loop: a skipped update counted as applied", LL,
             "applied = int(jax.device_get(state.version)) > step", "applied = True", (SKIP,)),
    Mutation("learner loop: a skipped update's groups not dropped", LL,
             'self._settle(groups, None if applied else "update_skipped")',
             "self._settle(groups if applied else [], None)", (SKIP,)),
    Mutation("learner loop: samplers not told of a skipped update", "jaxrl/controller/coordinator.py",
             "    self._asks = self._asks._replace(updates_skipped=self._asks.updates_skipped + 1)\n", "", (SKIP,)),
    Mutation("learner loop: one rng for every step", LL, "jax.random.fold_in(self._base_key, train_step)",
             "self._base_key", (LOOP + "every_step_trains_with_the_rng_of_its_own_train_step",)),
    Mutation("learner loop: params published under the old version", LL,
             "self.weights.publish(self.state.params, version)",
             "self.weights.publish(self.state.params, version - 1)",
             (LOOP + "an_applied_step_trains_its_samples_and_publishes_its_version",)),
    Mutation("weights: the same version taken again", WP,
             "return latest if latest is not None and latest.version > version else None",
             "return latest if latest is not None and latest.version >= version else None",
             (LOCAL + "publisher_versions_and_bitwise_params",)),
    Mutation("weights: a version published twice", WP,
             "if self._latest is not None and version <= self._latest.version:",
             "if self._latest is not None and version < self._latest.version:",
             (LOCAL + "publisher_versions_and_bitwise_params",)),
    Mutation("ledger: drops count groups, not samples", LE, "self.dropped[reason] += len(group)",
             "self.dropped[reason] += 1", (LOCAL + "ledger_round_trip",)),
    Mutation("ledger: trained tokens not counted", LE, "    self.tokens_trained += _completion_tokens(samples)\n", "",
             (LOCAL + "ledger_measures_trained_against_generated_lengths",)),
)

RR = "jaxrl/envs/runner.py"
RUNNER_T = "tests/test_envs_runner.py::test_"
RUNNER = (
    Mutation("reward runner: a timeout scores 0", RR,
             'results[w.job[0]] = _failed("timeout", f"reward fn took longer than {self.timeout_s}s; worker killed")',
             "results[w.job[0]] = RewardResult(0.0, True)", (RUNNER_T + "hanging_fn_is_killed_in_bounded_time",)),
    Mutation("reward runner: a crash scores 0", RR,
             'else _failed("crash", f"reward worker died (exit code {code})"))', "else RewardResult(0.0, True))",
             (RUNNER_T + "crashing_worker_and_bad_values",)),
    Mutation("reward runner: a failure's value is 0, not NaN", RR,
             "return RewardResult(math.nan, False, error, reason)", "return RewardResult(0.0, False, error, reason)",
             (RUNNER_T + "raising_fn_is_counted",)),
)

CK, BUILD, SPEC = "jaxrl/checkpoint.py", "jaxrl/controller/build.py", "jaxrl/controller/spec.py"
NEWEST = "tests/test_checkpoint.py::test_the_newest_checkpoint_is_restored_and_the_newest_ones_are_kept"
RESUME = ("tests/test_checkpoint.py::"
          "test_a_resume_gets_back_its_state_and_data_position_and_counts_the_samples_it_discards")
DAMAGED = ("tests/faults/test_faults_checkpoint.py::"
           "test_damaged_newest_checkpoint_is_named_and_the_previous_one_restored")
CHECKPOINT = (
    Mutation("restore: the oldest checkpoint, not the newest", CK,
             "steps = self._steps_on_disk()[::-1] if step is None else [step]",
             "steps = self._steps_on_disk() if step is None else [step]", (NEWEST,)),
    Mutation("retention: the oldest checkpoints kept", CK, "keep = self.verified_steps()[-self.max_to_keep :]",
             "keep = self.verified_steps()[: self.max_to_keep]", (NEWEST,)),
    Mutation("restore: arrays and record not checked against the marker", CK,
             'integrity.check_restored(step_dir, marker, integrity.to_hex(integrity.array_checksums(out["state"])),',
             '(lambda *unchecked: None)(step_dir, marker, integrity.to_hex(integrity.array_checksums(out["state"])),',
             (DAMAGED + "[arrays_differ]",)),
    Mutation("restore: files not checked against the marker", CK, "    integrity.check_files(step_dir, marker)\n", "",
             (DAMAGED + "[missing_file]",)),
    Mutation("restore: a fresh rng", CK, "return state.replace(rng=jax.random.wrap_key_data(state.rng)), out",
             "return state.replace(rng=jax.random.key(0)), out", (NEWEST,)),
    Mutation("resume: the live state, not the restored one", BUILD, "state = state.replace(frozen=live.frozen)",
             "state = live.replace(frozen=live.frozen)", (RESUME,)),
    Mutation("resume: samples held at the checkpoint not counted as discarded", BUILD,
             "  record.ledger.samples_discarded_at_resume += record.ledger.held_at_checkpoint()\n", "", (RESUME,)),
    Mutation("resume: data position from 0", SPEC, 'return cls(d["next_group_id"], list(d["pending_group_ids"])',
             'return cls(0, list(d["pending_group_ids"])', (RESUME,)),
    Mutation("resume: pending groups not generated again", "jaxrl/controller/coordinator.py",
             "self._regenerate = list(self._record.pending_group_ids)", "self._regenerate = []", (RESUME,)),
    Mutation("ledger: in flight ignores what a resume discarded", LE,
             "self.samples_dropped - self.samples_discarded_at_resume\n",
             "self.samples_dropped\n", (RESUME,)),
)

GUARD_T = "tests/test_envs_guard.py::test_"
FILTER_T = "tests/faults/test_faults_filter.py::test_"
GUARD = (
    Mutation("sandbox: import roots nobody can reach left as they are", "jaxrl/envs/sandbox.py",
             "    keep_imports_reachable()\n", "",
             (GUARD_T + "math_verify_scores_in_its_sandbox_from_an_install_nobody_can_read",)),
    Mutation("self-check: a right answer scored 0 passes", "jaxrl/envs/guard.py",
             "check.right is None or check.right and result.value == 1.0",
             "check.right is None or check.right and result.value >= 0.0", (GUARD_T + "verdict",)),
    Mutation("self-check: skipped by the run's scorer", "jaxrl/controller/data.py",
             "  if t.self_check:\n", "  if False:\n",
             (GUARD_T + "the_run_scorer_self_checks_its_rewards_before_it_scores",)),
    Mutation("failure window: never stops the run", "jaxrl/envs/guard.py",
             "if failed and len(errors) > self.max_frac * self.size:", "if False:",
             (GUARD_T + "the_failure_window_stops_on_the_first_failure_over_its_fraction",)),
    Mutation("failure window: counts every failure of the run, not the window's", "jaxrl/envs/guard.py",
             "errors = [e for e in self._recent if e is not None]",
             "errors = [e for e in self._recent if e is not None] + [None] * (self.failures - 1)",
             (GUARD_T + "the_failure_window_forgets_old_failures_and_passes_scattered_ones",)),
    Mutation("dynamic sampling: zero-variance groups trained", "jaxrl/controller/assembly.py",
             'if filter_groups == "zero_variance" and scored_alike(group):', "if False:",
             (FILTER_T + "only_groups_with_signal_are_trained_and_every_filtered_group_is_counted",)),
    Mutation("dynamic sampling: filtered groups never bounded", "jaxrl/controller/coordinator.py",
             "if filtered >= self.max_filtered_in_a_row:", "if False:",
             (FILTER_T + "a_policy_that_leaves_nothing_to_train_stops_the_run_with_one_line",)),
    Mutation("dynamic sampling: over-ask ignores the filter rate", "jaxrl/controller/assembly.py",
             "return min(MAX_OVER_ASK, (finished + 1) / (finished - rejected + 1))", "return 1.0",
             (BOOK + "over_ask_is_the_inverse_kept_fraction_with_a_prior_within_bounds",)),
    Mutation("dynamic sampling: surplus kept past its deadline", "jaxrl/controller/assembly.py",
             "    self._leave_out_past(step, done - chosen)\n", "",
             (BOOK + "over_asked_groups_beyond_the_places_are_surplus_at_their_deadline",)),
    Mutation("pass-rate filter: a resumed sampler starts from an empty table", "jaxrl/controller/sampler_loop.py",
             "copy.deepcopy(coord.resumed_pass_rate))", "{})",
             (FILTER_T + "the_pass_rate_filter_sets_prompts_aside_counted_and_its_table_survives_resume",)),
    Mutation("dynamic sampling: a resumed run learns the filter rate again", "jaxrl/controller/sampler_loop.py",
             "    self.rejected_groups, self.finished_groups = coord.resumed_filter\n", "",
             (BOOK + "a_resumed_run_starts_over_asking_at_the_filter_rate_its_checkpoint_counted",)),
    Mutation("pass-rate filter: a job's samplers resume with an empty table", "jaxrl/distributed/cross_process.py",
             '"pass_rate": copy.deepcopy(record.pass_rate),', '"pass_rate": {},',
             ("tests/test_distributed.py::test_a_checkpoint_record_holds_every_admitted_unsettled_group_and_every_"
              "position_no_sampler_reached",)),
    Mutation("pass-rate filter: a set-aside prompt counted as a failure", "jaxrl/controller/coordinator.py",
             "if set_aside:  # the filter working", "if False:",
             ("tests/test_controller_pass_rate.py::test_a_set_aside_prompt_is_skipped_and_counted_but_is_no_failure",)),
    Mutation("dynamic sampling: a surplus group trained", "jaxrl/controller/assembly.py",
             "  if group[0].left_out is not None:\n    return group[0].left_out\n", "", (REJECT,)),
    Mutation("independent samplers: the hub's part of each share ignored by the loop",
             "jaxrl/controller/sampler_loop.py", "        self.book.gb = asks.groups\n", "        pass\n",
             (BOOK + "the_sampler_loop_admits_for_the_part_of_each_share_it_is_asked_for",)),
    Mutation("independent samplers: every sampler asked for a whole share", HUB,
             "updates_skipped + self._extra, k, self._parts[sid]]", "updates_skipped + self._extra, k, None]",
             (HUB_T + "each_step_is_split_over_the_samplers_and_re_split_as_they_leave_and_join",)),
    Mutation("independent samplers: a joiner's part taken from the others before it delivers", HUB,
             "      if self._delivering:\n        self._joining.add(sid)\n", "",
             (HUB_T + "each_step_is_split_over_the_samplers_and_re_split_as_they_leave_and_join",)),
    Mutation("independent samplers: a split that ignores who is still joining", HUB,
             "ready = [s for s in samplers if s not in joining]", "ready = []",
             (HUB_T + "split_shares_each_step_evenly_and_a_joiner_gets_its_part_on_top_until_it_delivers",)),
    Mutation("independent samplers: a lost part of a share never asked again", HUB,
             "          self._extra += 1  # one more share", "          pass  # one more share",
             (HUB_T + "a_step_that_lacks_groups_nobody_generates_is_asked_again_as_one_more_share",)),
    Mutation("independent samplers: a share asked again moves the samplers' step", HUB,
             "self._asks.updates_skipped + self._extra", "self._asks.updates_skipped",
             (HUB_T + "a_step_that_lacks_groups_nobody_generates_is_asked_again_as_one_more_share",)),
    Mutation("independent samplers: a share asked again while a sampler still generates", HUB,
             "self._pending.get(sid, (None, 0.0))[0] == 0 and", "True or",
             (HUB_T + "a_step_that_lacks_groups_nobody_generates_is_asked_again_as_one_more_share",)),
    Mutation("learner processes: the lead never drops what every follower fetched", "jaxrl/distributed/follow.py",
             "    del self._entries[: max(0, upto - self.first)]\n    self.first = max(self.first, upto)\n", "",
             ("tests/test_distributed_follow.py::test_the_lead_keeps_only_what_some_follower_has_not_fetched",)),
    Mutation("learner processes: the lead's groups not recorded for the followers", "jaxrl/distributed/follow.py",
             "    self.log.took(group)\n", "",
             ("tests/test_distributed_follow.py::test_the_lead_hub_records_what_its_learner_loop_decides_and_takes",)),
)

MOE_TEST = "tests/test_learner_moe.py::test_"
REPLAY = MOE_TEST + "replay_makes_on_policy_ratios_one_and_recompute_does_not"
BALANCE = MOE_TEST + "load_balance_terms_are_in_the_loss_with_the_model_config_coefficients"
RECORDED = MOE_TEST + "sampler_records_the_routing_and_replay_scores_it"
MOE = (
    Mutation("MoE: the load-balancing aux loss cut from the objective", S, "cfg.router_aux_loss_coef * aux",
             "0.0 * aux", (BALANCE,)),
    Mutation("MoE: the router z-loss cut from the objective", S, "cfg.router_z_loss_coef * z", "0.0 * z",
             (BALANCE,)),
    Mutation("routing replay: the recorded experts ignored (routed afresh)", S,
             'replay = x.get("experts") if config.loss.routing == "replay" else None', "replay = None", (REPLAY,)),
    Mutation("routing replay: gated by the fresh top-k's probabilities", "jaxrl/models/moe.py",
             "top_MxK = jnp.take_along_axis(probs_MxX, experts_MxK, axis=-1)", "top_MxK = top_MxK",
             ("tests/test_moe.py::test_route_renormalises_and_replays_with_the_current_router",)),
    Mutation("routing replay: the sampler's routing not recorded", "jaxrl/sampler/sampler.py",
             "sample.experts += list(result.experts_SxCxNxK[slot, :n])", "sample.experts += [None] * n", (RECORDED,)),
    Mutation("routing replay: a decode step's routing recorded at the next step", "jaxrl/sampler/decode.py",
             "out[3].at[:, i].set(", "out[3].at[:, jnp.minimum(i + 1, steps - 1)].set(", (RECORDED,)),
    Mutation("routing replay: a batch puts the routing at the token's own column", "jaxrl/rollout.py",
             "experts[row, p - 1 : end - 1] = r.experts", "experts[row, p:end] = r.experts",
             (MOE_TEST + "batches_and_packing_carry_the_routing", REPLAY)),
    Mutation("routing replay: the prompt's routing not recorded", "jaxrl/sampler/admission.py",
             "prompt_experts=g.prefix.experts_PxNxK)", "prompt_experts=None)", (RECORDED,)),
    Mutation("routing replay: packets across processes drop the routing", "jaxrl/distributed/packets.py",
             "left_out=LEFT_OUT[int(row[14])], experts=experts,\n                prompt_experts=prompt_experts)",
             "left_out=LEFT_OUT[int(row[14])])",
             ("tests/test_distributed_multiprocess.py::test_a_mixture_of_experts_policy_trains_across_processes_on_"
              "its_recorded_routing", "tests/test_distributed.py::test_packet_carries_mixture_of_experts_routing_"
              "bit_for_bit")),
)
RPC, PEERS = "jaxrl/distributed/rpc.py", "tests/security/test_network_peers.py::test_"
NO_SECRET, FORGED = PEERS + "a_peer_without_the_secret_gets_nothing_and_is_counted_nowhere", \
  PEERS + "forged_groups_from_a_peer_with_the_secret_are_refused_under_their_reasons"
FLOOD = PEERS + "a_flood_of_idle_connections_and_oversized_frames_costs_bounded_threads_and_memory"
DESCRIBE = PEERS + "weights_are_described_to_registered_samplers_and_pending_describes_are_capped"
NETWORK = (
    Mutation("network peers: the secret not checked", RPC,
             'if not hmac.compare_digest(answer, mac(self.secret, b"client", w.nonce, client_nonce)):', "if False:",
             (NO_SECRET,)),
    Mutation("network peers: a frame's declared bytes not capped", RPC,
             "if max_frame_bytes is not None and total > max_frame_bytes:", "if False:", (FLOOD,)),
    Mutation("network peers: a header's bytes not capped", RPC, "if size > max_header_bytes:", "if False:",
             (FLOOD,)),
    Mutation("network peers: connections served past the cap", RPC,
             "if not self._slots.acquire(blocking=False):", "if not self._slots.acquire(blocking=True):",
             (PEERS + "authenticated_connections_past_the_cap_are_closed_at_once",)),
    Mutation("network peers: handshakes waiting without a cap", RPC,
             "if len(waiting) >= self.limits.max_handshakes:", "if False:", (FLOOD,)),
    Mutation("network peers: the prompt check removed", HUB,
             "if prompt is not None and any(not np.array_equal(r.prompt_tokens, prompt) for r in group):",
             "if False:", (FORGED,)),
    Mutation("network peers: another sampling accepted at the hub", HUB,
             "if any(r.sampling != spec.sampler.sampling for r in group):", "if False:", (FORGED,)),
    Mutation("network peers: versions the learner never published accepted", HUB,
             "or np.any(np.asarray(r.versions)[model] > version)", "", (FORGED,)),
    Mutation("network peers: a refused group not generated again", HUB,
             "          self._refuse(g, reason)\n          self._generate_again(gid, reason)\n",
             "          self._refuse(g, reason)\n", (FORGED,)),
    Mutation("network peers: a sampler id the hub never gave counted as fenced", HUB,
             '"fenced" if issued else "forged"', '"fenced"', (FORGED,)),
    Mutation("network peers: a sampler holds groups without a cap", HUB,
             "if sum(s == sid for s, _ in self._held.values()) >= self.max_held:", "if False:",
             (PEERS + "the_follow_log_and_a_sampler_s_hold_are_bounded_for_a_peer_with_the_secret",)),
    Mutation("network peers: a follow far past the end taken", "jaxrl/distributed/follow.py",
             "if n > self.first + len(self._entries):", "if False:",
             (PEERS + "the_follow_log_and_a_sampler_s_hold_are_bounded_for_a_peer_with_the_secret",)),
    Mutation("network peers: weights described to a caller the hub does not know", "jaxrl/distributed/learner_main.py",
             "    if not hub.known(request):\n", "    if False:\n", (DESCRIBE,)),
    Mutation("network peers: weight describes not capped", "jaxrl/distributed/weight_service.py",
             "if (sum(s == sampler for s, _, _ in self._pending) >= self.max_pending", "if (False", (DESCRIBE,)),
)
SB, SEC_T = "jaxrl/envs/sandbox.py", "tests/security/test_model_code.py::test_"
PIPE = SEC_T + "what_a_sandboxed_scorer_writes_on_its_pipe_is_never_run_and_fails_only_its_item"
SIGXCPU = SEC_T + "ignoring_sigxcpu_meets_a_hard_cpu_limit_in_run_code_and_in_a_worker"
SECURITY = (
    Mutation("worker messages: pickles accepted beside data (the old channel)", RR,
             "kind, body = wire.decode(w.conn.recv_bytes(wire.MAX_BYTES), _KINDS)",
             "kind, body = (lambda b: pickle.loads(b) if b[:1] == b'\\x80' else wire.decode(b, _KINDS))("
             "w.conn.recv_bytes(wire.MAX_BYTES))", (PIPE,)),
    Mutation("worker messages: an answer taken for whichever item is pending", RR,
             'body.get("seq") != w.job[2]', "False", (PIPE,)),
    Mutation("worker messages: infinities accepted", "jaxrl/envs/wire.py", "parse_float=_finite", "parse_float=float",
             (SEC_T + "the_wire_takes_plain_data_only",)),
    Mutation("sandboxed worker: no CPU watchdog past an ignored SIGXCPU", RR,
             "if w.cpu_seconds() - w.cpu_at_job > self.sandbox.cpu_s + 1:", "if False:", (SIGXCPU,)),
    Mutation("run_code: no hard CPU limit", SB, "soft + 1 if fresh else resource.RLIM_INFINITY",
             "resource.RLIM_INFINITY", (SIGXCPU,)),
    Mutation("sandbox: Landlock skipped", SB, "    ruleset = isolation.restrict(reads, writes, keep=per_item)\n", "",
             (SEC_T + "run_code_cannot_write_outside_its_scratch",
              SEC_T + "a_normal_users_sandbox_holds_the_same_boundaries")),
    Mutation("sandbox: no tmpfs quota on the scratch", SB,
             "    isolation.mount_scratch(scratch, limits.scratch_mb, NOBODY if root else uid, NOBODY if root else "
             "os.getgid())\n", "", (SEC_T + "the_scratch_has_a_total_quota",)),
    Mutation("run_code: the reason read from the program's last stderr line (the old status)", SB,
             'reason = _EXIT_REASONS.get(status, "crash")',
             'reason = (json.loads(_tail(err)).get("reason", "crash") if _tail(err).startswith("{") '
             'else _EXIT_REASONS.get(status, "crash"))', (SEC_T + "programs_cannot_forge_their_status_or_result",)),
    Mutation("process per item: the item's process keeps the trainer's pipe", RR, "        os.close(conn.fileno())\n",
             "", (SEC_T + "an_items_own_process_holds_no_pipe_to_the_trainer",)),
    Mutation("start-up: a kernel without isolation goes on", "jaxrl/envs/isolation.py", "  if not allow_unsafe:\n",
             "  if False:\n", (SEC_T + "a_kernel_without_landlock_stops_the_run_unless_the_config_opts_out",)),
)
MUTATIONS = OBJECTIVE + SAMPLER + CONTROLLER + RUNNER + SECURITY + CHECKPOINT + GUARD + MOE + NETWORK


def apply(mutation: Mutation, root: pathlib.Path) -> None:
  """Cuts the wire in the copy at `root`; ValueError if the snippet is not there exactly once."""
  path = root / mutation.path
  text = path.read_text()
  if text.count(mutation.old) != 1:
    raise ValueError(f"{mutation.name}: the snippet occurs {text.count(mutation.old)} times in {mutation.path}")
  path.write_text(text.replace(mutation.old, mutation.new))


def _pytest(root: pathlib.Path, files: list[str], timeout: int) -> tuple[str, str]:
  """(outcome, detail) of pytest -x over `files` in `root`: "passed", "failed" (detail: the first failing test) or
  "hang" (the run past `timeout`, or a test failed by pytest-timeout: a hang is no kill)."""
  # The checkout's compilation cache: the copy's unmutated programs compile once, not once per mutation.
  # COLUMNS: the short summary's lines whole, not cut at 80 characters.
  env = dict(os.environ, PYTHONPATH=str(root), JAX_NUM_CPU_DEVICES=os.environ.get("JAX_NUM_CPU_DEVICES", "8"),
             JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache")),
             COLUMNS="1000")
  try:
    run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *files], cwd=root,
                         env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return "hang", f"pytest ran past {timeout} s"
  failed = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
  summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip()[-200:]
  if run.returncode == 0:
    return "passed", summary
  if "from pytest-timeout" in run.stdout:  # -x: the one failure is a test past its time limit
    return "hang", failed[0].split(" - ")[0] if failed else summary
  return "failed", failed[0].split(" - ")[0] if failed else f"exit code {run.returncode}: {summary}"


def run_one(mutation: Mutation, timeout: int, first_only: bool = False) -> dict:
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jaxrl-mutant-") as tmp:
    root = pathlib.Path(tmp)
    for part in ("jaxrl", "tests", "configs", "pyproject.toml"):
      src = ROOT / part
      (shutil.copytree if src.is_dir() else shutil.copy)(src, root / part)
    apply(mutation, root)
    outcome, detail = _pytest(root, list(mutation.first), timeout) if mutation.first else ("passed", "")
    ran = "first"
    if outcome == "passed" and not first_only:
      outcome, detail = _pytest(root, group_tests(mutation.path), timeout)
      ran = "first+group"
  return {"mutation": mutation.name, "file": mutation.path, "killed": outcome == "failed", "by": detail,
          "outcome": outcome, "ran": ran, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", nargs="*", default=None, help="mutation names to run (default: all)")
  parser.add_argument("--area", nargs="*", default=None, help="mutations of the code under these paths")
  parser.add_argument("--first-only", action="store_true", help="each mutation's first tests only, not its group")
  parser.add_argument("--timeout", type=int, default=1200, help="seconds per pytest run")
  parser.add_argument("--out", default="bench/results/mutations.json")
  args = parser.parse_args(argv)
  chosen = [m for m in MUTATIONS if (args.only is None or m.name in args.only)
            and (args.area is None or any(m.path.startswith(a) for a in args.area))]
  rows = []
  print("| mutation | killed | by | s |\n|---|---|---|---|", flush=True)
  for mutation in chosen:
    row = run_one(mutation, args.timeout, args.first_only)
    rows.append(row)
    print(f"| {row['mutation']} | {'yes' if row['killed'] else 'NO (' + row['outcome'] + ')'} | {row['by']} | "
          f"{row['seconds']} |", flush=True)
  pathlib.Path(args.out).write_text(json.dumps(rows, indent=2))
  survivors = [r["mutation"] for r in rows if not r["killed"]]
  print(f"{len(rows) - len(survivors)} of {len(rows)} mutations killed" + (f"; survived: {survivors}" if survivors
                                                                            else ""))
  return 1 if survivors else 0


if __name__ == "__main__":
  sys.exit(main())
