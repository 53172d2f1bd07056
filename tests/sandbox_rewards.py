"""A reward fn that runs the completion as Python code (the worst case of a reward or tool that executes what a
model wrote), for tests/test_envs_sandbox.py, and a reward broken only inside the sandbox, for
tests/test_envs_guard.py: importable by the runner's worker processes."""

import os
import sys

from jaxrl.envs.rewards import register_reward, right_and_wrong


def run_completion(prompt, completion, meta):
  """1.0 if the completion runs to the end."""
  exec(completion, {})
  return 1.0


# A reward that imports what it needs on first use, from a folder named by $JAXRL_TEST_LAZY_DIR, and scores 0 when
# that import fails (as math-verify does when its LaTeX runtime cannot be imported): right only where it can import.
LAZY_DIR = "JAXRL_TEST_LAZY_DIR"


@register_reward("test_lazy_import", sandbox=True, checks=right_and_wrong("<answer>7</answer>", "<answer>8</answer>",
                                                                         {"answer": "7"}))
def lazy_import_reward(prompt, completion, meta):
  """1.0 if the completion's tagged answer equals meta["answer"], read by a module imported on first use."""
  if os.environ[LAZY_DIR] not in sys.path:
    sys.path.append(os.environ[LAZY_DIR])
  try:
    import lazy_answer_reader
  except ImportError:
    return 0.0
  return float(lazy_answer_reader.tagged(completion) == meta["answer"])
