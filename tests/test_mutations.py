"""The wiring proof (tests/mutations.py) stays in step with the code: every cut applies to exactly one place, and
applying one changes the file."""

import pathlib
import shutil

import pytest

from tests import mutations


@pytest.mark.parametrize("mutation", mutations.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_applies_once(mutation, tmp_path):
  src = mutations.ROOT / mutation.path
  dst = tmp_path / mutation.path
  dst.parent.mkdir(parents=True)
  shutil.copy(src, dst)
  mutations.apply(mutation, tmp_path)
  assert dst.read_text() != src.read_text()
  for first in mutation.first:
    path, _, node = first.partition("::")
    assert (mutations.ROOT / path).is_file(), first
    assert not node or f"def {node.split('[')[0]}(" in (mutations.ROOT / path).read_text(), first


def test_a_snippet_that_is_gone_is_an_error(tmp_path):
  cut = mutations.Mutation("gone", "jaxrl/learner/losses.py", "no such code", "x")
  (tmp_path / "jaxrl/learner").mkdir(parents=True)
  shutil.copy(mutations.ROOT / cut.path, tmp_path / cut.path)
  with pytest.raises(ValueError, match="occurs 0 times"):
    mutations.apply(cut, tmp_path)


def test_every_learner_test_file_is_run():
  assert set(mutations.LEARNER_TESTS) == {str(p.relative_to(mutations.ROOT))
                                          for p in pathlib.Path(mutations.ROOT / "tests").glob("test_learner_*.py")}
