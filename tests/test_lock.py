"""Locked installs: `make setup` installs requirements-lock.txt exactly; `make lock` rewrites it only after the
suite passes on the newest versions; `make upgrade-check` reports drift and never writes it."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-lock.txt"


def _tool():
    spec = importlib.util.spec_from_file_location("nbtrain_lock_tool", ROOT / "tools" / "lock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_lock_pins_every_package_but_torch():
    pins = _tool().read_lock(LOCK)
    assert len(pins) > 100, "a lock of every package, transitive ones included"
    body = [ln for ln in LOCK.read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", ln) for ln in body), body[:5]
    assert "torch" not in pins and "nbtrain" not in pins   # the set-up step pins torch (TORCH_SPEC)
    for name in ("transformers", "peft", "accelerate", "bitsandbytes", "pytest", "pip", "setuptools"):
        assert name in pins, name


def test_this_environment_is_the_locked_set():
    """What `make setup` installed is the lock, version for version (a package missing or at another version
    means the set-up did not install the lock)."""
    pins = _tool().read_lock(LOCK)

    def installed(name):   # the distribution imports would use: the first on sys.path (setuptools vendors a few)
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    wrong = {k: (v, installed(k)) for k, v in pins.items() if installed(k) != v}
    assert not wrong, f"locked vs installed: {wrong}"


def test_setup_installs_the_lock_and_pyproject_keeps_ranges():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^\$\(STAMP\):.*requirements-lock\.txt", make, re.M), "the set-up reruns when the lock changes"
    assert "pip install -q --no-deps -r requirements-lock.txt" in make
    assert re.search(r"^lock:", make, re.M) and re.search(r"^upgrade-check:", make, re.M)
    assert "upgrade-check" not in (ROOT / ".ci" / "run").read_text()   # drift never blocks CI
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert all("==" not in d for d in deps), deps
    assert any(d.replace(" ", "").startswith("torch>=") for d in deps)


def test_moved_lists_what_changed():
    moved = _tool().moved
    assert moved({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "2.1", "d": "4"}) == [
        "b 2 -> 2.1", "c 3 -> (none)", "d (none) -> 4"]


@pytest.mark.parametrize("suite_rc", [0, 1])
def test_lock_is_written_only_when_the_suite_passes(tmp_path, monkeypatch, capsys, suite_rc):
    tool = _tool()
    lock = tmp_path / "requirements-lock.txt"
    lock.write_text("a==1\nb==2\n")
    monkeypatch.setattr(tool, "LOCK", lock)
    monkeypatch.setattr(tool, "build_newest", lambda venv, spec, args: tmp_path / "py")
    monkeypatch.setattr(tool, "freeze", lambda py: {"a": "1", "b": "3", "c": "1"})
    monkeypatch.setattr(tool.subprocess, "check_output", lambda *a, **k: "2.13.0+cpu\n")
    runs = []
    monkeypatch.setattr(tool, "_pytest", lambda py, args: (runs.append(args) or suite_rc,
                                                           "FAILED tests/test_x.py::test_y - boom\n"))
    rc = tool.main(["lock", "--venv", str(tmp_path / "venv")])
    out = capsys.readouterr().out
    assert runs == [["-m", "not course", "--durations=10"]]   # the course's clean environment takes the old lock
    assert "b 2 -> 3" in out and "c (none) -> 1" in out
    if suite_rc == 0:
        assert rc == 0 and tool.read_lock(lock) == {"a": "1", "b": "3", "c": "1"}
    else:
        assert rc == 1 and lock.read_text() == "a==1\nb==2\n"
        assert "FAILED tests/test_x.py::test_y" in out


def test_upgrade_check_reports_and_never_writes(tmp_path, monkeypatch, capsys):
    tool = _tool()
    lock = tmp_path / "requirements-lock.txt"
    lock.write_text("a==1\n")
    monkeypatch.setattr(tool, "LOCK", lock)
    monkeypatch.setattr(tool, "build_newest", lambda venv, spec, args: tmp_path / "py")
    monkeypatch.setattr(tool, "freeze", lambda py: {"a": "2"})
    monkeypatch.setattr(tool.subprocess, "check_output", lambda *a, **k: "2.13.0+cpu\n")
    runs = []
    monkeypatch.setattr(tool, "_pytest", lambda py, args: (runs.append(args) or (1 if runs[-1][0] == "-m" else 0),
                                                           "FAILED tests/test_a.py::t - x\n" if len(runs) == 1 else ""))
    assert tool.main(["check", "--venv", str(tmp_path / "venv")]) == 1
    out = capsys.readouterr().out
    assert "upgrade-check: 1 package(s) moved, fast tests and notebooks 1 failure(s)" in out
    assert "a 1 -> 2" in out and "FAILED tests/test_a.py::t" in out
    assert runs == [["-m", "not slow and not course"], ["tests/test_notebooks.py", "tests/test_notebooks_real.py",
                                         "tests/test_notebooks_rl.py"]]
    assert lock.read_text() == "a==1\n"
