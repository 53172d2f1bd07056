"""Paged engine + Sampler: equals the dense engine token for token and logprob for logprob, one prefill per group
with shared prompt pages that no sample writes, preemption keeps every sample, rebuild recomputes live tokens only,
keep_kv, no recompiles."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from test_sampler_engine import CFG, MAX_LEN, _check_logprobs_match_forward, _drain, _greedy_reference, _random_params

from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

PAGE = 4
SP = SamplingParams(temperature=1.0, top_k=20)


@pytest.fixture(scope="module")
def model():
  graphdef, abstract = abstract_params(CFG)
  return graphdef, _random_params(abstract, 0), _random_params(abstract, 1)


@pytest.fixture(scope="module")
def engines():
  mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:])
  make = lambda **kw: make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, steps_per_call=4, min_bucket=8, **kw)
  # The small pool holds 14 pages: a single sample may need 12, so four slots cannot all grow. Its generate calls
  # run on 1, 2 or 4 rows, as many as are live (the other engine's always on 4).
  return make(), make(kv="paged", page_size=PAGE), make(kv="paged", page_size=PAGE, num_pages=14, row_buckets=(1, 2))


def _groups(sampler, seed=1, groups=5, n=3, sampling=SP, max_tokens=30):
  rng = np.random.default_rng(seed)
  for g in range(groups):
    prompt = rng.integers(2, CFG.vocab_size, rng.integers(3, 14)).tolist()
    sampler.submit(prompt, group_id=g, n=n, max_tokens=int(rng.integers(5, max_tokens)), sampling=sampling)


def _run(engine, params, seed=1, **kw):
  sampler = Sampler(engine, params, seed=0, eos_token_ids=(), **kw)
  _groups(sampler, seed)
  return _drain(sampler), sampler


def test_paged_equals_dense_token_for_token(model, engines):
  _, params, _ = model
  dense, paged, _ = engines
  want, _ = _run(dense, params)
  got, sampler = _run(paged, params)
  assert sorted(got) == sorted(want) == [(g, i) for g in range(5) for i in range(3)]
  for k, r in want.items():
    np.testing.assert_array_equal(got[k].completion_tokens, r.completion_tokens)
    np.testing.assert_array_equal(got[k].logprobs, r.logprobs)
    np.testing.assert_array_equal(got[k].versions, r.versions)
  assert sampler.stats.prefills == 5 and sampler.stats.preemptions == 0  # one prefill per group
  assert sampler.cache.pages.num_free == paged.num_pages  # every page came back


def test_out_of_pages_preempts_and_keeps_every_sample(model, engines):
  _, params, _ = model
  dense, _, small = engines
  want, _ = _run(dense, params, seed=2)
  got, sampler = _run(small, params, seed=2)
  assert sampler.stats.preemptions > 0
  assert sorted(got) == sorted(want)
  for k, r in want.items():
    np.testing.assert_array_equal(got[k].completion_tokens, r.completion_tokens)
    np.testing.assert_allclose(got[k].logprobs, r.logprobs, atol=1e-5)  # a resumed sample's cache is a prefill's
  assert sampler.cache.pages.num_free == small.num_pages


@pytest.mark.parametrize("which", ["dense", "small"])
def test_cancel_ends_a_group_and_frees_its_slots_and_pages_for_the_others(model, engines, which):
  """Cancelling group 1 once one of its samples has drawn tokens returns each of its samples not finished yet
  once, as it is (finish_reason "cancelled": what it drew so far, none if it was never placed); no sample of it comes
  out after that, the other groups' samples come out token for token as without the cancel, and every page is free
  at the end."""
  _, params, _ = model
  engine = dict(zip(("dense", "paged", "small"), engines, strict=True))[which]
  want, _ = _run(engine, params, seed=2)
  sampler = Sampler(engine, params, seed=0, eos_token_ids=())
  _groups(sampler, 2)
  out = []
  while not any(s is not None and s.group.request.group_id == 1 and s.tokens for s in sampler._slots):
    out += sampler.step()  # until a sample of group 1 has drawn tokens (dense: 2 steps; the small pool: more)
  cancelled = sampler.cancel(1)
  assert sampler.cancel(1) == []
  done = {(r.group_id, r.sample_index) for r in out}
  assert sorted((r.group_id, r.sample_index) for r in cancelled) == [(1, i) for i in range(3) if (1, i) not in done]
  assert {r.finish_reason for r in cancelled} == {"cancelled"} and sampler.stats.cancelled == len(cancelled)
  assert any(len(r.completion_tokens) for r in cancelled) and any(not len(r.completion_tokens) for r in cancelled)
  for r in cancelled:  # cut short: a prefix of what it would have drawn
    full = want[(1, r.sample_index)].completion_tokens
    assert len(r.completion_tokens) < len(full)
    np.testing.assert_array_equal(r.completion_tokens, full[: len(r.completion_tokens)])
  rest = _drain(sampler)
  assert not any(g == 1 for g, _ in rest)
  got = {(r.group_id, r.sample_index): r for r in out} | rest
  assert sorted(got) == sorted(k for k in want if k[0] != 1 or k in done)
  for k, r in got.items():
    np.testing.assert_array_equal(r.completion_tokens, want[k].completion_tokens)
  if which != "dense":
    assert sampler.cache.pages.num_free == engine.num_pages


def test_continuous_batching_with_shared_prompts_equals_one_at_a_time(model, engines):
  graphdef, params, _ = model
  _, _, small = engines  # a small pool: samples it preempts must resume the same greedy sequence
  sampler = Sampler(small, params, seed=0)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(2, CFG.vocab_size, n).tolist() for n in (13, 6, 9, 17)]
  budgets = [(30, 4), (12, 25), (40, 2), (7, 20)]  # per sample: groups whose samples end at different times
  for g, (p, b) in enumerate(zip(prompts, budgets, strict=True)):
    sampler.submit(p, group_id=g, n=2, max_tokens=b, sampling=SamplingParams(greedy=True))
  got = _drain(sampler)
  assert sampler.stats.prefills >= 4 and sorted(got) == [(g, i) for g in range(4) for i in range(2)]
  for (g, i), r in got.items():
    completion, reason = _greedy_reference(graphdef, params, prompts[g], budgets[g][i])
    assert r.completion_tokens.tolist() == completion and r.finish_reason == reason, (g, i)


def test_samples_never_write_the_shared_prompt_pages(model, engines):
  _, params, _ = model
  _, paged, _ = engines
  sampler = Sampler(paged, params, seed=0, eos_token_ids=())
  prompt = list(range(2, 15))  # 13 tokens: positions 0..11 fill 3 shared pages, 12 (rewritten) is private
  sampler.submit(prompt, group_id=0, n=3, max_tokens=20, sampling=SP)
  sampler.step()
  tables = [sampler.cache.pages.tables[s] for s in range(3)]
  shared = tables[0][:3]
  assert all(t[:3] == shared for t in tables) and len({t[3] for t in tables}) == 3
  assert list(sampler.cache.pages.num_shared_S[:3]) == [3, 3, 3]
  before = np.asarray(sampler.cache.state.cache.k_pages)
  prefix = paged.prefill(sampler._params, prompt)
  expected = np.asarray(prefix.cache.k_NxSxTxKxD)[:, 0, :12].reshape(CFG.num_layers, 3, PAGE, *before.shape[3:])
  np.testing.assert_array_equal(before[:, shared], expected)
  sampler.step()
  sampler.step()
  after = np.asarray(sampler.cache.state.cache.k_pages)
  np.testing.assert_array_equal(after[:, shared], before[:, shared])
  assert all(not np.array_equal(after[:, t[4]], before[:, t[4]]) for t in tables)  # private pages did change


def test_in_flight_update_recomputes_only_live_tokens(model, engines):
  dense, paged, _ = engines
  _, params, params_v1 = model
  out, stats = {}, {}
  for name, engine in (("dense", dense), ("paged", paged)):
    sampler = Sampler(engine, params, seed=0, eos_token_ids=())
    _groups(sampler, seed=4)
    first = sampler.step() + sampler.step()
    sampler.update_params(params_v1, version=1)
    out[name] = {**{(r.group_id, r.sample_index): r for r in first}, **_drain(sampler)}
    stats[name] = sampler.stats
  assert stats["paged"].rebuilds == stats["dense"].rebuilds == 1
  # Dense recomputes every slot up to the longest live position (its bucket); paged only the live tokens.
  assert stats["paged"].rebuilt_tokens < stats["dense"].rebuilt_tokens / 2
  for k, r in out["dense"].items():
    np.testing.assert_array_equal(out["paged"][k].completion_tokens, r.completion_tokens)
    np.testing.assert_array_equal(out["paged"][k].versions, r.versions)
    _check_logprobs_match_forward(model, out["paged"][k])
  assert any(set(r.versions.tolist()) == {0, 1} for r in out["paged"].values())


@pytest.mark.parametrize("kv", ["dense", "paged"])
def test_keep_kv_swaps_without_recompute(model, engines, kv):
  _, params, params_v1 = model
  engine = engines[0] if kv == "dense" else engines[1]
  sampler = Sampler(engine, params, seed=0, eos_token_ids=(), on_update="keep_kv")
  sampler.submit(list(range(2, 12)), group_id=0, n=4, max_tokens=20, sampling=SP)
  sampler.step()
  sampler.step()
  sampler.update_params(params_v1, version=1)
  assert sampler.version == 1 and sampler.num_active == 4
  got = _drain(sampler)
  assert sampler.stats.rebuilds == 0 and sampler.stats.rebuilt_tokens == 0
  for r in got.values():
    assert r.versions.tolist() == [0] * 8 + [1] * 12
    # Tokens drawn before the update are exact under v0; later ones came from v1 over v0's keys/values.
    before = dataclasses.replace(r, completion_tokens=r.completion_tokens[:8], logprobs=r.logprobs[:8],
                                 versions=r.versions[:8])
    _check_logprobs_match_forward(model[:2], before)


@pytest.mark.parametrize("name", ["paged", "small"])
def test_paged_engine_does_not_recompile(model, engines, name):
  _, params, _ = model
  engine = engines[1] if name == "paged" else engines[2]
  _run(engine, params, seed=5)
  assert len(engine._live_programs) == len(engine.row_buckets)  # every row bucket, compiled at the first call
  before = engine.compile_count()
  _run(engine, params, seed=6)
  assert engine.compile_count() == before


def test_generate_runs_only_the_live_rows(model, engines):
  """Two live slots of four run as a batch of 2 rows: same tokens and logprobs as the 4-row call, the idle slots
  untouched, and the results land in the live slots' rows."""
  _, params, _ = model
  _, paged, small = engines
  assert small.row_buckets == (1, 2, 4) and small.row_bucket(2) == 2 and paged.row_bucket(2) == 4
  out = {}
  for name, engine in (("full", paged), ("live", small)):
    placed = engine.place(params, 0)
    state = engine.init_decode_state()
    for slot, (prompt, first_page) in {1: ([5, 6, 7], 0), 3: ([9, 8, 7, 6, 5], 6)}.items():
      settings = engine.slot_settings(jax.random.key(slot), SP, max_new=6)
      state = engine.insert(engine.prefill(placed, prompt), state, slot, settings,
                            table_row=np.arange(first_page, first_page + engine.pages_per_slot) % 14)
    calls = []
    for _ in range(2):  # the second call ends both samples (6 tokens) midway: done rows go idle inside the loop
      state, result = engine.generate(placed, state, live=2)
      calls.append(jax.device_get(result))
    out[name] = jax.device_get(state), calls
  (full_state, full_calls), (state, calls) = out["full"], out["live"]
  np.testing.assert_array_equal(state.tokens_SxT, full_state.tokens_SxT)
  np.testing.assert_array_equal(state.pos_S, full_state.pos_S)
  assert not state.active_S.any() and state.num_generated_S.tolist() == [0, 6, 0, 6]
  assert state.tokens_SxT[[0, 2]].sum() == 0 and state.pos_S[[0, 2]].tolist() == [0, 0]
  for got, want in zip(calls, full_calls, strict=True):
    np.testing.assert_array_equal(got.tokens_SxK, want.tokens_SxK)
    np.testing.assert_array_equal(got.valid_SxK, want.valid_SxK)
    np.testing.assert_array_equal(got.done_S, want.done_S)
    # Under the tests' unoptimised XLA backend a 1-row matmul (2 rows over 2 devices) rounds unlike a wider one: a
    # few float32 ulps at these magnitudes (2.3e-6 seen at -1.57 in a full-suite run; 2e-6 was too tight).
    np.testing.assert_allclose(got.logprobs_SxK, want.logprobs_SxK, atol=5e-6)
  assert calls[0].valid_SxK[[1, 3]].all() and not calls[0].valid_SxK[[0, 2]].any()
  assert calls[1].done_S.tolist() == [False, True, False, True]
  with pytest.raises(ValueError, match="live=5 active slots is outside"):
    small.row_bucket(5)
  with pytest.raises(ValueError, match="row_buckets must be ints in"):
    make_engine(CFG, small.mesh, max_slots=4, max_len=MAX_LEN, kv="paged", page_size=PAGE, row_buckets=(0, 8))
  with pytest.raises(ValueError, match="row_buckets are for kv='paged'"):
    make_engine(CFG, small.mesh, max_slots=4, max_len=MAX_LEN, row_buckets=(2,))


def test_paged_configuration_errors_name_the_problem(engines):
  dense = engines[0]
  with pytest.raises(ValueError, match="multiple of page_size"):
    make_engine(CFG, dense.mesh, max_slots=2, max_len=10, kv="paged", page_size=4)
  with pytest.raises(ValueError, match="cannot hold one sample"):
    make_engine(CFG, dense.mesh, max_slots=2, max_len=16, kv="paged", page_size=4, num_pages=3)
  with pytest.raises(ValueError, match="kv must be one of"):
    make_engine(CFG, dense.mesh, max_slots=2, max_len=16, kv="ragged")


def test_config_selects_the_paged_cache():
  from jaxrl import config as config_lib
  from jaxrl.controller import build as build_lib

  c = config_lib.override(config_lib.base(), **{"sampler.kv": "paged", "sampler.page_size": 8,
                                                "sampler.on_update": "keep_kv"})
  kw = build_lib.engine_kwargs(config_lib.validate(c).sampler)
  assert (kw["kv"], kw["page_size"], kw["num_pages"]) == ("paged", 8, None)
  with pytest.raises(config_lib.ConfigError, match="multiple of sampler.page_size=5"):
    config_lib.validate(config_lib.override(c, **{"sampler.page_size": 5}))
  with pytest.raises(config_lib.ConfigError, match="sampler.kv='ragged'; allowed"):
    config_lib.validate(config_lib.override(c, **{"sampler.kv": "ragged"}))


def _episodes_with_an_update(engine, params, new_params, sampling):
  """Three groups, an in-flight update after two generate calls (live samples rebuilt on the new weights: chunks take
  the XLA path); {(group, index): rollout}. The interpreted kernels cost seconds a generate call, so samples end
  within 15 tokens: over the 8 drawn before the update, so some sample still spans both versions."""
  sampler = Sampler(engine, params, seed=0, eos_token_ids=())
  _groups(sampler, groups=3, seed=4, sampling=sampling, max_tokens=16)
  first = sampler.step() + sampler.step()
  sampler.update_params(new_params, version=1)
  out = {**{(r.group_id, r.sample_index): r for r in first}, **_drain(sampler)}
  assert sampler.stats.rebuilds == 1 and sampler.cache.pages.num_free == engine.num_pages
  return out


@pytest.fixture(scope="module")
def xla_episodes(model, engines):
  """The XLA engine's samples for the Pallas engines to equal: the module's paged engine (its programs compiled once
  for the file), on 4 devices as slots x kv heads."""
  _, params, new_params = model
  assert dict(engines[1].mesh.shape) == {"data": 2, "tensor": 2}
  return _episodes_with_an_update(engines[1], params, new_params, SP)


@pytest.mark.parametrize("attention, axes", [("pallas_gpu", {"data": 1}), ("pallas_tpu", {"data": 1}),
                                             ("pallas_gpu", {"data": 2, "tensor": 2})])
def test_engine_with_a_pallas_kernel(model, engines, request, attention, axes):
  """The paged engine decoding through a Pallas kernel (interpret mode on CPU), its pool in the kernels' layout;
  chunks (prefill, the rebuild after an in-flight update) take the XLA path over that layout. GPU: the XLA engine's
  samples token for token, on one device as on the reference's four. TPU: the kernel reads keys and values in
  bfloat16 (its design), so samples drift from a float32 engine's; each token's logprob is still its own
  distribution's (the full forward, bf16 tolerance). On a mesh of slots x kv heads the kernel runs in shard_map,
  each device on its slots' queries and its heads' pages."""
  _, params, new_params = model
  mesh = make_mesh(axes, jax.devices()[-math.prod(axes.values()):])  # (4 devices: the reference engine's)
  cfg = dataclasses.replace(CFG, head_dim=128) if attention == "pallas_tpu" else CFG  # the TPU kernel's lanes
  graphdef, abstract = abstract_params(cfg)
  if cfg is not CFG:
    params, new_params = (_random_params(abstract, seed) for seed in (0, 1))
  make = lambda **kw: make_engine(cfg, mesh, max_slots=4, max_len=MAX_LEN, steps_per_call=4, min_bucket=8, kv="paged",
                                  page_size=PAGE, **kw)
  engine = make(attention=attention, interpret=True)
  xla_layout = (make(attention="xla") if attention == "pallas_tpu" else engines[1]).layout  # GPU: the reference's
  assert (xla_layout, engine.layout) == ("NPZKD", "KNPZD")
  # (TPU: no top-k, whose support a bf16 logit can flip at its boundary; the logprobs are compared below.)
  got = _episodes_with_an_update(engine, params, new_params,
                                 SamplingParams(temperature=1.0) if attention == "pallas_tpu" else SP)
  assert sorted(got) == [(g, i) for g in range(3) for i in range(3)]
  assert any(set(r.versions.tolist()) == {0, 1} for r in got.values())
  if attention == "pallas_tpu":
    for r in got.values():
      _check_logprobs_match_forward((graphdef, params, new_params), r, atol=2e-2)
    return
  for k, r in request.getfixturevalue("xla_episodes").items():
    np.testing.assert_array_equal(got[k].completion_tokens, r.completion_tokens)
    np.testing.assert_array_equal(got[k].versions, r.versions)
    np.testing.assert_allclose(got[k].logprobs, r.logprobs, atol=1e-5)


def test_engine_attention_is_checked():
  mesh = make_mesh({"data": 2}, jax.devices()[:2])
  with pytest.raises(ValueError, match="one of"):
    make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, kv="paged", page_size=PAGE, attention="cuda")
  with pytest.raises(ValueError, match="kv='paged'"):
    make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, attention="pallas_gpu")
  with pytest.raises(ValueError, match="head_dim a multiple of 128"):  # CFG's is 8
    make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, kv="paged", page_size=PAGE, attention="pallas_tpu")
  auto = make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, kv="paged", page_size=PAGE)
  assert auto.attention == "xla" and auto.layout == "NPZKD"  # on CPU
