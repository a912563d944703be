"""The Panel shows exactly what happened, on one screen (issue 35), tested from code: set values, click, assert.

One Panel session as the issue's user had it: Train, Stop, Compare with four variants, then a Train that fails.
A simulated front end (tests/test_live_figure.FakeFrontend) answers every redraw of the live figure as plotly.js
does in JupyterLab. What the browser shows of the same session (bounding boxes at 1440 x 900) is in
tests/e2e/test_browser_results.py.
"""

from __future__ import annotations

import html
import re

import pytest

ipywidgets = pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from nbtrain.ui.panel import Panel  # noqa: E402

from .helpers import after_build  # noqa: E402
from .test_live_figure import FakeFrontend, assert_traces_at_steps  # noqa: E402
from .test_ui import TIMEOUT, small, wait_for  # noqa: E402

FOUR = ("fp32", "fp16", "bf16", "bf16-pure")


def texts(widget) -> list[str]:
    """The text of every HTML widget under ``widget`` (tags stripped), in display order; what a folded
    ``<details>`` holds (the comparison's full table, every column) is left out, as a reader sees it."""
    out = []
    if isinstance(widget, ipywidgets.HTML):
        shown = re.sub(r"<details.*?</details>", " ", widget.value, flags=re.S)
        out.append(re.sub(r"<[^>]+>", " ", html.unescape(shown)))
    for child in getattr(widget, "children", ()):
        out += texts(child)
    return out


def difference_rows(fig) -> int:
    return sum("per step" in (a.text or "") and "loss −" in (a.text or "") for a in fig.layout.annotations)


@pytest.fixture(scope="module")
def session():
    """One Panel session: Train then Stop, Compare of four precisions, and a Train whose run fails; what the
    panel showed after each step."""
    panel = Panel(small(max_steps=400, max_grad_norm=1.0), debounce_s=0,
                  callbacks=[FakeFrontend(lambda: panel.dashboard.figure)])
    seen = {"open_before": panel.settings.selected_index}

    panel.train_button.click()
    wait_for(lambda: panel.dashboard is not None and len(panel.dashboard.records) >= 5, TIMEOUT, "5 steps")
    seen["during_train"] = dict(folded=panel.settings.selected_index, area=panel.dashboard_area.children,
                                figure=panel.dashboard.figure)
    panel.stop_button.click()
    seen["stopped"] = panel.wait(TIMEOUT)
    seen["after_stop"] = dict(open=panel.settings.selected_index, figure=panel.dashboard.figure,
                              area=panel.dashboard_area.children, status=panel.status.value,
                              title=panel.settings.get_title(0))
    panel.settings.selected_index = 0    # what a click on the folded title does
    seen["clicked"] = panel.settings.selected_index

    panel.config = small(max_steps=3, subset=24, max_grad_norm=1.0)
    for p, box in panel.compare_choices.items():
        box.value = p in FOUR and not box.disabled
    panel.compare_button.click()
    wait_for(lambda: panel.settings.selected_index is None, 30, "the settings to fold")
    seen["cmp"] = panel.wait(TIMEOUT)
    seen["after_compare"] = dict(area=panel.summary_area.children + panel.dashboard_area.children,
                                 figure=panel.dashboard.figure,
                                 texts=texts(panel.widget), status=panel.status.value, notes=panel.notes.value,
                                 open=panel.settings.selected_index)
    return panel, seen


def test_a_train_folds_the_settings_and_shows_the_figure_alone_under_the_status(session):
    panel, seen = session
    assert seen["open_before"] == 0
    during = seen["during_train"]
    assert during["folded"] is None                           # folded while the run goes
    assert during["area"] == (during["figure"],)             # the figure alone: one status line (the runner's)
    assert panel.runner.board in panel.widget.children and panel.settings in panel.widget.children
    order = panel.widget.children
    assert order.index(panel.settings) < order.index(panel.runner.board)
    assert panel.runner.board.children == (panel.runner.previous, panel.summary_area, panel.dashboard_area)
    assert any(panel.status in getattr(c, "children", ()) for c in order[:order.index(panel.settings)])


def test_after_stop_the_settings_stay_folded_and_every_trace_keeps_its_steps(session):
    # issue 46 item 3: the answer stays in view where the run left it; a click on the title opens the settings
    panel, seen = session
    res, after = seen["stopped"], seen["after_stop"]
    assert res.summary["stopped_reason"] == "stopped" and "stopped" in after["status"]
    assert after["open"] is None and "click to open" in after["title"]
    assert seen["clicked"] == 0
    assert after["area"][0] is after["figure"]
    assert_traces_at_steps(after["figure"], {"run": res.history})   # the memory line reaches the last step


def test_after_compare_verdicts_then_table_then_figure_each_once(session):
    panel, seen = session
    cmp, after = seen["cmp"], seen["after_compare"]
    assert cmp is not None and set(cmp.results) == {p for p in FOUR if p not in panel.caps.reasons}
    area = after["area"]
    assert area[0] is panel.verdicts and area[1] is panel.comparison_table and area[2] is after["figure"]
    assert "nbtrain-verdicts" in panel.verdicts._dom_classes and "nbtrain-table" in panel.comparison_table._dom_classes
    assert 'class="nbt-verdicts"' in panel.verdicts.value and "nbt-verdicts" not in panel.comparison_table.value
    ran = {n: r.history for n, r in cmp.results.items()}
    assert_traces_at_steps(after["figure"], ran)
    # the difference panel once: the figure's last row, no second difference figure
    assert difference_rows(after["figure"]) == 1
    assert sum(isinstance(c, ipywidgets.Output) for c in area) == 0
    # each note once: bf16-pure's lost updates are its verdict's, not repeated under the status or the table
    shown = " ".join(after["texts"])
    assert len(re.findall(r"of updates lost", shown)) <= 1, shown
    assert after["notes"] == ""
    assert after["open"] is None                                   # folded after the Compare too


def test_a_start_that_fails_clears_nothing_of_the_last_comparison(session, tmp_path):
    panel, seen = session
    before = panel.summary_area.children + panel.dashboard_area.children
    verdicts, table, cmp = panel.verdicts.value, panel.comparison_table.value, panel.comparison
    # a run that starts and fails in its first forward: no step of it to show
    def boom(module, inputs, output):
        raise RuntimeError("boom in the first forward")

    monkeypatch = pytest.MonkeyPatch()
    after_build(monkeypatch, lambda model: model.register_forward_hook(boom))
    try:
        panel.config = small(max_steps=2)
        panel.train_button.click()
        job = panel.runner.job
        assert panel.wait(TIMEOUT) is None and job.kind == "train" and job.finished
    finally:
        monkeypatch.undo()
    assert "error" in panel.status.value and "boom in the first forward" in panel.status.value
    assert panel.summary_area.children + panel.dashboard_area.children == before   # the comparison is still there
    assert panel.verdicts.value == verdicts and panel.comparison_table.value == table
    assert panel.comparison is cmp
    assert panel.settings.selected_index == 0                      # and the settings are back to fix it
    # a start the checks refuse (a data path that is not here) changes nothing either
    panel.config = small(data=str(tmp_path / "missing.csv"), subset=None)
    panel.train_button.click()
    assert "not started" in panel.status.value
    assert panel.summary_area.children + panel.dashboard_area.children == before and panel.comparison is cmp


def test_the_panel_has_the_controls_its_advice_names():
    panel = Panel(small(), debounce_s=0)
    labels = {w.description.rstrip(":") for w in (panel.repeats_control, panel.seeds_control)}
    assert labels == {"repeats", "seeds"}
    assert 3 in [v for _, v in panel.repeats_control.options]


def test_a_compare_with_seeds_draws_its_band_in_the_figures_difference_row():
    panel = Panel(small(max_steps=2, subset=24), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p in ("fp32", "bf16") and not box.disabled
    panel.seeds_control.value = 1
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp is not None and cmp.band is not None and len(cmp.results) == 2
    fig = panel.difference_view
    assert panel.summary_area.children == (panel.verdicts, panel.comparison_table)
    # the figure stays where it was drawn while the run went; the table's notes go under it (issue 46 item 3)
    assert panel.dashboard_area.children == (fig, panel.runner.table_notes)
    assert fig is panel.dashboard.figure and difference_rows(fig) == 1
    kinds = [t.meta["kind"] for t in fig.data]
    assert kinds.count("noise_band_high") == 1 and kinds.count("noise_band_low") == 1
    band = next(t for t in fig.data if t.meta["kind"] == "noise_band_high")
    line = next(t for t in fig.data if t.meta["kind"] == "loss_diff")
    assert (band.xaxis, band.yaxis) == (line.xaxis, line.yaxis)    # in the difference row, with its lines
    assert any("grey: init noise" in (a.text or "") for a in fig.layout.annotations)
