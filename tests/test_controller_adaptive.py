"""rl.max_staleness="auto": the policy's decisions, its window, the config checks, and a tiny run that logs k."""

import sys
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, override, validate
from jaxrl.controller.adaptive import AdaptiveStaleness, AutoStaleness, decide
from jaxrl.controller.assembly import DeadlineBook
from jaxrl.metrics import read_jsonl
from jaxrl.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "configs"))
import tiny  # noqa: E402

CFG = AutoStaleness(k_min=1, k_max=3, ess_low=0.7, ess_high=0.9, kl_high=0.05, window=2)


@pytest.mark.parametrize("k,ess,kl,want", [
    (2, 0.95, 0.01, 3),  # small drift: run further ahead
    (3, 0.95, 0.01, 3),  # ... but not past k_max
    (2, 0.6, 0.01, 1),  # low ESS: come back
    (1, 0.6, 0.01, 1),  # ... but not below k_min
    (2, 0.95, 0.06, 1),  # high KL(mu || pi) alone is enough to come back
    (2, 0.95, 0.03, 2),  # ESS high but KL not clearly small: stay
    (2, 0.8, 0.0, 2),  # between the ESS thresholds: stay
])
def test_decide(k, ess, kl, want):
  assert decide(k, ess, kl, CFG) == want


def test_adaptive_waits_a_window_and_restarts_it_after_a_change():
  a = AdaptiveStaleness(CFG)
  assert a.k == 1
  assert a.observe(0.99, 0.0) == 1  # one step is not a window
  assert a.observe(0.97, 0.0) == 2  # mean 0.98 over 2 steps: up
  assert a.observe(0.50, 0.0) == 2  # the window restarted: one step under the new k is not enough
  assert a.observe(0.80, 0.0) == 1  # mean 0.65 < 0.7: down
  assert a.observe(0.80, 0.0) == 1
  assert a.observe(0.80, 0.0) == 1  # steady in the dead band (the window slides)
  assert a.observe(1.0, 0.0) == 1  # mean 0.9 is not > 0.9
  assert a.observe(1.0, 0.0) == 2


def test_admission_follows_the_adaptive_bound_and_the_hard_one_stays():
  book = DeadlineBook(max_staleness=3, groups_per_step=2)
  book.admit_k = 1
  assert book.room(version=0) == 4  # (0 + 1 - 0 + 1) * 2: the adaptive bound, not the hard one (8)
  assert book.admit(0, version=0) == 1  # due at 0 + 1
  book.admit_k = 7  # never above the hard bound
  assert book.admit_bound == 3 and book.admit(1, version=0) == 3
  book.admit_k = 0  # lowering it only makes the room stricter
  assert book.room(version=0) == 0


@pytest.mark.parametrize("fields,match", [
    ({"rl.max_staleness": "often"}, "max_staleness"),
    ({"rl.max_staleness": -1}, "max_staleness"),
    ({"rl.max_staleness": "auto", "rl.auto_staleness.k_min": 5}, "k_min <= k_max"),
    ({"rl.max_staleness": "auto", "rl.auto_staleness.ess_low": 0.95}, "ess_low < ess_high"),
])
def test_bad_auto_configs_are_config_errors(fields, match):
  with pytest.raises(ConfigError, match=match):
    validate(override(tiny.get_config(), **fields))


def test_a_tiny_run_under_auto_logs_k_every_step_and_keeps_the_hard_bound(tmp_path):
  c = override(tiny.get_config(), **{"rl.max_staleness": "auto", "num_steps": 8, "log.tensorboard": False,
                                    "log.progress": False, "rl.auto_staleness.k_max": 2,
                                    "rl.auto_staleness.window": 2})
  train(c, tmp_path)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert len(records) == 8
  ks = [r["admit_staleness"] for r in records]
  assert all(0 <= k <= 2 for k in ks) and max(ks) >= 1  # it moved up from k_min = 0
  assert all(r["staleness_max"] <= 2 for r in records)
  assert all(0 < r["ess_applied_frac"] <= 1 + 1e-6 for r in records)
