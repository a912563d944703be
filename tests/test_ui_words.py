"""Issue 46 item 7, the Panel's parts: errors name fields by the labels the user sees, the status line lets go of a
fixed error, a blank Data box gets one message, and a preset that moves the learning rate says so beside the field.
Widget tests without a browser: set ``.value``, click, read the widgets back."""

import html
import re

import pytest

pytest.importorskip("ipywidgets")

from nbtrain.ui.panel import Panel  # noqa: E402 (after the importorskip)

from .test_ui import small  # noqa: E402


def text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def test_errors_name_the_field_by_its_label():
    panel = Panel(small(), debounce_s=0)
    panel.controls["lr"].value = "abc"
    assert text(panel.form.field_errors["lr"].value).startswith("⚠ Learning rate: must be a number")
    assert "Training › Learning rate" in text(panel.error.value)
    panel.train_button.click()
    status = text(panel.status.value)
    assert status == "not started: fix the setting marked in red (Learning rate)", status
    panel.controls["micro_batch_size"].value = "0"
    panel.compare_button.click()
    assert text(panel.status.value) == ("not started: fix the settings marked in red (Learning rate, "
                                        "Micro batch (examples))")
    assert not re.search(r"\blr\b|micro_batch_size", text(panel.status.value) + text(panel.error.value))


def test_the_status_lets_go_of_a_fixed_error():
    panel = Panel(small(), debounce_s=0)
    panel.controls["lr"].value = "abc"
    panel.controls["max_seq_len"].value = "x"
    panel.train_button.click()
    assert "(Max seq len (tokens), Learning rate)" in text(panel.status.value)
    panel.controls["lr"].value = "2e-3"              # one fixed: the status names the other alone
    assert text(panel.status.value) == "not started: fix the setting marked in red (Max seq len (tokens))"
    panel.controls["max_seq_len"].value = "y"        # changed, still wrong: still named
    assert "(Max seq len (tokens))" in text(panel.status.value)
    panel.controls["max_seq_len"].value = "16"
    status = text(panel.status.value)
    assert "marked in red (" not in status and status.startswith("ready"), status
    assert panel.errors == []


def test_a_run_error_stays_until_its_field_changes():
    # a run that failed on a field (here the model): another field's change does not fix it
    from nbtrain.models.loading import _hub_error

    panel = Panel(small(model="someorg/nomodel"), debounce_s=0)
    panel.runner.finish(panel.runner.begin("train"),
                        error=_hub_error("someorg/nomodel", "tokenizer", OSError("offline"), cache_only=True))
    assert "fix the setting marked in red (Model)" in text(panel.status.value)
    panel.controls["lr"].value = "2e-3"
    assert "fix the setting marked in red (Model)" in text(panel.status.value)
    panel.controls["model"].value = "smollm2-135m-instruct"
    assert text(panel.status.value).startswith("ready")


def test_a_status_said_since_is_left_alone():
    panel = Panel(small(), debounce_s=0)
    panel.controls["lr"].value = "abc"
    panel.train_button.click()
    panel.runner.set_status("loaded x.yaml", "#666")
    panel.controls["lr"].value = "1e-3"
    assert text(panel.status.value) == "loaded x.yaml"


def test_a_blank_data_box_gets_one_message_saying_what_goes_there():
    panel = Panel(small(), debounce_s=0)
    panel.controls["data"].value = ""
    under = text(panel.form.field_errors["data"].value)
    assert under.startswith("⚠ Data: is blank: give builtin:") and "dataset id" in under, under
    assert panel.data_info.value == ""                     # no "dataset id (Hugging Face Hub)" line under it
    assert "non-empty string" not in under
    panel.controls["model"].value = " "
    assert text(panel.form.field_errors["model"].value).startswith("⚠ Model: is blank: give a preset")


def test_a_model_that_moves_the_learning_rate_says_so_beside_it():
    panel = Panel(debounce_s=0)
    assert panel.config.lr == 1e-3
    assert "changed" not in text(panel.form.help["lr"].value)
    panel.controls["model"].value = "tiny-vit"
    assert panel.config.lr == 3e-4
    beside = text(panel.form.help["lr"].value)
    assert "Learning rate changed 0.001 → 0.0003" in beside and "tiny-vit's preset" in beside, beside
    assert "Learning rate changed 0.001 → 0.0003" in text(panel.form.lr_note.value)   # under the model too
    assert panel.form.lr_note.layout.display != "none"
    panel.controls["lr"].value = "5e-4"                    # the user's own: the note goes
    assert "changed" not in text(panel.form.help["lr"].value) and panel.form.lr_note.value == ""
    assert panel.form.lr_note.layout.display == "none"
    panel.controls["model"].value = "tiny"                 # lr is the user's: not moved, nothing said
    assert panel.config.lr == 5e-4 and "changed" not in text(panel.form.help["lr"].value)
