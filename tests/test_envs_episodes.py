"""Multi-turn episodes: a slot continued with observation tokens computes what a fresh prefill of the whole
episode would; the loss mask covers exactly the model's tokens; the learner's logprobs of model tokens equal the
sampler's across turns and an in-flight weight update; a tool that raises, hangs, crashes or returns garbage is
counted and the other episodes go on; the envs' turns and chat-template rendering."""

import functools

import jax
import numpy as np
import pytest
from envs_faulty import BAD_TOKENS, CRASH, GARBAGE, HANG, OK, RAISE, FaultyTask
from sampling_util import random_params

from jaxrl.envs import Episodes, make_task
from jaxrl.envs.calculator import CalculatorEnv
from jaxrl.envs.env import Turn, call_env_step, step_env
from jaxrl.envs.guess import GuessEnv
from jaxrl.learner import token_logprobs
from jaxrl.learner.packing import pack_batch
from jaxrl.models import ModelConfig, forward
from jaxrl.models.hf import abstract_params
from jaxrl.rollout import SamplingParams, make_batch
from jaxrl.sampler import Sampler, make_engine
from jaxrl.sharding import make_mesh

pytest_plugins = ["conftest_assets"]  # the session fixture `smollm2_dir`
CFG = ModelConfig.tiny(eos_token_ids=(1,))
L = 64


def _params(seed, scale=0.08):
  # Small weights: the decode path and the full forward agree to float32 rounding (see test_learner_onpolicy.py).
  return random_params(abstract_params(CFG)[1], seed, scale)


def _engine(**kw):
  return make_engine(CFG, make_mesh({"data": 2, "tensor": 2}, jax.devices()[4:]), max_slots=4, max_len=L,
                     steps_per_call=4, min_bucket=8, rebuild_chunk=8, **kw)


@pytest.fixture(scope="module")
def engine():
  return _engine()


def _run(sampler, task, episodes, groups, n=2, sampling=None, max_tokens=6, update=None):
  sampling = sampling or SamplingParams()
  for g in range(groups):
    example = task.prompt(g)
    sampler.submit(list(example.prompt_tokens), g, n, meta={"episode": episodes.start(example)}, sampling=sampling,
                   max_tokens=max_tokens)
  out, calls = [], 0
  while sampler.num_active or sampler.num_waiting:
    out += sampler.step()
    calls += 1
    if update is not None and calls == update[0]:
      sampler.update_params(update[1], 1)
  return sorted(out, key=lambda r: (r.group_id, r.sample_index))


@pytest.fixture(scope="module")
def paged_engines():
  """A pool as large as the dense cache, and one of 10 pages (an episode may need 5): samples are preempted."""
  return _engine(kv="paged", page_size=8), _engine(kv="paged", page_size=8, num_pages=10)


@pytest.mark.parametrize("kv", ["dense", "paged"])
def test_append_continues_a_slot_as_a_prefill_of_the_whole_episode(engine, paged_engines, kv):
  """Prompt, a turn of 4 generated tokens (one generate call), a decode call while the slot waits (idle), then 11
  observation tokens appended (two chunks of 8): the next tokens and their logprobs equal those of a slot prefilled
  with the same 20 tokens at once. The module's engines: their programs are the episodes tests'."""
  engine = engine if kv == "dense" else paged_engines[0]
  turn_len = engine.steps_per_call
  params = engine.place(_params(0, scale=0.5), 0)
  settings = engine.slot_settings(jax.random.key(1), SamplingParams(greedy=True), turn_len)
  table = np.arange(engine.max_slots * (L // 8), dtype=np.int32).reshape(engine.max_slots, -1)  # (paged) pages of 8
  rows = {} if kv == "dense" else {"table_row": table[0]}
  prompt = np.array([4, 9, 17, 2, 33], np.int32)
  state = engine.init_decode_state()
  if kv == "paged":
    state = engine.set_tables(state, table)
  state = engine.insert(engine.prefill(params, prompt), state, 0, settings, **rows)
  state, first = engine.generate(params, state)
  turn = np.asarray(first.tokens_SxK[0])
  assert first.done_S[0] and len(turn) == turn_len
  state, idle = engine.generate(params, state)  # the parked slot is an idle row of this call
  assert not idle.valid_SxK[0].any()
  observation = np.arange(40, 51, dtype=np.int32)
  state = engine.append(params, state, 0, observation, len(prompt) + len(turn) - 1, max_new=40)
  state, after = engine.generate(params, state)

  whole = np.concatenate([prompt, turn, observation])
  rows = {} if kv == "dense" else {"table_row": table[1]}
  settings = settings.replace(max_new=np.int32(40))
  fresh = engine.insert(engine.prefill(params, whole), state, 1, settings, num_generated=len(turn), **rows)
  _, reference = engine.generate(params, fresh)
  np.testing.assert_array_equal(after.tokens_SxK[0], reference.tokens_SxK[1])
  np.testing.assert_allclose(after.logprobs_SxK[0], reference.logprobs_SxK[1], atol=2e-5)
  assert len(set(np.asarray(after.tokens_SxK[0]).tolist())) > 1  # not a degenerate repetition


def _same_rollouts(a, b):
  assert [(r.group_id, r.sample_index) for r in a] == [(r.group_id, r.sample_index) for r in b]
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x.completion_tokens, y.completion_tokens)
    np.testing.assert_array_equal(x.versions, y.versions)
    np.testing.assert_array_equal(x.loss_mask, y.loss_mask)
    np.testing.assert_allclose(x.logprobs, y.logprobs, rtol=0, atol=2e-5)
    assert x.meta["episode"] == y.meta["episode"] and x.finish_reason == y.finish_reason


def _run_counted(eng, params, task, **kw):
  """(rollouts, sampler, preemptions at an observation) of _run with a fresh sampler and driver."""
  sampler = Sampler(eng, params, seed=5)
  continued, at_observation = sampler._continue_episodes, []

  def spy():
    before = sampler.stats.preemptions
    out = continued()
    at_observation.append(sampler.stats.preemptions - before)
    return out

  sampler._continue_episodes = spy
  rollouts = _run(sampler, task, Episodes(task, vocab_size=CFG.vocab_size), groups=5,
                  sampling=SamplingParams(temperature=0.9), max_tokens=6, **kw)
  if eng.kv == "paged":
    assert sampler.cache.pages.num_free == eng.num_pages and not any(sampler.cache.pages.tables)  # every page came back
  return rollouts, sampler, sum(at_observation)


def test_paged_episodes_equal_dense_and_survive_preemption(engine, paged_engines):
  """Episodes over a paged cache equal the dense engine's token for token across turns and an in-flight update.
  Over a pool too small for every slot, samples (parked ones never) are preempted, and so is an episode whose
  observation cannot grow its pages: every episode still comes out as with the large pool (same sampling keys,
  same budgets), and every page returns to the pool."""
  task = make_task("token_turns", seed=1, vocab_size=CFG.vocab_size)
  old, new = _params(2), _params(3)
  dense, _, _ = _run_counted(engine, old, task, update=(6, new))
  paged, sampler, _ = _run_counted(paged_engines[0], old, task, update=(6, new))
  assert sampler.stats.preemptions == 0
  assert all(r.meta["episode"]["turns"] == 3 for r in dense)
  assert {0, 1} <= {int(v) for r in dense for v in r.versions}  # episodes span the update
  _same_rollouts(dense, paged)
  # Without an update (preemption changes when a sample's tokens are drawn, hence under which weights).
  large, _, _ = _run_counted(paged_engines[0], old, task)
  small, sampler, at_observation = _run_counted(paged_engines[1], old, task)
  assert sampler.stats.preemptions > at_observation > 0
  _same_rollouts(large, small)


def test_append_refuses_what_does_not_fit(engine):
  params = engine.place(_params(0), 0)
  state = engine.init_decode_state()
  with pytest.raises(ValueError, match="no room to generate"):
    engine.append(params, state, 0, np.arange(10), L - 5, max_new=4)
  with pytest.raises(ValueError, match="no observation tokens"):
    engine.append(params, state, 0, [], 3, max_new=4)


def test_loss_mask_covers_exactly_the_model_tokens(engine):
  task = make_task("token_turns", seed=0, vocab_size=CFG.vocab_size)
  episodes = Episodes(task, vocab_size=CFG.vocab_size)
  sampler = Sampler(engine, _params(1), seed=0)
  rollouts = _run(sampler, task, episodes, groups=3)
  assert len(rollouts) == 6 and episodes.stats()["ends"] == {"done": 6}
  for r in rollouts:
    assert r.meta["episode"]["turns"] == 3
    observed = ~r.model_mask
    # Two observations of [5, 6] between three model turns of at most 6 tokens, each ended by the stop id or budget.
    spans = np.flatnonzero(np.diff(np.concatenate([[0], observed.astype(int), [0]])))
    starts, ends = spans[::2], spans[1::2]
    assert len(starts) == 2 and all(e - s == 2 for s, e in zip(starts, ends, strict=True))
    turns = np.split(r.completion_tokens, np.sort(np.concatenate([starts, ends])))[::2]
    assert all(1 <= len(t) <= 6 and (len(t) == 6 or t[-1] in (1, 3)) for t in turns)
    np.testing.assert_array_equal(r.completion_tokens[observed], [5, 6, 5, 6])
    assert (r.logprobs[observed] == 0).all() and (r.versions[observed] == -1).all()
    assert (r.logprobs[~observed] < 0).all() and (r.versions[~observed] == 0).all()
  for batch in (make_batch(rollouts, 8, L), pack_batch(rollouts, L, (4, 8), max_segments=4)):
    assert batch.loss_mask_BxL.sum() == sum(r.model_mask.sum() for r in rollouts)
    assert (batch.versions_BxL[batch.loss_mask_BxL > 0] == 0).all()
    observed_tokens = (batch.segment_ids_BxL > 0) & (batch.loss_mask_BxL == 0) & (batch.versions_BxL == -1)
    prompts = sum(len(r.prompt_tokens) for r in rollouts)
    assert observed_tokens.sum() == prompts + 4 * len(rollouts)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _learner_logprobs(graphdef, params, sampling, batch):
  logits = forward(graphdef, params, batch.tokens_BxL, batch.positions_BxL, batch.segment_ids_BxL)
  return token_logprobs(logits, batch.tokens_BxL, sampling)[0]


@pytest.mark.parametrize("kv,sp", [("dense", SamplingParams(temperature=0.8, top_k=8)),
                                   ("dense", SamplingParams(top_p=0.7)),
                                   ("paged_small", SamplingParams(temperature=0.8, top_k=8))], ids=str)
def test_learner_logprobs_of_model_tokens_equal_the_sampler_across_turns_and_an_update(engine, paged_engines, kv,
                                                                                       sp):
  """Weights change while episodes are parked or decoding (recompute; paged_small: samples preempted and
  prefilled again, some across the update): each model token's logprob under the params of its version,
  recomputed by the learner over the whole episode, is the sampler's (ratio 1)."""
  graphdef, _ = abstract_params(CFG)
  old, new = _params(2), _params(3)
  task = make_task("token_turns", seed=1, vocab_size=CFG.vocab_size)
  episodes = Episodes(task, vocab_size=CFG.vocab_size)
  sampler = Sampler(engine if kv == "dense" else paged_engines[1], old, seed=5)
  rollouts = _run(sampler, task, episodes, groups=4, sampling=sp, update=(5, new))
  assert (sampler.stats.preemptions > 0) == (kv == "paged_small")
  batch = make_batch(rollouts, 8, L)
  model = batch.loss_mask_BxL > 0
  versions = batch.versions_BxL
  assert {0, 1} <= set(versions[model].tolist())  # some episodes span the update
  assert any(len(set(r.versions[r.model_mask].tolist())) == 2 for r in rollouts)
  logp = np.where(versions == 0, _learner_logprobs(graphdef, old, sp, batch), _learner_logprobs(graphdef, new, sp,
                                                                                                  batch))
  ratio = np.exp(logp[model] - batch.behavior_logprobs_BxL[model])
  np.testing.assert_allclose(ratio, 1.0, rtol=0, atol=2e-6)


def test_a_misbehaving_tool_is_counted_and_the_other_episodes_go_on(engine):
  task = FaultyTask(modes=(OK, RAISE, HANG, GARBAGE, BAD_TOKENS, CRASH))
  episodes = Episodes(task, vocab_size=CFG.vocab_size, timeout_s=2.0, workers=3)
  try:
    sampler = Sampler(engine, _params(1), seed=0)
    modes = {}
    for g in range(12):
      example = task.prompt(g)
      modes[g] = example.meta["mode"]
      sampler.submit(list(example.prompt_tokens), g, 1, meta={"episode": episodes.start(example)}, max_tokens=4)
    out = []
    while sampler.num_active or sampler.num_waiting:
      out += sampler.step()
  finally:
    episodes.close()
  assert len(out) == 12 and set(modes.values()) == {OK, RAISE, HANG, GARBAGE, BAD_TOKENS, CRASH}
  expected = {OK: None, RAISE: "error", HANG: "timeout", GARBAGE: "bad_value", BAD_TOKENS: "bad_value",
              CRASH: "crash"}
  for r in out:
    outcome, want = r.meta["episode"], expected[modes[r.group_id]]
    if want is None:
      assert outcome == {"reward": 1.0, "turns": 2, "end": "done", "error": None}
      assert (~r.model_mask).sum() == 2
    else:
      assert outcome["end"] == "env_error" and outcome["error"].startswith(want) and np.isnan(outcome["reward"])
  failures = episodes.stats()["env_failures"]
  count = lambda *ms: sum(modes[g] in ms for g in modes)
  assert failures == {k: v for k, v in {"error": count(RAISE), "timeout": count(HANG), "crash": count(CRASH),
                                        "bad_value": count(GARBAGE, BAD_TOKENS)}.items() if v}


def test_episode_reward_fails_with_its_env():
  from jaxrl.envs import RewardRunner

  runner = RewardRunner("episode")
  ok = {"reward": 0.5, "turns": 2, "end": "done", "error": None}
  bad = {"reward": float("nan"), "turns": 1, "end": "env_error", "error": "timeout: took longer"}
  results = runner.score([("", "", {"episode": ok}), ("", "", {"episode": bad}), ("", "", {})])
  assert results[0].value == 0.5 and not results[1].ok and "timeout" in results[1].error and not results[2].ok


def test_the_documented_env_runs_in_an_isolating_worker(tmp_path, monkeypatch):
  """docs/USAGE.md's user-written env, saved as a module, steps in a worker process (pickled there and back)."""
  import re
  from pathlib import Path

  from jaxrl.envs import TASKS
  from jaxrl.envs.episodes import EnvRunner

  usage = (Path(__file__).resolve().parents[1] / "docs" / "USAGE.md").read_text()
  (tmp_path / "usage_env.py").write_text(re.findall(r"```python\n(.*?)```", usage, re.S)[0])
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(TASKS, "lookup", None)  # the module registers "lookup": the monkeypatch undoes it
  import usage_env

  assert TASKS["lookup"] is usage_env.LookupTask
  task = make_task("lookup", seed=0)
  example = task.prompt(0)
  env = task.env(example)
  env.reset(example)
  runner = EnvRunner(task.trusted, timeout_s=30.0, workers=1)
  try:
    first = runner.submit(env, "<lookup>a</lookup>", []).result()
    assert first.ok, first.error
    env, turn = first.payload
    assert turn == Turn(observation=example.meta["table"]["a"]) and env is not None
    last = runner.submit(env, "so: yes", []).result()
    assert last.payload[1] == Turn(done=True, reward=1.0) and last.value == 1.0
  finally:
    runner.close()
  assert runner.steps == 2 and not runner.failures


def test_env_step_results_are_checked():
  class Env:
    def step(self, text, ids):
      return self.answer

  env = Env()
  for answer, ok in ((Turn(observation="12"), True), (Turn(observation=[1, 2]), True), (Turn(done=True), True),
                     ("12", False), (Turn(observation=1.5), False), (Turn(done=True, reward=float("inf")), False),
                     (Turn(done=1), False)):
    env.answer = answer
    result = call_env_step(step_env, env, "", [])
    assert result.ok == ok, answer
    assert result.ok or result.reason == "bad_value"


def test_calculator_and_guess_turns():
  task = make_task("calculator", seed=0)
  example = task.prompt(3)
  env = CalculatorEnv()
  messages = env.reset(example)
  assert messages == example.messages and "<calc>" in messages[0]["content"]  # the system prompt explains the tool
  assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user"]  # one example
  assert example.answer in [str(n) for n in range(10**4)] and "How many" in messages[-1]["content"]
  assert env.step("Let me compute <calc>12 * (3 + 4)</calc>", []) == Turn(observation="84")
  assert env.step("<calc>1 / 0</calc>", []).observation.startswith("error")
  assert env.step(f"So the answer is {example.answer}.", []) == Turn(done=True, reward=1.0)
  assert env.step("Answer: -1", []) == Turn(done=True, reward=0.0)
  guess = make_task("guess", seed=0).prompt(0)
  env = GuessEnv()
  env.reset(guess)
  secret = int(guess.answer)
  assert env.step(str(secret + 1), []).observation == "Lower."
  assert env.step(f"I guess {secret - 1}", []).observation == "Higher."
  assert env.step("no idea", []).observation.startswith("Reply with a number")
  assert env.step(str(secret), []) == Turn(done=True, reward=1.0)
  shaped = make_task("guess", seed=0, partial_credit=0.5).prompt(0)
  env.reset(shaped)
  high = shaped.meta["high"]
  assert env.step(str(secret + 2), []) == Turn(observation="Lower.", reward=0.5 * (1 - 2 / high))
  assert env.step("no idea", []).reward is None  # no guess: nothing to be close with
  assert env.step(str(secret), []) == Turn(done=True, reward=1.0)
  with pytest.raises(ValueError, match="partial_credit"):
    make_task("guess", partial_credit=1.0)


def test_tool_turns_render_with_the_chat_template(smollm2_dir):
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
  episodes = Episodes(make_task("calculator", seed=0), tok, vocab_size=49152)
  tool_turn = "<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
  assert tok.decode(episodes.encode("84", ended_by_eos=False)) == "<|im_end|>\n" + tool_turn  # closes the turn
  assert tok.decode(episodes.encode("84", ended_by_eos=True)) == "\n" + tool_turn  # the model's eos closed it
