"""README's two commands stay true: CI runs exactly the README's test command; the main job's config exists; its
train-step snippet stays short and uses what jaxrl.learner exports. Its results table quotes docs/BENCHMARKS.md."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _commands():
  readme = (REPO / "README.md").read_text()
  return re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S)


def test_ci_runs_the_readme_test_command():
  test_cmds = [line for block in _commands() for line in block.splitlines() if "pytest" in line]
  assert len(test_cmds) >= 1
  ci = (REPO / ".ci" / "run").read_text()
  assert test_cmds[0].strip() in ci.splitlines() or any(test_cmds[0].strip() == l.strip() for l in ci.splitlines())


def test_readme_main_job_uses_the_default_config():
  first = _commands()[0]
  assert "pip install" in first and "jaxrl-train --config=configs/default.py" in first
  assert (REPO / "configs" / "default.py").is_file()


def test_readme_train_step_snippet_is_short_and_uses_the_learner_exports():
  import jaxrl.learner

  readme = (REPO / "README.md").read_text()
  snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "jit_train_step(" in b)
  assert len([line for line in snippet.splitlines() if line.strip()]) <= 10
  names = re.search(r"from jaxrl\.learner import (.*)", snippet).group(1).split(", ")
  assert {"StepConfig", "jit_train_step"} <= set(names) <= set(jaxrl.learner.__all__)


def _results_rows():
  """(what, result, command, date) of each row of README's `## Results` table."""
  readme = (REPO / "README.md").read_text()
  section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
  lines = [line for line in section.splitlines() if line.startswith("|")]
  assert lines[0].replace(" ", "") == "|what|result|command|date|", lines[0]
  rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]
  assert rows and all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
  return rows


def test_every_readme_result_figure_is_in_benchmarks():
  benchmarks = (REPO / "docs" / "BENCHMARKS.md").read_text()
  for what, result, command, date in _results_rows():
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date), f"README result {what!r}: date {date!r} is not YYYY-MM-DD"
    assert command, f"README result {what!r}: no command"
    figures = re.findall(r"\*\*(.+?)\*\*", what + " " + result)
    for figure in figures:
      assert figure in benchmarks, f"README result {what!r}: {figure!r} is not in docs/BENCHMARKS.md"
