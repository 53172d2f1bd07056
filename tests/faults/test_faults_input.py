"""Bad input: fuzzed configs get a ConfigError naming the field before any work; malformed JSONL lines are
reported with their line numbers (or skipped, counted, and the run goes on); a tokenizer without a chat template
and prompts longer than the context are caught before work or skipped and counted; the CLI answers bad flags,
missing data and an unwritable workdir with one clear line and a non-zero exit, before any work."""

import json

import ml_collections
import pytest
from faults_util import (
  GOOD,
  LONG,
  NUM_STEPS,
  TALLY,
  check_history,
  cli,
  hf_folder,
  inject,
  read_trace,
  run_cli,
  tiny_config,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl import config as config_lib
from jaxrl import train as train_lib
from jaxrl.controller import build as build_lib
from jaxrl.settings import SETTINGS

# ---- fuzzed configs ---------------------------------------------------------------------------------------------

NOT_INT = st.one_of(st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.booleans(),
                    st.lists(st.integers(), max_size=2))
NOT_REAL = st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.just(float("nan")), st.just(float("inf")))
NOT_BOOL = st.one_of(st.integers(), st.text(max_size=3), st.none())
NOT_STR = st.one_of(st.integers(), st.floats(), st.none(), st.booleans())


def _bad_values() -> dict[str, st.SearchStrategy]:
  """Field -> values it must reject: wrong types, and values out of range."""
  bad = {}
  for s in SETTINGS:
    if s.kind == "int":
      bad[s.name] = st.one_of(NOT_INT, st.integers(max_value=s.lo - 1))
    elif s.kind == "real":
      bad[s.name] = NOT_REAL
    elif s.kind == "bool":
      bad[s.name] = NOT_BOOL
    elif s.kind == "choice":
      bad[s.name] = st.one_of(NOT_STR, st.text(max_size=8).filter(lambda v, c=s.choices: v not in c))
  bad.update({"sampler.temperature": st.one_of(NOT_REAL, st.floats(max_value=0)),
              "sampler.top_p": st.one_of(NOT_REAL, st.floats(max_value=0), st.floats(min_value=1.01, max_value=1e9)),
              "optimizer.learning_rate": st.one_of(NOT_REAL, st.floats(max_value=0)),
              "optimizer.weight_decay": st.one_of(NOT_REAL, st.floats(max_value=-1e-9)),
              "task.reward_timeout_s": st.one_of(NOT_REAL, st.floats(max_value=0)),
              "optimizer.max_grad_norm": st.one_of(st.text(max_size=3), st.floats(max_value=0), st.booleans())})
  for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
    bad[f"model.tiny.{name}"] = st.one_of(NOT_INT, st.integers(max_value=0))
  bad.update({
      "model.source": st.one_of(NOT_STR, st.just(""), st.just("/no/such/model")),
      "task.name": st.one_of(NOT_STR, st.text(max_size=8)),
      "task.reward": NOT_STR,
      "loss.clip_low": st.one_of(NOT_REAL, st.floats(min_value=1.0, max_value=1e6), st.floats(max_value=-1e-9)),
      "loss.policy_loss": st.one_of(NOT_STR, st.text(max_size=5)),
      "loss.advantage": st.one_of(NOT_STR, st.text(max_size=5)),
      "loss.is_cap": st.one_of(st.text(max_size=3), st.floats(max_value=0), st.booleans()),
      "loss.kl_coef": st.one_of(NOT_REAL, st.floats(max_value=-1e-9)),
      # The machine has 8 devices: ask for more, or split them so that no learner device is left.
      "mesh.num_devices": st.one_of(NOT_INT, st.integers(min_value=9),
                                    st.integers(max_value=1).filter(lambda n: n != -1)),
      "mesh.sampler_devices": st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.integers(max_value=0),
                                        st.integers(min_value=8), st.floats(min_value=1.0), st.floats(max_value=0.0)),
      "mesh.learner_axes": st.sampled_from([{"fsdp": 3, "tensor": 1}, {"fsdp": 16, "tensor": 1},
                                            {"fsdp": -1, "tensor": -1}, {"fsdp": 0, "tensor": 1},
                                            {"fsdp": "x", "tensor": 1}, {}]),
      "mesh.sampler_axes": st.sampled_from([{"data": 5, "tensor": 1}, {"data": -1, "tensor": 3}, {}]),
      "log.backends": st.sampled_from([("tensorboard",), ("jsonl", "comet"), "jsonl", ("jsonl", 1), None]),
      "log.project": st.one_of(NOT_STR, st.just("")),
      "log.run_name": NOT_STR,
  })
  return bad


BAD = _bad_values()
CROSS = {  # invalid combinations of valid values -> a phrase of the error
    (("sampler.max_new_tokens", 32), ("sampler.max_len", 32)): "no room for a prompt",
    (("sampler.max_len", 40), ("rl.seq_len", 32)): "exceeds rl.seq_len",
    (("rl.group_size", 3), ("rl.groups_per_step", 2)): "not divisible by the 4 learner devices",
    (("rl.group_size", 3), ("rl.groups_per_step", 1)): "does not split into rl.num_minibatches=2 mini-batches",
    (("task.name", "arithmetic"),): "has text prompts and the 'tiny' model has no tokenizer",
    (("optimizer.b3", 0.9),): "optimizer.b3 is not an option",
    (("loss.no_such_option", 1),): "loss.no_such_option is not an option",
}


def _mutated(changes, drop: str | None = None) -> ml_collections.ConfigDict:
  """configs/tiny.py (8 devices, 4 + 4) as a plain dict, changed, then back to a ConfigDict (no type checks)."""
  d = tiny_config("pipeline", mesh__num_devices=-1, mesh__sampler_devices=4).to_dict()
  for path, value in changes:
    *parents, last = path.split(".")
    node = d
    for p in parents:
      node = node[p]
    node[last] = value
  if drop:
    *parents, last = drop.split(".")
    node = d
    for p in parents:
      node = node[p]
    del node[last]
  return ml_collections.ConfigDict(d)


def test_the_unchanged_fuzz_base_is_valid():
  config_lib.validate(_mutated([]), num_devices=8)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_fuzzed_bad_field_gets_a_config_error_naming_it(data):
  path = data.draw(st.sampled_from(sorted(BAD)), label="field")
  value = data.draw(BAD[path], label="value")
  TALLY["configs fuzzed"] += 1
  with pytest.raises(config_lib.ConfigError) as info:
    config_lib.validate(_mutated([(path, value)]), num_devices=8)
  msg = str(info.value)
  assert msg.startswith("config: ") and "\n" not in msg
  assert path.split(".")[-1] in msg or path.rsplit(".", 1)[0] + "." in msg, msg


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_missing_fields_and_bad_combinations_get_a_config_error(data):
  if data.draw(st.booleans(), label="missing"):
    path = data.draw(st.sampled_from(sorted(p for p in BAD if not p.startswith(("loss.", "model.tiny.")))))
    expect, cfg = f"missing field {path}", _mutated([], drop=path)
  else:
    changes = data.draw(st.sampled_from(sorted(CROSS)))
    expect, cfg = CROSS[changes], _mutated(changes)
  TALLY["configs fuzzed"] += 1
  with pytest.raises(config_lib.ConfigError, match=expect):
    config_lib.validate(cfg, num_devices=8)


@pytest.fixture(scope="module")
def no_work(tmp_path_factory):
  """A workdir and a build that fails the test if it ever reaches the model."""
  return tmp_path_factory.mktemp("no-work")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_build_rejects_fuzzed_configs_before_any_work(no_work, monkeypatch, data):
  def work(*args):
    raise AssertionError("build reached the model with a bad config")

  monkeypatch.setattr(build_lib, "model_source", work)
  path = data.draw(st.sampled_from(sorted(BAD)))
  cfg = _mutated([(path, data.draw(BAD[path]))])
  TALLY["configs fuzzed"] += 1
  with pytest.raises(config_lib.ConfigError):
    train_lib.build(cfg, no_work / "run")
  assert not (no_work / "run" / "checkpoints").exists()


# ---- task data, tokenizer, prompt length ------------------------------------------------------------------------

BAD_LINES = {2: "{not json", 4: json.dumps({"question": "What is 1 + 1 ?"}), 7: json.dumps({"question": "What is 2 ?",
                                                                                              "answer": "2"})}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("data")
  lines = [json.dumps(r) for r in GOOD[:5]] + [json.dumps(LONG)] + [json.dumps(r) for r in GOOD[5:]]
  for n, bad in sorted(BAD_LINES.items()):
    lines.insert(n - 1, bad)
  (d / "train.jsonl").write_text("\n".join(lines) + "\n")
  (d / "eval.jsonl").write_text(json.dumps({"question": "What is 9 + 9 ?", "answer": "#### 18"}) + "\n")
  hf_folder(d / "model", chat_template=True)
  hf_folder(d / "model-no-template", chat_template=False)
  return d


def _text_config(data_dir, mode="sync", **kwargs):
  c = tiny_config(mode, model__source=str(data_dir / "model"), task__name="gsm8k")
  c.task.kwargs.path = str(data_dir / "train.jsonl")
  c.task.kwargs.eval_path = str(data_dir / "eval.jsonl")  # every train.jsonl record trains
  c.task.kwargs.instruction = ""
  for k, v in kwargs.items():
    c.task.kwargs[k] = v
  return c


def _no_params(monkeypatch):
  def work(*args):
    raise AssertionError("build loaded params before finding the problem")

  monkeypatch.setattr(build_lib, "base_params", work)


def test_malformed_jsonl_lines_are_reported_with_line_numbers_before_work(data_dir, tmp_path, monkeypatch):
  _no_params(monkeypatch)
  with pytest.raises(config_lib.ConfigError) as info:
    train_lib.build(_text_config(data_dir), tmp_path)
  msg = str(info.value)
  assert "3 malformed line(s)" in msg
  for n in BAD_LINES:
    assert f"train.jsonl:{n}:" in msg
  assert "invalid JSON" in msg and "missing field 'answer'" in msg and "no final answer" in msg
  TALLY["bad input items"] += len(BAD_LINES)


def test_a_tokenizer_without_chat_template_is_a_clear_error_before_work(data_dir, tmp_path, monkeypatch):
  _no_params(monkeypatch)
  c = _text_config(data_dir, on_error="skip")
  c.model.source = str(data_dir / "model-no-template")
  with pytest.raises(config_lib.ConfigError, match="has no chat template; set task.chat_template=False"):
    train_lib.build(c, tmp_path)
  TALLY["bad input items"] += 1


def test_skipped_lines_and_prompts_over_the_context_are_counted_and_the_run_goes_on(data_dir, tmp_path, monkeypatch):
  built = inject(monkeypatch)
  summary = train_lib.train(_text_config(data_dir, on_error="skip"), tmp_path)
  assert [n for n, _ in built["run"].sampler_side.task.skipped] == sorted(BAD_LINES)
  led = summary["ledger"]
  assert summary["steps"] == NUM_STEPS and led["samples_trained"] == NUM_STEPS * 16
  events = read_trace(tmp_path / "trace.jsonl")
  skips = [e for e in events if e["event"] == "skip_prompt"]
  assert skips and all("leaves no room to generate in sampler.max_len=32" in e["reason"] for e in skips)
  assert led["skipped_prompts"] == len(skips)
  check_history(events, summary, group_size=4)
  TALLY["bad input items"] += len(BAD_LINES) + len(skips)


def test_only_overlong_prompts_stop_the_run_instead_of_looping(data_dir, tmp_path):
  (tmp_path / "long.jsonl").write_text(json.dumps(LONG) + "\n")
  c = _text_config(data_dir, path=str(tmp_path / "long.jsonl"))
  c.rl.max_failures_in_a_row = 5
  with pytest.raises(RuntimeError, match=r"no progress: 5 failures in a row .*'skipped_prompt': 5"):
    train_lib.train(c, tmp_path / "run")


# ---- the CLI ----------------------------------------------------------------------------------------------------


def _cli_cases(tmp_path, data_dir):
  missing = tmp_path / "missing_data.py"
  missing.write_text(
      "from jaxrl import config\n\n\ndef get_config(arg=None):\n  c = config.base()\n"
      f"  c.model.source = {str(data_dir / 'model')!r}\n  c.task.name = 'gsm8k'\n"
      f"  c.task.kwargs.path = {str(tmp_path / 'no-such.jsonl')!r}\n  return c\n")
  (tmp_path / "a-file").write_text("")
  w = tmp_path / "w"
  return {
      "unknown key": ([*cli(w), "--config.no_such_key=1"], "unknown config key 'no_such_key'"),
      "wrong type": ([*cli(w), "--config.rl.group_size=four"], "rl.group_size"),
      "missing data file": ([*cli(w)[:3], f"--config={missing}", f"--workdir={w}"],
                            f"JSONL file not found: {tmp_path / 'no-such.jsonl'}"),
      "workdir not writable": ([*cli(tmp_path / "a-file" / "w")], "is not writable"),
  }


def test_cli_bad_input_is_one_clear_line_before_any_work(tmp_path, data_dir):
  for name, (args, message) in _cli_cases(tmp_path, data_dir).items():
    out = run_cli(args)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0, name
    assert "Traceback" not in out.stderr, f"{name}: {out.stderr[-2000:]}"
    assert lines and lines[-1].startswith("jaxrl-train: ") and message in lines[-1], f"{name}: {out.stderr[-2000:]}"
    assert not (tmp_path / "w" / "checkpoints").exists(), name
    TALLY["CLI bad inputs"] += 1
