"""Issue 16, the panel's and dashboard's part: no stale memory verdict, notes and advice shown, threads that end."""

import html
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import pytest

from nbtrain.engine import threads

ipywidgets = pytest.importorskip("ipywidgets")

import nbtrain.ui.panel as panel_mod  # noqa: E402 (after the importorskip)
from nbtrain.ui import render  # noqa: E402
from nbtrain.ui.panel import Panel  # noqa: E402
from nbtrain.viz import dashboard as D  # noqa: E402

from .test_ui import SMALL, TIMEOUT, small, wait_for  # noqa: E402,F401  (the panel tests' small config and wait)

NOTES = ["out of memory at step 3: OutOfMemoryError: CUDA out of memory <tried 2 GiB>",
         "lean_layers: 2 MLPs keep less for backward"]
ADVICE = ["micro_batch_size=2 with grad_accum_steps=4: same effective batch, half the activations",
          "gradient_checkpointing=True: recompute activations in backward",
          "method='lora': no gradients or optimizer state for the base",
          "precision='bf16': half the activation memory",
          "max_seq_len=64: shorter rows"]


def oom_result():
    """A TrainResult-like object of a run that ran out of memory at step 3."""
    return SimpleNamespace(summary={"steps": 2, "stopped_reason": "out_of_memory", "final_loss": 3.25,
                                    "precision_used": "fp16", "notes": list(NOTES), "advice": list(ADVICE)},
                           history=None, info=None)


# -- memory readout --------------------------------------------------------------------------------
def test_memory_box_says_estimating_right_after_a_change_never_the_old_verdict():
    pytest.importorskip("nbtrain.memory")
    import nbtrain.memory as memory

    panel = Panel(small(), debounce_s=0)
    assert "fits" in panel.memory.value and panel.memory_estimate is not None
    panel.debounce_s = 60      # the estimate stays pending for the whole test
    try:
        panel.controls["model"].value = "someorg/somemodel"
        assert "estimating" in panel.memory.value
        assert "fits" not in panel.memory.value and panel.memory_estimate is None
        stale_gen = panel._mem_gen
        panel.controls["model"].value = "tiny"
        panel.controls["micro_batch_size"].value = 64
        assert "estimating" in panel.memory.value and "fits" not in panel.memory.value
        # An estimate that finishes for values changed since is not put up.
        panel._refresh_memory_quietly(stale_gen)
        assert "estimating" in panel.memory.value and panel.memory_estimate is None
        est = panel.refresh_memory()
        assert est == memory.estimate_memory(small(micro_batch_size=64))
        assert panel.memory_estimate == est and "estimating" not in panel.memory.value
    finally:
        if panel._mem_timer is not None:
            panel._mem_timer.cancel()


def test_debounced_estimate_replaces_estimating_with_the_new_result():
    pytest.importorskip("nbtrain.memory")
    import nbtrain.memory as memory

    panel = Panel(small(), debounce_s=0.05)
    panel.controls["micro_batch_size"].value = 64
    assert "estimating" in panel.memory.value
    want = memory.estimate_memory(small(micro_batch_size=64))
    wait_for(lambda: panel.memory_estimate == want, 30, "the debounced estimate")
    assert "estimating" not in panel.memory.value and "fits" in panel.memory.value


# -- notes and advice ------------------------------------------------------------------------------
def test_panel_shows_notes_and_oom_advice_of_a_train():
    panel = Panel(small(), debounce_s=0)
    job = panel.runner.begin("train")
    panel.runner.finish(job, result=oom_result())
    assert "out of memory" in panel.status.value and render.RED in panel.status.value
    shown = panel.notes.value
    for note in NOTES:
        assert html.escape(note) in shown
    for advice in ADVICE[:3]:
        assert html.escape(advice) in shown
    assert "2 more" in shown and html.escape(ADVICE[4]) not in shown   # a short list
    box = next(c for c in panel.widget.children if panel.status in getattr(c, "children", ()))
    assert box.children.index(panel.notes) == box.children.index(panel.status) + 1   # under the status line
    job = panel.runner.begin("train")     # a press leaves them while its run has not started (it may fail) ...
    assert panel.notes.value == shown
    panel.runner.reveal(job)               # ... and clears them when it has
    assert panel.notes.value == ""


def test_panel_shows_notes_per_variant_after_a_compare():
    panel = Panel(small(), debounce_s=0)
    plain = SimpleNamespace(summary={"steps": 2, "stopped_reason": "max_steps", "notes": []})
    cmp = SimpleNamespace(results={"fp32": plain, "fp16": oom_result()}, table=None)
    job = panel.runner.begin("compare")
    panel.runner.finish(job, comparison=cmp)
    shown = panel.notes.value
    assert "<b>fp16</b>" in shown and "<b>fp32</b>" not in shown
    assert html.escape(NOTES[0]) in shown and html.escape(ADVICE[0]) in shown


def test_panel_shows_the_note_of_a_real_lean_layers_run():
    panel = Panel(small(max_steps=2, lean_layers=True), debounce_s=0)
    panel.train_button.click()
    res = panel.wait(TIMEOUT)
    assert res is not None, panel.status.value
    notes = res.summary["notes"]
    assert any("lean_layers" in n for n in notes)
    for note in notes:
        assert html.escape(note) in panel.notes.value


def _fake_display(monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def __init__(self, obj):
            self.last = obj

        def update(self, obj, raw=False):
            self.last = obj

    def display(obj, raw=False, display_id=None, **kw):
        shown.append(Handle(obj))
        return shown[-1]

    monkeypatch.setattr(IPython.display, "display", display)
    return shown


@pytest.mark.parametrize("mode", ["html", "widget"])
def test_dashboard_end_of_run_shows_notes_and_advice(mode, monkeypatch):
    from .test_viz import make_info, make_records

    shown = _fake_display(monkeypatch)
    dash = D.LiveDashboard(mode=mode)
    dash.on_run_start(make_info(total_steps=5))
    for r in make_records(5):
        dash.on_step_end(r)
    dash.on_run_end(oom_result())
    status = shown[0].last
    for note in NOTES:
        assert html.escape(note) in status["text/html"] and note in status["text/plain"]
    for advice in ADVICE[:3]:
        assert html.escape(advice) in status["text/html"] and advice in status["text/plain"]
    assert ADVICE[4] not in status["text/plain"]
    assert "stopped: out_of_memory" in status["text/plain"]


def test_dashboard_text_mode_prints_notes_and_advice_under_the_summary(capsys):
    from .test_viz import make_info, make_records

    dash = D.LiveDashboard(mode="text")
    dash.on_run_start(make_info(total_steps=5))
    for r in make_records(5):
        dash.on_step_end(r)
    dash.on_run_end(oom_result())
    out = capsys.readouterr().out
    lines = out.splitlines()
    summary = next(i for i, line in enumerate(lines) if "5 steps" in line)
    rest = "\n".join(lines[summary + 1:])
    assert f"note: {NOTES[0]}" in rest and "to fit in memory" in rest and ADVICE[0] in rest


# -- threads ---------------------------------------------------------------------------------------
def test_panel_finishes_imports_before_its_first_timer(monkeypatch):
    order = []
    real_track = panel_mod.track
    monkeypatch.setattr(panel_mod, "complete_imports", lambda cfg=None: order.append("imports"))
    monkeypatch.setattr(panel_mod, "track", lambda t, stop=None: (order.append("timer"), real_track(t, stop))[1])
    panel = Panel(small(), debounce_s=60)
    try:
        assert order[:2] == ["imports", "timer"]
    finally:
        panel._mem_timer.cancel()


def test_memory_timer_is_tracked_with_cancel_as_its_stop():
    panel = Panel(small(), debounce_s=60)
    timer = panel._mem_timer
    assert isinstance(timer, threading.Timer) and timer in threads._live
    threads._live[timer]()             # what interpreter exit does
    timer.join(5)
    assert not timer.is_alive() and "estimating" in panel.memory.value


def test_train_and_compare_threads_are_registered_and_their_stop_ends_the_job():
    panel = Panel(small(max_steps=400), debounce_s=0)
    panel.train_button.click()
    watch = [t for t in threads._live if t.name == "nbtrain-panel-watch"]
    assert len(watch) == 1 and watch[0].is_alive()
    wait_for(lambda: len(panel.dashboard.records) >= 1, what="a step")
    threads._live[watch[0]]()          # what interpreter exit does: stop, then join
    watch[0].join(TIMEOUT)
    assert not watch[0].is_alive() and watch[0] not in threads._live
    assert panel.result.summary["stopped_reason"] == "stopped"

    pytest.importorskip("nbtrain.compare")
    for p, box in panel.compare_choices.items():
        box.value = p == "fp32"
    panel.compare_button.click()
    th = panel.runner.compare_thread
    assert th in threads._live and th.is_alive()
    threads._live[th]()
    th.join(TIMEOUT)
    assert not th.is_alive() and th not in threads._live
    # Stopping a comparison stops all of it: fp32 was cut, or (stopped during the warm-up) never started.
    assert panel.comparison.stopped == "stopped"
    assert "fp32" in panel.comparison.cut + panel.comparison.not_run


SCRIPT = """
import nbtrain as nbt
from nbtrain.ui.panel import Panel

class Mark:
    def on_step_end(self, rec):
        print("STEP", flush=True)
    def on_run_end(self, result):
        print("END", result.summary["stopped_reason"], flush=True)

panel = Panel(nbt.TrainConfig(**{small!r}, max_steps=400), callbacks=[Mark()], debounce_s=0.05)
panel.train_button.click()
while panel.dashboard is None or not panel.dashboard.records:
    import time; time.sleep(0.02)
panel.stop_button.click()
assert panel.wait(120) is not None
for p, box in panel.compare_choices.items():
    box.value = p == "fp32"
finish = panel.runner.finish
def reporting_finish(job, result=None, comparison=None, error=None):
    if comparison is not None:
        print("COMPARE", comparison.stopped, flush=True)
    return finish(job, result=result, comparison=comparison, error=error)
panel.runner.finish = reporting_finish
panel.compare_button.click()
panel.controls["micro_batch_size"].value = 2   # and a memory estimate pending
print("EXIT", flush=True)
"""


def test_script_with_train_stop_then_compare_exits_cleanly(tmp_path):
    script = tmp_path / "panel_script.py"
    script.write_text(textwrap.dedent(SCRIPT.format(small=SMALL)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert "END stopped" in lines[:lines.index("EXIT")]          # the Train, stopped
    # The Compare still loading at exit was stopped and waited for, not killed: it ended as a stopped comparison.
    assert "COMPARE stopped" in lines[lines.index("EXIT") + 1:], proc.stdout[-2000:] + proc.stderr[-3000:]
