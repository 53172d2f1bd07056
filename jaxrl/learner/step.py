"""make_train_step: the learner's pure (state, batch, rng) -> (state, metrics), jitted once with donation.

One call is one learner step and makes one policy version, whatever the mini-batching: it runs
`num_epochs * num_minibatches` optimizer updates (PPO-style: each epoch a fresh permutation of the rows split into
mini-batches), each over `num_microbatches` gradient-accumulation chunks scanned in order (or, with
`microbatch_rows`, as many as keep each chunk at most that many rows per device: per batch shape). The version goes
up by one if any update applied, so staleness (learner step - token version) counts steps, as the controller bounds
it.
A step applies in full or is skipped (params and optimizer state as before it, version not bumped, skip counted)
when any of its updates has a non-finite loss or gradient, a valid sample's reward is non-finite, or it has no
completion tokens at all (a mini-batch of padding rows only is a no-op). That needs the pre-step TrainState kept
while the step runs (one more state of memory with 2+ updates per step); with atomic=False each update is skipped
on its own instead (optax.apply_if_finite's rule), no copy is kept, and the step applies if any update did.
A batch may be packed (several samples per row, jaxrl.learner.packing; its row count one of row_buckets): every
per-sample sum then runs over a segment, and mini-batches are drawn over rows.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.learner.advantages import compute_advantages
from jaxrl.learner.config import LossConfig
from jaxrl.learner.logprobs import chunked_token_logprobs, token_logprobs
from jaxrl.learner.losses import MAX_STATS, MIN_STATS, aggregation_weights, policy_objective
from jaxrl.learner.optim import AdamW
from jaxrl.learner.packing import to_tokens
from jaxrl.learner.state import TrainState
from jaxrl.rollout import Batch

LogitsFn = Callable[[object, jax.Array, jax.Array, jax.Array], jax.Array]

_BxL = ("tokens_BxL", "positions_BxL", "segment_ids_BxL", "loss_mask_BxL", "behavior_logprobs_BxL", "versions_BxL")
_B = ("rewards_B", "group_ids_B", "sample_mask_B")
_INTEGER = ("tokens_BxL", "positions_BxL", "segment_ids_BxL", "versions_BxL", "group_ids_B")


def as_logits_fn(model: LogitsFn | nnx.GraphDef) -> LogitsFn:
  """A logits_fn(params, tokens, positions, segment_ids) from itself or from an nnx GraphDef."""
  if isinstance(model, nnx.GraphDef):
    return lambda params, tokens, positions, segments: nnx.merge(model, params)(tokens, positions, segments)
  if callable(model):
    return model
  raise TypeError(f"expected a logits_fn or an nnx.GraphDef, got {type(model).__name__}")


def check_batch(batch: Batch, batch_size: int, seq_len: int, row_buckets: tuple[int, ...] = ()) -> None:
  """Raises ValueError naming the first field whose shape or dtype kind disagrees with [batch_size, seq_len].

  row_buckets: further row counts accepted (packed batches); per-sample fields may be [B] or [B, G] (packed).
  """
  if not isinstance(batch, Batch):
    raise TypeError(f"expected a jaxrl.rollout.Batch, got {type(batch).__name__}")
  rows = batch.tokens_BxL.shape[0] if batch.tokens_BxL.shape[0] in row_buckets else batch_size
  slots = batch.sample_mask_B.shape[1:]
  for name in _BxL + _B:
    x = getattr(batch, name)
    want = (rows, seq_len) if name in _BxL else (rows, *slots)
    if tuple(x.shape) != want:
      raise ValueError(f"Batch.{name} has shape {tuple(x.shape)}; this train step expects {want} "
                       f"(batch_size={batch_size}, seq_len={seq_len})")
    kind = jnp.integer if name in _INTEGER else jnp.floating
    if not jnp.issubdtype(x.dtype, kind):
      raise ValueError(f"Batch.{name} has dtype {x.dtype}; expected {kind.__name__}")


def batch_shardings(sharding_BxL: NamedSharding) -> Batch:
  """A Batch of shardings: rows split as sharding_BxL says (e.g. jaxrl.sharding.batch_sharding), L whole."""
  lead = sharding_BxL.spec[0] if len(sharding_BxL.spec) else None
  rows, rows_cols = NamedSharding(sharding_BxL.mesh, P(lead)), NamedSharding(sharding_BxL.mesh, P(lead, None))
  return Batch(**{name: rows_cols if name in _BxL else rows for name in _BxL + _B})


def batch_shards(batch_sharding: NamedSharding | None) -> int:
  """Devices the batch rows are split over (1 without a sharding): row counts must be multiples of it."""
  if batch_sharding is None or not len(batch_sharding.spec):
    return 1
  lead = batch_sharding.spec[0]
  names = (lead,) if isinstance(lead, str) else tuple(lead or ())
  return math.prod(batch_sharding.mesh.shape[a] for a in names)


def _cast_floats(tree, dtype):
  if dtype is None:
    return tree
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_train_step(model: LogitsFn | nnx.GraphDef, optimizer: optax.GradientTransformation, loss_config: LossConfig,
                    *, batch_size: int, seq_len: int, num_microbatches: int = 1, num_minibatches: int = 1,
                    num_epochs: int = 1, compute_dtype=None, state_shardings: TrainState | None = None,
                    batch_sharding: NamedSharding | None = None, staleness_bins: int = 8,
                    row_buckets: tuple[int, ...] = (), logprob_chunk: int = 0, atomic: bool = True,
                    microbatch_rows: int = 0):
  """Builds the jitted `step(state, batch, rng) -> (state, metrics)`; the state argument is donated.

  model: logits_fn(params, tokens_BxL, positions_BxL, segment_ids_BxL) -> logits_BxLxV, or an nnx GraphDef.
  batch_size, seq_len: the Batch shape accepted (anything else raises ValueError when traced); row_buckets adds
  row counts (packed batches, jaxrl.learner.packing: one compilation each), each divisible as batch_size is.
  num_minibatches: optimizer updates per epoch, over disjoint row subsets drawn by a permutation from `rng`.
  num_epochs: passes over the batch per step (PPO epochs), each with its own permutation.
  num_microbatches: gradient-accumulation chunks per update; the loss is normalised over the whole update.
  microbatch_rows: if > 0, each batch shape (row bucket) takes the fewest chunks, at least num_microbatches, that
  split its update's rows per device evenly into chunks of at most this many rows (fewer when no divisor fits: 1
  row). The same update up to float summation order: it bounds the activations one chunk holds, and on XLA:CPU a
  chunk past ~6 rows of 128 tokens left the core's cache (the headline's 4-layer train step: 8 rows 59.5 ms in one
  chunk, 37.2 ms in two; docs/BENCHMARKS.md). Which rows form a mini-batch (num_minibatches > 1) follows the
  chunking, as with num_microbatches.
  compute_dtype: if set, floating params are cast to it for the forward pass (fp32 master weights, bf16 math).
  state_shardings (see train_state_shardings) and batch_sharding (rows over the learner's data axes) place the
  step on a mesh; give both or neither. staleness_bins: histogram bins 0..bins-1 plus one for >= bins.
  logprob_chunk: if > 0 (model an nnx GraphDef of a Decoder), log-probs and entropies are computed that many
  positions at a time from the hidden states, never holding float32 [B, L, V] logits.
  atomic: a non-finite update skips its whole step (the pre-step state is kept until the step ends: +1 TrainState
  of memory when num_minibatches * num_epochs > 1); False: it skips only itself.
  """
  cfg = loss_config
  logits_fn = as_logits_fn(model)
  m, k, e = num_minibatches, num_microbatches, num_epochs
  if m < 1 or k < 1 or e < 1:
    raise ValueError(f"num_minibatches, num_microbatches and num_epochs must be >= 1 (got {m}, {k}, {e})")
  if microbatch_rows < 0:
    raise ValueError(f"microbatch_rows must be >= 0 (0: num_microbatches chunks), got {microbatch_rows}")
  if batch_size < 1 or seq_len < 2:
    raise ValueError(f"need batch_size >= 1 and seq_len >= 2 (got {batch_size}, {seq_len})")
  if batch_size % (m * k):
    raise ValueError(f"batch_size={batch_size} is not divisible by num_minibatches * num_microbatches = {m * k}")
  if logprob_chunk < 0 or (logprob_chunk and not isinstance(model, nnx.GraphDef)):
    raise ValueError(f"logprob_chunk={logprob_chunk} needs to be >= 0, and > 0 only with an nnx GraphDef model")
  if (state_shardings is None) != (batch_sharding is None):
    raise ValueError("give both state_shardings and batch_sharding (a mesh step) or neither (one device)")
  lead = None
  shards = batch_shards(batch_sharding)
  if batch_sharding is not None:
    lead = batch_sharding.spec[0] if len(batch_sharding.spec) else None
  for b in (batch_size, *row_buckets):
    if b % (m * k * shards):
      raise ValueError(f"a batch of {b} rows makes micro-batches of {b / (m * k):g} rows, not divisible by the "
                       f"{shards} devices of the batch axes; change batch_size, row_buckets, num_minibatches or "
                       f"num_microbatches")
  updates_per_step = m * e

  def chunks(b: int) -> int:
    """Gradient-accumulation chunks per update for a batch of b rows (see microbatch_rows)."""
    if not microbatch_rows:
      return k
    per_device = b // (m * shards)
    return next(d for d in range(k, per_device + 1) if per_device % d == 0 and per_device // d <= microbatch_rows)

  prox_pass = cfg.proximal == "recompute" and updates_per_step > 1
  ref_pass = cfg.kl_coef > 0

  def constrain(x, axis):
    if lead is None:
      return x
    spec = [None] * x.ndim
    spec[axis] = lead
    return jax.lax.with_sharding_constraint(x, NamedSharding(batch_sharding.mesh, P(*spec)))

  def split(x, k):
    """[E*B, ...] -> [E*M, K, rows, ...]; row i*M*K + j*K + c of an epoch goes to its mini-batch j, micro-batch c
    (shard-local)."""
    rows = x.shape[0] // (e * m * k)
    x = x.reshape(e, rows, m, k, *x.shape[1:])
    return constrain(jnp.moveaxis(x, 1, 3).reshape(e * m, k, rows, *x.shape[4:]), 2)

  def chunked(fn, x, k):
    """fn over the batch in the K*M shard-local chunks of `split`, one at a time (bounded memory); [B, L] out."""
    b = jax.tree.leaves(x)[0].shape[0]
    parts = jax.tree.map(lambda a: constrain(jnp.moveaxis(a.reshape(b // (m * k), m * k, *a.shape[1:]), 0, 1), 1),
                         x)
    out = jax.lax.map(fn, parts)
    return jnp.moveaxis(out, 0, 1).reshape(b, *out.shape[2:])

  def logprobs(params, x):
    params = _cast_floats(params, compute_dtype)
    if logprob_chunk:
      decoder = nnx.merge(model, params)
      hidden = decoder(x["tokens"], x["positions"], x["segments"], hidden=True)
      return chunked_token_logprobs(hidden, decoder.head(), x["tokens"], cfg.sampling, logprob_chunk)
    logits = logits_fn(params, x["tokens"], x["positions"], x["segments"])
    return token_logprobs(logits, x["tokens"], cfg.sampling)

  def micro_loss(params, x, weights_BxL, v0, v_now):
    logp, in_support, entropy = logprobs(params, x)
    behavior = x["behavior"]
    prox = None
    if cfg.proximal == "recompute":
      prox = x["prox"] if prox_pass else jax.lax.stop_gradient(logp)
    elif cfg.proximal == "interpolate":
      v_t = x["versions"]
      alpha = jnp.where(v_now > v_t, (v0 - v_t) / jnp.maximum(v_now - v_t, 1e-6), 1.0).clip(0.0, 1.0)
      prox = behavior + alpha * (jax.lax.stop_gradient(logp) - behavior)
    return policy_objective(logp, behavior, x["adv"], weights_BxL, cfg, prox_logp_BxL=prox,
                            ref_logp_BxL=x.get("ref"), entropy_BxL=entropy, in_support_BxL=in_support,
                            segment_ids_BxL=x["segments"])

  def train_step(state: TrainState, batch: Batch, rng: jax.Array):
    check_batch(batch, batch_size, seq_len, row_buckets)
    b = batch.tokens_BxL.shape[0]
    k = chunks(b)
    rows = b // (m * k)
    if ref_pass and state.ref_params is None:
      raise ValueError("LossConfig.kl_coef > 0 needs TrainState.ref_params (init_train_state(ref_params=...))")
    valid_B = batch.sample_mask_B > 0
    rewards_ok = jnp.all(jnp.isfinite(batch.rewards_B) | ~valid_B)
    v0 = state.version
    per_row = {
        "tokens": batch.tokens_BxL, "positions": batch.positions_BxL, "segments": batch.segment_ids_BxL,
        "loss_mask": batch.loss_mask_BxL.astype(jnp.float32),
        "behavior": batch.behavior_logprobs_BxL.astype(jnp.float32), "versions": batch.versions_BxL,
        "sample_mask": batch.sample_mask_B.astype(jnp.float32).reshape(b, -1),
    }
    # Forward passes at fixed params, before any update: prox (decoupled PPO's pre-update policy) and ref.
    if prox_pass:
      per_row["prox"] = chunked(lambda x: logprobs(state.params, x)[0], per_row, k)
    if ref_pass:
      per_row["ref"] = jax.lax.stop_gradient(chunked(lambda x: logprobs(state.ref_params, x)[0], per_row, k))
    rewards_B = batch.rewards_B  # [B], or [B, G] for packed rows (column g: segment g + 1)
    kl_reward_B = jnp.zeros_like(rewards_B)
    if ref_pass and cfg.kl_estimator == "k1_reward":
      on_tokens = (per_row["loss_mask"] > 0) & to_tokens(valid_B.reshape(b, -1), batch.segment_ids_BxL, fill=False)
      kl_BxL = jnp.where(on_tokens, per_row["behavior"] - per_row["ref"], 0.0)
      if rewards_B.ndim == 1:
        kl_reward_B = jnp.sum(kl_BxL, axis=1)
      else:  # the sum over each sample's segment
        segment_BxLxG = jax.nn.one_hot(batch.segment_ids_BxL - 1, rewards_B.shape[1], dtype=jnp.float32)
        kl_reward_B = jnp.einsum("bl,blg->bg", kl_BxL, segment_BxLxG)
      rewards_B = rewards_B - cfg.kl_coef * kl_reward_B
    # Advantages over every sample of the batch (a group may span rows), then onto each sample's tokens.
    per_row["adv"] = to_tokens(compute_advantages(rewards_B.reshape(-1), batch.group_ids_B.reshape(-1),
                                                  batch.sample_mask_B.reshape(-1), cfg).reshape(b, -1),
                               batch.segment_ids_BxL)
    if updates_per_step > 1:
      keys = rng[None] if e == 1 else jax.random.split(rng, e)
      order = jax.vmap(lambda key: jax.random.permutation(key, b))(keys).reshape(-1)
      per_row = jax.tree.map(lambda x: x[order], per_row)
    parts = jax.tree.map(lambda x: split(x, k), per_row)

    def update(carry, mini):
      state, n_applied = carry
      weights = aggregation_weights(mini["loss_mask"].reshape(k * rows, seq_len),
                                    mini["sample_mask"].reshape(k * rows, -1), cfg.aggregation, cfg.norm_length,
                                    mini["segments"].reshape(k * rows, seq_len))
      weights = weights.reshape(k, rows, seq_len)
      # Where the params are between version v0 and v0 + 1 (for proximal="interpolate").
      v_now = v0 + n_applied / updates_per_step

      def accumulate(grads, xs):
        x, w = xs
        (loss, stats), g = jax.value_and_grad(micro_loss, has_aux=True)(state.params, x, w, v0, v_now)
        return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), (loss, stats)

      zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
      grads, (losses, stats) = jax.lax.scan(accumulate, zeros, (mini, weights))
      stats = {name: (jnp.max(v) if name in MAX_STATS else jnp.min(v) if name in MIN_STATS else jnp.sum(v))
               for name, v in stats.items()}
      loss = losses.sum()
      grad_norm = optax.tree.norm(grads)
      has_tokens = stats["tokens"] > 0
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      ok = finite & rewards_ok & has_tokens
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
      if isinstance(optimizer, AdamW):  # in place (no copies of the moments)
        params, opt_state = optimizer.apply(grads, state.opt_state, state.params, ok)
      else:
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
        params = keep(optax.apply_updates(state.params, updates), state.params)
        opt_state = keep(opt_state, state.opt_state)
      state = state.replace(params=params, opt_state=opt_state)
      reasons = {"skip/reward": ~rewards_ok, "skip/empty": rewards_ok & ~has_tokens,
                 "skip/nonfinite": rewards_ok & has_tokens & ~finite}
      return (state, n_applied + ok.astype(jnp.int32)), {"loss": loss, "grad_norm": grad_norm, "applied": ok,
                                                          **reasons, **stats}

    start = state
    (state, _), per_update = jax.lax.scan(update, (state, jnp.int32(0)), parts)
    # An atomic step applies in full or not at all: a version is the result of all its updates (and a batch is
    # trained on whole or its groups are dropped, counted). A mini-batch of padding rows only is a no-op, not a fault.
    # The pre-step state is kept for this only when there are 2+ updates.
    any_of = lambda name: jnp.any(per_update[name])
    reasons = {"skip/reward": any_of("skip/reward"), "skip/nonfinite": any_of("skip/nonfinite"),
               "skip/empty": jnp.all(per_update["skip/empty"])}
    if atomic:
      step_ok = ~(reasons["skip/reward"] | reasons["skip/nonfinite"] | reasons["skip/empty"])
    else:  # each update kept or skipped alone: the step applies if any did, and says why not when none did
      step_ok = any_of("applied")
      reasons = {"skip/reward": ~step_ok & reasons["skip/reward"], "skip/empty": ~step_ok & reasons["skip/empty"],
                 "skip/nonfinite": ~step_ok & ~reasons["skip/reward"] & ~reasons["skip/empty"]}
    if atomic and updates_per_step > 1:
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(step_ok, a, b), new, old)
      state = state.replace(params=keep(state.params, start.params), opt_state=keep(state.opt_state, start.opt_state))
    state = state.replace(step=start.step + 1, version=v0 + step_ok.astype(jnp.int32),
                          skipped=start.skipped + (~step_ok).astype(jnp.int32))
    per_update["applied"] = per_update["applied"] & step_ok
    metrics = _summarise(per_update, batch, v0, valid_B, staleness_bins)
    metrics.update({name: flag.astype(jnp.float32) for name, flag in reasons.items()})  # why the step was skipped
    metrics["updates_nonfinite"] = jnp.sum(per_update["skip/nonfinite"].astype(jnp.float32))
    if cfg.is_cap is not None or cfg.is_ess_min is not None:
      metrics["is_cap"] = jnp.min(per_update["is_cap_min"])  # the smallest truncation applied this step
    metrics["kl_reward_mean"] = jnp.sum(jnp.where(valid_B, kl_reward_B, 0.0)) / jnp.maximum(valid_B.sum(), 1)
    return state, metrics

  if state_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  replicated = NamedSharding(batch_sharding.mesh, P())
  return jax.jit(train_step, donate_argnums=0,
                 in_shardings=(state_shardings, batch_shardings(batch_sharding), replicated),
                 out_shardings=(state_shardings, replicated))


def _summarise(per_update, batch: Batch, v0, valid_B, staleness_bins: int) -> dict[str, jax.Array]:
  """Step metrics from the per-update stats (stacked over mini-batches) and the batch."""
  total = lambda name: jnp.sum(per_update[name].astype(jnp.float32))
  applied = per_update["applied"]

  def mean(name):  # over the updates applied (a non-atomic step may skip some); over all when none was
    v = per_update[name]
    return jnp.where(jnp.any(applied), jnp.sum(jnp.where(applied, v, 0.0)) / jnp.maximum(jnp.sum(applied), 1),
                     jnp.mean(v))

  tokens = total("tokens")
  per_token = lambda name: total(name) / jnp.maximum(tokens, 1.0)
  ratio_mean = per_token("ratio_sum")
  ratio_sq = per_token("ratio_sq_sum")
  trained_BxL = (batch.loss_mask_BxL > 0) & to_tokens(valid_B, batch.segment_ids_BxL, fill=False)
  staleness = jnp.where(trained_BxL, v0 - batch.versions_BxL, 0)
  hist_bin = jnp.clip(staleness, 0, staleness_bins)
  hist = jnp.sum(jax.nn.one_hot(hist_bin, staleness_bins + 1, dtype=jnp.float32) * trained_BxL[..., None], (0, 1))
  num_trained = jnp.maximum(trained_BxL.sum(), 1)
  rewards = jnp.where(valid_B, batch.rewards_B, 0.0)
  return {
      "loss": mean("loss"),
      "loss/policy": mean("loss/policy"),
      "loss/kl": mean("loss/kl"),
      "loss/entropy": mean("loss/entropy"),
      "grad_norm": mean("grad_norm"),
      "updates_applied": total("applied"),
      "updates_skipped": jnp.sum(1.0 - per_update["applied"].astype(jnp.float32)),
      "clip_frac_low": per_token("clip_low"),
      "clip_frac_high": per_token("clip_high"),
      "clip_frac_dual": per_token("clip_dual"),
      "is_truncated_frac": per_token("is_truncated"),
      "is_masked_frac": per_token("is_masked"),
      "out_of_support_frac": total("out_of_support") / jnp.maximum(tokens + total("out_of_support"), 1.0),
      "ratio_mean": ratio_mean,
      "ratio_std": jnp.sqrt(jnp.maximum(ratio_sq - ratio_mean**2, 0.0)),
      "ratio_max": jnp.max(per_update["ratio_max"]),
      "ratio_min": jnp.min(per_update["ratio_min"]),
      # Kish effective sample size of the pi/mu weights, as a fraction of the tokens: (sum w)^2 / (n sum w^2).
      "ess_frac": ratio_mean**2 / jnp.maximum(ratio_sq, 1e-30),
      # The same for the weights the loss applied (after caps and masks; prox / mu, 1 without IS): the variance
      # the correction actually pays.
      "ess_applied_frac": total("w_sum") ** 2 / jnp.maximum(tokens * total("w_sq_sum"), 1e-30),

      "kl_behavior": per_token("kl_behavior_sum"),
      "kl_ref": per_token("kl_ref_sum"),
      "entropy": per_token("entropy_sum"),
      "num_tokens": tokens,
      "num_samples": jnp.sum(valid_B.astype(jnp.float32)),
      "num_input_tokens": jnp.sum((batch.segment_ids_BxL > 0).astype(jnp.float32)),
      "reward_mean": jnp.sum(rewards) / jnp.maximum(valid_B.sum(), 1),
      "staleness_hist": hist,
      "staleness_mean": jnp.sum(staleness) / num_trained,
      "staleness_max": jnp.max(jnp.where(trained_BxL, staleness, jnp.iinfo(jnp.int32).min)),
      "staleness_min": jnp.min(jnp.where(trained_BxL, staleness, jnp.iinfo(jnp.int32).max)),
  }


def timed_step(step, state: TrainState, batch: Batch, rng: jax.Array):
  """Runs `step`, waits for it, and adds host-side step_time_s, tokens_per_s and input_tokens_per_s."""
  start = time.perf_counter()
  state, metrics = step(state, batch, rng)
  metrics = jax.device_get(metrics)
  seconds = time.perf_counter() - start
  metrics["step_time_s"] = seconds
  metrics["tokens_per_s"] = float(metrics["num_tokens"]) / seconds
  metrics["input_tokens_per_s"] = float(metrics["num_input_tokens"]) / seconds
  return state, metrics
