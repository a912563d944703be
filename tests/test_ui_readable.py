"""The panel reads in a 968 px JupyterLab output: no label cut short, and the field errors a person must see
(a model or data path that is not there) marked where the field is. Widget tests, no browser."""

import re

import pytest

ipywidgets = pytest.importorskip("ipywidgets")

from ipywidgets.widgets.widget_description import DescriptionWidget  # noqa: E402 (after the importorskip)
from nbtrain.ui import render  # noqa: E402
from nbtrain.ui.controls import Choice  # noqa: E402
from nbtrain.ui.panel import SECTIONS, Panel  # noqa: E402

# ipywidgets 8's CSS (widgets-base.css), which decides how much room a text gets inside a widget.
CHAR_PX = 7.5            # JupyterLab's 13 px widget font: ~7 px a character, rounded up for wide fonts
LABEL_MARGIN = 8         # right margin of a description label
CHECKBOX_PX = 21         # the box and its right margin, before a checkbox's own text
SELECT_PADDING = 28      # a dropdown's arrow (20 px padding) and its left padding and border
INPUT_PADDING = 10       # a text box's 4 px padding each side and its border
BUTTON_PADDING = 20      # 10 px each side
ICON_PX = 18
DEFAULT_LABEL_PX = 80    # --jp-widgets-inline-label-width, when no description_width is set
DEFAULT_BUTTON_PX = 148  # --jp-widgets-inline-width-short
OUTPUT_PX = 968
TAB_CONTENT_PX = OUTPUT_PX - 2 * 15 - 2 * 6 - 2   # tab padding, the page's own padding, borders
HELP_MIN_PX = 300        # room left beside a control for its help text


def px(value):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)px\s*", str(value or ""))
    return float(m.group(1)) if m else None


def walk(w):
    yield w
    for child in getattr(w, "children", ()) or ():
        yield from walk(child)


def fits(text, room):
    return len(str(text)) * CHAR_PX <= room


def cut_texts(panel):
    """Every (where, text, room in px) of a text that would be cut with an ellipsis."""
    cut = []
    for w in walk(panel.widget):
        width = px(w.layout.width)
        if isinstance(w, (ipywidgets.Button, ipywidgets.ToggleButton)):
            room = (width or DEFAULT_BUTTON_PX) - BUTTON_PADDING - (ICON_PX if w.icon else 0)
            if w.layout.width != "auto" and not fits(w.description, room):
                cut.append(("button", w.description, room))
            continue
        if isinstance(w, ipywidgets.Label) and width is not None:
            if not fits(w.value, width):
                cut.append(("label", w.value, width))
            continue
        if not isinstance(w, DescriptionWidget):
            continue
        label_px = px(w.style.description_width) or DEFAULT_LABEL_PX
        if isinstance(w, ipywidgets.Checkbox):
            if width is not None:   # "auto" grows to its text
                room = width - (label_px + LABEL_MARGIN if w.indent else 0) - CHECKBOX_PX
                if not fits(w.description, room):
                    cut.append(("checkbox", w.description, room))
            continue
        if w.description and not fits(w.description, label_px):
            cut.append(("description", w.description, label_px))
        if width is None:
            continue
        box = width - (label_px + LABEL_MARGIN if w.description else 0)
        if isinstance(w, ipywidgets.Dropdown):
            for label in w._options_labels:
                if not fits(label, box - SELECT_PADDING):
                    cut.append(("option", label, box - SELECT_PADDING))
        if getattr(w, "placeholder", "") and not fits(w.placeholder, box - INPUT_PADDING):
            cut.append(("placeholder", w.placeholder, box - INPUT_PADDING))
    return cut


def test_the_panel_reads_in_a_968px_output():
    panel = Panel(debounce_s=0)
    assert cut_texts(panel) == []
    # and the room that takes still fits the output, with space beside each control for its help
    for name, row in panel.form.rows.items():
        control = panel.controls[name]
        if isinstance(control, Choice):
            assert row.children[0] is control    # the help goes below it
            continue
        width = px(control.layout.width)
        assert width is not None and width + HELP_MIN_PX <= TAB_CONTENT_PX, (name, width)
    for w in walk(panel.widget):
        if isinstance(w, ipywidgets.HBox) and not isinstance(w, Choice):
            assert sum(px(c.layout.width) or 0 for c in w.children) <= TAB_CONTENT_PX, w


def test_every_field_explains_itself_on_hover():
    panel = Panel(debounce_s=0)
    for name, w in panel.controls.items():
        tip = (w.label if isinstance(w, Choice) else w).tooltip
        assert tip, name
    # the non-finite dropdown's short "default" is spelled out in its tooltip
    nonfinite = panel.controls["nonfinite"]
    assert "default" in dict(nonfinite.options) and nonfinite.value == "default"
    assert "GradScaler" in nonfinite.tooltip and "stop" in nonfinite.tooltip


# -- data and model values that point nowhere ----------------------------------------------------------
RED = render.RED


def test_a_data_path_that_does_not_exist_is_flagged_and_a_dataset_id_is_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    panel = Panel(debounce_s=0)
    data = panel.controls["data"]
    for value in ["./nope.jsonl", "../nope/train.csv", "/no/such/dir", "~/nope-dir/", "nope.parquet",
                  "some/dir/rows.txt", "a/b/c"]:
        data.value = value
        info = panel.data_info.value
        assert "no such file or folder" in info and value in info and RED in info, value
        assert "Hub" not in info, value
        assert panel.config.data == value   # it may exist where the config runs: flagged, not refused
    for value in ["someorg/somedata", "wikitext"]:
        data.value = value
        assert "dataset id (Hugging Face Hub)" in panel.data_info.value, value
        assert "no such" not in panel.data_info.value and RED not in panel.data_info.value, value
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    for value in [str(rows), "rows.jsonl", "./rows.jsonl"]:
        data.value = value
        assert "local jsonl" in panel.data_info.value and RED not in panel.data_info.value, value
    data.value = "builtin:python-docs"
    assert "builtin:" in panel.data_info.value and RED not in panel.data_info.value
    data.value = "builtin:no-such-set"
    assert "unknown builtin" in panel.data_info.value and RED in panel.data_info.value


def test_a_model_path_that_does_not_exist_is_flagged_and_a_model_id_is_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    panel = Panel(debounce_s=0)
    model = panel.controls["model"]
    for value in ["./nope-model", "/no/such/model", "~/nope-model/", "org/model.safetensors", "pytorch_model.bin"]:
        model.value = value
        info = panel.model_info.value
        assert "no such directory" in info and value in info and RED in info, value
        assert "Hub id: downloaded" not in info, value
    for value, needle in [("tiny", "preset"), ("someorg/somemodel", "Hub id"), ("someorg/model-v2.5-0.5B", "Hub id"),
                          (str(tmp_path), "local directory")]:
        model.value = value
        assert needle in panel.model_info.value, value
        assert "no such" not in panel.model_info.value and RED not in panel.model_info.value, value


# -- a run's model error marks the Model field -------------------------------------------------------------
# (A model path that is not here no longer starts a run: test_panel_inputs checks Train refuses it, marked, once.)


def test_a_model_error_from_loading_marks_the_model_field():
    # The error loading raises when a Hub id cannot be fetched (offline, or no such repo).
    from nbtrain.models.loading import _hub_error

    panel = Panel(debounce_s=0)
    job = panel.runner.begin("train")
    panel.runner.finish(job, error=_hub_error("someorg/nomodel", "tokenizer", OSError("offline"), cache_only=True))
    assert panel.controls["model"].layout.border
    assert panel.tabs.selected_index == list(SECTIONS).index("Model")
