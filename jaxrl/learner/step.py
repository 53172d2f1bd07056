"""The learner step: pure `train_step(state, batch, rng, *, config) -> (state, metrics)`, a StepConfig fixing what
every call shares, and jit_train_step(config, shardings) jitting it (state donated).

One call is one learner step and makes one policy version, whatever the mini-batching: it runs
`num_epochs * num_minibatches` optimizer updates, each over `num_microbatches` gradient-accumulation chunks scanned
in order (or, with `microbatch_rows`, as many as keep each chunk at most that many rows per device: per batch
shape). The version goes up by one if the step applies, so staleness (learner step - token version) counts steps,
as the controller bounds it.

Mini-batches are drawn by sample before the batch is built: row r of a batch belongs to mini-batch
r % num_minibatches, and a packed row holds samples of one mini-batch only (jaxrl.learner.packing). A packed batch
therefore trains exactly the mini-batches of the unpacked batch of the same samples in the same order; the
controller draws that order per step (RunSpec.make_batch). Every epoch runs the same mini-batches, each epoch in its
own order drawn from `rng` (as verl's PPO epochs reuse their mini-batches).

A step applies in full or is skipped (params and optimizer state as before it, version not bumped, skip counted)
when any of its updates has a non-finite loss or gradient, a valid sample's reward is non-finite, or it has no
completion tokens at all (a mini-batch of padding rows only is a no-op). That needs the pre-step TrainState kept
while the step runs (one more state of memory with 2+ updates per step); with atomic=False each update is skipped
on its own instead (optax.apply_if_finite's rule), no copy is kept, and the step applies if any update did.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
from jaxrl.learner.optim import apply_update
from jaxrl.learner.packing import to_tokens
from jaxrl.learner.state import TrainState
from jaxrl.models import lora
from jaxrl.rollout import Batch
from jaxrl.sharding import under_mesh

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
  experts = batch.experts_BxLxNxK
  if experts is not None and (experts.ndim != 4 or tuple(experts.shape[:2]) != (rows, seq_len)
                              or not jnp.issubdtype(experts.dtype, jnp.integer)):
    raise ValueError(f"Batch.experts_BxLxNxK has shape {tuple(experts.shape)} and dtype {experts.dtype}; this train "
                     f"step expects integers of shape ({rows}, {seq_len}, layers, experts per token)")


def batch_shardings(sharding_BxL: NamedSharding) -> Batch:
  """A Batch of shardings: rows split as sharding_BxL says (e.g. jaxrl.sharding.batch_sharding), L whole; also
  for a MoE batch's routing (a batch without routing, None there, takes it too)."""
  lead = sharding_BxL.spec[0] if len(sharding_BxL.spec) else None
  rows, rows_cols = NamedSharding(sharding_BxL.mesh, P(lead)), NamedSharding(sharding_BxL.mesh, P(lead, None))
  return Batch(**{name: rows_cols if name in _BxL else rows for name in _BxL + _B}, experts_BxLxNxK=rows)


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


def needs_prox_pass(loss: LossConfig, updates_per_step: int) -> bool:
  """Decoupled PPO's pre-step policy needs its own pass only when a later update sees other params."""
  return loss.proximal == "recompute" and updates_per_step > 1


def needs_ref_pass(loss: LossConfig) -> bool:
  return loss.kl_coef > 0


def fixed_param_pass_count(loss: LossConfig, updates_per_step: int) -> int:
  """Forward passes over the whole batch a step runs at fixed params besides its updates' (prox, ref)."""
  return int(needs_prox_pass(loss, updates_per_step)) + int(needs_ref_pass(loss))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """What every call of the step fixes; checked when made (a bad value raises ValueError naming it)."""

  model: LogitsFn | nnx.GraphDef  # logits_fn(params, tokens_BxL, positions_BxL, segment_ids_BxL), or a GraphDef
  optimizer: optax.GradientTransformation  # any optax transformation (make_optimizer's AdamW updates in place)
  loss: LossConfig = LossConfig()
  # The Batch shape accepted (anything else raises ValueError when traced); row_buckets adds row counts (packed
  # batches, jaxrl.learner.packing: one compilation each), each divisible as batch_size is.
  batch_size: int
  seq_len: int
  row_buckets: tuple[int, ...] = ()
  num_minibatches: int = 1  # optimizer updates per epoch; row r of a batch is in mini-batch r % num_minibatches
  num_epochs: int = 1  # passes over the batch per step (PPO epochs), each over the mini-batches in its own order
  num_microbatches: int = 1  # gradient-accumulation chunks per update; the loss is normalised over the update
  # If > 0, each batch shape (row bucket) takes the fewest chunks, at least num_microbatches, that split its
  # update's rows per device evenly into chunks of at most this many rows (fewer when no divisor fits: 1 row). The
  # same update up to float summation order: it bounds the activations one chunk holds (and on a CPU keeps a chunk
  # in the core's cache: bench/headline_parts.py; docs/BENCHMARKS_HISTORY.md, "The headline: colocated sync vs
  # pipeline").
  microbatch_rows: int = 0
  compute_dtype: object = None  # if set, floating params are cast to it for the forward pass (fp32 master, bf16 math)
  # Rows over the learner's data axes (jaxrl.sharding.batch_sharding); with jit_train_step's state shardings it
  # places the step on a mesh.
  batch_sharding: NamedSharding | None = None
  staleness_bins: int = 8  # the staleness histogram's bins 0..bins-1 plus one for >= bins
  # If > 0 (model an nnx GraphDef of a Decoder), log-probs and entropies are computed that many positions at a time
  # from the hidden states, never holding float32 [B, L, V] logits.
  logprob_chunk: int = 0
  # A non-finite update skips its whole step (the pre-step state is kept until the step ends: +1 TrainState of
  # memory when num_minibatches * num_epochs > 1); False: it skips only itself.
  atomic: bool = True
  logits_fn: LogitsFn = dataclasses.field(init=False, repr=False, compare=False)  # from model

  def __post_init__(self):
    m, k, e = self.num_minibatches, self.num_microbatches, self.num_epochs
    if m < 1 or k < 1 or e < 1:
      raise ValueError(f"num_minibatches, num_microbatches and num_epochs must be >= 1 (got {m}, {k}, {e})")
    if self.microbatch_rows < 0:
      raise ValueError(f"microbatch_rows must be >= 0 (0: num_microbatches chunks), got {self.microbatch_rows}")
    if self.batch_size < 1 or self.seq_len < 2:
      raise ValueError(f"need batch_size >= 1 and seq_len >= 2 (got {self.batch_size}, {self.seq_len})")
    if self.batch_size % (m * k):
      raise ValueError(f"batch_size={self.batch_size} is not divisible by num_minibatches * num_microbatches = "
                       f"{m * k}")
    if self.logprob_chunk < 0 or (self.logprob_chunk and not isinstance(self.model, nnx.GraphDef)):
      raise ValueError(f"logprob_chunk={self.logprob_chunk} needs to be >= 0, and > 0 only with an nnx GraphDef "
                       "model")
    shards = batch_shards(self.batch_sharding)
    for b in (self.batch_size, *self.row_buckets):
      if b % (m * k * shards):
        raise ValueError(f"a batch of {b} rows makes micro-batches of {b / (m * k):g} rows, not divisible by the "
                         f"{shards} devices of the batch axes; change batch_size, row_buckets, num_minibatches or "
                         f"num_microbatches")
    object.__setattr__(self, "row_buckets", tuple(self.row_buckets))
    object.__setattr__(self, "logits_fn", as_logits_fn(self.model))

  @property
  def updates_per_step(self) -> int:
    return self.num_minibatches * self.num_epochs

  @property
  def prox_pass(self) -> bool:
    return needs_prox_pass(self.loss, self.updates_per_step)

  @property
  def ref_pass(self) -> bool:
    return needs_ref_pass(self.loss)

  def chunks(self, rows: int) -> int:
    """Gradient-accumulation chunks per update for a batch of `rows` rows (see microbatch_rows)."""
    return chunk_count(rows // (self.num_minibatches * batch_shards(self.batch_sharding)), self.num_microbatches,
                       self.microbatch_rows)

  def constrain(self, x: jax.Array, axis: int) -> jax.Array:
    """x with `axis` split over the batch's devices (the other axes whole)."""
    if self.batch_sharding is None or not len(self.batch_sharding.spec):
      return x
    spec = [None] * x.ndim
    spec[axis] = self.batch_sharding.spec[0]
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.batch_sharding.mesh, P(*spec)))


def chunk_count(rows_per_device: int, num_microbatches: int, microbatch_rows: int) -> int:
  """Gradient-accumulation chunks of an update of rows_per_device rows on each device: num_microbatches, or with
  microbatch_rows > 0 the fewest (at least num_microbatches) that split them evenly into chunks of at most that."""
  if not microbatch_rows:
    return num_microbatches
  return next(d for d in range(num_microbatches, rows_per_device + 1)
              if rows_per_device % d == 0 and rows_per_device // d <= microbatch_rows)


def jit_train_step(config: StepConfig, shardings: TrainState | None = None):
  """`train_step` for `config`, jitted with the state argument donated: step(state, batch, rng) -> (state,
  metrics). shardings (train_state_shardings) and config.batch_sharding place it on a mesh: both or neither."""
  if (shardings is None) != (config.batch_sharding is None):
    raise ValueError("give both the state's shardings and StepConfig.batch_sharding (a mesh step) or neither "
                     "(one device)")
  step = functools.partial(train_step, config=config)
  if shardings is None:
    return jax.jit(step, donate_argnums=0)
  replicated = NamedSharding(config.batch_sharding.mesh, P())
  # Under the mesh: its attention kernel runs in shard_map over it, and the model keeps its activations row-sharded
  # (sharding.constrain_rows)
  step = under_mesh(step, config.batch_sharding.mesh)
  return jax.jit(step, donate_argnums=0, in_shardings=(shardings, batch_shardings(config.batch_sharding), replicated),
                 out_shardings=(shardings, replicated))


def train_step(state: TrainState, batch: Batch, rng: jax.Array, *, config: StepConfig):
  """One learner step: advantages, the fixed-parameter passes, the mini-batch updates, and the step's commit.

  Pure: same (state, batch, rng) in, same (state, metrics) out. jit it with config bound (jit_train_step does).
  """
  check_batch(batch, config.batch_size, config.seq_len, config.row_buckets)
  if config.ref_pass and state.ref_params is None:
    raise ValueError("LossConfig.kl_coef > 0 needs TrainState.ref_params (init_train_state(ref_params=...))")
  k = config.chunks(batch.tokens_BxL.shape[0])
  per_row = batch_arrays(batch)
  per_row |= fixed_param_passes(config, state, per_row, k)
  rewards_B, kl_reward_B = kl_shaped_rewards(config.loss, batch, per_row)
  per_row["adv"] = token_advantages(config.loss, rewards_B, batch)
  valid_B = batch.sample_mask_B > 0
  rewards_ok = jnp.all(jnp.isfinite(batch.rewards_B) | ~valid_B)
  # The updates' mini-batches in the order they run, scanned over as inputs: a loop that indexes the mini-batches
  # itself (closing over them) deadlocked XLA:CPU's collectives when the sampler ran beside it (tests/test_e2e.py).
  order = minibatch_order(rng, config.num_minibatches, config.num_epochs)
  updates = jax.tree.map(lambda x: jnp.take(x, order, axis=0), split_minibatches(config, per_row, k))
  update = functools.partial(one_update, config, state.version, rewards_ok)
  (after, _), per_update = jax.lax.scan(update, (state, jnp.int32(0)), updates)
  v0 = state.version
  state, per_update, reasons = commit(config, state, after, per_update)
  metrics = _summarise(per_update, batch, v0, valid_B, config.staleness_bins)
  metrics.update({name: flag.astype(jnp.float32) for name, flag in reasons.items()})  # why the step was skipped
  metrics["updates_nonfinite"] = jnp.sum(per_update["skip/nonfinite"].astype(jnp.float32))
  if config.loss.is_cap is not None or config.loss.is_ess_min is not None:
    metrics["is_cap"] = jnp.min(per_update["is_cap_min"])  # the smallest truncation applied this step
  metrics["kl_reward_mean"] = jnp.sum(jnp.where(valid_B, kl_reward_B, 0.0)) / jnp.maximum(valid_B.sum(), 1)
  return state, metrics


def batch_arrays(batch: Batch) -> dict[str, jax.Array]:
  """The batch's per-row arrays the updates read (float32 masks and log-probs; per-sample arrays as [B, G])."""
  b = batch.tokens_BxL.shape[0]
  out = {"tokens": batch.tokens_BxL, "positions": batch.positions_BxL, "segments": batch.segment_ids_BxL,
         "loss_mask": batch.loss_mask_BxL.astype(jnp.float32),
         "behavior": batch.behavior_logprobs_BxL.astype(jnp.float32), "versions": batch.versions_BxL,
         "sample_mask": batch.sample_mask_B.astype(jnp.float32).reshape(b, -1)}
  if batch.experts_BxLxNxK is not None:
    out["experts"] = batch.experts_BxLxNxK
  return out


def token_logprobs_of(config: StepConfig, params, x: dict[str, jax.Array], frozen=None):
  """(logprobs, in_support, entropy) [B, L] of x's tokens under `params` (on top of the `frozen` ones, a LoRA
  run's base: TrainState.frozen), as the sampler drew them."""
  return scores_and_router_loss(config, params, x, frozen)[0]


def scores_and_router_loss(config: StepConfig, params, x: dict[str, jax.Array], frozen=None):
  """(token_logprobs_of's triple, a mixture-of-experts model's load-balance terms or {}: {"router_aux", "router_z",
  "router_loss": their sum weighted by the model config's coefficients}). A MoE model routes x's tokens through
  their recorded experts (x["experts"]) when LossConfig.routing is "replay"."""
  if frozen is not None:
    params = lora.merge(frozen, params)
  params = _cast_floats(params, config.compute_dtype)
  decoder = nnx.merge(config.model, params) if isinstance(config.model, nnx.GraphDef) else None
  # A user's own nnx model (the importable train step) need not be jaxrl's Decoder: only the Decoder routes experts
  moe = decoder is not None and getattr(getattr(decoder, "cfg", None), "is_moe", False)
  if not (moe or config.logprob_chunk):
    logits = config.logits_fn(params, x["tokens"], x["positions"], x["segments"])
    return token_logprobs(logits, x["tokens"], config.loss.sampling), {}
  replay = x.get("experts") if config.loss.routing == "replay" else None
  out = decoder(x["tokens"], x["positions"], x["segments"], hidden=bool(config.logprob_chunk),
                **(dict(experts_BxTxNxK=replay, routing=True) if moe else {}))
  out, routing = out if moe else (out, None)
  if config.logprob_chunk:
    scores = chunked_token_logprobs(out, decoder.head(), x["tokens"], config.loss.sampling, config.logprob_chunk)
  else:
    scores = token_logprobs(out, x["tokens"], config.loss.sampling)
  if routing is None:
    return scores, {}
  aux, z, cfg = routing.aux_loss(), routing.z_loss(), decoder.cfg
  return scores, {"router_aux": aux, "router_z": z,
                  "router_loss": cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z}


def fixed_param_passes(config: StepConfig, state: TrainState, per_row: dict, k: int) -> dict[str, jax.Array]:
  """Forward passes at fixed params, before any update: prox (decoupled PPO's pre-step policy) and ref (the KL's
  reference), each with its support mask (a token outside it has probability 0 there)."""
  out = {}
  if config.prox_pass:
    prox = lambda x: token_logprobs_of(config, state.params, x, state.frozen)
    out["prox"], out["prox_in_support"], _ = _chunked(config, prox, per_row, k)
  if config.ref_pass:
    # A LoRA run's reference is its initial adapters (B = 0) on the shared base: exactly the base model.
    ref = lambda x: token_logprobs_of(config, state.ref_params, x, state.frozen)
    ref, out["ref_in_support"], _ = _chunked(config, ref, per_row, k)
    out["ref"] = jax.lax.stop_gradient(ref)
  return out


def _chunked(config: StepConfig, fn, x: dict, k: int):
  """fn over the batch in its M*K shard-local chunks, one at a time (bounded memory); [B, ...] outputs."""
  b = x["tokens"].shape[0]
  n = config.num_minibatches * k
  parts = jax.tree.map(lambda a: config.constrain(jnp.moveaxis(a.reshape(b // n, n, *a.shape[1:]), 0, 1), 1), x)
  out = jax.lax.map(fn, parts)
  return jax.tree.map(lambda o: jnp.moveaxis(o, 0, 1).reshape(b, *o.shape[2:]), out)


def kl_shaped_rewards(cfg: LossConfig, batch: Batch, per_row: dict) -> tuple[jax.Array, jax.Array]:
  """(rewards, kl penalty) per sample: with kl_estimator="k1_reward" the reward less kl_coef * sum_t (log mu - log
  ref) over the sample's tokens inside ref's support; else the rewards as they are and a zero penalty."""
  rewards_B = batch.rewards_B  # [B], or [B, G] for packed rows (column g: segment g + 1)
  if not (cfg.kl_coef > 0 and cfg.kl_estimator == "k1_reward"):
    return rewards_B, jnp.zeros_like(rewards_B)
  b = batch.tokens_BxL.shape[0]
  valid_BxL = to_tokens((batch.sample_mask_B > 0).reshape(b, -1), batch.segment_ids_BxL, fill=False)
  on_tokens = (per_row["loss_mask"] > 0) & valid_BxL & per_row["ref_in_support"]
  kl_BxL = jnp.where(on_tokens, per_row["behavior"] - per_row["ref"], 0.0)
  if rewards_B.ndim == 1:
    kl_reward_B = jnp.sum(kl_BxL, axis=1)
  else:  # the sum over each sample's segment
    segment_BxLxG = jax.nn.one_hot(batch.segment_ids_BxL - 1, rewards_B.shape[1], dtype=jnp.float32)
    kl_reward_B = jnp.einsum("bl,blg->bg", kl_BxL, segment_BxLxG)
  return rewards_B - cfg.kl_coef * kl_reward_B, kl_reward_B


def token_advantages(cfg: LossConfig, rewards_B: jax.Array, batch: Batch) -> jax.Array:
  """Advantages over every sample of the batch (a group may span rows and mini-batches), on each sample's tokens."""
  b = batch.tokens_BxL.shape[0]
  adv = compute_advantages(rewards_B.reshape(-1), batch.group_ids_B.reshape(-1), batch.sample_mask_B.reshape(-1),
                           cfg)
  return to_tokens(adv.reshape(b, -1), batch.segment_ids_BxL)


def split_minibatches(config: StepConfig, per_row: dict, k: int) -> dict[str, jax.Array]:
  """[B, ...] -> [M, K, B / (M K), ...]: row (a K + c) M + j goes to mini-batch j, micro-batch c. Each device's
  rows hold a share of every (mini-batch, micro-batch), so no update moves rows between devices."""
  m = config.num_minibatches

  def split(x):
    x = x.reshape(x.shape[0] // (m * k), k, m, *x.shape[1:])
    return config.constrain(jnp.moveaxis(x, (2, 1), (0, 1)), 2)

  return jax.tree.map(split, per_row)


def minibatch_order(rng: jax.Array, num_minibatches: int, num_epochs: int) -> jax.Array:
  """The mini-batch of each update: every epoch visits each mini-batch once, in an order drawn from rng."""
  keys = jax.random.split(rng, num_epochs)
  return jax.vmap(lambda key: jax.random.permutation(key, num_minibatches))(keys).reshape(-1)


def one_update(config: StepConfig, v0: jax.Array, rewards_ok: jax.Array, carry, mini: dict):
  """One optimizer update over a mini-batch (its micro-batches accumulated in order); skipped, and why, if its loss
  or gradient is not finite, a reward is not, or it has no tokens."""
  state, n_applied = carry
  # Where the params are between version v0 and v0 + 1 (for proximal="interpolate").
  v_now = v0 + n_applied / config.updates_per_step
  grads, loss, stats = _gradients(config, state.params, mini, v0, v_now, state.frozen)
  grad_norm = optax.tree.norm(grads)
  has_tokens = stats["tokens"] > 0
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ok = finite & rewards_ok & has_tokens
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  params, opt_state = apply_update(config.optimizer, grads, state.opt_state, state.params, ok)
  reasons = {"skip/reward": ~rewards_ok, "skip/empty": rewards_ok & ~has_tokens,
             "skip/nonfinite": rewards_ok & has_tokens & ~finite}
  return ((state.replace(params=params, opt_state=opt_state), n_applied + ok.astype(jnp.int32)),
          {"loss": loss, "grad_norm": grad_norm, "applied": ok, **reasons, **stats})


def _gradients(config: StepConfig, params, mini: dict, v0: jax.Array, v_now: jax.Array, frozen=None):
  """(float32 gradients, loss, stats) of one update: its K micro-batches' sums, the loss normalised over all.
  Gradients of `params` only: `frozen` (a LoRA run's base) is read, never differentiated."""
  k, rows, seq_len = mini["tokens"].shape
  weights = aggregation_weights(mini["loss_mask"].reshape(k * rows, seq_len), mini["sample_mask"].reshape(k * rows, -1),
                                config.loss.aggregation, config.loss.norm_length,
                                mini["segments"].reshape(k * rows, seq_len)).reshape(k, rows, seq_len)

  def accumulate(grads, xs):
    x, w = xs
    (loss, stats), g = jax.value_and_grad(micro_loss, has_aux=True)(params, x, w, v0, v_now)
    return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), (loss, stats)

  micro_loss = functools.partial(_micro_loss, config, frozen=frozen, router_scale=1.0 / k)
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  grads, (losses, stats) = jax.lax.scan(accumulate, zeros, (mini, weights))
  stats = {name: (jnp.max(v) if name in MAX_STATS else jnp.min(v) if name in MIN_STATS else jnp.sum(v))
           for name, v in stats.items()}
  return grads, losses.sum(), stats


def _micro_loss(config: StepConfig, params, x: dict, weights_BxL: jax.Array, v0: jax.Array, v_now: jax.Array,
                frozen=None, router_scale: float = 1.0):
  """policy_objective of one micro-batch at `params` (on `frozen`), with its anchor as LossConfig.proximal says;
  a MoE model's load-balance terms added with its config's coefficients, each micro-batch's mean weighted by
  router_scale (1 / micro-batches: the update's mean)."""
  cfg = config.loss
  (logp, in_support, entropy), router = scores_and_router_loss(config, params, x, frozen)
  prox = None
  if cfg.proximal == "recompute":
    prox = x["prox"] if config.prox_pass else jax.lax.stop_gradient(logp)
  elif cfg.proximal == "interpolate":
    v_t = x["versions"]
    alpha = jnp.where(v_now > v_t, (v0 - v_t) / jnp.maximum(v_now - v_t, 1e-6), 1.0).clip(0.0, 1.0)
    prox = x["behavior"] + alpha * (jax.lax.stop_gradient(logp) - x["behavior"])
  loss, stats = policy_objective(logp, x["behavior"], x["adv"], weights_BxL, cfg, prox_logp_BxL=prox,
                                 ref_logp_BxL=x.get("ref"), entropy_BxL=entropy, in_support_BxL=in_support,
                                 prox_in_support_BxL=x.get("prox_in_support"),
                                 ref_in_support_BxL=x.get("ref_in_support"), segment_ids_BxL=x["segments"])
  if router:
    loss += router_scale * router.pop("router_loss")
    stats |= {f"loss/{name}": router_scale * value for name, value in router.items()}
  return loss, stats


def commit(config: StepConfig, start: TrainState, after: TrainState, per_update: dict):
  """The step's result, decided here alone: atomic, all its updates or none (a version is the result of all its
  updates, and a batch is trained on whole or its groups are dropped, counted); else whatever updates applied.
  A mini-batch of padding rows only is a no-op, not a fault. Returns (state, per_update with "applied" as it
  stands after the commit, the skip reasons)."""
  any_of = lambda name: jnp.any(per_update[name])
  reasons = {"skip/reward": any_of("skip/reward"), "skip/nonfinite": any_of("skip/nonfinite"),
             "skip/empty": jnp.all(per_update["skip/empty"])}
  if config.atomic:
    step_ok = ~(reasons["skip/reward"] | reasons["skip/nonfinite"] | reasons["skip/empty"])
    if config.updates_per_step > 1:  # the pre-step state was kept for this (one update skips itself)
      keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(step_ok, a, b), new, old)
      after = after.replace(params=keep(after.params, start.params), opt_state=keep(after.opt_state, start.opt_state))
  else:  # each update kept or skipped alone: the step applies if any did, and says why not when none did
    step_ok = any_of("applied")
    reasons = {"skip/reward": ~step_ok & reasons["skip/reward"], "skip/empty": ~step_ok & reasons["skip/empty"],
               "skip/nonfinite": ~step_ok & ~reasons["skip/reward"] & ~reasons["skip/empty"]}
  state = after.replace(step=start.step + 1, version=start.version + step_ok.astype(jnp.int32),
                        skipped=start.skipped + (~step_ok).astype(jnp.int32))
  return state, {**per_update, "applied": per_update["applied"] & step_ok}, reasons


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
  router = {name: mean(name) for name in ("loss/router_aux", "loss/router_z") if name in per_update}
  return router | {
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
      # Tokens without a ratio (outside prox's support: weight 0) and without a KL term (outside ref's support).
      "prox_out_of_support_frac": per_token("prox_out_of_support"),
      "ref_out_of_support_frac": per_token("ref_out_of_support"),
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

