"""nbtrain.memory around the estimate: its text and HTML report, the out-of-memory advice, and the checks an
estimate makes of a config (a config for another device estimates here; unknown LoRA targets do not)."""

from __future__ import annotations

import html
import subprocess
import sys

import pytest

from nbtrain.config import ConfigError, TrainConfig
from nbtrain.memory import (estimate_html, estimate_memory, estimate_report, estimate_text, fmt_gib, format_estimate,
                            oom_advice)


def _cfg(**kw) -> TrainConfig:
    base = dict(model="tiny", max_seq_len=64, micro_batch_size=4, precision="fp32", max_steps=1)
    return TrainConfig(**{**base, **kw})


def test_text_and_html_read_the_same_rows():
    est = estimate_memory(_cfg(micro_batch_size=64, max_seq_len=512), device="cpu", device_total_gib=0.05)
    report = estimate_report(est)
    assert [name for name, _ in report.parts] == ["weights", "gradients", "optimizer", "activations",
                                                   "logits + loss", "overhead"]
    text, readout, full = estimate_text(est), estimate_html(est, "cpu"), estimate_html(est, details=True)
    assert format_estimate(est) == text == str(est) and full == est._repr_html_()
    for name, gib in report.parts:
        assert f"{gib:>9.2f}" in text and f"{name} {fmt_gib(gib)}" in readout and name in full
    assert "DOES NOT FIT" in text and "✗ does not fit" in readout and "✗ does not fit" in full
    assert html.escape(est.peak_phase) in readout and est.peak_phase in text
    first = est.advice[0]
    assert html.escape(first.description) in readout and first.description in text
    assert all(html.escape(a.description) in full for a in est.advice)
    assert all(html.escape(a.description) not in readout for a in est.advice[1:])   # the readout: the first only


def test_html_readout_of_a_fitting_estimate():
    est = estimate_memory(_cfg(), device="cpu", device_total_gib=64)
    readout = estimate_html(est, "cpu")
    assert "✓ fits" in readout and fmt_gib(est.total_gib) in readout and fmt_gib(64) in readout
    assert "(cpu)" in readout and "try" not in readout


def test_fmt_gib():
    assert [fmt_gib(x) for x in (None, float("inf"), 2048, 1.5, 0.5, 1e-6)] == \
        ["?", "?", "2.00 TiB", "1.50 GiB", "512.0 MiB", "1 KiB"]


def test_a_precision_this_device_cannot_run_is_estimated():
    """A tf32 config (a GPU's) estimates on any machine, with fp32-sized tensors."""
    tf32 = estimate_memory(_cfg(precision="tf32"), device="cpu", device_total_gib=64)
    fp32 = estimate_memory(_cfg(precision="fp32"), device="cpu", device_total_gib=64)
    assert tf32.precision == "tf32"
    assert (tf32.total_gib, tf32.activations_gib, tf32.peak_phase) == (fp32.total_gib, fp32.activations_gib,
                                                                       fp32.peak_phase)
    assert estimate_memory(_cfg(precision="tf32"), device="cuda", device_total_gib=80).fits


def test_unknown_lora_targets_are_an_error():
    with pytest.raises(ConfigError, match="lora_targets"):
        estimate_memory(_cfg(method="lora", lora_targets=["no_such_proj"]), device="cpu", device_total_gib=64)


def test_estimate_takes_a_train_config():
    with pytest.raises(TypeError, match="TrainConfig"):
        estimate_memory({"model": "tiny"}, device="cpu", device_total_gib=64)


def test_oom_advice_asks_for_a_quarter_less():
    cfg = _cfg(micro_batch_size=16, max_seq_len=256)
    advice = oom_advice(cfg)
    assert advice and all(isinstance(a, str) for a in advice)
    est = estimate_memory(cfg)
    want = estimate_memory(cfg, device_total_gib=min(est.total_gib, est.device_total_gib) * 0.75).advice
    assert advice == [a.description for a in want]


def test_oom_advice_never_raises():
    advice = oom_advice(_cfg(method="lora", lora_targets=["no_such_proj"]))
    assert len(advice) == 1 and advice[0].startswith("(no estimate available: ConfigError")
    assert "gradient_checkpointing" in advice[0]


def test_memory_imports_no_heavy_optional_package():
    code = ("import sys, nbtrain.memory; bad = [m for m in ('bitsandbytes', 'peft', 'ipywidgets', 'plotly') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
