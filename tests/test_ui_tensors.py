"""Issue 27 item 4, the Panel: bf16-pure and fp8 precision rows, the Optimizer control, the stochastic-rounding box,
and the memory readout naming the optimizer and the weights' dtype. Widget tests without a browser: set
``.value``, call ``.click()``, assert on the config and the run."""

import dataclasses
import html
import re

import pytest

import nbtrain as nbt
from nbtrain.config import OPTIMIZERS, ConfigError, TrainConfig
from nbtrain.hardware import PRECISIONS

ipywidgets = pytest.importorskip("ipywidgets")

from nbtrain.ui.form import SECTIONS, rounding_unavailable  # noqa: E402 (after the importorskip)
from nbtrain.ui.panel import Panel  # noqa: E402

SMALL = {"model": "tiny", "data": "builtin:python-docs", "subset": 24, "max_seq_len": 32, "micro_batch_size": 4,
         "eval_fraction": 0.0, "precision": "bf16", "lr": 1e-3, "max_steps": 2}
TIMEOUT = 240


def small(**kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, **kw})


def text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", value))


@pytest.fixture
def fake_caps(monkeypatch):
    """This device, except that bf16-pure and sgd are impossible here and paged AdamW too (whatever the
    hardware), and fp8 carries a note: the test does not depend on the machine."""
    import nbtrain.hardware
    import nbtrain.ui.panel

    real = nbt.capabilities()
    reasons = {**real.reasons, "bf16-pure": "pretend: no bf16 storage here",
               "paged_adamw_8bit": "pretend: paged needs CUDA", "sgd": "pretend: no sgd today"}
    notes = {**real.notes, "fp8": "pretend: fp8 is emulated here"}
    caps = dataclasses.replace(
        real, reasons=reasons, notes=notes,
        allowed_precisions=tuple(p for p in real.allowed_precisions if p != "bf16-pure"),
        allowed_optimizers=tuple(o for o in real.allowed_optimizers if o not in ("paged_adamw_8bit", "sgd")))
    monkeypatch.setattr(nbtrain.hardware, "capabilities", lambda *a, **k: caps)
    monkeypatch.setattr(nbtrain.ui.panel, "capabilities", lambda *a, **k: caps)
    return caps


def test_precision_and_optimizer_controls_list_every_name():
    panel = Panel(small(), debounce_s=0)
    assert panel.controls["precision"].options == ("auto", *PRECISIONS)
    assert {"bf16-pure", "fp8"} <= set(panel.controls["precision"].options)
    assert panel.controls["optimizer"].options == OPTIMIZERS
    assert set(panel.compare_choices) == set(PRECISIONS)
    for field in ("precision", "optimizer", "stochastic_rounding"):
        assert field in SECTIONS["Precision"]
    # the real device: whatever it cannot run is greyed with its reason, the rest is clickable
    caps = panel.caps
    for name, button in {**panel.controls["precision"].buttons, **panel.controls["optimizer"].buttons}.items():
        assert button.disabled == (name in caps.reasons), name
        if name in caps.reasons:
            assert caps.reasons[name] in button.tooltip
    for p in ("bf16-pure", "fp8"):   # there to tick, not ticked by default (fp8 off a GPU is emulated, slow)
        assert not panel.compare_choices[p].value


def test_new_precisions_are_greyed_with_their_reason_and_notes_shown(fake_caps):
    panel = Panel(small(), debounce_s=0)
    picker = panel.controls["precision"]
    assert picker.buttons["bf16-pure"].disabled and "no bf16 storage here" in picker.buttons["bf16-pure"].tooltip
    assert html.escape("pretend: no bf16 storage here") in panel.precision_info.value
    assert panel.compare_choices["bf16-pure"].disabled and "bf16-pure" not in panel.compare_precisions()
    # fp8 runs, with its note beside it, as fp16's note on a CPU
    assert not picker.buttons["fp8"].disabled and "pretend: fp8 is emulated here" in picker.buttons["fp8"].tooltip
    assert html.escape("pretend: fp8 is emulated here") in panel.precision_info.value
    picker.value = "fp8"
    assert panel.config.precision == "fp8" and panel.errors == []
    picker.value = "bf16-pure"
    with pytest.raises(ConfigError) as e:
        _ = panel.config
    assert e.value.field == "precision" and "no bf16 storage here" in panel.form.field_errors["precision"].value
    panel.train_button.click()
    assert panel.run is None and "not started" in panel.status.value


def test_an_optimizer_this_device_cannot_run_is_greyed_and_yields_no_config(fake_caps):
    panel = Panel(small(), debounce_s=0)
    opt = panel.controls["optimizer"]
    for name in OPTIMIZERS:
        assert opt.buttons[name].disabled == (name in fake_caps.reasons), name
    assert "paged needs CUDA" in opt.buttons["paged_adamw_8bit"].tooltip
    info = panel.form.optimizer_info.value
    assert html.escape("pretend: paged needs CUDA") in info and "unavailable" in info
    opt.value = "adamw_8bit"
    assert panel.config.optimizer == "adamw_8bit" and panel.errors == []
    assert "▶" in panel.form.optimizer_info.value and "adamw_8bit" in text(panel.form.optimizer_info.value)
    opt.value = "paged_adamw_8bit"
    with pytest.raises(ConfigError) as e:
        _ = panel.config
    assert e.value.field == "optimizer" and "paged needs CUDA" in panel.form.field_errors["optimizer"].value
    assert panel.controls["optimizer"].layout.border
    panel.train_button.click()
    panel.compare_button.click()
    assert panel.run is None and panel.runner.job is None
    assert panel.tabs.selected_index == list(SECTIONS).index("Precision")
    opt.value = "adafactor"
    assert panel.errors == [] and panel.config.optimizer == "adafactor"


def test_stochastic_rounding_is_enabled_only_for_bf16_pure_with_adamw():
    panel = Panel(small(), debounce_s=0)
    if "bf16-pure" in panel.caps.reasons:
        pytest.skip(f"bf16-pure cannot run here: {panel.caps.reasons['bf16-pure']}")
    c = panel.controls
    box, help_line = c["stochastic_rounding"], panel.form.help["stochastic_rounding"]
    assert box.disabled and not box.value
    assert "needs precision bf16-pure (now bf16" in text(help_line.value) and "unavailable" in box.tooltip
    c["precision"].value = "bf16-pure"
    assert not box.disabled and "unavailable" not in text(help_line.value)
    box.value = True
    cfg = panel.config
    assert (cfg.precision, cfg.optimizer, cfg.stochastic_rounding) == ("bf16-pure", "adamw", True)
    # another optimizer: the ticked box is an error on its field, and stays clickable so it can be unticked
    c["optimizer"].value = "sgd" if "sgd" not in panel.caps.reasons else "adafactor"
    assert [e["field"] for e in panel.errors] == ["stochastic_rounding"] and not box.disabled
    assert "needs optimizer adamw" in text(help_line.value)
    box.value = False
    assert panel.errors == [] and box.disabled
    c["optimizer"].value = "adamw"
    assert not box.disabled
    c["precision"].value = "fp8"
    assert box.disabled and "needs precision bf16-pure (now fp8" in text(help_line.value)
    # the rule is TrainConfig's own
    for p in ("bf16", "bf16-pure", "fp8"):
        for o in OPTIMIZERS:
            try:
                TrainConfig(precision=p, optimizer=o, stochastic_rounding=True)
                allowed = True
            except ConfigError:
                allowed = False
            assert allowed == (rounding_unavailable(p, o) == ""), (p, o)


@pytest.mark.parametrize("cfg", [small(precision="bf16-pure", stochastic_rounding=True), small(precision="fp8"),
                                 small(optimizer="adamw_8bit"), small(optimizer="adafactor"),
                                 small(optimizer="paged_adamw_8bit"), small(precision="bf16-pure", optimizer="sgd")],
                         ids=lambda c: f"{c.precision}-{c.optimizer}-{c.stochastic_rounding}")
def test_config_round_trip_with_the_new_fields(cfg):
    panel = Panel(cfg, debounce_s=0)
    if any(v in panel.caps.reasons for v in (cfg.precision, cfg.optimizer)):
        assert panel.form.validate()[0] is None   # shown, but reported as not runnable here
        values, _ = panel.form._values()
        assert TrainConfig(**values) == cfg
    else:
        assert panel.config == cfg


def test_the_memory_line_names_the_optimizer_and_the_weights_dtype():
    panel = Panel(small(), debounce_s=0)
    c = panel.controls
    line = text(panel.memory.value)
    est = panel.memory_estimate
    assert est is not None and "adamw" in line and "(fp32)" in line
    assert getattr(est, "weights_dtype", "fp32") == "fp32"
    c["optimizer"].value = "adamw_8bit"
    assert "adamw_8bit" in text(panel.memory.value)
    assert panel.memory_estimate.optimizer_gib < est.optimizer_gib
    c["optimizer"].value = "adamw"
    c["precision"].value = "bf16-pure"
    line = text(panel.memory.value)
    assert "(bf16)" in line and "adamw" in line
    assert panel.memory_estimate.weights_gib == pytest.approx(est.weights_gib / 2, rel=1e-6)


def test_train_runs_the_tensors_the_panel_shows():
    panel = Panel(small(), debounce_s=0)
    if "bf16-pure" in panel.caps.reasons:
        pytest.skip(f"bf16-pure cannot run here: {panel.caps.reasons['bf16-pure']}")
    c = panel.controls
    c["precision"].buttons["bf16-pure"].value = True   # what a click in the browser does
    c["stochastic_rounding"].value = True
    panel.train_button.click()
    res = panel.wait(TIMEOUT)
    assert res is not None and res is panel.result and res.summary["steps"] == 2
    assert res.config.precision == "bf16-pure" and res.config.stochastic_rounding
    assert res.summary["weights_dtype"] == "bf16" and res.summary["optimizer"] == "adamw"
    assert res.summary["precision_used"] == "bf16-pure"
    c["stochastic_rounding"].value = False
    c["precision"].value = "bf16"
    c["optimizer"].buttons["adafactor"].value = True
    panel.train_button.click()
    res = panel.wait(TIMEOUT)
    assert res.summary["optimizer"] == "adafactor" and res.summary["weights_dtype"] == "fp32"


def test_compare_with_stochastic_rounding_keeps_it_on_bf16_pure_only():
    panel = Panel(small(), debounce_s=0)
    if any(p in panel.caps.reasons for p in ("bf16", "bf16-pure")):
        pytest.skip("bf16 or bf16-pure cannot run here")
    panel.controls["precision"].value = "bf16-pure"
    panel.controls["stochastic_rounding"].value = True
    for p, box in panel.compare_choices.items():
        box.value = p in ("bf16", "bf16-pure")
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp is panel.comparison and cmp.finished == ["bf16", "bf16-pure"]
    assert cmp.configs["bf16-pure"].stochastic_rounding and not cmp.configs["bf16"].stochastic_rounding
    assert cmp.fair
    t = cmp.table.set_index("variant")
    assert t.loc["bf16-pure", "weights_dtype"] == "bf16" and t.loc["bf16", "weights_dtype"] == "fp32"
    assert "Weights" in panel.comparison_table.value   # the compact table shows what differs
