"""jaxrl.cost_profile: the measurements a profiling run takes on an engine and a learner; the jaxrl-profile CLI."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl import cost_profile as profile
from jaxrl.models import Decoder, ModelConfig
from jaxrl.sampler import make_engine
from jaxrl.sharding import make_mesh
from jaxrl.sim.calibrate import Calibration

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine_and_params():
  cfg = ModelConfig.tiny(vocab_size=64, num_layers=1, max_position_embeddings=64)
  params = nnx.split(Decoder(cfg, nnx.Rngs(0)))[1]
  engine = make_engine(cfg, make_mesh({"data": 2}, jax.devices()[:2]), max_slots=4, max_len=64, steps_per_call=4)
  return engine, engine.place(params, 0)


def test_decode_rows_cover_every_batch_and_growing_contexts(engine_and_params):
  engine, params = engine_and_params
  rows = profile.decode_times(engine, params, [1, 4], prompt_len=4, calls=6, per_row=3)
  # Per batch: a warm-up call, then 6 timed calls in 2 rows of 3; the context is the middle of each row's calls.
  assert [(b, ctx) for b, ctx, _ in rows] == [(1, 14), (1, 26), (4, 14), (4, 26)]
  assert all(t > 0 for _, _, t in rows)


def test_decode_rows_need_room_in_the_cache(engine_and_params):
  engine, params = engine_and_params
  with pytest.raises(ValueError, match="max_len=64 leaves no room for 3 timed decode calls after a 60-token prompt"):
    profile.decode_times(engine, params, [1], prompt_len=60, calls=3)


def test_admission_probe_admits_a_full_pool_per_step(engine_and_params):
  engine, params = engine_and_params
  seconds, admitted = profile.admission_step_s(engine, params, prompt_len=4, group_size=2, reps=2)
  assert admitted == 4 and seconds > 0
  seconds, admitted = profile.admission_step_s(engine, params, prompt_len=4, group_size=8, reps=1)
  assert admitted == 4  # a group larger than the pool fills it


def test_transfer_moves_exactly_the_sampler_copy_of_the_weights(engine_and_params):
  engine, params = engine_and_params
  seconds, nbytes = profile.transfer_s(params.params, engine, reps=2)
  assert seconds > 0
  assert nbytes == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.params))


def test_full_rollouts_fill_every_row():
  rollouts = profile.full_rollouts(batch_size=6, seq_len=16, group_size=3, vocab_size=50, prompt_len=4)
  assert [r.num_tokens for r in rollouts] == [16] * 6
  assert [r.group_id for r in rollouts] == [0, 0, 0, 1, 1, 1]
  assert len({r.reward for r in rollouts[:3]}) == 2  # rewards differ within a group: GRPO advantages are not 0


def test_contention_compares_each_side_at_once_against_alone():
  """Fake calls: a decode call 'takes' 2 units while a train step runs, else 1; a train step 3 units while the
  profiler's sampler thread runs, else 1. The factors come out exactly."""
  training = threading.Event()

  def decode_call():
    busy = training.is_set()
    time.sleep(0.002)
    return 2.0 if busy else 1.0

  def train_call():
    concurrent = any(t.name == "jaxrl-profile-sampler" for t in threading.enumerate())
    training.set()
    time.sleep(0.05)
    training.clear()
    return 3.0 if concurrent else 1.0

  decode_x, train_x, details = profile.contention(decode_call, train_call, train_reps=3)
  assert (decode_x, train_x) == (2.0, 3.0)
  assert details["decode_calls_both"] >= 10


@pytest.mark.slow
def test_cli_writes_a_calibration_of_the_configs_own_shapes(tmp_path):
  out = tmp_path / "cal.json"
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-m", "jaxrl.cost_profile", "--config=configs/bench_pipeline.py:test",
                         f"--out={out}", "--decode_calls=3", "--train_reps=1", "--nocontention"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  cal = Calibration.load(out)
  m = cal.measurements
  # configs/bench_pipeline.py:test: 16 slots on a 4-device sampler, a 1-layer float32 model of vocab 256, width 64.
  assert (cal.max_batch, cal.devices_per_engine) == (16, 4)
  cfg = ModelConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=32)
  abstract = nnx.eval_shape(lambda: nnx.split(Decoder(cfg, nnx.Rngs(0)))[1])
  assert cal.weight_bytes == sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(abstract))
  assert [b for b, _, _ in m.decode] == [1, 4, 16]  # 3 calls per batch size: one row each
  assert (m.decode_contention, m.train_contention) == (1.0, 1.0)  # --nocontention
  assert m.train_tokens_per_s_per_device > 0 and m.update_s > 0 and m.prefill_s_per_token >= 0
  assert "decode step:" in proc.stdout and f"wrote {out}" in proc.stdout


def test_cli_rejects_a_bad_config(tmp_path):
  env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", PYTHONPATH=str(REPO))
  proc = subprocess.run([sys.executable, "-m", "jaxrl.cost_profile", "--config=configs/bench_pipeline.py:test",
                         "--config.rl.group_size=0", f"--out={tmp_path / 'cal.json'}"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "rl.group_size must be an int >= 1" in proc.stderr
  assert not (tmp_path / "cal.json").exists()


# Logs of one run of each mode of bench/sim_natural.py (configs/tiny.py at natural lengths, 24 steps; its round 0 of
# 3, 18:31), on the shared 2-core box at load ~23 (the other engineers): metrics.jsonl, summary.json and trace.jsonl.
NATURAL = REPO / "tests" / "data" / "natural_runs"


@pytest.mark.parametrize("mode", ["sync", "pipeline"])
def test_from_run_calibrates_a_natural_length_run_on_its_own_lengths(mode):
  """--from-run on a run whose lengths are the model's own: the simulated runs train the logged lengths, sample by
  sample in group order, and predict the run's trained tokens per second."""
  from bench.sim_natural import WARMUP, config
  from jaxrl.metrics import read_jsonl
  from jaxrl.sim import runlog

  c = config(mode, 24)
  r = profile.from_run(c, NATURAL / mode, devices=8, warmup=WARMUP)
  records = read_jsonl(NATURAL / mode / "metrics.jsonl")
  logged = runlog.group_lengths(read_jsonl(NATURAL / mode / "trace.jsonl"), c.rl.group_size)
  assert logged.shape == (24 * c.rl.groups_per_step, c.rl.group_size) and len(np.unique(logged)) > 10
  assert r["measured_tokens_per_s"] == pytest.approx(1 / runlog.seconds_per_token(records, WARMUP, 16))
  # Replayed from the group that puts the simulated window of the run's own mode (after k + 1 steps) on the run's.
  skip = (WARMUP - (0 if mode == "sync" else c.rl.max_staleness) - 1) * c.rl.groups_per_step
  replayed = np.resize(logged[skip:], (2 * len(logged), c.rl.group_size))  # from the first again past the last
  for sim in (r["prediction"].sync, r["prediction"].pipeline):
    s = sim.samples
    made = s["group"] >= 0
    assert (s["length"][made] == replayed[s["group"][made], np.arange(made.size)[made] % c.rl.group_size]).all()
  # So the simulated run of its own mode trains, in its window, the very samples the run trained in its own.
  trained = np.mean([x["completion_len"] for x in runlog.steady(records, WARMUP)[1:]])
  assert r[f"{mode}_trained_len"] == pytest.approx(trained, rel=1e-9)
  assert r["token_ratio"] == pytest.approx(r["pipeline_tokens_per_s"] / r["sync_tokens_per_s"])
  assert abs(r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1) < 0.10


def test_from_run_needs_the_trace_of_a_natural_length_run(tmp_path):
  from bench.sim_natural import WARMUP, config

  for name in ("metrics.jsonl", "summary.json"):
    (tmp_path / name).write_text((NATURAL / "sync" / name).read_text())
  with pytest.raises(ValueError, match="log.trace=True"):
    profile.from_run(config("sync", 24), tmp_path, devices=8, warmup=WARMUP)
