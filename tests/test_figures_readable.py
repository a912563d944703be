"""Figures a person can read (issue 18): the loss-scale axis, its no-GradScaler note, axis units, the
finished figure's title, the run's own CPU memory, and a live widget that the browser never sees written
to after its view is gone."""

import dataclasses
import math

import pandas as pd
import plotly.graph_objects as go
import pytest

from nbtrain.engine.records import StepRecord
from nbtrain.viz import figures as F
from nbtrain.viz.dashboard import LiveDashboard
from nbtrain.viz.widget import live_figure_widget

from .test_viz import assert_same, col, feed, frame, make_info, make_records


def yaxis(fig, row, col_=1):
    return fig.get_subplot(row, col_).yaxis


def with_tensors(records, gib):
    """The records with ``host_tensors_gib`` set (a field another change adds to StepRecord)."""
    out = []
    for r, v in zip(records, gib):
        if "host_tensors_gib" in {f.name for f in dataclasses.fields(StepRecord)}:
            out.append(dataclasses.replace(r, host_tensors_gib=v))
        else:
            r = dataclasses.replace(r)
            r.host_tensors_gib = v
            out.append(r)
    return out


def as_frame(records):
    return pd.DataFrame([{**r.to_dict(), "host_tensors_gib": getattr(r, "host_tensors_gib", None)}
                         for r in records])


def expected_pow2_labels(values):
    """Every power of two from the smallest to the largest value, written as a person reads it."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    return [f"{2 ** k:,}" for k in range(int(math.log2(min(v))), int(math.log2(max(v))) + 1)]


# ------------------------------------------------------------------------------------------------
# The loss-scale panel
# ------------------------------------------------------------------------------------------------
def test_scale_axis_labels_powers_of_two_in_full():
    recs = make_records(30, skip={5, 12}, inf_grad={5, 12})          # 65,536 -> 32,768 -> 16,384
    fig = F.run_figure(recs, None, make_info())
    ax = yaxis(fig, *F.PANEL_CELLS["scale"])
    assert ax.type == "log" and ax.tickmode == "array"           # only these labels, no crowded minor ones
    want = expected_pow2_labels([r.scale for r in recs])
    assert want == ["16,384", "32,768", "65,536"]
    assert [t for t in ax.ticktext if t in want] == want
    assert all(math.log2(v).is_integer() for v in ax.tickvals)
    assert list(ax.ticktext) == [f"{int(v):,}" for v in ax.tickvals]
    # The comparison figure's scale panel reads the same way.
    cmp = F.compare_figure({"fp32": frame(make_records(30, scaler=False)), "fp16": frame(recs)},
                           infos={"fp32": make_info("fp32", scaler=False), "fp16": make_info()})
    row, c = F._COMPARE_GRID["scale"]
    assert {"16,384", "32,768", "65,536"} <= set(yaxis(cmp, row, c).ticktext)


def test_scale_axis_stays_readable_over_a_wide_range():
    ax = F.scale_axis([2.0 ** 24, 2.0 ** 10, 2.0])
    assert 2 <= len(ax["tickvals"]) <= F.MAX_SCALE_TICKS
    assert ax["ticktext"][-1] == "16,777,216"               # the largest (initial) scale keeps its label
    assert min(ax["tickvals"]) <= 2.0 ** 4                  # and the low end is still covered
    assert F.scale_axis([65536.0] * 5)["ticktext"] == ["32,768", "65,536", "131,072"]
    assert F.scale_axis([0.5, 0.25])["ticktext"] == ["0.25", "0.5"]
    assert F.scale_axis([math.nan, None])["showticklabels"] is False


def test_live_figure_relabels_the_scale_axis_when_the_scale_drops():
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=1000)
    recs = make_records(40, skip={30, 35}, inf_grad={30, 35})
    dash.on_run_start(make_info(total_steps=40))
    for r in recs[:20]:
        dash.on_step_end(r)
    dash.refresh()
    assert "65,536" in yaxis(dash.figure, *F.PANEL_CELLS["scale"]).ticktext
    for r in recs[20:]:
        dash.on_step_end(r)
    dash.refresh()          # an in-place update, not a rebuild: the ticks must follow the data
    assert set(expected_pow2_labels([r.scale for r in recs])) <= set(
        yaxis(dash.figure, *F.PANEL_CELLS["scale"]).ticktext)


def _note(fig):
    notes = [a for a in fig.layout.annotations if a.name == "no_scaler"]
    assert len(notes) == 1
    return notes[0]


def test_no_scaler_note_sits_where_it_hides_no_data():
    # Mixed: the fp16 line fills the panel, so the note goes above its plot area, as the second line of the
    # panel's own title: one annotation, so the two cannot overprint, however many runs it names (issue 35).
    four = {p: (make_records(20, seed=k, scaler=False), None, make_info(p, scaler=False))
            for k, p in enumerate(("fp32", "bf16", "bf16-pure"))}
    fig = F.runs_figure({"fp32": four["fp32"], "fp16": (make_records(20, seed=2), None, make_info()),
                         "bf16": four["bf16"], "bf16-pure": four["bf16-pure"]})
    note = _note(fig)
    sp = fig.get_subplot(*F.PANEL_CELLS["scale"])
    assert note.text.startswith(F.SCALE_TITLE + "<br>") and note.yanchor == "bottom"   # above the data area
    assert note.y == pytest.approx(sp.yaxis.domain[1])
    assert sum(F.SCALE_TITLE in (a.text or "") for a in fig.layout.annotations) == 1
    assert "fp32, bf16, bf16-pure" in note.text and "fp16" not in note.text.replace("fp16-", "")
    # Same in the comparison figure.
    cmp = F.compare_figure({"fp32": frame(make_records(20, scaler=False)), "fp16": frame(make_records(20))},
                           infos={"fp32": make_info("fp32", scaler=False), "fp16": make_info()})
    assert _note(cmp).yanchor == "bottom" and _note(cmp).text.startswith(F.SCALE_TITLE + "<br>")
    assert _note(cmp).y == pytest.approx(cmp.get_subplot(4, 1).yaxis.domain[1])
    # A run without a scaler: an empty panel that says why, and no "loss scale" legend entry.
    solo = F.run_figure(make_records(10, scaler=False), None, make_info("bf16", scaler=False))
    assert _note(solo).text == "no GradScaler<br>(bf16 does not need one)"
    assert not F.find_trace(solo, "scale", "scale").showlegend
    assert not any(t.showlegend is not False and t.name == "loss scale" for t in solo.data)
    assert F.find_trace(F.run_figure(make_records(10), None, make_info()), "scale", "scale").showlegend


# ------------------------------------------------------------------------------------------------
# Units
# ------------------------------------------------------------------------------------------------
def test_every_panel_y_axis_has_a_title_with_its_unit():
    fig = F.run_figure(make_records(10), None, make_info())
    titles = [yaxis(fig, *F.PANEL_CELLS[p]).title.text for p in ("loss", "grad_norm", "scale", "memory")]
    assert titles == ["loss (nats/token)", "grad norm (L2)", "loss scale", "memory (GiB)"]

    class Cls:
        task = "sequence-classification"

    cls = F.run_figure(make_records(10), None, dataclasses.replace(make_info(), config=Cls()))
    assert yaxis(cls, 1).title.text == "loss (nats/example)"
    cmp = F.compare_figure({"a": frame(make_records(10)), "b": frame(make_records(10, seed=3))})
    axes = [cmp.layout[k] for k in cmp.layout if k.startswith("yaxis")]
    assert len(axes) == 7 and all(ax.title.text for ax in axes), [ax.title.text for ax in axes]
    assert yaxis(cmp, 1, 2).title.text == "tokens/s" and yaxis(cmp, 5, 1).title.text == "memory (GiB)"


# ------------------------------------------------------------------------------------------------
# The finished figure
# ------------------------------------------------------------------------------------------------

def _title_clear_of_panel_titles(layout):
    """The title's lines (plotly draws ~1.3 em per line) end above where the first panel titles begin."""
    title = layout["title"]
    lines = title["text"].count("<br>") + 1
    bottom = title.get("pad", {}).get("t", 0) + 1.3 * title["font"]["size"] * lines
    first_panel_titles = [a for a in layout["annotations"] if a.get("yref") == "paper" and a["y"] == 1]
    assert first_panel_titles
    top_of_panel_titles = layout["margin"]["t"] - 1.3 * max(a["font"]["size"] for a in first_panel_titles)
    return bottom < top_of_panel_titles


@pytest.mark.parametrize("variants", [("run",), ("fp32", "fp16", "bf16")])
def test_finished_figure_has_a_one_line_title_clear_of_the_panel_titles(frontend, variants):
    dash = LiveDashboard(mode="widget")
    for v in variants:
        name = None if v == "run" else v
        feed(dash, make_info("fp16" if v == "run" else v, scaler=v in ("run", "fp16"), variant=name),
             make_records(12, variant=name, scaler=v in ("run", "fp16")))
    status, fig = frontend["handles"]
    layout = fig.obj["application/vnd.plotly.v1+json"]["layout"]
    title = layout["title"]["text"]
    summary = status.obj["text/plain"]
    assert "<br>" not in title and "\n" not in title and len(title) <= 90
    assert title not in summary and "steps" not in title       # the summary lives in the line above
    assert "12 steps" in summary
    for v in variants:
        assert (v if v != "run" else "fp16") in title
    assert _title_clear_of_panel_titles(layout), (layout["title"], layout["margin"])


# ------------------------------------------------------------------------------------------------
# CPU memory: the run's own tensors
# ------------------------------------------------------------------------------------------------
def test_cpu_memory_panel_plots_the_runs_tensors_with_rss_secondary():
    recs = with_tensors(make_records(15), [0.05 + 0.001 * i for i in range(15)])
    for hist in (recs, as_frame(recs)):
        fig = F.run_figure(hist, None, make_info())
        main = F.find_trace(fig, "memory", "host_tensors")
        assert_same(main.y, [r.host_tensors_gib for r in recs])
        assert "run tensors" in main.name
        rss = F.find_trace(fig, "memory", "host_rss")
        assert_same(rss.y, col(recs, "host_rss_gib"))
        assert rss.line.dash == "dot" and "whole process" in rss.name
        assert "includes earlier runs and libraries" in rss.hovertemplate
        assert F.find_trace(fig, "memory", "skipped").y is not None
    assert any("tensors" in a.text for a in fig.layout.annotations)
    # Older histories (no such field, or all None) still draw, on RSS.
    for old in (make_records(15), with_tensors(make_records(15), [None] * 15)):
        fig = F.run_figure(old, None, make_info())
        assert not F.find_traces(fig, panel="memory", kind="host_tensors")
        assert_same(F.find_trace(fig, "memory", "host_rss").y, col(old, "host_rss_gib"))


def test_comparison_compares_cpu_variants_on_their_own_tensors():
    a = with_tensors(make_records(10, seed=1), [0.08] * 10)
    b = with_tensors(make_records(10, seed=2), [0.05 + 0.01 * i for i in range(10)])
    # RSS grows with each run in the process; the run tensors do not.
    b = [dataclasses.replace(r, host_rss_gib=r.host_rss_gib + 1.0) for r in b]
    cmp = F.compare_figure({"fp32": as_frame(a), "bf16": as_frame(b)})
    assert_same(F.find_trace(cmp, "memory", "host_tensors", run="bf16").y, [r.host_tensors_gib for r in b])
    assert not F.find_traces(cmp, panel="memory", kind="host_rss")
    peak = F.find_traces(cmp, kind="peak_memory")[0]
    assert list(peak.y) == [pytest.approx(0.08), pytest.approx(0.14)]
    assert "tensors" in peak.name
    # A summary's peak wins over the history's.
    cmp = F.compare_figure({"fp32": as_frame(a), "bf16": as_frame(b)},
                           summaries={"fp32": {"peak_host_tensors_gib": 0.5},
                                      "bf16": {"peak_host_tensors_gib": 0.25}})
    assert list(F.find_traces(cmp, kind="peak_memory")[0].y) == [0.5, 0.25]
    # Without the field: the RSS peak, as before.
    old = F.compare_figure({"fp32": frame(make_records(10)), "bf16": frame(make_records(10, seed=2))})
    assert "RSS" in F.find_traces(old, kind="peak_memory")[0].name


# ------------------------------------------------------------------------------------------------
# The live widget and the browser
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def frontend(monkeypatch):
    """A stand-in for JupyterLab's widget front end, as plotly's FigureWidget behaves there.

    plotly's view subscribes to the model's ``_py2js_*`` changes through the model it got at initialize
    time, so removing the view (its output replaced) purges the graph div but leaves the subscription:
    every later message to that model makes plotly.js throw ("gd.data must be an array"). This records
    what is displayed where and what each widget is sent, and lists the messages a dead view would get.
    """
    import IPython.display
    import ipywidgets

    log = {"shown": {}, "dead": set(), "errors": [], "sent": [], "handles": [], "answers": []}

    class Handle:
        def __init__(self, obj):
            self.obj = None
            log["handles"].append(self)
            self.update(obj)

        def update(self, obj, raw=False):
            old, self.obj = self.obj, obj
            if isinstance(old, go.FigureWidget) and obj is not old:
                log["dead"].add(id(old))         # the view is removed; its listeners are not
            if isinstance(obj, go.FigureWidget):
                log["shown"].setdefault(id(obj), len(log["sent"]))

    def display(obj, raw=False, display_id=None, **kw):
        return Handle(obj)

    original = ipywidgets.Widget._send

    def send(self, msg, buffers=None):
        log["sent"].append((id(self), msg))
        state = msg.get("state", {}) if isinstance(msg, dict) else {}
        live = {k for k, v in state.items() if k.startswith("_py2js_") and v is not None}
        if id(self) in log["dead"] and live:
            log["errors"].append(sorted(live))
        elif live and id(self) in log["shown"]:
            # plotly.js answers each edit a live view gets: its trace deltas, then its layout delta (two comm
            # messages); while a cell runs they wait in the kernel's queue (deliver_answers)
            for k in sorted(live):
                edit = state[k]
                for key, trait in (("trace_edit_id", "_js2py_traceDeltas"),
                                   ("layout_edit_id", "_js2py_widget_layoutDelta")):
                    if isinstance(edit, dict) and key in edit:
                        log["answers"].append((self, trait, {key: edit[key]}))
        return original(self, msg, buffers)

    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(ipywidgets.Widget, "_send", send)
    return log


def deliver_answers(log) -> list:
    """Deliver the front end's queued answers, as the kernel does once the cell is done; returns the comms that
    were closed by then (the kernel logs "No such comm" for each, and drops the message)."""
    unknown = []
    for widget, trait, msg in log["answers"]:
        if widget.comm is None:
            unknown.append((id(widget), trait))
        else:
            setattr(widget, trait, {"trace_deltas": [], "layout_delta": {}, **msg})
    log["answers"].clear()
    return unknown


def test_live_widget_gets_no_message_after_its_view_is_replaced(frontend):
    dash = LiveDashboard(mode="widget", max_redraws_per_s=1000)
    runs = {"fp32": make_records(15, variant="fp32", scaler=False),
            "fp16": make_records(15, variant="fp16", skip={4}, inf_grad={4}),
            "bf16": make_records(15, variant="bf16", scaler=False)}
    widgets_used = []
    for name, recs in runs.items():
        feed(dash, make_info(name, scaler=name == "fp16", variant=name), recs)
        widgets_used.append(dash.figure)
    assert frontend["errors"] == []
    # Each run drew on its own widget; the finished ones were closed once the front end had answered them.
    assert len({id(w) for w in widgets_used}) == 3
    assert deliver_answers(frontend) == []
    assert all(w.comm is None for w in widgets_used[:2]) and widgets_used[2].comm is not None
    # A new widget arrives complete: nothing was added to it, or deleted from it, before it was shown.
    for w in widgets_used[1:]:
        shown_at = frontend["shown"][id(w)]
        early = [m for i, (wid, m) in enumerate(frontend["sent"][:shown_at]) if wid == id(w)
                 and any(k in m.get("state", {}) for k in ("_py2js_addTraces", "_py2js_deleteTraces"))]
        assert early == []
    # What was drawn is all there, in the figure the dashboard keeps.
    for name, recs in runs.items():
        assert_same(F.find_trace(dash.figure, "loss", "loss", run=name).y, col(recs, "loss"))
    assert F.iter_runs(dash.figure) == list(runs)
    # The status line and the live figure were shown in the same two places throughout.
    assert len(frontend["handles"]) == 2


def test_a_retired_live_widget_is_closed_after_the_front_ends_last_answer_never_before(frontend):
    """Notebook 04's log console collected "No such comm" warnings in every run: a comparison in one cell drew each
    run on a new widget and closed the last one as the next run started, while plotly.js's answers to that widget's
    last redraws still waited in the kernel's queue (a busy kernel reads comm messages after the cell). A retired
    widget now closes when its last answer arrives."""
    dash = LiveDashboard(mode="widget", max_redraws_per_s=1000)
    widgets_used = []
    for name in ("fp32", "fp16", "bf16"):   # one cell: no answer is read in between
        feed(dash, make_info(name, scaler=name == "fp16", variant=name), make_records(6, variant=name,
                                                                                      scaler=name == "fp16"))
        widgets_used.append(dash.figure)
    assert all(w.comm is not None for w in widgets_used)   # nothing closed under queued answers
    assert frontend["answers"], "the simulated front end answered nothing: the test would prove nothing"
    assert deliver_answers(frontend) == []                 # the cell is done: no answer finds its comm closed
    assert [w.comm is None for w in widgets_used] == [True, True, False]
    # a widget with nothing left to answer closes at once
    fresh = live_figure_widget(F.make_run_layout())
    fresh.close_when_answered()
    assert fresh.comm is None


def test_live_comparison_has_the_exact_difference_panel_while_the_second_run_is_drawn():
    """Overlaid live runs get a fifth panel: each run's loss minus the first run's, per step, exactly; it is
    updated in place as the second run goes (issue 21: live as in the final figure)."""
    a = make_records(12, variant="fp32", seed=1)
    b = make_records(12, variant="bf16", seed=2)
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=1000)
    feed(dash, make_info("fp32", scaler=False, variant="fp32"), a)
    dash.on_run_start(make_info("bf16", scaler=False, variant="bf16"))
    for r in b[:7]:
        dash.on_step_end(r)
    dash.refresh()
    fig = dash.figure
    diff = F.find_trace(fig, "loss_diff", "loss_diff", run="bf16")
    expect = [rb.loss - ra.loss for ra, rb in zip(a[:7], b[:7])]
    assert list(diff.x[:7]) == list(range(1, 8)) and list(diff.y[:7]) == expect
    assert all(math.isnan(v) for v in diff.y[7:])            # steps bf16 has not reached yet
    for r in b[7:]:
        dash.on_step_end(r)
    dash.on_run_end(None)
    diff = F.find_trace(dash.figure, "loss_diff", "loss_diff", run="bf16")
    assert list(diff.y) == [rb.loss - ra.loss for ra, rb in zip(a, b)]
    assert list(F.find_trace(dash.figure, "loss_diff", "loss_diff", run="fp32").y) == [0.0] * 12
    # a single run has no difference panel
    solo = LiveDashboard(mode="widget", display=False)
    feed(solo, make_info("fp32", scaler=False, variant="fp32"), a)
    assert not F.find_traces(solo.figure, panel="loss_diff")
