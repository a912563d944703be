#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine (about 5-9 minutes on an H200):
#   1. the `gpu`-marked tests: each precision on CUDA, a REAL fp16 overflow (skipped and diagnosed, bf16 holds),
#      a REAL out-of-memory (history kept, memory released, auto_batch_size finds a fit), QLoRA on CUDA with a
#      merged save, chunked loss cutting peak memory, the HF Trainer callback under fp16;
#   2. benchmarks/gpu_suite.py (bare loop vs nbtrain vs transformers.Trainer, optimisations) -- --quick by default;
#   3. benchmarks/memory_check.py (estimate vs measured peak), a reduced grid by default;
#   4. benchmarks/chunked_loss.py: the output layer + loss alone at Qwen2.5-0.5B's head, plain vs chunked
#      (recompute) vs chunked (fused): time and peak memory (~15 s).
# Results go to benchmarks/results/ and, when $OUT is set, there too. FULL=1 runs the full suite and grid.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name(0))" \
    || exit 1
status=0
python3 benchmarks/chunked_loss.py --out "$OUT" 2>&1 | tail -12 || status=1
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_hf_callback.py tests/test_viz.py \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -25 || status=1
if [ "${FULL:-0}" = 1 ]; then
    python3 benchmarks/gpu_suite.py 2>&1 | tail -60 || status=1
    python3 benchmarks/memory_check.py 2>&1 | tail -40 || status=1
else
    python3 benchmarks/gpu_suite.py --quick 2>&1 | tail -40 || status=1
    python3 benchmarks/memory_check.py --methods full,lora,qlora --precisions bf16 --seqs 1024 2>&1 | tail -20 \
        || status=1
fi
exit $status
