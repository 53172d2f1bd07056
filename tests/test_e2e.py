"""End to end on the tiny config (8 CPU devices, sampler 4 / learner 4): learning, staleness, accounting, resume."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl.config import override, validate
from jaxrl.integrity import MARKER
from jaxrl.metrics import read_jsonl
from jaxrl.train import train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "configs"))
import tiny  # noqa: E402

# The 12-step runs' schedule for the shorter runs too: the optimizer's decay is part of the train step's program, so
# their steps are the one compiled for the file's first run (the persistent cache), not one more each.
SCHEDULE = {"optimizer.decay_steps": tiny.get_config().num_steps}


def _config(mode, **overrides):
  c = tiny.get_config(mode)
  c.log.tensorboard = False
  c.log.progress = False
  return override(c, **overrides)


@pytest.fixture(scope="module", params=["sync", "pipeline", "pipeline_packed"])
def tiny_run(request, tmp_path_factory):
  workdir = tmp_path_factory.mktemp(request.param)
  mode, _, packed = request.param.partition("_")
  c = _config(mode, **{"eval.num_examples": 8}, **({"rl.pack": True} if packed else {}))
  summary = train(c, workdir)
  return c, summary, read_jsonl(workdir / "metrics.jsonl"), workdir


def test_reward_rises(tiny_run):
  c, summary, records, _ = tiny_run
  rewards = [r["reward_mean"] for r in records]
  assert len(rewards) == c.num_steps == summary["steps"]
  first, last = np.mean(rewards[:2]), np.mean(rewards[-3:])
  assert last > first + 0.3, f"{c.mode}: reward went from {first:.3f} to {last:.3f}"


def test_every_trained_sample_obeys_the_staleness_bound(tiny_run):
  c, summary, records, _ = tiny_run
  bound = 0 if c.mode == "sync" else c.rl.max_staleness
  # Two optimizer updates per learner step, one version per step: staleness is counted in the unit it is bounded in.
  assert c.rl.num_minibatches == 2 and all(r["updates_applied"] == 2 for r in records)
  assert [r["version"] for r in records] == list(range(1, c.num_steps + 1))
  # Host side (min token version per sample) and learner side (per-token versions inside the step).
  assert 0 <= summary["staleness_max"] <= bound
  assert all(r["staleness_max"] <= bound for r in records)
  if c.mode == "pipeline":
    assert summary["staleness_mean"] > 0  # the pipeline really overlapped sampling and training


def test_counts_add_up(tiny_run):
  c, summary, records, _ = tiny_run
  led = summary["ledger"]
  dropped = sum(led["dropped"].values())
  assert led["samples_trained"] == c.num_steps * c.rl.group_size * c.rl.groups_per_step
  assert led["samples_generated"] == led["samples_trained"] + dropped + summary["samples_in_flight"]


def test_pipeline_run_on_the_paged_cache(tmp_path):
  c = _config("pipeline", **{"sampler.kv": "paged", "sampler.page_size": 8, "sampler.num_pages": 24, "num_steps": 3,
                             "eval.num_examples": 0}, **SCHEDULE)
  summary = train(c, tmp_path)
  led = summary["ledger"]
  assert led["samples_trained"] == 3 * c.rl.group_size * c.rl.groups_per_step
  assert led["samples_generated"] == led["samples_trained"] + sum(led["dropped"].values()) + \
      summary["samples_in_flight"]


def _cli(module_main, argv):
  """Runs an absl CLI's main in-process (config overrides are read from sys.argv, as absl.app.run would leave it)."""
  import sys

  from absl import flags

  saved = sys.argv
  sys.argv = ["cli", *argv]
  try:
    flags.FLAGS.unparse_flags()
    flags.FLAGS(sys.argv)
    module_main(["cli"])
  finally:
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # overrides are defined while parsing
      delattr(flags.FLAGS, name)
    sys.argv = saved


def test_the_trained_policy_evaluates_as_the_run_did_and_exports_to_a_hf_folder(tiny_run, tmp_path):
  """jaxrl-generate --config --workdir scores the newest checkpoint on the held-out examples exactly as the run's own
  eval after training; jaxrl-export writes those params as a HF folder that loads back bitwise."""
  from jaxrl import generate
  from jaxrl.models import hf
  from jaxrl.policy import export_main, load_policy

  c, summary, _, workdir = tiny_run
  config = [f"--config={REPO / 'configs' / 'tiny.py'}:{c.mode}", "--config.eval.num_examples=8"]
  out, summary_out = tmp_path / "eval.jsonl", tmp_path / "eval.json"
  _cli(generate.main, [*config, f"--workdir={workdir}", f"--output={out}", f"--summary_out={summary_out}"])
  got = json.loads(summary_out.read_text())
  after = summary["eval_after"]
  assert (got["version"], got["checkpoint_step"], got["num_examples"]) == (c.num_steps, c.num_steps, 8)
  assert got["reward_mean"] == pytest.approx(after["reward_mean"], abs=1e-12)
  assert got["reward_mean"] > summary["eval_before"]["reward_mean"]  # it is the trained policy, not the base one
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["group_id"] for r in rows] == list(range(8))
  assert np.mean([r["reward"] for r in rows]) == pytest.approx(got["reward_mean"], abs=1e-12)

  policy = load_policy(validate(c), workdir)
  hf_dir = tmp_path / "hf"
  export_main(["jaxrl-export", *config, f"--workdir={workdir}", f"--out={hf_dir}"])
  cfg, _, back = hf.load_params(hf_dir)
  assert (cfg.num_layers, cfg.vocab_size) == (policy.model_cfg.num_layers, policy.model_cfg.vocab_size)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(policy.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  step, saved = _params(workdir)
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(policy.params)[0]), np.asarray(jax.tree.leaves(saved)[0]))


def test_a_checkpoint_step_loads_that_step_and_a_missing_one_names_the_steps_kept(tiny_run, tmp_path):
  from jaxrl import generate
  from jaxrl.checkpoint import Checkpointer
  from jaxrl.policy import load_policy

  c, _, _, workdir = tiny_run
  ckpt = Checkpointer(workdir / "checkpoints", read_only=True)
  kept = ckpt.all_steps()
  ckpt.close()
  assert len(kept) >= 2 and kept[-1] == c.num_steps
  c = validate(c)
  earlier, newest = load_policy(c, workdir, step=kept[0]), load_policy(c, workdir)
  assert (earlier.version, earlier.checkpoint_step, newest.checkpoint_step) == (kept[0], kept[0], kept[-1])
  first = lambda policy: np.asarray(jax.tree.leaves(policy.params)[0])  # noqa: E731
  assert not np.array_equal(first(earlier), first(newest))
  with pytest.raises(FileNotFoundError, match=rf"no checkpoint of step 1 in .* \(it has {re.escape(str(kept))}\)"):
    load_policy(c, workdir, step=1)
  summary_out = tmp_path / "eval.json"
  config = [f"--config={REPO / 'configs' / 'tiny.py'}:{c.mode}", "--config.eval.num_examples=4"]
  _cli(generate.main, [*config, f"--workdir={workdir}", f"--step={kept[0]}", f"--output={tmp_path / 'out.jsonl'}",
                       f"--summary_out={summary_out}"])
  assert json.loads(summary_out.read_text())["checkpoint_step"] == kept[0]


def test_a_workdir_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
  from jaxrl import generate
  from jaxrl.policy import export_main

  config = f"--config={REPO / 'configs' / 'tiny.py'}"
  with pytest.raises(SystemExit) as exit_:
    _cli(generate.main, [config, f"--workdir={tmp_path / 'none'}"])
  assert exit_.value.code == 2
  assert f"no checkpoint in {tmp_path / 'none'}" in capsys.readouterr().err
  (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
  with pytest.raises(SystemExit) as exit_:
    export_main(["jaxrl-export", config, f"--workdir={tmp_path / 'empty'}", f"--out={tmp_path / 'hf'}"])
  assert exit_.value.code == 2
  assert "no checkpoint in" in capsys.readouterr().err and not (tmp_path / "hf").exists()
  with pytest.raises(SystemExit) as exit_:
    export_main(["jaxrl-export", config, f"--out={tmp_path / 'hf'}"])
  assert exit_.value.code == 2 and "--workdir required" in capsys.readouterr().err


@pytest.mark.parametrize("argv, match", [
    (["--tiny", "--workdir=/x", "--prompt_ids=1"], "need --config"),
    (["--config=configs/tiny.py", "--tiny"], "one of --config, --model_dir and --tiny"),
    (["--config=configs/tiny.py", "--dtype=bfloat16"], "--config.model.dtype"),
])
def test_generate_usage_errors_with_a_config(argv, match):
  from absl import app

  from jaxrl import generate

  argv = [a.replace("configs/", f"{REPO / 'configs'}/") for a in argv]
  with pytest.raises(app.UsageError, match=match):
    _cli(generate.main, argv)


def test_generate_with_a_config_uses_the_runs_sampler_engine(monkeypatch, tmp_path):
  """sampler.kv (its pages) and sampler.dtype reach jaxrl-generate's engine, built as a run builds its own."""
  import jax.numpy as jnp

  from jaxrl import generate
  from jaxrl.controller import build

  built, real = [], build.build_engine
  monkeypatch.setattr(build, "build_engine", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
  out = tmp_path / "out.jsonl"
  _cli(generate.main, [f"--config={REPO / 'configs' / 'tiny.py'}", "--config.sampler.kv=paged",
                       "--config.sampler.page_size=8", "--config.sampler.dtype=bfloat16", "--prompt_ids=3,4,5",
                       "--max_tokens=4", f"--output={out}"])
  (engine,) = built
  assert (engine.kv, engine.page_size, engine.dtype, engine.max_len) == ("paged", 8, jnp.bfloat16, 32)
  (row,) = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(row["completion_tokens"]) == 4


def test_generate_holds_a_lora_policys_base_as_a_runs_sampler_and_generates_as_the_merged_policy(monkeypatch,
                                                                                                   tmp_path):
  """jaxrl-generate --config builds the run's sampler engine (controller.sides): a LoRA policy's base held once, its
  adapters placed on it. The samples equal those of the merged policy placed whole on a plain engine."""
  from jaxrl import generate
  from jaxrl.controller import build, sides

  built, real = [], build.build_engine
  monkeypatch.setattr(build, "build_engine", lambda *a, **kw: built.append(real(*a, **kw)) or built[-1])
  argv = [f"--config={REPO / 'configs' / 'tiny.py'}", "--config.model.lora.enabled=True", "--config.model.lora.rank=4",
          "--prompt_ids=3,4,5", "--prompt_ids=7,8", "--n=2", "--max_tokens=6", "--temperature=0.7"]
  _cli(generate.main, [*argv, f"--output={tmp_path / 'held.jsonl'}"])
  (engine,) = built
  assert engine.base is not None  # the base, held once
  monkeypatch.setattr(generate, "_sampler_params", lambda policy: (policy.params, None))
  monkeypatch.setattr(sides, "sampler_engine", lambda c, cfg, mesh, path, base, **kw: real(c.sampler, cfg, mesh, **kw))
  _cli(generate.main, [*argv, f"--output={tmp_path / 'merged.jsonl'}"])
  held, merged = ([json.loads(line) for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                  for n in ("held", "merged"))
  assert len(held) == 4 and held == merged


def _params(workdir):
  from jaxrl.checkpoint import Checkpointer

  ck = Checkpointer(Path(workdir) / "checkpoints")
  step = ck.latest_step()
  path = Path(workdir) / "checkpoints" / str(step) / "state"
  ck.close()
  import orbax.checkpoint as ocp

  tree = ocp.StandardCheckpointer().restore(path)
  return step, tree["params"]


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted_sync_run(tmp_path):
  steps, every = 8, 4
  full = _config("sync", num_steps=steps, **{"checkpoint.every_steps": every}, **SCHEDULE)
  summary_full = train(full, tmp_path / "full")

  killed = tmp_path / "killed"
  cmd = [sys.executable, "-m", "jaxrl.train", "--config=configs/tiny.py:sync", f"--workdir={killed}",
         f"--config.num_steps={steps}", f"--config.checkpoint.every_steps={every}", "--config.log.tensorboard=False",
         "--config.log.progress=False", f"--config.optimizer.decay_steps={SCHEDULE['optimizer.decay_steps']}"]
  # The tests' matmul precision (tests/conftest.py), so the run's programs are the ones just compiled here: it reads
  # them from the compilation cache it inherits instead of compiling them again.
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 300
  # The commit marker, not the step folder: a kill between Orbax's rename and the marker is an unfinished save
  # (the resume then starts afresh, rightly; tests/test_integrity.py covers it).
  while not (killed / "checkpoints" / str(every) / MARKER).exists():
    assert proc.poll() is None, f"run ended before its first checkpoint: {proc.stderr.read().decode()[-2000:]}"
    assert time.monotonic() < deadline, "no checkpoint within 300 s"
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  latest = max(int(p.name) for p in (killed / "checkpoints").iterdir() if p.name.isdigit())
  assert every <= latest < steps  # killed mid-run

  summary = train(_config("sync", num_steps=steps, **{"checkpoint.every_steps": every}, **SCHEDULE), killed)
  assert summary["resumed_from"] == latest and summary["steps"] == steps
  assert summary["ledger"]["samples_trained"] == summary_full["ledger"]["samples_trained"]
  step_a, params_a = _params(tmp_path / "full")
  step_b, params_b = _params(killed)
  assert step_a == step_b == steps
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rec = json.loads((killed / "summary.json").read_text())
  assert rec["resumed_from"] == latest
  assert [r["step"] for r in read_jsonl(killed / "metrics.jsonl")] == list(range(1, steps + 1))  # each step once


def test_no_config_dict_reaches_a_component(tmp_path, monkeypatch):
  """Past config.validate every piece of a run reads the typed RunConfig (or its section): a ConfigDict field read
  anywhere else fails the run. The run covers build, both loops, eval, checkpoints, metrics, trace and telemetry."""
  import ml_collections

  from jaxrl import config as config_lib
  from jaxrl.settings import RunConfig

  c = _config("pipeline", **{"num_steps": 2, "eval.num_examples": 4, "log.trace": True, "checkpoint.every_steps": 1},
              **SCHEDULE)
  real_validate, inside = config_lib.validate, [0]
  read = {name: getattr(ml_collections.ConfigDict, name) for name in ("__getattr__", "__getitem__", "to_dict")}
  leaks, typed = [], []

  def guarded(name):
    def method(self, *args, **kwargs):
      if not inside[0]:
        leaks.append(f"ConfigDict.{name}{args}")
        raise AssertionError(f"a ConfigDict reached a component: {name}{args}")
      return read[name](self, *args, **kwargs)
    return method

  def validate(*args, **kwargs):
    inside[0] += 1
    try:
      cfg = real_validate(*args, **kwargs)
    finally:
      inside[0] -= 1
    typed.append(cfg)
    return cfg

  monkeypatch.setattr(config_lib, "validate", validate)
  for name in read:
    monkeypatch.setattr(ml_collections.ConfigDict, name, guarded(name))
  summary = train(c, tmp_path)
  assert not leaks and summary["steps"] == 2 and "eval_after" in summary
  assert len(typed) == 1 and isinstance(typed[0], RunConfig)  # validated once, at the entry point
  with pytest.raises(AssertionError, match="a ConfigDict reached a component"):
    c.rl.group_size  # noqa: B018 - the guard is live: a leak would have failed the run


def test_a_mixture_of_experts_policy_learns_in_the_pipeline(tmp_path):
  """The tiny config with a Qwen3-MoE decoder (8 experts, 2 per token), routing replay and the aux loss in the
  objective: the reward rises as the dense model's does, and the router's terms are in the step metrics."""
  moe = dict(architecture="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             router_aux_loss_coef=0.01)
  c = _config("pipeline", **{"model.tiny": dict(tiny.get_config().model.tiny) | moe, "eval.num_examples": 0})
  summary = train(c, tmp_path)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  rewards = [r["reward_mean"] for r in records]
  assert len(rewards) == c.num_steps == summary["steps"]
  first, last = np.mean(rewards[:2]), np.mean(rewards[-3:])
  assert last > first + 0.3, f"MoE: reward went from {first:.3f} to {last:.3f}"
  assert all(r["loss/router_aux"] > 0 for r in records)
