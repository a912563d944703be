"""The course under the capabilities of the GPU a student has: every notebook runs to its end, its library checks
included, while nbtrain's ``capabilities()`` answers as an NVIDIA T4 (compute capability 7.5, 15 GiB, bf16
"supported" but emulated: ``precision="auto"`` picks fp16 with the GradScaler) or an A100 (8.0, 40 GiB: bf16).

What a notebook prints, picks and asserts from ``capabilities()`` (its device, name, memory, allowed precisions,
``auto_precision``, notes) is then the GPU's; the arithmetic still runs on this CPU (``default_device()`` stays
"cpu", so the runs' tensors do too). A notebook that asserts a value only a CPU gives, or reads a measurement by
what ``capabilities()`` says rather than by where its run ran, fails here. On a real GPU the same notebooks run in
tests/test_gpu_notebooks.py (marked ``gpu``).

Marked ``course``: ~26 notebook runs, 1 to 3 minutes each, for the slower course target, not ``make test``.
Executed copies are written to test-artifacts/notebooks/<name>.<gpu>.ipynb.
"""

from __future__ import annotations

import time

import nbformat
import pytest

from .test_notebooks import ARTIFACTS, EXPECTED, NOTEBOOKS, _execute, with_checks

# (torch.cuda.get_device_properties(0) fields, torch.cuda.is_bf16_supported(), what precision="auto" must pick)
GPUS = {
    "T4": dict(name="Tesla T4", major=7, minor=5, total_gib=15, bf16_supported=True, auto="fp16"),
    "A100": dict(name="NVIDIA A100-SXM4-40GB", major=8, minor=0, total_gib=40, bf16_supported=True, auto="bf16"),
}


def as_gpu(gpu: str) -> str:
    """A first code cell that makes nbtrain's capabilities() answer as ``gpu`` (a key of GPUS) in the kernel."""
    g = GPUS[gpu]
    return f'''\
# tests/test_notebooks_devices.py: nbtrain's capabilities() answers as {gpu} ({g["name"]}); the arithmetic stays on
# this CPU (default_device() is still "cpu").
import sys as _sys
import types as _types

import torch as _torch

import nbtrain as _nbt
import nbtrain.hardware as _hw

# The GPU's capabilities, computed by nbtrain's own code from what torch would report on that GPU (the lru cache
# of _capabilities is bypassed, so its honest answer for this CPU stays as it is).
_props = _types.SimpleNamespace(name={g["name"]!r}, major={g["major"]}, minor={g["minor"]},
                                total_memory={g["total_gib"]} * 2**30)
_saved = _torch.cuda.get_device_properties, _torch.cuda.is_bf16_supported
_torch.cuda.get_device_properties = lambda *a, **k: _props
_torch.cuda.is_bf16_supported = lambda *a, **k: {g["bf16_supported"]}
try:
    _gpu_caps = _hw._capabilities.__wrapped__("cuda")
finally:
    _torch.cuda.get_device_properties, _torch.cuda.is_bf16_supported = _saved
_real_capabilities = _hw.capabilities


def _as_gpu(device=None):
    """capabilities() as the GPU answers, whatever the device asked for (the runs train on "cpu", which stands for
    the GPU here), except for nbtrain.precision: its capabilities("cpu").fp16_fast decides how fp16 arithmetic is
    computed on the processor that does it, which is this CPU (without fp16 hardware fp16's linears are emulated
    with fp32 GEMMs; told "fp16 is fast" it would run torch's scalar fp16 GEMM here, ~20x slower, the same numbers).
    That probe is about the arithmetic, not about the device a student trains on, so it keeps the honest answer."""
    if _sys._getframe(1).f_globals.get("__name__") == "nbtrain.precision":
        return _real_capabilities(device)
    return _gpu_caps


# Every loaded nbtrain module that imported the name (from ..hardware import capabilities) gets the fake; a module
# loaded later copies nbtrain.hardware's, the fake too, and so does a function that imports it when called.
for _name, _mod in list(_sys.modules.items()):
    if (_name == "nbtrain" or _name.startswith("nbtrain.")) and getattr(_mod, "capabilities", None) is _real_capabilities:
        _mod.capabilities = _as_gpu
assert _nbt.capabilities().name == {g["name"]!r} and _nbt.capabilities().device == "cuda"
assert _nbt.capabilities().auto_precision == {g["auto"]!r}, _nbt.capabilities().auto_precision
assert _hw.default_device() == "cpu" and _hw.resolve_precision("auto") == {g["auto"]!r}
import nbtrain.precision as _precision
assert _precision._emulate_fp16_on_cpu() is not _real_capabilities("cpu").fp16_fast   # asked of this CPU, honestly
'''


def still_gpu(gpu: str) -> str:
    """A last code cell: the fake held to the end, in every nbtrain module the notebook loaded."""
    g = GPUS[gpu]
    return f'''\
# tests/test_notebooks_devices.py: capabilities() still answers as {gpu}, in every nbtrain module now loaded
import nbtrain as _nbt
_held = [n for n, m in list(_sys.modules.items()) if (n == "nbtrain" or n.startswith("nbtrain."))
         and getattr(m, "capabilities", _as_gpu) is not _as_gpu]
assert not _held, f"modules that escaped the fake: {{_held}}"
assert _nbt.capabilities().name == {g["name"]!r} and _nbt.capabilities().auto_precision == {g["auto"]!r}
assert _hw.default_device() == "cpu" and _precision._emulate_fp16_on_cpu() is not _real_capabilities("cpu").fp16_fast
'''


def run_as_gpu(name: str, gpu: str, cwd) -> None:
    """Execute notebook ``name`` (checks included) under ``gpu``'s capabilities, as run_notebook does: no error
    output, no stderr box; the executed copy goes to test-artifacts/notebooks/<name>.<gpu>.ipynb."""
    path = NOTEBOOKS / f"{name}.ipynb"
    nb = with_checks(nbformat.read(path, as_version=4), path)
    nb.cells.insert(0, nbformat.v4.new_code_cell(as_gpu(gpu)))
    nb.cells.append(nbformat.v4.new_code_cell(still_gpu(gpu)))
    start = time.monotonic()
    try:
        _execute(nb, cwd)
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / f"{name}.{gpu}.ipynb")
    print(f"{name} as {gpu}: {time.monotonic() - start:.0f} s")
    assert not any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    stderr = [(i, o.get("text", "")[:300]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.outputs if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert not stderr, f"{name} as {gpu}: stderr output in cells {stderr}"


@pytest.mark.course
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_as_on_a_gpu(name, gpu, tmp_path):
    run_as_gpu(name, gpu, tmp_path)
