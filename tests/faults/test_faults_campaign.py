"""The kill campaign's CI subset: a job of 1 learner + 1 sampler process SIGKILLed twice inside random phases of a
random process (sampling, training, weight publish, checkpoint save, eval), resumed each time by the same command,
finishes its steps with every rollout accounted for, no sample trained twice, and every step's groups those of an
uninterrupted run. Single-host runs get random kills in test_faults_resume.py. The full campaign (every topology,
20+ kills each) is `python tests/faults/kill_campaign.py --docs`; docs/RELIABILITY.md holds its tally."""

import pytest
from faults_util import TALLY
from kill_campaign import STEPS, Topology, campaign


@pytest.mark.timeout(600)  # the slowest tests: 111-183 s on the 2-core box under load (docs/RELIABILITY.md)
@pytest.mark.slow
def test_a_multiprocess_job_killed_twice_resumes_exactly_and_accounts_for_every_rollout(tmp_path, xla_cache_dir):
  tally = campaign(Topology.parse("mp1+1"), kills=2, out=tmp_path, seed=1, per_run=2, cache=xla_cache_dir)
  TALLY["processes SIGKILLed"] += tally["kills"]
  TALLY["runs resumed after SIGKILL"] += tally["resumes"]
  assert not tally["failures"], tally["failures"]
  assert (tally["kills"], tally["resumes"], tally["runs"], tally["unaccounted"]) == (2, 2, 1, 0)
  (run,) = tally["runs_checked"]
  assert run["attempts"] == 3 and run["trained"] == STEPS * 16 and run["same_steps_as_uninterrupted"]
