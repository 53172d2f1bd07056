"""The wiring proof (tests/mutations.py) stays in step with the code: every cut applies to exactly one place,
applying one changes the file, its first tests exist, and every cut has a group of tests to fail."""

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


def test_each_area_runs_its_own_test_files_and_every_cut_has_an_area():
  tests = lambda pattern: {str(p.relative_to(mutations.ROOT)) for p in (mutations.ROOT / "tests").glob(pattern)}
  assert set(mutations.group_tests("jaxrl/learner/step.py")) == tests("test_learner_*.py")
  assert set(mutations.group_tests("jaxrl/sampler/decode.py")) == tests("test_sampler_*.py")
  assert set(mutations.group_tests("jaxrl/controller/build.py")) == tests("test_controller_*.py") | tests(
      "test_checkpoint*.py")
  assert mutations.group_tests("jaxrl/envs/runner.py") == ["tests/security/test_model_code.py",
                                                            "tests/test_envs_runner.py"]
  assert all(mutations.group_tests(m.path) for m in mutations.MUTATIONS)
  with pytest.raises(ValueError, match="jaxrl/sim/plan.py is in no test group"):
    mutations.group_tests("jaxrl/sim/plan.py")
