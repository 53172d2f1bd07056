"""A reward fn that runs the completion as Python code (the worst case of a reward or tool that executes what a
model wrote), for tests/test_envs_sandbox.py: importable by the runner's worker processes."""


def run_completion(prompt, completion, meta):
  """1.0 if the completion runs to the end."""
  exec(completion, {})
  return 1.0
