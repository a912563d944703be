"""Widget tests without a browser: set ``.value``, call ``.click()``, assert on the config and the run."""

import dataclasses
import html
import subprocess
import sys
import time

import pytest

import nbtrain as nbt
from nbtrain.config import ConfigError, TrainConfig

from .helpers import Collect

ipywidgets = pytest.importorskip("ipywidgets")

from nbtrain.ui.panel import SECTIONS, Panel  # noqa: E402 (after the importorskip)

SMALL = {"model": "tiny", "data": "builtin:python-docs", "subset": 48, "max_seq_len": 32, "micro_batch_size": 4,
         "eval_fraction": 0.0, "precision": "fp32", "lr": 1e-3}
TIMEOUT = 240  # generous: two shared CPU cores


def small(**kw) -> TrainConfig:
    return TrainConfig(**{**SMALL, **kw})


def wait_for(pred, timeout=TIMEOUT, what="condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- import hygiene --------------------------------------------------------------------------------
def test_import_nbtrain_loads_no_widgets_and_panel_resolves_lazily():
    code = ("import sys, nbtrain\n"
            "assert 'ipywidgets' not in sys.modules, 'import nbtrain loaded ipywidgets'\n"
            "assert 'nbtrain.ui' not in sys.modules\n"
            "from nbtrain.ui.panel import Panel\n"
            "assert nbtrain.Panel is Panel\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- config <-> controls ---------------------------------------------------------------------------
# field -> (value to put in its widget, the config value that must come out)
CHANGES = {
    "model": ("someorg/somemodel", "someorg/somemodel"),
    "task": ("sequence-classification", "sequence-classification"),
    "data": ("builtin:python-docs-topics", "builtin:python-docs-topics"),
    "text_column": ("body", "body"),
    "label_column": ("y", "y"),
    "image_column": ("img", "img"),
    "max_seq_len": (64, 64),
    "subset": ("48", 48),
    "precision": ("bf16", "bf16"),
    "micro_batch_size": (3, 3),
    "grad_accum_steps": (5, 5),
    "method": ("lora", "lora"),
    "lora_r": (4, 4),
    "lora_alpha": (32.5, 32.5),
    "lora_dropout": (0.1, 0.1),
    "lora_targets": ("q_proj, v_proj", ["q_proj", "v_proj"]),
    "quant_bits": (8, 8),
    "gradient_checkpointing": (True, True),
    "lean_layers": (True, True),
    "lr": (1e-3, 1e-3),
    "weight_decay": (0.01, 0.01),
    "optimizer": ("sgd", "sgd"),
    "stochastic_rounding": (True, True),
    "scheduler": ("linear", "linear"),
    "warmup_steps": (10, 10),
    "max_steps": ("7", 7),
    "epochs": ("2.5", 2.5),
    "max_grad_norm": ("", None),
    "packing": (True, True),
    "eval_fraction": (0.2, 0.2),
    "eval_every": ("5", 5),
    "log_every": (3, 3),
    "seed": (7, 7),
    "data_seed": ("5", 5),
    "output_dir": ("/tmp/nbtrain-out", "/tmp/nbtrain-out"),
    "nonfinite": ("stop", "stop"),
    "chunked_loss": (True, True),
    "loss_chunk_tokens": (512, 512),
    "compile": (True, True),
    "auto_batch_size": (True, True),
    "save_every": ("10", 10),
    "resume_from": ("/tmp/nbtrain-out/checkpoints", "/tmp/nbtrain-out/checkpoints"),
    "report_to": ("[tensorboard]", ["tensorboard"]),
    "data_format": ("alpaca", "alpaca"),
    "columns": ("{output: answer}", {"output": "answer"}),
    "dataset_entry": ("alpaca_en, glaive", "alpaca_en,glaive"),
    "chat_template": ("chatml", "chatml"),
    "train_on": ("last", "last"),
    "sample_prompts": ("What does the with statement do?\n\nWhat is a list?", ["What does the with statement do?",
                                                                               "What is a list?"]),
    "sample_every": ("5", 5),
    "max_new_tokens": (32, 32),
    "sharding": ("fsdp", "fsdp"),
    "reshard_after_forward": (False, False),
    "objective": ("dpo", "dpo"),
    "pref_beta": ("0.5", 0.5),
    "simpo_gamma": ("1.5", 1.5),
    "precompute_ref": (True, True),
}


def test_every_field_has_a_control_and_a_test_case():
    panel = Panel(debounce_s=0)
    assert set(panel.controls) == set(TrainConfig.model_fields)
    # GRPO's fields have their cases in test_grpo_panel (they start from a GRPO config)
    from .test_grpo_panel import GRPO_CHANGES

    assert set(CHANGES) | set(GRPO_CHANGES) == set(TrainConfig.model_fields)
    for name, w in panel.controls.items():
        assert isinstance(w, ipywidgets.Widget), name
    # TrainConfig's defaults, with the preset's own learning rate (tiny: 1e-3; issue 35)
    assert panel.config == TrainConfig(lr=1e-3) and TrainConfig().model == "tiny"


@pytest.mark.parametrize("field", list(CHANGES))
def test_setting_a_control_changes_that_field(field):
    # save_every is only valid with an output_dir (checkpoints go there), stochastic_rounding only with bf16-pure
    # weights: those start from a config that allows them
    bases = {"save_every": {"output_dir": "/tmp/nbtrain-out"}, "stochastic_rounding": {"precision": "bf16-pure"},
             "precompute_ref": {"objective": "dpo"}}
    base = TrainConfig(**bases.get(field, {}))
    panel = Panel(base, debounce_s=0)
    value, expected = CHANGES[field]
    panel.controls[field].value = value
    # (validate, not panel.errors: offline, the memory estimate marks a Hub id it cannot fetch under the model field)
    assert panel.form.validate()[1] == []
    cfg = panel.config
    assert getattr(cfg, field) == expected
    # and nothing else moved
    others = {k: v for k, v in cfg.to_dict().items() if k != field}
    assert others == {k: v for k, v in base.to_dict().items() if k != field}


def _varied_configs():
    caps = nbt.capabilities()
    cfgs = [
        TrainConfig(),
        small(),
        small(subset=None, max_steps=None, epochs=1.5, max_grad_norm=None, eval_every=3, output_dir="/tmp/o"),
        small(max_grad_norm=0.0, eval_fraction=0.0, nonfinite="continue", scheduler="constant", seed=2**32 - 1),
        small(method="lora", lora_r=16, lora_alpha=8, lora_dropout=0.0, lora_targets=["q_proj", "v_proj"]),
        small(method="lora", lora_targets=["o_proj"], gradient_checkpointing=True),
        small(lora_targets=["all-linear"]),   # a one-item list spelled like the string: stays a list
        small(task="sequence-classification", data="builtin:python-docs-topics", text_column="t",
              label_column="lab", packing=False),
        small(packing=True, max_seq_len=8, lr=3e-5, weight_decay=0.1, warmup_steps=4, log_every=10),
        small(micro_batch_size=2, grad_accum_steps=16, precision="auto"),
        small(task="image-classification", data="builtin:digits", model="tiny-vit", image_column="img",
              label_column="y"),
    ]
    for p in caps.allowed_precisions:
        cfgs.append(small(precision=p))
    if "qlora" in caps.allowed_methods:
        cfgs.append(small(method="qlora", quant_bits=8))
    return cfgs


@pytest.mark.parametrize("cfg", _varied_configs(), ids=lambda c: repr(c)[:60])
def test_config_round_trip(cfg):
    assert Panel(cfg, debounce_s=0).config == cfg


def test_config_setter_and_yaml_round_trip(tmp_path):
    a = small(method="lora", lora_targets=["q_proj"], max_steps=None, epochs=2.0)
    b = small(subset=None, scheduler="linear")
    panel = Panel(a, debounce_s=0)
    panel.config = b
    assert panel.config == b
    panel.save_yaml(tmp_path / "b.yaml")
    panel.config = a
    assert panel.load_yaml(tmp_path / "b.yaml") == b
    assert panel.config == b
    # the Save/Load buttons use the path box
    panel.yaml_path.value = str(tmp_path / "c.yaml")
    panel.controls["seed"].value = 11
    panel.save_button.click()
    assert TrainConfig.from_yaml(tmp_path / "c.yaml") == b.replace(seed=11)


def test_load_yaml_error_is_shown_and_controls_keep_their_values(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("micro_batch_size: 0\n")
    cfg = small()
    panel = Panel(cfg, debounce_s=0)
    with pytest.raises(ConfigError):
        panel.load_yaml(path)
    assert "micro_batch_size" in panel.error.value
    assert panel.config == cfg
    panel.yaml_path.value = str(path)
    panel.load_button.click()     # the button shows the error and raises nothing
    assert "micro_batch_size" in panel.error.value


# -- precision, method, accumulation ---------------------------------------------------------------
@pytest.fixture
def fake_caps(monkeypatch):
    """This device, except that bf16 is impossible (so the test does not depend on the hardware)."""
    import nbtrain.hardware
    import nbtrain.ui.panel

    real = nbt.capabilities()
    reasons = {**real.reasons, "bf16": "pretend this device has no bf16 at all"}
    caps = dataclasses.replace(real, reasons=reasons, bf16_supported=False, bf16_native=False,
                               allowed_precisions=tuple(p for p in real.allowed_precisions if p != "bf16"))
    monkeypatch.setattr(nbtrain.hardware, "capabilities", lambda *a, **k: caps)
    monkeypatch.setattr(nbtrain.ui.panel, "capabilities", lambda *a, **k: caps)
    return caps


def test_impossible_precision_is_disabled_with_its_reason_and_yields_no_config(fake_caps):
    panel = Panel(small(), debounce_s=0)
    picker = panel.controls["precision"]
    for p, why in fake_caps.reasons.items():
        if p not in picker.buttons:
            continue
        assert picker.buttons[p].disabled
        assert why in picker.buttons[p].tooltip
        assert html.escape(why) in panel.precision_info.value
        assert panel.compare_choices[p].disabled and not panel.compare_choices[p].value
    for p in fake_caps.allowed_precisions:
        assert not picker.buttons[p].disabled
    assert "bf16" not in panel.compare_precisions()
    # auto shows what it resolves to
    assert f"<b>{fake_caps.auto_precision}</b>" in panel.precision_info.value

    picker.value = "bf16"
    assert picker.buttons["bf16"].value   # shown as selected, and reported
    with pytest.raises(ConfigError) as e:
        _ = panel.config
    assert e.value.field == "precision"
    assert "Precision › <b>Precision</b>" in panel.error.value   # where it is, by the field's label
    assert "no bf16 at all" in panel.form.field_errors["precision"].value
    panel.train_button.click()
    assert panel.run is None and "not started" in panel.status.value
    assert panel.tabs.selected_index == list(SECTIONS).index("Precision")
    picker.value = "fp32"
    assert panel.error.value == "" and panel.config.precision == "fp32"


def test_precision_buttons_select_one_option():
    panel = Panel(small(), debounce_s=0)
    picker = panel.controls["precision"]
    picker.buttons["fp16"].value = True      # what a click in the browser does
    assert picker.value == "fp16" and panel.config.precision == "fp16"
    assert [p for p, b in picker.buttons.items() if b.value] == ["fp16"]
    picker.buttons["fp16"].value = False     # clicking the selected one keeps it selected
    assert picker.value == "fp16" and picker.buttons["fp16"].value
    assert "65504" in panel.precision_info.value


def test_method_fields_that_do_not_apply_are_hidden():
    panel = Panel(small(), debounce_s=0)
    rows = panel.form.rows
    lora = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
    assert all(rows[f].layout.display == "none" for f in lora + ("quant_bits",))
    assert rows["gradient_checkpointing"].layout.display != "none"
    panel.controls["method"].value = "lora"
    assert all(rows[f].layout.display != "none" for f in lora)
    assert rows["quant_bits"].layout.display == "none"
    panel.controls["method"].value = "qlora"
    assert all(rows[f].layout.display != "none" for f in lora + ("quant_bits",))


def test_accumulation_shows_effective_batch_and_tokens_live():
    panel = Panel(small(), debounce_s=0)
    c = panel.controls
    c["micro_batch_size"].value = 4
    c["grad_accum_steps"].value = 8
    c["max_seq_len"].value = 32
    assert "4 × 8 = 32" in panel.accumulation_info.value
    assert "32 × 32 = 1,024" in panel.accumulation_info.value
    c["grad_accum_steps"].value = 2
    assert "4 × 2 = 8" in panel.accumulation_info.value and "8 × 32 = 256" in panel.accumulation_info.value


# -- errors are shown, not thrown ------------------------------------------------------------------
@pytest.mark.parametrize("field,value,needle", [
    ("micro_batch_size", 0, "greater than or equal to 1"),
    ("subset", "abc", "whole number"),
    ("lr", -1.0, "greater than 0"),
    ("lora_targets", "", "all-linear"),
])
def test_invalid_value_shows_inline_message_and_starts_nothing(field, value, needle):
    panel = Panel(small(max_steps=2), debounce_s=0)
    panel.controls[field].value = value
    assert panel.form.label(field) in panel.error.value                       # by the label the field shows
    assert needle in panel.form.field_errors[field].value                      # the message under it
    assert panel.controls[field].layout.border    # the field is marked
    assert panel.errors[0]["field"] == field
    panel.train_button.click()
    panel.compare_button.click()
    assert panel.run is None and panel.runner.job is None
    assert "not started" in panel.status.value
    assert not panel.train_button.disabled
    with pytest.raises(ConfigError):
        _ = panel.config
    assert "fix the settings" in panel.memory.value


def test_cross_field_error_names_the_field():
    panel = Panel(small(), debounce_s=0)
    panel.controls["max_steps"].value = ""
    panel.controls["epochs"].value = ""
    assert "Max steps" in panel.error.value
    panel.controls["epochs"].value = "1"
    assert panel.error.value == "" and panel.config.max_steps is None and panel.config.epochs == 1.0


def test_display_delegates_to_the_widget():
    panel = Panel(debounce_s=0)
    bundle = panel._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == panel.widget.model_id
    for w in (panel.train_button, panel.stop_button, panel.compare_button, panel.status, panel.error,
              panel.memory):
        assert isinstance(w, ipywidgets.Widget)


# -- memory readout --------------------------------------------------------------------------------
def test_memory_readout_follows_the_settings_and_matches_estimate_memory():
    memory = pytest.importorskip("nbtrain.memory")
    panel = Panel(small(micro_batch_size=4, max_seq_len=32), debounce_s=0)
    seen = []

    def check():
        est = memory.estimate_memory(panel.config)
        assert panel.memory_estimate == est
        assert memory.fmt_gib(est.total_gib) in panel.memory.value
        assert memory.fmt_gib(est.device_total_gib) in panel.memory.value
        assert ("✓ fits" if est.fits else "✗ does not fit") in panel.memory.value
        seen.append(panel.memory.value)

    check()
    panel.controls["micro_batch_size"].value = 64
    check()
    panel.controls["max_seq_len"].value = 512
    check()
    panel.controls["method"].value = "lora"
    check()
    assert len(set(seen)) == 4, "each change must change the readout"


def test_memory_readout_shows_first_advice_when_it_does_not_fit():
    memory = pytest.importorskip("nbtrain.memory")
    cfg = small(micro_batch_size=4096, max_seq_len=131072)
    est = memory.estimate_memory(cfg)
    assert not est.fits and est.advice
    panel = Panel(cfg, debounce_s=0)
    assert "✗ does not fit" in panel.memory.value
    assert html.escape(est.advice[0].description) in panel.memory.value


def test_memory_readout_is_debounced():
    pytest.importorskip("nbtrain.memory")
    panel = Panel(small(), debounce_s=0.05)
    wait_for(lambda: panel.memory_estimate is not None, 30, "the first estimate")
    before = panel.memory.value
    for mb in (5, 6, 7, 64):     # a burst of changes: one estimate at the end
        panel.controls["micro_batch_size"].value = mb
    wait_for(lambda: panel.memory.value != before, 30, "the debounced estimate")
    import nbtrain.memory as m

    wait_for(lambda: panel.memory_estimate == m.estimate_memory(small(micro_batch_size=64)), 30, "final value")


# -- training from the buttons ---------------------------------------------------------------------
def test_train_stop_train():
    collect = Collect()
    panel = Panel(small(max_steps=3), callbacks=[collect], debounce_s=0)

    panel.train_button.click()
    run = panel.run
    assert run is not None
    assert panel.train_button.disabled and panel.compare_button.disabled and not panel.stop_button.disabled
    panel.train_button.click()                     # disabled in the browser; a click from code is ignored too
    assert panel.run is run
    assert run.wait(TIMEOUT) is not None
    res = panel.result
    assert res is run.result
    assert res.summary["stopped_reason"] == "max_steps" and len(res.history) == 3
    assert list(res.history["step"]) == [1, 2, 3]
    assert panel.status.value.count("done") == 1
    assert not panel.train_button.disabled and panel.stop_button.disabled
    assert len(panel.dashboard.records) == 3 and collect.result is res

    # a long run, stopped after a couple of steps
    panel.controls["max_steps"].value = "400"
    panel.train_button.click()
    run2 = panel.run
    assert run2 is not run
    wait_for(lambda: len(panel.dashboard.records) >= 2, what="two steps")
    n_at_stop = len(panel.dashboard.records)
    panel.stop_button.click()
    assert panel.stop_button.disabled
    assert run2.wait(TIMEOUT) is not None
    res2 = panel.result
    assert res2.summary["stopped_reason"] == "stopped"
    assert n_at_stop <= len(res2.history) <= n_at_stop + 3
    assert list(res2.history["step"]) == list(range(1, len(res2.history) + 1))
    assert "stopped" in panel.status.value
    assert not panel.train_button.disabled

    # and a second Train after Stop works
    panel.controls["max_steps"].value = "2"
    panel.train_button.click()
    assert panel.run.wait(TIMEOUT) is not None
    assert panel.result.summary["stopped_reason"] == "max_steps" and len(panel.result.history) == 2
    assert res2.summary["stopped_reason"] == "stopped"    # the earlier result is untouched


@pytest.fixture
def in_colab(monkeypatch):
    """A kernel that looks like Colab's (it has loaded google.colab), where a FigureWidget must never be made:
    Colab does not render one (googlecolab/colab-cdn-widget-manager#51, googlecolab/colabtools#5889)."""
    import importlib.machinery
    import types

    import plotly.graph_objects as go

    def no_figure_widget(*args, **kwargs):
        raise AssertionError("a plotly FigureWidget was made in Colab, which does not render it")

    colab = types.ModuleType("google.colab")
    colab.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)   # find_spec() reads it, as in Colab
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.delenv("NBTRAIN_DASHBOARD", raising=False)
    monkeypatch.setattr(go, "FigureWidget", no_figure_widget)


def _losses(output) -> list:
    """The loss points of the figure an ipywidgets.Output holds, read from its plotly JSON (base64 'bdata')."""
    import base64

    import numpy as np

    (out,) = output.outputs
    assert "cdn.plot.ly" in out["data"]["text/html"]     # Colab draws the HTML: plotly.js comes from its CDN
    (tr,) = [t for t in out["data"]["application/vnd.plotly.v1+json"]["data"]
             if (t.get("meta") or {}).get("panel") == "loss" and t["meta"].get("kind") == "loss"]
    y = tr.get("y", [])
    if isinstance(y, dict):
        y = np.frombuffer(base64.b64decode(y["bdata"]), dtype=np.dtype(y["dtype"]))
    return [float(v) for v in y]


def test_panel_in_colab_draws_its_live_figure_the_html_way(in_colab):
    """issue 25: in Colab the Panel keeps its core ipywidgets and draws the live figure as plotly HTML in an
    ipywidgets.Output, resent after each redraw, instead of a FigureWidget."""
    panel = Panel(small(max_steps=400), debounce_s=0)
    panel.train_button.click()
    live, dash = panel.live_figure, panel.dashboard
    wait_for(lambda: panel.dashboard_area.children == (live.widget,), what="the live figure, once the run started")
    assert dash.mode == "html" and live is not None
    assert isinstance(live.output, ipywidgets.Output)
    wait_for(lambda: live.output.outputs and len(_losses(live.output)) >= 2, what="two steps in the live figure")
    assert "step" in live.status.value
    panel.stop_button.click()
    res = panel.run.wait(TIMEOUT)
    assert res.summary["stopped_reason"] == "stopped" and "stopped" in panel.status.value
    assert panel.wait(TIMEOUT) is res and not panel.train_button.disabled
    assert live.shown >= 2 and live.shown <= dash.redraws
    # the live output holds the last redraw: every step; then the finished figure takes the area, drawn alike
    assert _losses(live.output) == list(res.history.loss)
    (final,) = panel.dashboard_area.children
    assert _losses(final) == list(res.history.loss)

    # a second Train gets a new live figure, and works the same
    panel.controls["max_steps"].value = "2"
    panel.train_button.click()
    assert panel.live_figure is not live
    res2 = panel.run.wait(TIMEOUT)
    panel.wait(TIMEOUT)
    assert _losses(panel.dashboard_area.children[0]) == list(res2.history.loss) and len(res2.history) == 2


def test_panel_outside_colab_keeps_the_figure_widget():
    import plotly.graph_objects as go

    panel = Panel(small(max_steps=1), debounce_s=0)
    panel.train_button.click()
    assert panel.dashboard.mode == "widget" and isinstance(panel.dashboard.figure, go.FigureWidget)
    assert panel.run.wait(TIMEOUT) is not None
    panel.wait(TIMEOUT)
    # the figure alone (the runner's status line is the one status line)
    assert panel.live_figure is None and panel.dashboard_area.children == (panel.dashboard.figure,)


def test_compare_in_colab(in_colab):
    pytest.importorskip("nbtrain.compare")
    panel = Panel(small(max_steps=2), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p == "fp32"
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp is not None and set(cmp.results) == {"fp32"} and panel.dashboard.mode == "html"
    # the verdicts, the table, then the finished figure
    assert panel.summary_area.children == (panel.verdicts, panel.comparison_table)
    assert isinstance(panel.dashboard_area.children[0], ipywidgets.Output)   # the finished figure, under them


def test_a_run_that_fails_shows_its_error_and_frees_the_buttons(tmp_path):
    data = tmp_path / "rows.csv"
    data.write_text("foo\nhello world\nanother line\n")
    panel = Panel(small(data=str(data), subset=None, max_steps=2), debounce_s=0)
    assert panel.errors == []
    panel.train_button.click()
    assert panel.wait(TIMEOUT) is None
    assert panel.runner.job.done.is_set()
    assert "error" in panel.status.value and "text" in panel.status.value
    assert panel.result is None
    assert not panel.train_button.disabled and panel.stop_button.disabled


def test_compare_runs_the_ticked_precisions_in_the_background():
    pytest.importorskip("nbtrain.compare")
    panel = Panel(small(max_steps=2), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p == "fp32" or (p == "bf16" and not box.disabled)
    wanted = panel.compare_precisions()
    panel.compare_button.click()
    assert panel.train_button.disabled and panel.compare_button.disabled
    cmp = panel.wait(TIMEOUT)
    assert cmp is panel.comparison and cmp is not None
    assert set(cmp.results) == set(wanted) and len(cmp.table) == len(wanted)
    assert all(r.summary["steps"] == 2 for r in cmp.results.values())
    assert "done" in panel.status.value
    assert panel.comparison_table in panel.summary_area.children
    assert not panel.train_button.disabled


def test_stop_during_compare_stops_the_comparison():
    pytest.importorskip("nbtrain.compare")
    panel = Panel(small(max_steps=300), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p in ("fp32", "bf16") and not box.disabled
    wanted = panel.compare_precisions()
    panel.compare_button.click()
    wait_for(lambda: len(panel.dashboard.records) >= 2, what="two steps of the first variant")
    panel.stop_button.click()
    cmp = panel.wait(TIMEOUT)
    # The variant running at Stop keeps its steps; the later ones never start (tests/test_compare_readable.py
    # checks what the status and the table then say).
    assert cmp is not None and cmp.stopped == "stopped" and list(cmp.results) == [wanted[0]]
    assert cmp.results[wanted[0]].summary["stopped_reason"] == "stopped"
    assert 1 <= cmp.results[wanted[0]].summary["steps"] <= 6
    assert cmp.not_run == list(wanted[1:])
    assert "stopped" in panel.status.value and not panel.train_button.disabled


def test_a_runs_config_error_marks_its_field():
    # What TrainConfig allows but this machine cannot run fails in the run's prepare phase, naming the field.
    panel = Panel(small(), debounce_s=0)
    job = panel.runner.begin("train")
    panel.runner.finish(job, error=ConfigError("precision: 'bf16' cannot run here: no bf16", field="precision"))
    assert "ConfigError" in panel.status.value and "no bf16" in panel.form.field_errors["precision"].value
    assert panel.controls["precision"].layout.border and not panel.controls["lr"].layout.border
    assert "Precision › <b>Precision</b>" in panel.error.value
    assert panel.tabs.selected_index == list(SECTIONS).index("Precision")
    assert not panel.train_button.disabled


def test_field_help_is_the_config_description():
    panel = Panel(debounce_s=0)
    for name, info in TrainConfig.model_fields.items():
        assert html.escape(info.description or "") in panel.form.help[name].value, name
