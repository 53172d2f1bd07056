"""Packing: layout, errors, and a packed train step equal to the unpacked one on the same samples."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl.learner import LossConfig, StepConfig, init_train_state, jit_train_step
from jaxrl.learner.packing import first_fit_decreasing, pack_batch, row_buckets, segment_sums, to_tokens
from jaxrl.rollout import Rollout, SamplingParams, make_batch

V, N, L, G = 8, 12, 12, 4  # vocab, samples, tokens per row, segments per packed row


def segment_model(params, tokens, positions, segments):
  """Bigram + position terms + a causal sum of embeddings within the segment: leaks if segments leak."""
  t = tokens.shape[1]
  see = (segments[:, :, None] == segments[:, None, :]) & (jnp.arange(t)[:, None] >= jnp.arange(t)[None, :])
  context = jnp.einsum("bts,bsv->btv", see.astype(jnp.float32), params["e"][tokens])
  return params["w"][tokens] + params["p"][positions] + 0.3 * context


def params0():
  k = jax.random.split(jax.random.key(0), 3)
  return {"w": 0.5 * jax.random.normal(k[0], (V, V)), "p": 0.2 * jax.random.normal(k[1], (L, V)),
          "e": 0.2 * jax.random.normal(k[2], (V, V))}


def rollouts(seed=0, n=N):
  """Samples of 3..7 tokens, off-policy behaviour logprobs, groups of 4 with distinct rewards."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    p = int(rng.integers(1, 3))
    c = int(rng.integers(2, 8 - p))
    out.append(Rollout(rng.integers(0, V, p).astype(np.int32), rng.integers(0, V, c).astype(np.int32),
                       rng.normal(-2.0, 0.3, c).astype(np.float32), np.zeros(c, np.int32), "eos",
                       group_id=100 + i // 4, sample_index=i % 4, reward=float(rng.uniform())))
  return out


def test_row_buckets():
  assert row_buckets(12) == (1, 2, 3, 4, 6, 8, 12)
  assert row_buckets(16, 4) == (4, 8, 12, 16)
  with pytest.raises(ValueError, match="multiple of unit"):
    row_buckets(12, 8)


def test_first_fit_decreasing_respects_budget_and_slots():
  lengths = [7, 2, 5, 3, 3, 1, 8, 4]
  rows = first_fit_decreasing(lengths, 8, max_segments=2)
  assert sorted(i for r in rows for i in r) == list(range(8))
  assert all(sum(lengths[i] for i in r) <= 8 and len(r) <= 2 for r in rows)
  assert rows == [[6], [0, 5], [2, 3], [7, 4], [1]]  # longest first, each into the first row with room
  assert first_fit_decreasing([1] * 5, 8, max_segments=2) == [[0, 1], [2, 3], [4]]  # rows full of segments


def test_pack_batch_layout():
  rs = rollouts()
  batch = pack_batch(rs, L, row_buckets(N), G)
  b = batch.tokens_BxL.shape[0]
  assert b in row_buckets(N) and b < N and batch.rewards_B.shape == (b, G)
  seen = set()
  for row in range(b):
    for slot in range(G):
      cols = np.flatnonzero(batch.segment_ids_BxL[row] == slot + 1)
      if batch.sample_mask_B[row, slot] == 0:
        assert cols.size == 0
        continue
      i = next(j for j, r in enumerate(rs) if r.group_id == batch.group_ids_B[row, slot]
               and r.reward == batch.rewards_B[row, slot])
      seen.add(i)
      r = rs[i]
      np.testing.assert_array_equal(batch.tokens_BxL[row, cols], np.concatenate([r.prompt_tokens,
                                                                                  r.completion_tokens]))
      np.testing.assert_array_equal(batch.positions_BxL[row, cols], np.arange(r.num_tokens))
      np.testing.assert_array_equal(batch.behavior_logprobs_BxL[row, cols[len(r.prompt_tokens):]], r.logprobs)
      assert batch.loss_mask_BxL[row, cols].sum() == len(r.completion_tokens)
  assert seen == set(range(N))
  assert batch.segment_ids_BxL.astype(bool).sum() == sum(r.num_tokens for r in rs)


def test_pack_batch_errors():
  rs = rollouts()
  long = Rollout(np.ones(4, np.int32), np.ones(L, np.int32), np.zeros(L, np.float32), np.zeros(L, np.int32),
                 "length", group_id=7)
  with pytest.raises(ValueError, match=r"rollout 12 \(group 7\) has 16 tokens, more than seq_len=12"):
    pack_batch([*rs, long], L, row_buckets(N), G)
  with pytest.raises(ValueError, match="need 6 packed rows of 12 tokens, more than the largest row bucket 2"):
    pack_batch(rs, L, (1, 2), G)
  with pytest.raises(ValueError, match="max_segments"):
    pack_batch(rs, L, (N,), 0)


def test_segment_sums_and_to_tokens():
  seg = np.array([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]], np.int32)
  x = np.arange(12.0, dtype=np.float32).reshape(2, 6)
  vals = np.array([[10.0, 20.0, 30.0], [1.0, 2.0, 3.0]], np.float32)
  sums, whole, tokens = jax.device_get(jax.jit(lambda x, seg, vals: (
      segment_sums(x, seg), segment_sums(x, None), to_tokens(vals, seg, fill=-1)))(x, seg, vals))  # one program
  np.testing.assert_array_equal(sums[0, :5], [1, 1, 9, 9, 9])
  np.testing.assert_array_equal(sums[1, :4], [6, 7, 17, 17])
  np.testing.assert_array_equal(whole, x.sum(1, keepdims=True))
  np.testing.assert_array_equal(tokens, [[10, 10, 20, 20, 20, -1], [1, 2, 3, 3, -1, -1]])


_BEHAVIOR = dict(proximal="behavior", is_level="none", is_cap=None)  # PPO anchored at mu, no IS weights
CONFIGS = {
    "grpo_token_ppo": LossConfig(**_BEHAVIOR, clip_low=0.1, clip_high=0.1, dual_clip=None),
    "drgrpo_seqsum_ppo_dual": LossConfig(**_BEHAVIOR, advantage="dr_grpo", aggregation="seq_sum_norm", clip_low=3e-2,
                                         clip_high=4e-2, dual_clip=1.5),
    "rloo_seqmean_seqIS": LossConfig(advantage="rloo", aggregation="seq_mean", proximal="recompute",
                                     is_level="sequence", is_cap=2.0, entropy_coef=0.01),
    "reinforce_pg_tokenIS_kl": LossConfig(advantage="reinforce", policy_loss="pg", proximal="interpolate",
                                          is_level="token", is_cap=None, is_mask_low=0.5, is_mask_high=1.5,
                                          kl_coef=0.1, kl_estimator="k2", dual_clip=None),
    "grpo_seqmean_topk_klreward": LossConfig(**_BEHAVIOR, aggregation="seq_mean", dual_clip=None,
                                             sampling=SamplingParams(temperature=0.8, top_k=4), kl_coef=0.05,
                                             kl_estimator="k1_reward"),
    "gspo_seqmean_dual": LossConfig(**_BEHAVIOR, aggregation="seq_mean", policy_loss="gspo", clip_low=0.01,
                                    clip_high=0.02, dual_clip=1.5, entropy_coef=0.02),
    "decoupled_epochs_seqmeanIS_ess": LossConfig(proximal="recompute", is_level="sequence_mean", is_ess_min=0.95,
                                                 is_cap=None),
}
# Extra StepConfig fields: two epochs over one mini-batch make the second update's prox / mu weights
# non-trivial (the pre-step pass), and each update sees the whole batch, so row order does not matter.
STEP_KW = {"decoupled_epochs_seqmeanIS_ess": dict(num_epochs=2), "rloo_seqmean_seqIS": dict(num_epochs=2)}


def _after_one_step(cfg, batch, rows, **kw):
  step = jit_train_step(StepConfig(model=segment_model, optimizer=optax.sgd(0.3), loss=cfg, batch_size=N, seq_len=L,
                                   row_buckets=rows, **kw))
  ref = jax.tree.map(lambda x: x + 0.1, params0())
  state = init_train_state(params0(), optax.sgd(0.3), ref_params=ref if cfg.kl_coef else None, version=2)
  state, metrics = step(state, batch, jax.random.key(0))
  return jax.device_get((state.params, metrics))


_UNPACKED = {}


def _unpacked_step(name, **kw):
  """_after_one_step of CONFIGS[name] on the unpacked batch of its rollouts: run once per step settings, as both
  tests below compare against the same step (the arrays are host copies, read only)."""
  kw = {"num_microbatches": 1, "num_minibatches": 1, "num_epochs": 1, **kw}
  key = (name, tuple(sorted(kw.items())))
  if key not in _UNPACKED:
    _UNPACKED[key] = _after_one_step(CONFIGS[name], make_batch(rollouts(seed=len(name)), N, L), (), **kw)
  return _UNPACKED[key]


# Every config at (mini-batches, epochs) (1, 1), (2, 1), (2, 2); a config whose own num_epochs is 2 runs (2, 1) as
# (2, 2) (the same step on the same samples), so that case runs once.
PACKED_CASES = [(name, m, e) for name in sorted(CONFIGS) for m, e in ((1, 1), (2, 1), (2, 2))
                if not (e == 2 and STEP_KW.get(name, {}).get("num_epochs") == 2)]


@pytest.mark.parametrize("name,minibatches,epochs", PACKED_CASES)
def test_packed_step_equals_unpacked(name, minibatches, epochs):
  """Every advantage, loss and aggregation, at one mini-batch, at the run config's two, and two of them for two
  epochs: a mini-batch is the same samples packed or not (sample i in mini-batch i % M), so the step is the same."""
  cfg, rs = CONFIGS[name], rollouts(seed=len(name))
  k = 2 if name == "grpo_token_ppo" else 1  # gradient accumulation over packed micro-batches too
  buckets = tuple(b for b in (2, 4, 6, 8, 12) if b % (minibatches * k) == 0)
  packed = pack_batch(rs, L, buckets, G, num_minibatches=minibatches)
  assert packed.tokens_BxL.shape[0] < N
  kw = dict(num_microbatches=k, num_minibatches=minibatches, **STEP_KW.get(name, {}))
  kw["num_epochs"] = max(kw.get("num_epochs", 1), epochs)
  params_u, m_u = _unpacked_step(name, **kw)
  params_p, m_p = _after_one_step(cfg, packed, buckets[:-1], **kw)
  assert m_u["updates_applied"] == kw["num_epochs"] * minibatches and m_u["num_samples"] == N
  moved = np.abs(params_u["w"] - params0()["w"]).max()
  assert moved > 1e-4
  for leaf in params_u:  # SGD: equal updates are equal gradients
    np.testing.assert_allclose(params_p[leaf], params_u[leaf], rtol=1e-5, atol=1e-5 * moved, err_msg=leaf)
  for metric, value in m_u.items():
    np.testing.assert_allclose(m_p[metric], value, rtol=1e-5, atol=1e-6, err_msg=metric)


def _rewards_by_row(batch):
  """The rewards (distinct per sample here: the samples' names) in each row of a batch, packed or not."""
  mask = batch.sample_mask_B.reshape(batch.tokens_BxL.shape[0], -1) > 0
  return [batch.rewards_B.reshape(mask.shape)[r][mask[r]].tolist() for r in range(mask.shape[0])]


def test_packed_minibatches_hold_their_own_samples():
  """Row r of a packed batch holds only samples of mini-batch r % M (sample i is in mini-batch i % M), every sample
  once; RunSpec.make_batch shuffles the samples by (seed, step) first, the same way packed or not."""
  from jaxrl.controller.spec import RunSpec
  from jaxrl.settings import RL, Sampler, Task
  rs = rollouts(seed=5)
  index = {np.float32(r.reward).item(): i for i, r in enumerate(rs)}
  assert len(index) == N
  for m in (1, 2, 3):
    rows = _rewards_by_row(pack_batch(rs, L, (6, 12), G, num_minibatches=m))
    assert all(index[x] % m == r % m for r, row in enumerate(rows) for x in row)
    assert sorted(index[x] for row in rows for x in row) == list(range(N))
  rl = RL(group_size=4, groups_per_step=3, seq_len=L, num_minibatches=2, max_segments=G)
  spec = dict(sampler=Sampler(), task=Task(), num_steps=1, seed=7)
  plain, packed = RunSpec(rl=rl, **spec), RunSpec(rl=dataclasses.replace(rl, pack=True), **spec, row_buckets=(6, 12))
  minibatches = lambda batch: [sorted(x for row in _rewards_by_row(batch)[j::2] for x in row) for j in range(2)]
  assert minibatches(plain.make_batch(rs, 3)) == minibatches(packed.make_batch(rs, 3))
  assert minibatches(plain.make_batch(rs, 3)) == minibatches(plain.make_batch(rs, 3))
  assert minibatches(plain.make_batch(rs, 3)) != minibatches(plain.make_batch(rs, 4))


def _tiny_decoder(**kw):
  """nnx.split(Decoder(cfg, nnx.Rngs(0))), its params built in one compiled program (init_params), not op by op."""
  from jaxrl.models import ModelConfig, init_params
  return init_params(ModelConfig.tiny(vocab_size=V, **kw))


def test_perturbing_one_segment_changes_no_other_segment():
  """Real decoder, chunked attention with blocks smaller than a segment: log-probs stay within segments."""
  from jaxrl.learner.logprobs import token_logprobs
  graphdef, params = _tiny_decoder(train_attention="chunked", attention_block=4)
  batch = pack_batch(rollouts(seed=3), L, (N,), G)
  row = int(np.argmax((batch.segment_ids_BxL == 3).any(1)))  # a row with three samples
  from flax import nnx

  @jax.jit
  def logp(tokens):
    logits = nnx.merge(graphdef, params)(tokens, batch.positions_BxL, batch.segment_ids_BxL)
    return token_logprobs(logits, tokens)[0]

  base = np.asarray(logp(batch.tokens_BxL))
  for seg in (1, 2, 3):
    tokens = batch.tokens_BxL.copy()
    cols = batch.segment_ids_BxL[row] == seg
    tokens[row, cols] = (tokens[row, cols] + 1) % V
    # Entry t scores token t from position t - 1: a segment's first entry (a prompt token, never trained) is
    # scored across the boundary by construction, so only entries with positions > 0 are compared.
    diff = (np.abs(np.asarray(logp(tokens)) - base) > 0) & (batch.positions_BxL > 0)
    assert diff[row, cols].any()
    assert not diff[row, ~cols].any() and not np.delete(diff, row, axis=0).any()


def test_packed_decoder_step_with_chunked_kernels_equals_unpacked():
  """The memory-efficient path (chunked attention, chunked log-probs) on packed rows = the plain padded step."""
  cfg = LossConfig(**_BEHAVIOR, aggregation="seq_mean", policy_loss="gspo", clip_low=0.05, clip_high=0.05,
                   entropy_coef=0.01, dual_clip=None)
  rs = rollouts(seed=4)
  out = {}
  for name, kw, batch, rows, chunk in (
      ("unpacked", {}, make_batch(rs, N, L), (), 0),
      ("packed", dict(train_attention="chunked", attention_block=4), pack_batch(rs, L, (4, 8), G), (4, 8), 5)):
    graphdef, params = _tiny_decoder(**kw)
    step = jit_train_step(StepConfig(model=graphdef, optimizer=optax.sgd(0.5), loss=cfg, batch_size=N, seq_len=L,
                                     row_buckets=rows, logprob_chunk=chunk))
    state, metrics = step(init_train_state(params, optax.sgd(0.5)), batch, jax.random.key(0))
    out[name] = jax.device_get((state.params, metrics))
  (p_u, m_u), (p_p, m_p) = out["unpacked"], out["packed"]
  for a, b in zip(jax.tree.leaves(p_p), jax.tree.leaves(p_u), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for metric in ("loss", "grad_norm", "entropy", "ratio_mean", "num_tokens", "num_samples"):
    np.testing.assert_allclose(m_p[metric], m_u[metric], rtol=1e-5, err_msg=metric)


@pytest.mark.parametrize("name", ["grpo_token_ppo", "rloo_seqmean_seqIS", "reinforce_pg_tokenIS_kl"])
def test_microbatch_rows_chunks_each_bucket_and_trains_the_same_update(name):
  """rl.microbatch_rows: each row bucket takes the fewest chunks of at most that many rows: a 6-row batch at 2 rows
  is the num_microbatches=3 program exactly (bit for bit), 8 rows the num_microbatches=4 one, and either equals the
  unpacked one-chunk step within rounding (prox and ref passes chunked the same way)."""
  cfg, rs = CONFIGS[name], rollouts(seed=len(name))
  kw = STEP_KW.get(name, {})
  buckets = (6, 8)
  params_u, m_u = _unpacked_step(name, **kw)
  moved = np.abs(params_u["w"] - params0()["w"]).max()
  for rows, chunks in ((6, 3), (8, 4)):
    batch = pack_batch(rs, L, (rows,), G)
    by_rows = _after_one_step(cfg, batch, buckets, microbatch_rows=2, **kw)
    by_count = _after_one_step(cfg, batch, (rows,), num_microbatches=chunks, **kw)
    for a, b in zip(jax.tree.leaves(by_rows), jax.tree.leaves(by_count), strict=True):
      np.testing.assert_array_equal(a, b)
    params_p, m_p = by_rows
    for leaf in params_u:
      np.testing.assert_allclose(params_p[leaf], params_u[leaf], rtol=1e-5, atol=1e-5 * moved, err_msg=leaf)
    np.testing.assert_allclose(m_p["loss"], m_u["loss"], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="microbatch_rows must be >= 0"):
    jit_train_step(StepConfig(model=segment_model, optimizer=optax.sgd(0.3), loss=cfg, batch_size=N, seq_len=L,
                              microbatch_rows=-1))
