"""The kill campaign's CI subset: a job of 1 learner + 1 sampler process SIGKILLed twice inside random phases of a
random process (sampling, training, weight publish, checkpoint save, eval), resumed each time by the same command,
finishes its steps with every rollout accounted for, no sample trained twice, and every step's groups those of an
uninterrupted run; and a run with independent samplers whose learner and one sampler are SIGKILLed. Single-host runs
get random kills in test_faults_resume.py. The full campaign (every topology,
20+ kills each) is `python tests/faults/kill_campaign.py --docs`; docs/RELIABILITY.md holds its tally."""

import independent_campaign
import pytest
from faults_util import REPO, TALLY, child_env
from kill_campaign import STEPS, Topology, campaign

from jaxrl.distributed.launch import free_ports


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


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_independent_samplers_and_a_restarted_learner_account_for_every_rollout(tmp_path, xla_cache_dir):
  """A jaxrl-learner and 2 jaxrl-sampler programs: one sampler SIGKILLed (another joins in its place) and the
  learner SIGKILLed and resumed while the samplers run on and register again with it."""
  env = {**child_env(), "JAX_COMPILATION_CACHE_DIR": str(xla_cache_dir)}
  tally = independent_campaign.campaign(2, 1, 1, tmp_path, env, REPO, free_ports(1)[0], seed=1, gap_s=(2.0, 4.0))
  TALLY["processes SIGKILLed"] += tally["kills"]
  TALLY["runs resumed after SIGKILL"] += tally["resumes"]
  assert not tally["failures"], tally["failures"]
  assert (tally["kills"], tally["resumes"], tally["runs"], tally["unaccounted"]) == (2, 1, 1, 0)
  (run,) = tally["runs_checked"]
  assert run["attempts"] == 2 and run["trained"] == independent_campaign.STEPS * 16
