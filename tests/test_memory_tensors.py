"""Issue 27.4, memory by tensor class: the estimate's weights, gradients and optimizer state by precision and
optimizer against the real tensors, and its peak against traced training steps (a live-storage trace of every
tensor, and the run's own tracer, StepRecord.host_tensors_gib) for bf16-pure, fp8 and each optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from .helpers import storage_bytes as _storage_bytes
import nbtrain as nbt
from nbtrain.config import TrainConfig
from nbtrain.data.batching import MicroBatch
from nbtrain.engine.losses import micro_loss_sum
from nbtrain.engine.optimizers import build_optimizer, optimizer_state_bytes
from nbtrain.engine.telemetry import LiveTensorBytes, RunTensorBytes
from nbtrain.memory import estimate_memory, estimate_text
from nbtrain.memory.facts import optimizer_state_bytes as estimated_state_bytes
from nbtrain.models import build_model, count_params, load_tokenizer
from nbtrain.models.tensors import apply_tensor_precision
from nbtrain.precision import PRECISION_TABLE

GIB = 2**30
try:
    import bitsandbytes  # noqa: F401
    HAVE_BNB = True
except Exception:   # not installed, or its native library does not load
    HAVE_BNB = False
try:
    import torchao.float8  # noqa: F401
    HAVE_TORCHAO = True
except Exception:
    HAVE_TORCHAO = False

needs_bnb = pytest.mark.skipif(not HAVE_BNB, reason="needs bitsandbytes")


@pytest.fixture(scope="module")
def boundary_model(tmp_path_factory):
    """A small Llama whose tensors straddle bitsandbytes' 8-bit threshold (4096 elements): q/o projections have
    exactly 4096 (8-bit state), k/v 2048 and the norms 64 (fp32 state), the MLP and embeddings more."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from nbtrain.models.presets import preset_tokenizer

    tok = preset_tokenizer("tiny")
    path = tmp_path_factory.mktemp("boundary")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _cfg(**kw) -> TrainConfig:
    base = dict(model="tiny", max_seq_len=64, micro_batch_size=4, precision="fp32", max_steps=1)
    return TrainConfig(**{**base, **kw})


def _step(model, cfg: TrainConfig, opt, tracker: RunTensorBytes) -> tuple[int, float]:
    """One optimizer step the way nbtrain's loop takes it; (gradient bytes before the update, the run tracer's
    value for the step in bytes)."""
    spec = PRECISION_TABLE[cfg.precision]
    V = model.config.vocab_size
    for _ in range(cfg.grad_accum_steps):
        ids = torch.randint(4, V, (cfg.micro_batch_size, cfg.max_seq_len))
        mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                        n_targets=ids.shape[0] * (ids.shape[1] - 1), n_tokens=ids.numel())
        with tracker.micro():
            loss = micro_loss_sum(model, mb, "causal-lm", spec, "cpu",
                                  cfg.loss_chunk_tokens if cfg.chunked_loss else None) / ids.numel()
            loss.backward()
            del loss
    grads = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
    opt.step()
    run = tracker.step_peak() * GIB
    opt.zero_grad(set_to_none=True)
    return grads, run


def _measure(cfg: TrainConfig) -> dict:
    """The model built as prepare() builds it (its precision applied, the config's optimizer), two steps: the
    exact parts after the first, the second traced by LiveTensorBytes (every storage, short-lived ones too) and by
    the run's tracer."""
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, cfg.precision, "cpu")
    apply_tensor_precision(model, PRECISION_TABLE[cfg.precision], fp8_native=False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(cfg, params, "cpu")
    tracker = RunTensorBytes("cpu", model, opt)
    grads, _ = _step(model, cfg, opt, tracker)
    before = list(model.parameters()) + list(model.buffers())
    before += [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    with LiveTensorBytes({t.untyped_storage()._cdata for t in before}) as live:
        _, run = _step(model, cfg, opt, tracker)
    return dict(weights=_storage_bytes(model.parameters()), gradients=grads, optimizer=optimizer_state_bytes(opt),
                params=count_params(model), live=_storage_bytes(before) + live.peak, run=run,
                dtypes={p.dtype for p in params}, state=opt.state)


CASES = {
    "bf16-pure": dict(precision="bf16-pure"),
    "bf16-pure sgd": dict(precision="bf16-pure", optimizer="sgd"),
    "bf16-pure checkpointing": dict(precision="bf16-pure", gradient_checkpointing=True, grad_accum_steps=2),
    "adafactor": dict(optimizer="adafactor"),
    "sgd": dict(optimizer="sgd"),
    "adamw_8bit": dict(optimizer="adamw_8bit", model="boundary"),
    "adamw_8bit lora": dict(optimizer="adamw_8bit", method="lora"),
    "paged_adamw_8bit bf16-pure": dict(optimizer="paged_adamw_8bit", precision="bf16-pure", model="boundary"),
    "fp8": dict(precision="fp8"),
}


@pytest.fixture(scope="module")
def measured(boundary_model):
    """Each case estimated and measured once, shared by the tests below."""
    out = {}
    for name, kw in CASES.items():
        if "8bit" in kw.get("optimizer", "") and not HAVE_BNB or kw.get("precision") == "fp8" and not HAVE_TORCHAO:
            continue
        kw = dict(kw)
        if kw.get("model") == "boundary":
            kw["model"] = boundary_model
        cfg = _cfg(**kw)
        out[name] = (cfg, estimate_memory(cfg, device="cpu", device_total_gib=64), _measure(cfg))
    return out


def _case(measured, name):
    if name not in measured:
        pytest.skip("needs bitsandbytes" if "8bit" in name else "needs torchao")
    return measured[name]


@pytest.mark.parametrize("name", list(CASES))
def test_each_tensor_class_matches_the_real_tensors(measured, name):
    cfg, est, m = _case(measured, name)
    assert (est.trainable_params, est.total_params) == m["params"]
    assert est.weights_bytes == m["weights"]
    assert est.gradients_bytes == m["gradients"]
    assert est.optimizer_bytes == m["optimizer"], (est.optimizer, m["optimizer"])
    assert est.optimizer == cfg.optimizer
    # the trainable weights' dtype, as the run's summary names it
    assert {"fp32": torch.float32, "bf16": torch.bfloat16}[est.weights_dtype] == m["dtypes"].pop()


@pytest.mark.parametrize("name", list(CASES))
def test_peak_matches_a_traced_step(measured, name):
    """The tensor peak against every storage alive at each op of a real step (short-lived ones too)."""
    _, est, m = _case(measured, name)
    assert est.tensors_peak_gib * GIB == pytest.approx(m["live"], rel=0.03), (est.peak_phase, m["live"])


@pytest.mark.parametrize("name", list(CASES))
def test_run_tensors_match_the_run_tracer(measured, name):
    """What StepRecord.host_tensors_gib counts (weights, optimizer state, saved tensors) against the estimate's
    figure for it."""
    _, est, m = _case(measured, name)
    assert est.run_tensors_gib * GIB == pytest.approx(m["run"], rel=0.03), m["run"]


@pytest.mark.parametrize("kw", [dict(precision="bf16-pure"), dict(optimizer="adafactor"), dict(optimizer="sgd"),
                                pytest.param(dict(optimizer="adamw_8bit"), marks=needs_bnb)],
                         ids=["bf16-pure", "adafactor", "sgd", "adamw_8bit"])
def test_a_run_records_what_the_estimate_says(kw):
    """Through nbt.train itself: the run's host_tensors_gib (its peak over the measured steps) within 3% of the
    estimate's run_tensors_gib, and the summary's weights dtype and optimizer are the estimate's."""
    cfg = nbt.TrainConfig(**{**dict(model="tiny", subset=32, eval_fraction=0.0, max_seq_len=64, micro_batch_size=4,
                                    packing=True, precision="fp32", max_steps=2), **kw})
    r = nbt.train(cfg)
    est = nbt.estimate_memory(cfg, device="cpu", device_total_gib=64)
    assert r.summary["peak_host_tensors_gib"] == pytest.approx(est.run_tensors_gib, rel=0.03)
    assert (r.summary["weights_dtype"], r.summary["optimizer"]) == (est.weights_dtype, est.optimizer)


@needs_bnb
def test_the_8bit_threshold_is_bitsandbytes_own(measured):
    """The boundary model's q/o projections (4096 elements) get uint8 states, k/v (2048) and the norms fp32."""
    cfg, est, m = _case(measured, "adamw_8bit")
    kinds = {tuple(p.shape): s["state1"].dtype for p, s in m["state"].items()}
    assert kinds[(64, 64)] == torch.uint8 and kinds[(32, 64)] == torch.float32 and kinds[(64,)] == torch.float32
    shapes = [tuple(p.shape) for p in m["state"]]
    # all in fp32 (what a model whose tensors were all small would keep) would be far more
    assert estimated_state_bytes("adamw", shapes) > 3 * est.optimizer_bytes


def test_state_per_parameter_by_optimizer_and_precision():
    """The rules of thumb: AdamW 8 B/param (4 under bf16-pure), 8-bit ~2 B, SGD 4 (2), Adafactor factored."""
    big = [(4096, 4096)]
    n = 4096 * 4096
    assert estimated_state_bytes("adamw", big) == 8 * n + 4
    assert estimated_state_bytes("adamw", big, 2) == 4 * n + 4
    assert estimated_state_bytes("sgd", big) == 4 * n and estimated_state_bytes("sgd", big, 2) == 2 * n
    assert estimated_state_bytes("adamw_8bit", big) == 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4
    assert estimated_state_bytes("adamw_8bit", [(4095,)]) == 8 * 4095          # below the threshold: fp32
    assert estimated_state_bytes("adafactor", big) == 4 * (4096 + 4096) + 4    # a row and a column, and its RMS
    assert estimated_state_bytes("adafactor", [(4096,)]) == 4 * 4096 + 4


def test_master_weights_and_the_report():
    fp32, bf16, pure = (estimate_memory(_cfg(precision=p), device="cpu", device_total_gib=64)
                        for p in ("fp32", "bf16", "bf16-pure"))
    # the fp32 master copy is a share of the weights under autocast, none under fp32 and bf16-pure
    assert bf16.master_weights_bytes == 4 * bf16.trainable_params == bf16.weights_bytes
    assert bf16.master_weights_gib == pytest.approx(bf16.master_weights_bytes / GIB)
    assert fp32.master_weights_bytes == pure.master_weights_bytes == 0
    assert pure.weights_bytes == fp32.weights_bytes // 2 and pure.gradients_bytes == fp32.gradients_bytes // 2
    assert (fp32.weights_dtype, bf16.weights_dtype, pure.weights_dtype) == ("fp32", "fp32", "bf16")
    # no autocast weight copies under bf16-pure: its activations are below bf16's
    assert pure.activations_gib < bf16.activations_gib
    sgd = estimate_memory(_cfg(precision="bf16-pure", optimizer="sgd"), device="cpu", device_total_gib=64)
    text, html = estimate_text(sgd), sgd._repr_html_()
    assert "bf16-pure (bf16 weights), sgd" in text and "bf16 momentum" in text
    assert "master copy" in estimate_text(bf16) and "master copy" not in text
    assert "<th>dtype</th>" in html and "sgd: bf16 momentum" in html
    assert "weights 3.0 MiB (bf16)" in nbt.memory.estimate_html(pure, "cpu")


@pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao")
def test_fp8_is_noted_as_approximate_and_keeps_fp32_master_weights():
    est = estimate_memory(_cfg(precision="fp8"), device="cpu", device_total_gib=64)
    assert est.weights_dtype == "fp32" and est.master_weights_bytes == 4 * est.trainable_params
    assert any(n.startswith("fp8: approximate") for n in est.notes)
    # no bf16 weight copies for the float8 layers: below bf16's activations on the CPU, where they keep the fp32
    # input the norm keeps anyway; on CUDA torchao casts that input to bf16 first and keeps the copy too
    assert est.activations_gib < estimate_memory(_cfg(precision="bf16"), device="cpu",
                                                 device_total_gib=64).activations_gib
    cuda = estimate_memory(_cfg(precision="fp8"), device="cuda", device_total_gib=80)
    assert cuda.activations_gib != est.activations_gib and "fp32 inputs" not in cuda.dtypes["activations"]
