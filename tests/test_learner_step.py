"""The train step on one device: version and skip semantics, bad input, accumulation, compile-once, dtypes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl.learner import (
    LossConfig,
    StepConfig,
    init_train_state,
    jit_train_step,
    make_optimizer,
    token_logprobs,
    train_step,
)
from jaxrl.rollout import Rollout, SamplingParams, make_batch

V, B, L = 8, 8, 6


def bigram(params, tokens, positions, segments):
  return params["w"][tokens]


def params0():
  return {"w": 0.5 * jax.random.normal(jax.random.key(0), (V, V))}


def rollouts(w, *, version=0, n=B, group_size=4, seed=0, stale_w=None):
  """Samples from softmax(stale_w or w) with numpy; reward = fraction of completion tokens equal to 3."""
  rng = np.random.default_rng(seed)
  sample_w = np.asarray(w if stale_w is None else stale_w, np.float64)
  out = []
  for i in range(n):
    prompt = rng.integers(0, V, size=2)
    toks, lps = [], []
    prev = prompt[-1]
    for _ in range(rng.integers(1, L - 1)):
      p = np.exp(sample_w[prev] - sample_w[prev].max())
      p /= p.sum()
      prev = rng.choice(V, p=p)
      toks.append(prev)
      lps.append(np.log(p[prev]))
    out.append(Rollout(prompt.astype(np.int32), np.array(toks, np.int32), np.array(lps, np.float32),
                       np.full(len(toks), version, np.int32), "length", group_id=i // group_size,
                       reward=float(np.mean(np.array(toks) == 3))))
  return out


def batch_of(rs, batch_size=B):
  return make_batch(rs, batch_size, L)


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "sgd2": lambda: optax.sgd(2.0), "adam": lambda: optax.adam(1e-2),
              "adam_acc": lambda: optax.adam(0.05)}
_STEPS = {}


def run(cfg=None, opt="sgd", params=None, version=0, **kw):
  """(step, fresh state, on-policy batch); steps are shared between tests so that each compiles once."""
  cfg = cfg or LossConfig()
  key = (cfg, opt, tuple(sorted(kw.items())))
  if key not in _STEPS:
    _STEPS[key] = jit_train_step(StepConfig(model=bigram, optimizer=OPTIMIZERS[opt](), loss=cfg, batch_size=B,
                                            seq_len=L, **kw))
  params = params0() if params is None else params
  state = init_train_state(params, OPTIMIZERS[opt](), version=version)
  return _STEPS[key], state, batch_of(rollouts(params["w"]))


def host(tree):
  as_np = lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
  return jax.tree.map(as_np, tree)


def test_applied_update_bumps_version_and_moves_params():
  step, state, batch = run()
  before = host(state.params)
  state, m = step(state, batch, jax.random.key(0))
  assert (int(state.step), int(state.version), int(state.skipped)) == (1, 1, 0)
  assert m["updates_applied"] == 1 and m["updates_skipped"] == 0
  assert not np.allclose(before["w"], state.params["w"])
  np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-5)  # on-policy data: pi = mu
  np.testing.assert_allclose(m["ess_frac"], 1.0, rtol=1e-5)
  assert abs(float(m["kl_behavior"])) < 1e-6
  assert m["num_tokens"] == float(batch.loss_mask_BxL.sum())


@pytest.mark.parametrize("corrupt,reason", [
    ("nan_reward", "skip/reward"), ("inf_reward", "skip/reward"), ("empty", "skip/empty"),
    ("nan_behavior", "skip/nonfinite"),
])
def test_bad_values_skip_without_touching_state(corrupt, reason):
  step, state, batch = run(opt="adam")
  state, _ = step(state, batch, jax.random.key(0))  # one good update first: the optimizer state is non-trivial
  if corrupt == "nan_reward":
    batch = batch.replace(rewards_B=batch.rewards_B.copy())
    batch.rewards_B[2] = np.nan
  elif corrupt == "inf_reward":
    batch = batch.replace(rewards_B=batch.rewards_B.copy())
    batch.rewards_B[0] = np.inf
  elif corrupt == "empty":
    batch = batch_of([])
  else:
    lp = batch.behavior_logprobs_BxL.copy()
    lp[1, 3] = np.nan  # a trained token (every rollout has >= 1 completion token at index 2)
    lp[1, 2] = np.nan
    batch = batch.replace(behavior_logprobs_BxL=lp)
  before = host((state.params, state.opt_state))
  state, m = step(state, batch, jax.random.key(0))
  after = host((state.params, state.opt_state))
  jax.tree.map(np.testing.assert_array_equal, after, before)  # bitwise unchanged
  assert (int(state.step), int(state.version), int(state.skipped)) == (2, 1, 1)
  assert m[reason] == 1 and m["updates_skipped"] == 1 and m["updates_applied"] == 0
  state, m = step(state, batch_of(rollouts(state.params["w"], version=1, seed=5)), jax.random.key(0))
  assert int(state.version) == 2 and np.isfinite(state.params["w"]).all()  # recovers on the next good batch


def test_garbage_in_padding_is_ignored():
  step, state, batch = run()
  rs = rollouts(params0()["w"], n=B - 2)
  clean = batch_of(rs)
  dirty = batch_of(rs)
  dirty.rewards_B[-2:] = np.nan  # padding rows
  dirty.behavior_logprobs_BxL[-2:] = np.nan
  dirty.behavior_logprobs_BxL[:, 0] = np.inf  # prompt positions are never trained on
  s1, m1 = step(state, clean, jax.random.key(0))
  w1 = np.asarray(s1.params["w"])
  s2, m2 = step(init_train_state(params0(), optax.sgd(0.5)), dirty, jax.random.key(0))
  np.testing.assert_array_equal(s2.params["w"], w1)
  assert m2["updates_applied"] == 1 and m2["num_samples"] == B - 2


def test_bad_shapes_raise_clear_errors():
  step, state, batch = run()
  with pytest.raises(ValueError, match=r"Batch.tokens_BxL has shape \(8, 7\).*expects \(8, 6\)"):
    step(state, make_batch(rollouts(params0()["w"]), B, L + 1), jax.random.key(0))
  with pytest.raises(ValueError, match=r"Batch.rewards_B has shape \(4,\)"):
    step(state, batch.replace(rewards_B=batch.rewards_B[:4]), jax.random.key(0))
  with pytest.raises(ValueError, match="Batch.tokens_BxL has dtype float32"):
    step(state, batch.replace(tokens_BxL=batch.tokens_BxL.astype(np.float32)), jax.random.key(0))
  with pytest.raises(TypeError, match="Batch"):
    step(state, {"tokens_BxL": batch.tokens_BxL}, jax.random.key(0))
  with pytest.raises(ValueError, match="not divisible"):
    StepConfig(model=bigram, optimizer=optax.sgd(1.0), batch_size=B, seq_len=L, num_microbatches=3)
  with pytest.raises(ValueError, match="batch_size >= 1"):
    StepConfig(model=bigram, optimizer=optax.sgd(1.0), batch_size=0, seq_len=L)
  with pytest.raises(ValueError, match="ref_params"):
    s, st, b = run(LossConfig(kl_coef=0.1))
    s(st, b, jax.random.key(0))


def test_step_config_is_keyword_only_and_frozen_and_the_plain_step_equals_the_jitted_one():
  with pytest.raises(TypeError):
    StepConfig(bigram, optax.sgd(0.5), LossConfig(), B, L)  # two adjacent ints cannot be swapped silently
  config = StepConfig(model=bigram, optimizer=optax.sgd(0.5), batch_size=B, seq_len=L)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.seq_len = 2
  rows = NamedSharding(jax.make_mesh((1,), ("data",)), P("data"))
  with pytest.raises(ValueError, match="give both the state's shardings and StepConfig.batch_sharding"):
    jit_train_step(dataclasses.replace(config, batch_sharding=rows))
  _, state, batch = run()
  plain = train_step(state, batch, jax.random.key(1), config=config)
  jitted = jit_train_step(config)(state, batch, jax.random.key(1))
  np.testing.assert_allclose(plain[0].params["w"], jitted[0].params["w"], rtol=1e-6)
  assert int(plain[0].version) == int(jitted[0].version) == 1
  np.testing.assert_allclose(plain[1]["loss"], jitted[1]["loss"], rtol=1e-6)


@pytest.mark.parametrize("cfg", [
    LossConfig(),
    LossConfig(advantage="dr_grpo", aggregation="seq_mean", policy_loss="gspo", clip_low=3e-4, clip_high=4e-4,
               proximal="behavior", is_level="none", is_cap=None, dual_clip=None),
    LossConfig(advantage="rloo", aggregation="seq_mean", proximal="recompute", is_level="sequence", is_cap=2.0,
               entropy_coef=0.01),
])
def test_grad_accumulation_equals_one_big_batch(cfg):
  params = params0()
  stale = params["w"] + 0.3 * jax.random.normal(jax.random.key(1), (V, V))
  batch = batch_of(rollouts(params["w"], stale_w=stale))  # off-policy, so ratios and clips matter
  new = {}
  for k in (1, 4):
    step, state, _ = run(cfg, opt="adam_acc", num_microbatches=k)
    state, m = step(state, batch, jax.random.key(0))
    new[k] = (np.asarray(state.params["w"]), host(m))
  np.testing.assert_allclose(new[4][0], new[1][0], rtol=1e-6, atol=1e-7)
  for name in ("loss", "grad_norm", "ratio_mean", "clip_frac_high", "num_tokens", "entropy"):
    np.testing.assert_allclose(new[4][1][name], new[1][1][name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_step_compiles_once():
  traces = []

  def counted(params, tokens, positions, segments):
    traces.append(1)
    return bigram(params, tokens, positions, segments)

  opt = make_optimizer(0.1, warmup_steps=1, decay_steps=5)
  step = jit_train_step(StepConfig(model=counted, optimizer=opt, loss=LossConfig(), batch_size=B, seq_len=L,
                                   num_microbatches=2))
  state = init_train_state(params0(), opt)
  for i in range(3):
    state, _ = step(state, batch_of(rollouts(state.params["w"], version=i, seed=i)), jax.random.key(i))
  assert int(state.version) == 3
  assert len(traces) == 1  # one trace (the micro-batch scan traces its body once) ...
  assert step._cache_size() == 1  # ... and one executable


def test_step_is_pure():
  step, _, batch = run(DECOUPLED["recompute"], opt="sgd2", num_minibatches=2)
  outs = [step(run(DECOUPLED["recompute"], opt="sgd2", num_minibatches=2)[1], batch, jax.random.key(3))
          for _ in range(2)]
  jax.tree.map(np.testing.assert_array_equal, host(outs[0]), host(outs[1]))


_UNCAPPED = dict(clip_low=0.05, clip_high=0.05, is_cap=None, dual_clip=None)
DECOUPLED = {
    "behavior": LossConfig(**_UNCAPPED, proximal="behavior", is_level="none"),
    "recompute": LossConfig(**_UNCAPPED, proximal="recompute", is_level="token"),
    "interpolate": LossConfig(**_UNCAPPED, proximal="interpolate", is_level="token"),
}


@pytest.mark.parametrize("proximal", ["recompute", "interpolate"])
def test_decoupled_ppo_on_policy_equals_standard_ppo(proximal):
  """With on-policy data, prox (recomputed or interpolated from versions) equals mu at every mini-batch.

  The second of two mini-batch updates sees moved params, so the PPO ratio and its clip are live.
  """
  results = []
  for c in (DECOUPLED["behavior"], DECOUPLED[proximal]):
    step, state, batch = run(c, opt="sgd2", num_minibatches=2)
    state, m = step(state, batch, jax.random.key(7))
    results.append((np.asarray(state.params["w"]), float(m["clip_frac_low"] + m["clip_frac_high"])))
    assert int(state.version) == 1 and m["updates_applied"] == 2  # one version per learner step
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6, atol=1e-7)
  assert results[0][1] > 0  # the trust region clipped something in the second update


def test_interpolated_proximal_lies_between_behavior_and_current():
  """Stale data: interpolate differs from both anchoring at mu and recomputing prox (second update)."""
  params = params0()
  stale = params["w"] + 0.5 * jax.random.normal(jax.random.key(2), (V, V))
  batch = batch_of(rollouts(params["w"], stale_w=stale, version=3))
  out = {}
  for name, c in DECOUPLED.items():
    step, state, _ = run(c, opt="sgd2", num_minibatches=2, version=5)
    state, _ = step(state, batch, jax.random.key(7))
    out[name] = np.asarray(state.params["w"])
  d = lambda a, b: np.abs(out[a] - out[b]).max()
  assert d("interpolate", "recompute") > 1e-4 and d("interpolate", "behavior") > 1e-4


def test_staleness_histogram_and_versions():
  w = params0()["w"]
  rs = rollouts(w, n=4)
  for r, v in zip(rs, (12, 9, 6, 0), strict=True):
    r.versions = np.full(len(r.versions), v, np.int32)
  rs[0].versions = np.array([12] + [7] * (len(rs[0].versions) - 1), np.int32)  # mixed versions in one sample
  step, state, _ = run(version=12)
  state, m = step(state, batch_of(rs), jax.random.key(0))
  stale = np.concatenate([12 - r.versions for r in rs])
  want = np.bincount(np.minimum(stale, 8), minlength=9)  # 8 bins (default) + one for >= 8
  assert want[8] > 0 and want[0] > 0
  np.testing.assert_array_equal(m["staleness_hist"], want)
  assert m["staleness_max"] == 12 and m["staleness_min"] == 0
  np.testing.assert_allclose(m["staleness_mean"], stale.mean(), rtol=1e-6)
  assert int(state.version) == 13


def test_fp32_master_bf16_compute_and_bf16_params():
  step, state, batch = run(opt="adam")
  ref, _ = step(state, batch, jax.random.key(0))
  step16, state16, _ = run(opt="adam", compute_dtype=jnp.bfloat16)
  mixed, m = step16(state16, batch, jax.random.key(0))
  assert mixed.params["w"].dtype == jnp.float32 and m["updates_applied"] == 1
  delta = lambda s: np.asarray(s.params["w"]) - np.asarray(params0()["w"])
  np.testing.assert_allclose(delta(mixed), delta(ref), atol=2e-3)  # adam steps of 1e-2; bf16 logits
  pure16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params0())
  step_b, state_b, _ = run(opt="adam", params=pure16)
  out, m = step_b(state_b, batch, jax.random.key(0))
  assert out.params["w"].dtype == jnp.bfloat16 and m["updates_applied"] == 1
  assert np.isfinite(np.asarray(out.params["w"], np.float32)).all()


def test_kl_to_reference_params():
  params = params0()
  cfg = LossConfig(kl_coef=0.5)
  step = jit_train_step(StepConfig(model=bigram, optimizer=optax.sgd(0.5), loss=cfg, batch_size=B, seq_len=L))
  ref = jax.tree.map(jnp.copy, params)
  state = init_train_state(params, optax.sgd(0.5), ref_params=ref)
  batch = batch_of(rollouts(params0()["w"]))
  state, m = step(state, batch, jax.random.key(0))
  assert abs(float(m["kl_ref"])) < 1e-6  # first step: pi == ref
  state, m = step(state, batch, jax.random.key(0))
  assert float(m["kl_ref"]) > 1e-4 and float(m["loss/kl"]) > 0
  np.testing.assert_array_equal(state.ref_params["w"], params0()["w"])  # frozen


def test_out_of_support_tokens_are_dropped_and_counted():
  cfg = LossConfig(sampling=SamplingParams(top_k=2))
  step, state, batch = run(cfg)
  # Recompute the behavior logprobs under the same support, as the sampler would report them.
  scores = jax.jit(lambda params, tokens: token_logprobs(bigram(params, tokens, None, None), tokens, cfg.sampling))
  lp, in_support, _ = scores(state.params, batch.tokens_BxL)
  batch = batch.replace(behavior_logprobs_BxL=np.where(batch.loss_mask_BxL > 0, np.asarray(lp), 0.0))
  trained = batch.loss_mask_BxL > 0
  outside = float((trained & ~np.asarray(in_support)).sum())
  assert outside > 0  # the data were sampled without top-k, so some tokens fall outside the top-2 support
  state, m = step(state, batch, jax.random.key(0))
  np.testing.assert_allclose(m["out_of_support_frac"], outside / trained.sum(), rtol=1e-6)
  assert m["num_tokens"] == trained.sum() - outside and m["updates_applied"] == 1


def test_a_fault_in_one_minibatch_skips_the_whole_step_and_padding_is_a_no_op():
  """Two mini-batches: NaN in one row rolls the other update back too (no version); a mini-batch of padding only
  is skipped without failing the step."""
  step, state, batch = run(DECOUPLED["recompute"], opt="sgd2", num_minibatches=2)
  before = np.asarray(state.params["w"])
  behavior = batch.behavior_logprobs_BxL.copy()
  behavior[0, batch.loss_mask_BxL[0] > 0] = np.nan
  state, m = step(state, batch.replace(behavior_logprobs_BxL=behavior), jax.random.key(1))
  assert (int(state.version), int(state.skipped)) == (0, 1)
  assert m["updates_applied"] == 0 and m["updates_skipped"] == 2 and m["skip/nonfinite"] == 1
  np.testing.assert_array_equal(state.params["w"], before)
  state, m = step(state, batch_of(rollouts(params0()["w"], n=1)), jax.random.key(1))  # 1 real row of 8
  assert (int(state.version), int(state.skipped)) == (1, 1)
  assert m["updates_applied"] == 1 and m["updates_skipped"] == 1 and m["skip/empty"] == 0


def test_without_atomic_steps_a_faulty_minibatch_skips_only_its_own_update():
  """atomic=False (no pre-step copy of the state): NaN in row 0 skips the update of row 0's mini-batch alone; the
  other mini-batch's update applies exactly as if the faulty mini-batch had had no tokens, and the version goes up."""
  step, state, batch = run(DECOUPLED["recompute"], opt="adam", num_minibatches=2, atomic=False)
  key = jax.random.key(1)
  # Row r is in mini-batch r % 2 (num_minibatches 2): row 0's mini-batch is the even rows.
  faulty = np.arange(0, B, 2)
  behavior = batch.behavior_logprobs_BxL.copy()
  behavior[0, batch.loss_mask_BxL[0] > 0] = np.nan
  state_nan, m = step(state, batch.replace(behavior_logprobs_BxL=behavior), key)
  assert (int(state_nan.version), int(state_nan.skipped)) == (1, 0)
  assert m["updates_applied"] == 1 and m["updates_nonfinite"] == 1 and m["skip/nonfinite"] == 0
  loss_mask = batch.loss_mask_BxL.copy()
  loss_mask[faulty] = 0
  _, fresh, _ = run(DECOUPLED["recompute"], opt="adam", num_minibatches=2, atomic=False)
  state_ref, m_ref = step(fresh, batch.replace(loss_mask_BxL=loss_mask), key)
  assert m_ref["updates_applied"] == 1 and m_ref["updates_nonfinite"] == 0
  np.testing.assert_array_equal(state_nan.params["w"], state_ref.params["w"])
  for a, b in zip(jax.tree.leaves(state_nan.opt_state), jax.tree.leaves(state_ref.opt_state), strict=True):
    np.testing.assert_array_equal(a, b)
  # Every update non-finite: the step is skipped, with its reason, as an atomic step would be.
  behavior[:, :] = np.nan
  _, fresh, _ = run(DECOUPLED["recompute"], opt="adam", num_minibatches=2, atomic=False)
  before = np.asarray(fresh.params["w"])
  state_all, m = step(fresh, batch.replace(behavior_logprobs_BxL=behavior), key)
  assert (int(state_all.version), int(state_all.skipped)) == (0, 1)
  assert m["updates_applied"] == 0 and m["updates_nonfinite"] == 2 and m["skip/nonfinite"] == 1
  np.testing.assert_array_equal(state_all.params["w"], before)


def test_atomic_steps_keep_the_pre_step_state_and_cost_its_memory():
  """The pre-step copy is what atomic steps cost: with 2 updates the compiled step holds one more TrainState of
  temporaries than with atomic=False; with one update neither keeps a copy."""
  params = {"w": jnp.zeros((512, 512))}  # 1 MiB: the state's params + two Adam moments are 3 MiB
  state = init_train_state(params, optax.adam(1e-2))
  batch = batch_of(rollouts(np.zeros((V, V))))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))

  def temporaries(atomic, m):
    step = jit_train_step(StepConfig(model=lambda p, t, *_: p["w"][t, :V], optimizer=optax.adam(1e-2), batch_size=B,
                                     seq_len=L, num_minibatches=m, atomic=atomic))
    return step.lower(state, batch, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes

  assert temporaries(True, 2) - temporaries(False, 2) >= 0.9 * state_bytes
  assert abs(temporaries(True, 1) - temporaries(False, 1)) < 0.01 * state_bytes  # a few scalars differ
