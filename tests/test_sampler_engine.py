"""Engine + Sampler: continuous batching equals one-at-a-time decoding, exact behavior logprobs and versions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.models import ModelConfig, forward
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams
from jaxrl.sampler import Request, Sampler, make_engine, sampling_logprobs
from jaxrl.sharding import make_mesh

MAX_LEN = 48
CFG = ModelConfig.tiny(eos_token_ids=(1,))


def _random_params(abstract, seed):
  """Random weights drawn by numpy (eager jax.random would compile once per shape); norm scales near 1."""
  rng = np.random.default_rng(seed)

  def leaf(path, x):
    base = 1.0 if "scale" in jax.tree_util.keystr(path) else 0.0
    return jnp.asarray(base + 0.25 * rng.standard_normal(x.shape), x.dtype)

  return jax.tree_util.tree_map_with_path(leaf, abstract)


@pytest.fixture(scope="module")
def model():
  graphdef, abstract = abstract_params(CFG)
  return graphdef, _random_params(abstract, 0), _random_params(abstract, 1)  # versions 0 and 1


@pytest.fixture(scope="module")
def engine():
  mesh = make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:])  # a sampler submesh: slots x kv heads
  return make_engine(CFG, mesh, max_slots=4, max_len=MAX_LEN, steps_per_call=4, min_bucket=8)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, params, tokens_T, length):
  """Full-sequence forward (no cache) over a right-padded sequence: logits_TxV."""
  t = tokens_T.shape[0]
  segments = (jnp.arange(t) < length).astype(jnp.int32)
  return forward(graphdef, params, tokens_T[None], jnp.arange(t)[None], segments[None])[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def _sequence_logprobs(graphdef, params, tokens_T, sampling, length):
  """Entry t: log p(token t+1) under `sampling` built from the full forward's logits at t."""
  logits = _full_logits(graphdef, params, tokens_T, length)
  return sampling_logprobs(logits[:-1], tokens_T[1:], sampling)


def _padded(tokens):
  out = np.zeros(MAX_LEN, np.int32)
  out[: len(tokens)] = tokens
  return out


def _greedy_reference(graphdef, params, prompt, max_tokens, stop_ids=(1,)):
  """One sequence at a time, full forward at every step: (completion, finish_reason)."""
  seq = list(prompt)
  while True:
    logits = _full_logits(graphdef, params, _padded(seq), len(seq))
    seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    completion = seq[len(prompt):]
    if completion[-1] in stop_ids:
      return completion, "eos"
    if len(completion) == max_tokens or len(seq) == MAX_LEN:
      return completion, "length"


def _prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [rng.integers(2, CFG.vocab_size, rng.integers(1, 20)).tolist() for _ in range(n)]


def _drain(sampler, max_steps=1000):
  """Steps until every sample submitted finished; {(group, index): rollout}. Each test's samples end within a few
  dozen steps: a sampler still busy after max_steps (say one that preempts and resumes a sample forever) fails."""
  out = []
  for _ in range(max_steps):
    if not (sampler.num_active or sampler.num_waiting):
      return {(r.group_id, r.sample_index): r for r in out}
    out += sampler.step()
  raise AssertionError(f"still generating after {max_steps} sampler steps: {sampler.num_active} samples in slots, "
                       f"{sampler.num_waiting} waiting, {sampler.stats.preemptions} preemptions")


def _check_logprobs_match_forward(model, rollout, atol=1e-5):
  """Each token's behavior logprob equals the full forward of the version it is tagged with."""
  graphdef, *by_version = model
  seq = np.concatenate([rollout.prompt_tokens, rollout.completion_tokens])
  p, c = len(rollout.prompt_tokens), len(rollout.completion_tokens)
  for v in np.unique(rollout.versions):
    ref = np.asarray(_sequence_logprobs(graphdef, by_version[v], _padded(seq), rollout.sampling, len(seq)))[p - 1 :]
    mask = rollout.versions == v
    np.testing.assert_allclose(rollout.logprobs[mask], ref[:c][mask], atol=atol, rtol=0)


def test_decode_state_is_sharded_on_the_sampler_mesh(engine):
  state = engine.init_decode_state()
  assert state.cache.k_NxSxTxKxD.sharding.spec == P(None, "data", None, "tensor", None)
  assert state.tokens_SxT.sharding.spec == P("data", None)
  assert engine.max_slots == 4 and engine.buckets == (8, 16, 32, 48)


def test_greedy_continuous_batching_equals_one_at_a_time(model, engine):
  graphdef, params, _ = model
  prompts = _prompts(10, seed=0)
  max_tokens = [3, 29, 5, 17, 2, 40, 8, 11, 6, 23]
  sampler = Sampler(engine, params)
  for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
    sampler.submit(p, group_id=i, max_tokens=m, sampling=SamplingParams(greedy=True))
  got = _drain(sampler)
  assert sorted(got) == [(i, 0) for i in range(10)]
  for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
    completion, reason = _greedy_reference(graphdef, params, p, m)
    assert got[i, 0].completion_tokens.tolist() == completion, f"prompt {i}"
    assert got[i, 0].finish_reason == reason
    assert (got[i, 0].logprobs == 0).all() and (got[i, 0].versions == 0).all()
  assert sampler.stats.prefills == 10
  # Slots were refilled while others ran: fewer decode calls than a static batch padded to its longest.
  static_calls = sum(-(-max(len(got[i, 0].completion_tokens) for i in range(b, min(b + 4, 10))) // 4)
                     for b in range(0, 10, 4))
  assert sampler.stats.decode_calls < static_calls


def test_no_recompilation_as_requests_come_and_go(model, engine):
  _, params, _ = model
  sampler = Sampler(engine, params)

  def run(seed):
    for i, p in enumerate(_prompts(7, seed)):
      sampler.submit(p, group_id=i, n=1 + i % 3, max_tokens=3 + 5 * i, sampling=SamplingParams(top_k=8))
    _drain(sampler)

  run(seed=1)
  before = engine.compile_count()
  run(seed=2)
  assert engine.compile_count() == before


def test_sampled_tokens_do_not_depend_on_slot_placement(model, engine):
  _, params, _ = model
  sp = SamplingParams(temperature=1.2, top_p=0.9)
  requests = [Request(p, group_id=10 + i, n=2, sampling=sp, max_tokens=4 + 3 * i) for i, p in enumerate(_prompts(5, 3))]

  def run(eng, reqs, **kw):
    sampler = Sampler(eng, params, seed=7, **kw)
    for r in reqs:
      sampler.submit_request(r)
    return _drain(sampler)

  base = run(engine, requests)
  other_engine = make_engine(CFG, make_mesh({"data": 2}, jax.devices()[:2]), max_slots=2, max_len=MAX_LEN,
                             steps_per_call=3, min_bucket=16)
  for got in (run(engine, requests[::-1]), run(engine, requests, admission="static"),
              run(other_engine, requests[2:] + requests[:2])):
    assert sorted(got) == sorted(base)
    for k, r in base.items():
      np.testing.assert_array_equal(got[k].completion_tokens, r.completion_tokens)
      np.testing.assert_allclose(got[k].logprobs, r.logprobs, atol=1e-5)  # other meshes sum in another order
  assert len({tuple(r.completion_tokens) for r in base.values()}) == len(base)  # the samples really differ
  assert run(engine, requests[:1])[10, 0].completion_tokens.tolist() == base[10, 0].completion_tokens.tolist()


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.6, top_k=5),
                                SamplingParams(temperature=1.4, top_p=0.7), SamplingParams(greedy=True)])
def test_behavior_logprobs_equal_full_forward(model, engine, sp):
  _, params, _ = model
  sampler = Sampler(engine, params, seed=1)
  for i, p in enumerate(_prompts(3, 4)):
    sampler.submit(p, group_id=i, n=2, sampling=sp, max_tokens=25)
  for r in _drain(sampler).values():
    assert r.sampling == sp
    _check_logprobs_match_forward(model, r)


def test_in_flight_update_tags_each_token_with_its_version(model, engine):
  _, params, params_v1 = model
  sampler = Sampler(engine, params, seed=2, eos_token_ids=())
  for i, p in enumerate(_prompts(6, 5)):
    sampler.submit(p, group_id=i, max_tokens=20, sampling=SamplingParams(temperature=0.9, top_k=20))
  first = sampler.step() + sampler.step()  # 8 tokens per slot on version 0
  assert not first and sampler.num_active == 4
  sampler.update_params(params_v1, version=1)
  assert sampler.version == 1 and sampler.num_active == 4  # no slot dropped
  got = _drain(sampler)
  assert sampler.stats.rebuilds == 1
  mixed = [r for r in got.values() if set(r.versions.tolist()) == {0, 1}]
  fresh = [r for r in got.values() if set(r.versions.tolist()) == {1}]
  assert len(mixed) == 4 and len(fresh) == 2
  for r in mixed:
    assert r.versions.tolist() == [0] * 8 + [1] * 12
  for r in got.values():
    _check_logprobs_match_forward(model, r)


def test_finish_mode_completes_in_flight_samples_on_old_params(model, engine):
  _, params, params_v1 = model
  sampler = Sampler(engine, params, seed=3, on_update="finish", eos_token_ids=())
  for i, p in enumerate(_prompts(6, 6)):
    sampler.submit(p, group_id=i, max_tokens=6 + 3 * i, sampling=SamplingParams())
  sampler.step()
  sampler.update_params(params_v1, version=1)
  assert sampler.version == 0
  out = []
  while sampler.num_active:
    out += sampler.step()
    assert sampler.num_waiting == 2  # nothing admitted while draining
  got = _drain(sampler)
  assert sampler.version == 1
  assert all((r.versions == 0).all() for r in out) and len(out) == 4
  assert all((r.versions == 1).all() for r in got.values()) and len(got) == 2
  for r in [*out[:1], *got.values()]:
    _check_logprobs_match_forward(model, r)


def test_group_shares_one_prefill(model, engine):
  _, params, _ = model
  sampler = Sampler(engine, params, seed=4)
  sampler.submit([5, 6, 7], group_id=0, n=5, sampling=SamplingParams(temperature=2.0), max_tokens=6)  # > 4 slots
  sampler.submit([9, 9], group_id=1, n=2, sampling=SamplingParams(temperature=2.0), max_tokens=6)
  got = _drain(sampler)
  assert sampler.stats.prefills == 2
  assert sorted(got) == [(0, i) for i in range(5)] + [(1, 0), (1, 1)]
  assert len({tuple(got[0, i].completion_tokens) for i in range(5)}) == 5


def test_a_group_admitted_across_an_update_prefills_its_prompt_again_with_the_new_params(model, engine):
  """A group of more samples than slots: those admitted after an update attend a prompt the new params computed."""
  _, params, params_v1 = model
  sampler = Sampler(engine, params, seed=5, eos_token_ids=())
  sampler.submit([5, 6, 7], group_id=0, n=6, sampling=SamplingParams(temperature=1.5), max_tokens=4)
  first = sampler.step() + sampler.step()  # four slots, one call: four samples end on version 0
  assert len(first) == 4 and sampler.num_active == 0 and sampler.num_waiting == 2
  sampler.update_params(params_v1, version=1)
  rest = list(_drain(sampler).values())
  assert sampler.stats.prefills == 2 and sorted(r.sample_index for r in rest) == [4, 5]
  for r in first + rest:
    assert set(r.versions.tolist()) == {r.sample_index // 4}
    _check_logprobs_match_forward(model, r)


def test_stop_tokens_eos_and_lengths(model, engine):
  graphdef, params, _ = model
  prompt = [7, 3, 12]
  free, _ = _greedy_reference(graphdef, params, prompt, 30, stop_ids=())
  stop = free[3]
  expect = free[: free.index(stop) + 1]
  greedy = SamplingParams(greedy=True)
  sampler = Sampler(engine, params, eos_token_ids=(stop,))
  sampler.submit(prompt, group_id=0, sampling=greedy, max_tokens=30)
  sampler.submit(prompt, group_id=1, sampling=greedy, max_tokens=30, ignore_eos=True, stop_token_ids=(free[5],))
  sampler.submit(prompt, group_id=2, sampling=greedy, max_tokens=30, ignore_eos=True)
  sampler.submit(list(range(2, MAX_LEN + 1)), group_id=3, sampling=greedy)  # max_len - 1 tokens: room for one
  got = _drain(sampler)
  assert (got[0, 0].completion_tokens.tolist(), got[0, 0].finish_reason) == (expect, "eos")
  assert (got[1, 0].completion_tokens.tolist(), got[1, 0].finish_reason) == (free[: free.index(free[5]) + 1], "stop")
  assert (got[2, 0].completion_tokens.tolist(), got[2, 0].finish_reason) == (free, "length")
  assert (len(got[3, 0].completion_tokens), got[3, 0].finish_reason) == (1, "length")


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_strings_end_the_sample_and_free_the_slot(model, engine, overlap):
  graphdef, params, _ = model
  prompt = [4, 4, 8]
  free, _ = _greedy_reference(graphdef, params, prompt, 25, stop_ids=())
  decoded = []
  detok = lambda ids: decoded.append(len(ids)) or "".join(f"<{t}>" for t in ids)
  stop = f"<{free[2]}><{free[3]}>"
  end = detok(free).index(stop) + len(stop)
  expect = next(free[:i] for i in range(1, 26) if len(detok(free[:i])) >= end)
  decoded.clear()
  sampler = Sampler(engine, params, eos_token_ids=(), detokenize=detok, overlap=overlap)
  sampler.submit(prompt, group_id=0, sampling=SamplingParams(greedy=True), max_tokens=25, stop_strings=(stop,))
  sampler.submit(prompt, group_id=1, sampling=SamplingParams(greedy=True), max_tokens=25)
  if overlap:
    assert sampler.step() == []  # the first call's results are read in the next step, after it dispatches
  first = sampler.step()  # 4 tokens: the stop string completes in this call
  assert [(r.group_id, r.finish_reason, r.completion_tokens.tolist()) for r in first] == [(0, "stop", expect)]
  assert sampler.num_active == 1
  assert _drain(sampler)[1, 0].completion_tokens.tolist() == free
  # Stop checks re-decode a window of the last tokens per new token, not the whole completion.
  assert len(decoded) == len(expect) and max(decoded) <= len(stop) + 8


def test_stop_string_found_late_in_a_long_completion(model, engine):
  graphdef, params, _ = model
  free, _ = _greedy_reference(graphdef, params, [5, 9], 40, stop_ids=())
  detok = lambda ids: "".join(f"<{t}>" for t in ids)
  stop = f"<{free[36]}><{free[37]}>"
  end = detok(free).index(stop) + len(stop)
  expect = next(free[:i] for i in range(1, 41) if len(detok(free[:i])) >= end)  # re-decoding everything
  sampler = Sampler(engine, params, eos_token_ids=(), detokenize=detok)
  sampler.submit([5, 9], group_id=0, sampling=SamplingParams(greedy=True), max_tokens=40, stop_strings=(stop,))
  (r,) = _drain(sampler).values()
  assert (r.finish_reason, r.completion_tokens.tolist()) == ("stop", expect)


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_tokens=list(range(2, MAX_LEN + 2))), "does not fit the KV cache"),
    (dict(prompt_tokens=[]), "empty prompt"),
    (dict(stop_token_ids=(CFG.vocab_size,)), r"stop token ids \[64\] are outside the vocabulary"),
    (dict(prompt_tokens=[3, -1]), "prompt token ids"),
    (dict(n=0), "n must be"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop_strings=("x",)), "detokenize"),
    (dict(stop_token_ids=tuple(range(2, 12))), "max_stop_ids"),
])
def test_bad_requests_fail_alone(model, engine, kw, match):
  graphdef, params, _ = model
  sampler = Sampler(engine, params)
  greedy = SamplingParams(greedy=True)
  sampler.submit([5, 6], group_id=0, sampling=greedy, max_tokens=9)
  with pytest.raises(ValueError, match=match):
    sampler.submit_request(Request(**{"prompt_tokens": [2, 3], "group_id": 1, "sampling": greedy, **kw}))
  sampler.submit([7], group_id=2, sampling=greedy, max_tokens=9)
  got = _drain(sampler)
  assert sorted(got) == [(0, 0), (2, 0)]
  assert got[0, 0].completion_tokens.tolist() == _greedy_reference(graphdef, params, [5, 6], 9)[0]
  assert got[2, 0].completion_tokens.tolist() == _greedy_reference(graphdef, params, [7], 9)[0]


def test_bad_configuration_is_rejected(model, engine):
  _, params, _ = model
  sampler = Sampler(engine, params, version=3)
  with pytest.raises(ValueError, match="went backwards"):
    sampler.update_params(params, version=2)
  with pytest.raises(ValueError, match="on_update"):
    Sampler(engine, params, on_update="drop")
  with pytest.raises(ValueError, match="eos token ids"):
    Sampler(engine, params, eos_token_ids=(CFG.vocab_size + 1,))
  with pytest.raises(ValueError, match="max_slots"):
    make_engine(CFG, engine.mesh, max_slots=0, max_len=8)
  with pytest.raises(ValueError, match="dtype must be one of"):
    make_engine(CFG, engine.mesh, max_slots=2, max_len=8, dtype="float16")
  with pytest.raises(ValueError, match="does not fit"):
    engine.prefill(sampler._params, np.arange(MAX_LEN))


def test_a_groups_samples_go_in_with_one_program_as_each_would_alone(model, engine):
  """insert_group (the dense sampler's admissions) leaves the decode state bit for bit as one insert per slot."""
  _, params, _ = model
  placed = engine.place(params, 0)
  prefix = engine.prefill(placed, np.array([4, 9, 2], np.int32))
  settings = [engine.slot_settings(jax.random.key(i), SamplingParams(temperature=0.5 + i, top_k=i), 5 + i, (7,))
              for i in range(3)]
  slots = [3, 0, 2]
  one_by_one = engine.init_decode_state()
  for slot, s in zip(slots, settings, strict=True):
    one_by_one = engine.insert(prefix, one_by_one, slot, s)
  grouped = engine.insert_group(prefix, engine.init_decode_state(), slots, settings)
  for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(grouped), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.asarray(grouped.active_S).tolist() == [True, False, True, True]
  for bad, match in (([1, 1, 2], "distinct"), ([0, 4, 1], "distinct and in"), ([0, 1], "2 slots with 3 settings")):
    with pytest.raises(ValueError, match=match):
      engine.insert_group(prefix, engine.init_decode_state(), bad, settings)
  paged = make_engine(CFG, engine.mesh, max_slots=4, max_len=MAX_LEN, steps_per_call=4, min_bucket=8, kv="paged",
                      page_size=8)
  assert not hasattr(paged, "insert_group")  # a paged slot needs its own page table: one insert per sample
  with pytest.raises(ValueError, match="table_row is required"):
    paged.insert(prefix, paged.init_decode_state(), slots[0], settings[0])


@pytest.mark.parametrize("group_id", [0, 7, 2**31 + 5])
def test_sample_keys_are_fold_ins_of_the_group_key(group_id):
  """A group's sample keys, made in one program, are fold_in(fold_in(sampler key, group id), sample index)."""
  from jaxrl.sampler.samples import sample_key_data

  key = jax.random.key(11)
  got = np.asarray(sample_key_data(key, np.uint32(group_id), 3))
  group = jax.random.fold_in(key, group_id)
  want = np.stack([np.asarray(jax.random.key_data(jax.random.fold_in(group, i))) for i in range(3)])
  np.testing.assert_array_equal(got, want)
