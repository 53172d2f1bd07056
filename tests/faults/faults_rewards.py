"""Reward fns that fail, for the fault tests. They run in RewardRunner's worker processes (this folder is on the
sys.path the runner hands its workers); importing this module fails while $JAXRL_FAULTS_BREAK_IMPORT names a file
that exists, so a test can make workers unable to start."""

import os

_BREAK = os.environ.get("JAXRL_FAULTS_BREAK_IMPORT")
if _BREAK and os.path.exists(_BREAK):
  raise ImportError(f"faults_rewards: import broken on purpose ({_BREAK} exists)")


def _target_fraction(meta) -> float:
  ids = meta["completion_ids"]
  return sum(t in meta["target_ids"] for t in ids) / len(ids) if ids else 0.0


def flaky(prompt, completion, meta):
  """The target_token reward, raising for about one sample in thirteen (by the completion's token ids)."""
  if sum(meta["completion_ids"]) % 13 == 0:
    raise ValueError("flaky reward: injected failure")
  return _target_fraction(meta)


def always_raises(prompt, completion, meta):
  raise ValueError("broken reward: injected failure")


def dies_and_breaks_restarts(prompt, completion, meta):
  """Kills its worker on the first call, after breaking this module's import for every later worker."""
  if not os.path.exists(os.environ["JAXRL_FAULTS_BREAK_IMPORT"]):
    open(os.environ["JAXRL_FAULTS_BREAK_IMPORT"], "w").close()
    os._exit(3)
  return _target_fraction(meta)


def rare(prompt, completion, meta):
  """1 for about one completion in forty (by its token ids), else 0: about 90% of groups of 4 score all equal,
  the filter rate dynamic sampling is tested at."""
  return float(sum(meta["completion_ids"]) % 40 == 0)


def always_zero(prompt, completion, meta):
  """0 for every completion: no group has a learning signal."""
  return 0.0
