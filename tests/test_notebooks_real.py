"""The preference-tuning notebook (SmolLM2, ~85 s of one CPU thread), executed in a file of its own so that
pytest-xdist runs it on the other worker beside tests/test_notebooks.py's notebooks (a file stays on one worker)."""

import pytest

from .test_notebooks import NOTEBOOKS, SEPARATE, run_notebook


@pytest.mark.slow
@pytest.mark.repo_notebooks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SEPARATE[:1])
def test_notebook_executes(name):
    run_notebook(NOTEBOOKS / f"{name}.ipynb")
