"""estimate_memory for the preference objectives (issue 38): the doubled forward (chosen + rejected rows), DPO's
frozen reference copy as its own part, and the reference forward's no_grad transient against a traced forward.

No estimate-vs-run comparison for a preference run here: the engine's preference loop is being written (issue 38);
the measured check of a whole step belongs with it."""

from __future__ import annotations

import contextlib
import copy
import html

import pytest
import torch

from nbtrain.config import TrainConfig
from nbtrain.engine.telemetry import LiveTensorBytes
from nbtrain.memory import estimate_html, estimate_memory, estimate_target_fraction, estimate_text
from nbtrain.memory.facts import architecture
from nbtrain.memory.timeline import step_peak
from nbtrain.models import build_model, load_tokenizer
from nbtrain.models.tensors import apply_tensor_precision
from nbtrain.precision import PRECISION_TABLE

from .helpers import storage_bytes

GIB = 2**30


def _cfg(**kw) -> TrainConfig:
    base = dict(model="tiny", max_seq_len=64, micro_batch_size=4, precision="fp32", max_steps=1)
    return TrainConfig(**{**base, **kw})


def _est(**kw):
    return estimate_memory(_cfg(**kw), device="cpu", device_total_gib=64)


def _model(cfg: TrainConfig, precision: str):
    """The model as prepare() builds it: its precision's tensor dtypes applied (bf16-pure: bf16 weights)."""
    torch.manual_seed(0)
    model = build_model(cfg, load_tokenizer(cfg), None, precision, "cpu")
    apply_tensor_precision(model, PRECISION_TABLE[precision], fp8_native=False)
    return model


# -- the reference copy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision,dtype", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16-pure", "bf16")])
def test_reference_copy_is_the_models_parameters_in_the_weights_dtype(precision, dtype):
    cfg = _cfg(objective="dpo", precision=precision)
    est = estimate_memory(cfg, device="cpu", device_total_gib=64)
    # what a frozen copy of the trained model holds: its parameters, as stored (bf16-pure: bf16; else fp32 masters)
    reference = copy.deepcopy(_model(cfg, precision)).requires_grad_(False)
    assert est.reference_weights_bytes == storage_bytes(reference.parameters()) > 0
    assert est.reference_weights_bytes == est.weights_bytes
    assert est.reference_weights_gib == pytest.approx(est.reference_weights_bytes / GIB)
    assert est.dtypes["reference weights"].startswith(dtype)
    # held all run: in every phase, so the peak and what a CPU run's tracer sees both carry it
    pre = estimate_memory(cfg.replace(precompute_ref=True), device="cpu", device_total_gib=64)
    assert est.run_tensors_gib - pre.run_tensors_gib == pytest.approx(est.reference_weights_gib)
    assert est.tensors_peak_gib - pre.tensors_peak_gib >= est.reference_weights_gib
    # no gradients or optimizer state for it
    assert (est.gradients_bytes, est.optimizer_bytes) == (pre.gradients_bytes, pre.optimizer_bytes)


def test_reference_weights_is_its_own_row_in_the_table_text_and_html():
    est = _est(objective="dpo")
    table = est.table().set_index("part")["GiB"]
    assert table["reference weights"] == est.reference_weights_gib
    assert list(table.index[:4]) == ["weights", "gradients", "optimizer", "reference weights"]
    text = estimate_text(est)
    assert "reference weights" in text and "frozen copy" in text
    assert "reference weights" in estimate_html(est, "cpu")
    assert "reference weights" in estimate_html(est, details=True)
    assert "dpo: 8 rows per forward (chosen + rejected)" in text


@pytest.mark.parametrize("kw,note", [
    (dict(objective="dpo", method="lora"), "adapters off: no copy"),
    (dict(objective="dpo", method="qlora"), "adapters off: no copy"),
    (dict(objective="dpo", precompute_ref=True), "no reference copy"),
    (dict(objective="orpo"), "no reference model"),
    (dict(objective="simpo"), "no reference model"),
    (dict(), None),
])
def test_no_reference_copy_without_a_full_dpo_reference(kw, note):
    est = _est(**kw)
    assert est.reference_weights_bytes == 0 and est.reference_weights_gib == 0
    assert "reference weights" not in set(est.table()["part"]) and "reference weights" not in estimate_text(est)
    if note is None:
        assert not any("reference" in n for n in est.notes)
    else:
        assert any(note in n for n in est.notes), est.notes


def test_lora_dpo_holds_the_same_weights_as_lora_lm():
    dpo, lm = _est(objective="dpo", method="lora"), _est(method="lora", micro_batch_size=8)
    assert (dpo.weights_bytes, dpo.gradients_bytes, dpo.optimizer_bytes) == \
        (lm.weights_bytes, lm.gradients_bytes, lm.optimizer_bytes)


# -- the doubled forward --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["dpo", "orpo", "simpo"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_preference_micro_batch_is_twice_the_rows(objective, precision):
    pref = step_peak(_cfg(objective=objective, precompute_ref=False), precision, "cpu")
    lm_same = step_peak(_cfg(), precision, "cpu")
    lm_double = step_peak(_cfg(micro_batch_size=8), precision, "cpu")
    # exactly the activations and logits of objective="lm" at twice the micro batch...
    assert (pref.activations, pref.logits) == (lm_double.activations, lm_double.logits)
    # ...which is twice those at the same micro batch but for what does not grow with the batch: RoPE's cos/sin
    # tables (2 x head_dim x T in the residual's dtype) and, under autocast, the weights' 16-bit copies
    assert pref.logits == 2 * lm_same.logits
    head_dim = architecture("tiny", "causal-lm", 2).head_dim
    fixed = 2 * lm_same.activations - pref.activations
    if precision == "fp32":
        assert fixed == 2 * head_dim * 4 * 64
    else:
        assert 0 < fixed < 0.25 * lm_same.activations


def test_orpo_and_simpo_peak_is_lm_at_twice_the_micro_batch():
    lm = _est(micro_batch_size=8)
    for objective in ("orpo", "simpo"):
        est = _est(objective=objective)
        assert est.tensors_peak_gib == lm.tensors_peak_gib and est.peak_phase == lm.peak_phase


# -- the reference forward (no_grad) -------------------------------------------------------------------------------
@pytest.mark.parametrize("method,precision", [("full", "fp32"), ("lora", "fp32"), ("full", "bf16"),
                                              ("lora", "bf16")])
def test_reference_forward_transient_covers_a_traced_no_grad_forward(method, precision):
    """The estimate's reference forward against the live storages of a real one: the 2B rows through the frozen
    copy (full) or the model with its adapters off (LoRA) under no_grad, to the answer tokens' summed log-probs."""
    cfg = _cfg(objective="dpo", method=method, precision=precision)
    model = _model(cfg, precision)
    if method == "full":
        model = copy.deepcopy(model).requires_grad_(False)
    V = model.config.vocab_size
    ids = torch.randint(4, V, (2 * cfg.micro_batch_size, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ignore = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), ids, mask)}
    adapters_off = model.disable_adapter() if method != "full" else contextlib.nullcontext()
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())
    with torch.no_grad(), adapters_off, autocast, LiveTensorBytes(ignore) as traced:
        logits = model(input_ids=ids, attention_mask=mask).logits
        logps = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)
        del logits
    assert logps.shape == (2 * cfg.micro_batch_size,)
    estimated = step_peak(cfg, precision, "cpu").reference_forward
    assert traced.peak <= estimated <= 1.1 * traced.peak, (estimated, traced.peak)


@pytest.mark.parametrize("kw", [dict(objective="orpo"), dict(objective="simpo"),
                                dict(objective="dpo", precompute_ref=True), dict()])
def test_no_reference_forward_without_a_reference_in_the_step(kw):
    assert step_peak(_cfg(**kw), "fp32", "cpu").reference_forward == 0


def test_reference_forward_is_a_phase_on_top_of_the_policys_activations():
    est = _est(objective="dpo", method="lora")
    p = step_peak(est.config, "fp32", "cpu")
    assert p.reference_forward > 0
    # the phase sits on the held weights, state and saved activations, so the peak is at least their sum
    assert p.peak >= p.weights + p.optimizer + p.activations + p.reference_forward
    assert "reference forward" in est.peak_phase


def test_the_logprob_mismatch_forward_lifts_bf16_weights_to_fp32():
    """summary["logprob_mismatch"] re-runs the policy in fp32 on sampled steps with bf16-pure's weights lifted to
    fp32 in place (engine.preference): 2 more bytes per parameter, before the step's gradients exist. With a small
    batch and little optimizer state, that is the step's peak."""
    kw = dict(max_seq_len=8, micro_batch_size=1, precision="bf16-pure", optimizer="sgd")
    pref, lm = step_peak(_cfg(objective="orpo", **kw), "bf16-pure", "cpu"), step_peak(_cfg(**kw), "bf16-pure", "cpu")
    assert "mismatch" in pref.phase and "mismatch" not in lm.phase
    assert pref.peak >= pref.weights + pref.optimizer + 2 * pref.total > lm.peak - lm.gradients
    # under fp32 nothing is lifted: the fp32 forward is a no_grad forward like the reference's
    fp32 = step_peak(_cfg(objective="dpo", method="lora"), "fp32", "cpu")
    assert "mismatch" not in fp32.phase


# -- advice and data ------------------------------------------------------------------------------------------------
def test_advice_for_full_dpo_first_drops_the_reference_copy():
    cfg = _cfg(objective="dpo", micro_batch_size=16, max_seq_len=128)
    full = estimate_memory(cfg, device="cpu", device_total_gib=64)
    est = estimate_memory(cfg, device="cpu", device_total_gib=full.total_gib * 0.9)
    first = est.advice[0]
    assert first.change == {"precompute_ref": True}
    assert first.total_gib <= est.total_gib - est.reference_weights_gib
    assert html.escape(first.description) in estimate_html(est, "cpu")
    # advice never offers what a preference objective refuses (the chunked loss, packing)
    assert all("chunked_loss" not in a.change for a in est.advice)
    for a in est.advice:
        cfg.replace(**a.change)   # each is a valid config


def test_target_fraction_counts_the_chosen_and_the_rejected_rows():
    T = 9
    rows = [{"input_ids": [1] * T, "labels": [-100] * 5 + [1] * 4,
             "rejected_input_ids": [1] * T, "rejected_labels": [-100] * 7 + [1] * 2}]
    # the shifted targets: 4 of the chosen row's 8 positions, 2 of the rejected's
    assert estimate_target_fraction(rows, T) == pytest.approx((4 + 2) / (2 * (T - 1)))
    assert estimate_target_fraction([{k: v for k, v in rows[0].items() if "rejected" not in k}], T) == \
        pytest.approx(4 / (T - 1))
