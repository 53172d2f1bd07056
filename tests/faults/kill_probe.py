"""`python -m kill_probe` (tests/faults on the path): jaxrl-train, or with JAXRL_PROBE=distributed one process of
a multi-process job, that records which phases it is in (sampling, training, publish, checkpoint, eval) in
$JAXRL_PROBE_DIR/<process>.json, so that a kill campaign can SIGKILL it inside a phase it picked. The record is
written to a temporary file and renamed (a reader never sees half of it); the trainer itself has no hooks."""

import collections
import functools
import json
import os
import threading

from jaxrl import checkpoint
from jaxrl.controller import data, learner_loop, weights
from jaxrl.sampler import sampler

_LOCK = threading.Lock()
_ACTIVE: collections.Counter = collections.Counter()
_ENTERED: collections.Counter = collections.Counter()
_PATH = os.path.join(os.environ["JAXRL_PROBE_DIR"], os.environ.get("JAXRL_PROCESS_ID", "0") + ".json")


def _write() -> None:
  tmp = f"{_PATH}.{threading.get_ident()}.tmp"
  with open(tmp, "w") as f:
    json.dump({"pid": os.getpid(), "active": [k for k, v in _ACTIVE.items() if v], "entered": _ENTERED}, f)
  os.replace(tmp, _PATH)


def _marked(phase: str, fn):
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    with _LOCK:
      _ACTIVE[phase] += 1
      _ENTERED[phase] += 1
      _write()
    try:
      return fn(*args, **kwargs)
    finally:
      with _LOCK:
        _ACTIVE[phase] -= 1
        _write()

  return wrapper


def _mark(owner, name: str, phase: str) -> None:
  setattr(owner, name, _marked(phase, getattr(owner, name)))


_mark(sampler.Sampler, "step", "sampling")
_mark(learner_loop.LearnerLoop, "_train", "training")
_mark(weights.WeightPublisher, "publish", "publish")
_mark(checkpoint.Checkpointer, "save", "checkpoint")
_mark(checkpoint.Checkpointer, "_commit_step", "checkpoint")  # the background write and commit
_mark(data, "evaluate_policy", "eval")  # before the trainers import it by name

if os.environ.get("JAXRL_PROBE") == "distributed":
  from jaxrl.distributed import cross_process

  _mark(cross_process.LearnerPublisher, "publish", "publish")
  _mark(cross_process.Ferry, "_copy_weights", "publish")  # a sampler receiving a version
  from jaxrl.distributed import job as distributed_job

  if __name__ == "__main__":
    distributed_job.main()
elif __name__ == "__main__":
  from jaxrl import train

  train.main()
