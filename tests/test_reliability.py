"""Issue 8: nan policy, the precision doctor, out of memory, checkpoint/resume, bad input, no state bleed."""

import gc
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nbtrain as nbt
from nbtrain.config import ConfigError

from .helpers import after_build, inject_inf


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- non-finite policy -------------------------------------------------------------------------------------------
def test_nonfinite_skip_policy_marks_and_goes_on(tiny_cfg, monkeypatch):
    inject_inf(monkeypatch, on_forward_calls={2})
    r = nbt.train(tiny_cfg.replace(nonfinite="skip"))
    h = r.history
    assert len(h) == tiny_cfg.max_steps and r.summary["stopped_reason"] == "max_steps"
    assert h.skipped.tolist() == [False, True, False, False]
    assert math.isnan(h.loss[1]) or math.isinf(h.loss[1])   # kept in the history, not averaged away
    assert all(torch.isfinite(p).all() for p in r.model.parameters())


def test_nonfinite_continue_policy_steps_anyway(tiny_cfg, monkeypatch):
    inject_inf(monkeypatch, on_forward_calls={2})
    r = nbt.train(tiny_cfg.replace(nonfinite="continue", max_steps=2, max_grad_norm=None))
    assert not r.history.skipped.any() and r.history.nonfinite.tolist() == [False, True]
    assert not all(torch.isfinite(p).all() for p in r.model.parameters())


# -- doctor ------------------------------------------------------------------------------------------------------
def test_diagnose_fp16_overflow_and_nan(tiny_cfg, monkeypatch):
    inject_inf(monkeypatch, on_forward_calls={2, 3})
    r = nbt.train(tiny_cfg.replace(precision="fp16", subset=40, max_seq_len=24, max_steps=4))
    kinds = {f.kind: f for f in r.diagnose()}
    f = kinds["fp16_overflow"]
    assert f.evidence["skipped_steps"] == [2, 3] and f.evidence["min_scale"] == 65536.0 / 4
    assert f.advice[0].startswith("keep the GradScaler") and any("1e-5" in a for a in f.advice)
    assert "nonfinite" not in kinds   # skipped by the scaler: overflow, not divergence


def test_diagnose_nan_without_scaler_names_step(tiny_cfg, monkeypatch):
    inject_inf(monkeypatch, on_forward_calls={3})
    r = nbt.train(tiny_cfg)
    f = {f.kind: f for f in r.diagnose()}["nonfinite"]
    assert f.step == 3 and "step 3" in f.message
    assert nbt.TrainResult.diagnose(r) == r.diagnose()


def test_healthy_run_has_no_error_findings(tiny_cfg):
    r = nbt.train(tiny_cfg)
    assert not [f for f in r.diagnose() if f.severity == "error"]
    assert 0.0 <= r.summary["grad_fp16_underflow_share"] <= 1.0


def test_fp16_underflow_is_information_and_fits_the_run():
    """Tiny gradients are no fault of an fp32 or bf16 run: an "info" note for fp16, whose scaler (if on) handles them."""
    import pandas as pd

    from nbtrain.engine.doctor import diagnose

    for scale, says in ((float("nan"), "not in fp16"), (65536.0, "keep the GradScaler on (it scales")):
        h = pd.DataFrame({"step": [1, 2], "loss": [2.0, 1.9], "scale": [scale, scale], "skipped": [False, False],
                          "nonfinite": [False, False], "lr": [1e-3, 1e-3], "grad_norm": [1.0, 1.0]})
        f = {f.kind: f for f in diagnose(h, {"grad_fp16_underflow_share": 0.3})}["fp16_underflow"]
        assert f.severity == "info" and says in f.message + f.advice[0], (f.message, f.advice)


def test_scan_fp16_overflow_names_the_module(tiny_cfg):
    from nbtrain.models import build_model, load_tokenizer

    tok = load_tokenizer(tiny_cfg)
    model = build_model(tiny_cfg, tok, None, "fp32", "cpu")
    assert nbt.scan_fp16_overflow(model, torch.tensor([[5, 6, 7, 8]])) == []
    target = next(n for n, m in model.named_modules() if n.endswith("mlp.down_proj"))
    with torch.no_grad():
        model.get_submodule(target).weight.mul_(1e7)
    found = nbt.scan_fp16_overflow(model, torch.tensor([[5, 6, 7, 8]]))
    assert found and any(d["module"] == target for d in found)
    assert all(d["max_abs"] > 65504 for d in found)


# -- out of memory -----------------------------------------------------------------------------------------------
def _oom_when(monkeypatch, predicate):
    calls = {"n": 0}

    def pre(module, args, kwargs):
        calls["n"] += 1
        if predicate(calls["n"], kwargs["input_ids"]):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    after_build(monkeypatch, lambda model: model.register_forward_pre_hook(pre, with_kwargs=True))


def test_out_of_memory_ends_run_with_history_model_and_advice(tiny_cfg, monkeypatch):
    _oom_when(monkeypatch, lambda n, ids: n == 3)
    r = nbt.train(tiny_cfg.replace(max_steps=6))
    assert r.summary["stopped_reason"] == "out_of_memory" and len(r.history) == 2
    assert r.summary["advice"] and all(isinstance(a, str) for a in r.summary["advice"])
    assert all(p.grad is None for p in r.model.parameters())
    r.model(input_ids=torch.tensor([[1, 2, 3]]))   # still usable


def test_auto_batch_size_finds_largest_fitting_micro_batch(tiny_cfg, monkeypatch):
    _oom_when(monkeypatch, lambda n, ids: ids.shape[0] > 4)
    r = nbt.train(tiny_cfg.replace(micro_batch_size=16, grad_accum_steps=1, auto_batch_size=True, max_steps=2))
    assert r.summary["stopped_reason"] == "max_steps"
    assert (r.config.micro_batch_size, r.config.grad_accum_steps) == (4, 4)
    assert list(r.history.micro_steps) == [4, 4]
    assert any("micro_batch_size=4" in n for n in r.summary["notes"])


# -- checkpoint and resume ---------------------------------------------------------------------------------------
def test_resume_is_exact_in_fp32(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(max_steps=6, output_dir=str(tmp_path / "a"), save_every=3)
    full = nbt.train(cfg)
    ck = tmp_path / "a" / "checkpoints" / "step-000003"
    assert ck.is_dir() and (tmp_path / "a" / "checkpoints" / "step-000006").is_dir()
    resumed = nbt.train(cfg.replace(output_dir=str(tmp_path / "b"), resume_from=str(ck)))
    assert resumed.history.loss.tolist() == full.history.loss.tolist()
    assert resumed.summary["data_hash"] == full.summary["data_hash"]
    a, b = _weights(full.model), _weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_interrupt_matches_uninterrupted(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(max_steps=5, output_dir=str(tmp_path / "run"), save_every=2, precision="bf16")

    class Interrupt:
        def on_step_end(self, rec):
            if rec.step == 3:
                raise KeyboardInterrupt

    first = nbt.train(cfg, callbacks=[Interrupt()])
    assert first.summary["stopped_reason"] == "interrupted"
    resumed = nbt.train(cfg.replace(resume_from=str(tmp_path / "run")))   # newest valid: step 2
    straight = nbt.train(cfg.replace(output_dir=str(tmp_path / "straight")))
    assert len(resumed.history) == 5
    for x, y in zip(resumed.history.loss, straight.history.loss):
        assert x == pytest.approx(y, rel=1e-3)


def test_corrupt_checkpoint_fails_clearly_and_previous_loads(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(max_steps=4, output_dir=str(tmp_path / "r"), save_every=2)
    nbt.train(cfg)
    root = tmp_path / "r" / "checkpoints"
    state = root / "step-000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: os.path.getsize(state) // 2])   # truncate the newest
    with pytest.raises(nbt.CheckpointError, match="truncated or corrupt"):
        nbt.train(cfg.replace(resume_from=str(root / "step-000004")))
    r = nbt.train(cfg.replace(resume_from=str(root), output_dir=str(tmp_path / "r2")))
    assert any("step-000002" in n for n in r.summary["notes"]) and len(r.history) == 4


def test_resume_with_a_different_config_is_refused(tiny_cfg, tmp_path):
    cfg = tiny_cfg.replace(max_steps=2, output_dir=str(tmp_path / "r"), save_every=2)
    nbt.train(cfg)
    with pytest.raises(nbt.CheckpointError, match="seed"):
        nbt.train(cfg.replace(seed=1, resume_from=str(tmp_path / "r")))


def test_save_every_needs_output_dir():
    with pytest.raises(ConfigError, match="save_every"):
        nbt.TrainConfig(save_every=5)


# -- bad input: any values give a config or a ConfigError naming the field ----------------------------------------
_values = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.text(max_size=5), max_size=3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(nbt.TrainConfig.model_fields)), _values, max_size=4))
def test_any_values_give_config_or_named_error(kwargs):
    kwargs.pop("resume_from", None)   # a path that is only read when training
    try:
        nbt.TrainConfig(**kwargs)
    except ConfigError as e:
        assert e.field and (e.field in nbt.TrainConfig.model_fields or e.field == "config"), e


# -- no leaks, no state bleed ------------------------------------------------------------------------------------
def test_five_runs_no_leak_no_bleed(tiny_cfg):
    import psutil

    proc = psutil.Process()
    from nbtrain.precision import tf32_state

    flags = lambda: (torch.get_default_dtype(), torch.is_grad_enabled(), tf32_state())  # noqa: E731
    before = flags()
    histories, rss = [], []
    for i in range(5):
        r = nbt.train(tiny_cfg.replace(precision="bf16" if i % 2 else "fp32"))
        if i % 2 == 0:
            histories.append(r.history.loss.tolist())
        del r
        gc.collect()
        rss.append(proc.memory_info().rss)
        assert flags() == before
    assert histories[0] == histories[1] == histories[2]
    # After the first run warms caches, memory stays flat (no per-run growth beyond allocator noise).
    assert rss[-1] - rss[1] < 60 * 2**20, [x / 2**20 for x in rss]
