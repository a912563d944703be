"""The RL notebook (GRPO on SmolLM2), executed in a file of its own so that pytest-xdist runs it on a worker of its
own beside tests/test_notebooks.py's and tests/test_notebooks_real.py's notebooks (a file stays on one worker)."""

import pytest

from .test_notebooks import NOTEBOOKS, SEPARATE, run_notebook


@pytest.mark.slow
@pytest.mark.repo_notebooks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", SEPARATE[1:])
def test_notebook_executes(name):
    run_notebook(NOTEBOOKS / f"{name}.ipynb")
