"""The live figure is right (issue 35): no exception in the kernel while it is drawn, and every trace keeps its x.

In JupyterLab, plotly.js answers every restyle with "trace deltas" (the values it computed). Measured there with
plotly 7.1: a trace whose y is all NaN (the loss scale of an fp32 run) came back with its x as a typed array the
comm serialises as an index-keyed dict, and the clipping line's y ``[1.0, 1.0]`` as ``[1, 1]``. Stock
``FigureWidget`` then raised ``ValueError`` in the kernel (``_remove_overlapping_props``) or removed x/y from the
trace, and lines were drawn at 0, 1, 2, ... ``FakeFrontend`` sends such deltas for every trace after every
redraw, from code: the stock widget fails under it (shown first, so the simulation is known to bite), the
dashboard's does not.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

import nbtrain as nbt
from nbtrain.engine import StopTraining

pytest.importorskip("anywidget")
go = pytest.importorskip("plotly.graph_objects")

from nbtrain.viz import figures as F  # noqa: E402
from nbtrain.viz.dashboard import LiveDashboard  # noqa: E402
from nbtrain.viz.widget import live_figure_widget  # noqa: E402

from .test_viz import make_info, make_records  # noqa: E402

SMALL = dict(model="tiny", data="builtin:python-docs", subset=48, max_seq_len=32, micro_batch_size=4,
             eval_fraction=0.0, precision="fp32", lr=1e-3, max_grad_norm=1.0)


def echoed(fig) -> dict:
    """What plotly.js's front end sends back after a restyle, for every trace: x as the JSON of a typed array (an
    index-keyed dict), an integral y as ints."""
    deltas = []
    for tr in fig.data:
        d = {"uid": tr.uid}
        if tr.x is not None and len(tr.x):
            d["x"] = {str(i): v for i, v in enumerate(np.asarray(tr.x, dtype=float).tolist())}
        y = np.asarray(tr.y if tr.y is not None else [], dtype=float)
        if y.size and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            d["y"] = [int(v) for v in y]
        deltas.append(d)
    return {"trace_deltas": deltas, "trace_edit_id": fig._last_trace_edit_id}


def answer(fig) -> None:
    """Deliver the front end's answer to the kernel's figure, as the comm does (a trait set)."""
    fig._js2py_traceDeltas = echoed(fig)
    fig._js2py_layoutDelta = {"layout_delta": {"xaxis": {"range": [0, 1]}, "height": 500},
                              "layout_edit_id": fig._last_layout_edit_id}


class FakeFrontend:
    """A callback placed after a dashboard: answers each of its redraws as the browser would, and keeps every
    restyle the kernel sent that would remove a property in plotly.js (``removals``): a batch fills what a trace
    did not change with plotly's Undefined, which plotly.js's restyle takes as "delete" (measured in JupyterLab:
    lines lost their x)."""

    def __init__(self, figure_of):
        self.figure_of = figure_of   # the figure is replaced between runs: ask for it each time
        self.answered = 0
        self.removals: list = []
        self._seen = None
        self._watched: set = set()

    def _watch(self, fig) -> None:
        if id(fig) in self._watched:
            return
        self._watched.add(id(fig))
        from plotly.basedatatypes import Undefined

        def sent(change):
            msg = change["new"] or {}
            data = msg.get("style_data") or msg.get("restyle_data") or {}
            traces = msg.get("style_traces") or msg.get("restyle_traces") or []
            for prop, values in data.items():
                for k, v in enumerate(values if isinstance(values, list) else [values]):
                    if v is Undefined:
                        idx = traces[k] if isinstance(traces, list) and k < len(traces) else traces
                        self.removals.append((fig.data[idx].meta if isinstance(idx, int) else idx, prop))

        fig.observe(sent, names=["_py2js_update", "_py2js_restyle"])

    def _answer(self) -> None:
        fig = self.figure_of()
        if fig is None or not hasattr(fig, "_js2py_traceDeltas"):
            return
        self._watch(fig)
        stamp = (id(fig), fig._last_trace_edit_id)
        if stamp != self._seen:
            self._seen = stamp
            answer(fig)
            self.answered += 1

    def on_run_start(self, info) -> None:
        self._answer()

    def on_step_end(self, record) -> None:
        self._answer()

    def on_run_end(self, result) -> None:
        self._answer()


def small_figure():
    # an fp32-like run: no scale (an all-NaN scale line), a clipping line at 1
    return F.run_figure(make_records(8, scaler=False), None, None)


def test_the_simulated_front_end_breaks_plotlys_own_widget():
    # The simulation reproduces what was seen in the browser: stock FigureWidget raises or loses x.
    fig = go.FigureWidget(small_figure())
    with fig.batch_update():
        for tr in fig.data:
            tr.x = tr.x
    try:
        answer(fig)
    except ValueError as e:
        assert "truth value of an array" in str(e)
    else:
        lost = [tr.meta["kind"] for tr in fig.data if tr.x is None or len(tr.x) == 0]
        assert lost, "the stock widget kept every x: the simulation no longer reproduces the bug"


def test_the_live_widget_keeps_every_property_under_the_front_ends_answers():
    fig = live_figure_widget(small_figure())
    before = [repr((None if tr.x is None else list(tr.x), None if tr.y is None else list(tr.y))) for tr in fig.data]
    for _ in range(3):
        with fig.batch_update():
            for tr in fig.data:
                tr.x = tr.x
        answer(fig)
    after = [repr((None if tr.x is None else list(tr.x), None if tr.y is None else list(tr.y))) for tr in fig.data]
    assert after == before
    assert not fig._trace_edit_in_process and not fig._layout_edit_in_process   # the edits were acknowledged
    assert fig.layout.height == F.RUN_HEIGHT    # the front end's layout answer overwrote nothing


def steps_of(history) -> list[int]:
    return [int(s) for s in history["step"]]


def assert_traces_at_steps(fig, histories: dict) -> None:
    """Every run's traces lie at that run's steps; loss, grad norm and the memory line reach its last step."""
    for tr in fig.data:
        run, kind = tr.meta["run"], tr.meta["kind"]
        if run not in histories:
            continue
        steps = steps_of(histories[run])
        x = [] if tr.x is None else [float(v) for v in tr.x]
        assert set(x) <= set(map(float, steps)), (run, kind, x[:8])
        if kind in ("loss", "loss_ema", "grad_norm", "loss_diff"):
            assert x == [float(s) for s in steps], (run, kind, x[:8], steps[:8])
        if kind in ("host_tensors", "host_tensors_carried", "host_rss", "clip_threshold") and x:
            assert max(x) == steps[-1] or kind == "host_tensors", (run, kind, x)
    for run, history in histories.items():
        mem = F.find_traces(fig, panel="memory", run=run)
        reach = max(float(v) for tr in mem for v in (tr.x if tr.x is not None else []) if v is not None)
        assert reach == steps_of(history)[-1], f"{run}: the memory line ends at {reach}, the run at step " \
                                               f"{steps_of(history)[-1]}"


def test_a_run_a_stopped_run_and_a_compare_keep_their_x_under_the_front_end():
    # Train
    dash = LiveDashboard(display=False, mode="widget")
    front = FakeFrontend(lambda: dash.figure)
    res = nbt.train(nbt.TrainConfig(**SMALL, max_steps=12), callbacks=[dash, front])
    assert res.summary["stopped_reason"] == "max_steps", res.summary   # a callback error would say so
    assert front.answered >= 3
    assert_traces_at_steps(dash.figure, {"run": res.history})

    # Stop at step 9: between the sampled memory steps (1-3, 10, ...)
    class StopAt:
        def on_step_end(self, record):
            if record.step == 9:
                raise StopTraining

    dash = LiveDashboard(display=False, mode="widget")
    front = FakeFrontend(lambda: dash.figure)
    res = nbt.train(nbt.TrainConfig(**SMALL, max_steps=40), callbacks=[dash, front, StopAt()])
    assert res.summary["stopped_reason"] == "stopped" and len(res.history) == 9
    assert_traces_at_steps(dash.figure, {"run": res.history})
    carried = F.find_trace(dash.figure, "memory", "host_tensors_carried")
    assert list(carried.x) == [3.0, 9.0] and carried.line.dash == "dot"   # drawn on, and drawn as such

    # Compare: four variants, the scale line of three of them all NaN (the trace that raised in the browser)
    dash = LiveDashboard(display=False, mode="widget")
    front = FakeFrontend(lambda: dash.figure)
    cmp = nbt.compare(nbt.TrainConfig(**{**SMALL, "max_steps": 4, "subset": 24}),
                      precisions=("fp32", "fp16", "bf16", "bf16-pure"), callbacks=[dash, front], warmup=False)
    ran = {n: r.history for n, r in cmp.results.items() if r.history is not None and len(r.history)}
    assert len(ran) == 4, cmp.table[["variant", "status", "notes"]]
    assert all(r.summary["stopped_reason"] == "max_steps" for r in cmp.results.values())
    assert_traces_at_steps(dash.figure, ran)
    assert front.removals == []   # nothing the browser would delete (an all-NaN scale line's x, a Δ line's x)
    # the difference panel, once, at each run's steps
    assert {tr.meta["run"] for tr in dash.figure.data if tr.meta["kind"] == "loss_diff"} == set(ran)


def decoded(obj):
    """Plotly JSON with its typed arrays (``{"dtype", "bdata"}``, base64) as lists, as plotly.js reads them."""
    import base64

    if isinstance(obj, dict):
        if set(obj) >= {"dtype", "bdata"}:
            return np.frombuffer(base64.b64decode(obj["bdata"]), dtype=obj["dtype"]).tolist()
        return {k: decoded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decoded(v) for v in obj]
    return obj


def test_html_mode_draws_every_trace_at_its_steps(monkeypatch):
    shown = []

    class Handle:
        def __init__(self, obj):
            shown.append(obj)

        def update(self, obj, raw=False):
            shown.append(obj)

    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False, display_id=None: Handle(obj))
    dash = LiveDashboard(display=True, mode="html")
    res = nbt.train(nbt.TrainConfig(**SMALL, max_steps=6), callbacks=[dash])
    assert res.summary["stopped_reason"] == "max_steps"
    figs = [b["application/vnd.plotly.v1+json"] for b in shown if isinstance(b, dict)
            and "application/vnd.plotly.v1+json" in b]
    assert figs, "no figure was shown"
    last = go.Figure(decoded(figs[-1]))
    assert_traces_at_steps(last, {"run": res.history})
    assert not any(math.isnan(v) for tr in last.data if tr.meta["kind"] == "loss" for v in tr.x)


def test_the_live_widget_asks_its_views_to_fit_their_width_after_each_rebuild():
    # A view drawn before the page held it stood at plotly.js's default width until the run ended: the first
    # redraws after each rebuild ask every view to size itself to its output (a relayout of autosize).
    dash = LiveDashboard(display=False, mode="widget", max_redraws_per_s=1000)
    sent = []
    original = dash.figure._send_relayout_msg
    dash.figure._send_relayout_msg = lambda data, source_view_id=None: (sent.append(dict(data)),
                                                                        original(data, source_view_id))
    res = nbt.train(nbt.TrainConfig(**SMALL, max_steps=6), callbacks=[dash])
    assert res.summary["stopped_reason"] == "max_steps"
    fits = [d for d in sent if d == {"autosize": True}]
    assert 1 <= len(fits) <= 3 * max(1, dash.redraws), sent
    assert dash.figure.layout.width is None and dash.figure.layout.height == F.RUN_HEIGHT


class InstantTimer:
    """threading.Timer's stand-in: keeps the delay and runs the call when started (no waiting in tests)."""

    delays: list = []

    def __init__(self, delay, fn, args=()):
        self.delay, self.fn, self.args, self.daemon = delay, fn, args, False

    def start(self):
        InstantTimer.delays.append(self.delay)
        self.fn(*self.args)


def test_the_views_are_asked_to_fit_their_width_again_after_each_runs_first_point():
    # Issue 46: the view that shows a run's first point is drawn after that point's redraw, at plotly.js's 700 px
    # default, and a run held at a slow step sends no other redraw: the first point stood 700 px wide in a 1,008 px
    # output. Later fits, from a timer, reach the view once it is on the page.
    dash = LiveDashboard(display=False, mode="widget", max_redraws_per_s=1000)
    dash._timer = InstantTimer
    InstantTimer.delays = []
    fits = []
    for name in ("fp32", "bf16"):
        recs = make_records(3, variant=name, scaler=False)
        dash.on_run_start(make_info(name, scaler=False, variant=name))
        fig = dash.figure
        original = fig._send_relayout_msg
        fig._send_relayout_msg = lambda data, source_view_id=None, o=original: (fits.append(dict(data)), o(data))
        dash.on_step_end(recs[0])
        late = len(InstantTimer.delays)
        assert late >= 2 and sorted(InstantTimer.delays) == InstantTimer.delays, InstantTimer.delays
        assert fits.count({"autosize": True}) >= late   # each late fit was sent
        fits.clear()
        InstantTimer.delays = []
        for r in recs[1:]:
            dash.on_step_end(r)
        assert InstantTimer.delays == []   # only the first point schedules them
        dash.on_run_end(None)
    # a figure that is no longer the dashboard's gets no late fit
    old = dash.figure
    dash._late_fit(live_figure_widget(F.make_run_layout()))
    assert dash.figure is old


def test_a_late_fit_never_reaches_the_live_view_a_run_end_replaced():
    # A late fit (a timer thread) checked that the figure was still live, lost the GIL, and sent its relayout after
    # run_end had replaced the live view by the static copy: the purged view failed in the browser ("Error setting
    # state: Cannot read properties of undefined (reading '_guiEditing')", one CI run). Here the fit thread is held
    # between its check and its message; its message must come before the replacement, or not at all.
    dash = LiveDashboard(display=False, mode="widget", max_redraws_per_s=1000)
    dash._timer = _NoTimer
    dash.on_run_start(make_info("fp32", scaler=False, variant="fp32"))
    for r in make_records(3, scaler=False):
        dash.on_step_end(r)
    fig, events = dash.figure, []
    checked, replaced = threading.Event(), threading.Event()
    send = fig._send_relayout_msg
    fig._send_relayout_msg = lambda data, source_view_id=None: (
        events.append("fit") if data == {"autosize": True} else None, send(data, source_view_id))
    fit = fig.fit_width

    def preempted_fit():
        checked.set()
        replaced.wait(1.0)   # the replacement, if it can happen meanwhile, happens now
        fit()
    fig.fit_width = preempted_fit

    class Handle:
        def __init__(self, name):
            self.name = name

        def update(self, *args, **kwargs):
            events.append(self.name)
            if self.name == "figure":
                replaced.set()
    dash.view.display = True
    dash.view._fig_handle, dash.view._status_handle = Handle("figure"), Handle("status")
    late = threading.Thread(target=dash._late_fit, args=(fig,), daemon=True)
    redraw = dash._redraw

    def redraw_then_a_late_fit(force=False):
        drawn = redraw(force)
        if late.ident is None:   # the run end's last redraw is done: the timer fires now
            late.start()
            checked.wait(30)
        return drawn
    dash._redraw = redraw_then_a_late_fit
    dash.on_run_end(None)
    late.join(30)
    assert not late.is_alive() and "figure" in events, events
    assert "fit" not in events[events.index("figure"):], events
    assert dash.view.retired


class _NoTimer:
    def __init__(self, *args, **kwargs):
        self.daemon = True

    def start(self):
        pass


def test_a_first_point_is_drawn_with_its_marker_then_as_a_line():
    # plotly draws no line through one point: at a run's first point the loss and grad-norm panels stood empty.
    one = F.run_figure(make_records(1, scaler=False))
    for panel, kind in (("loss", "loss"), ("loss", "loss_ema"), ("grad_norm", "grad_norm"), ("memory", "host_rss")):
        assert F.find_trace(one, panel, kind).mode == "lines+markers", (panel, kind)
    two = F.run_figure(make_records(2, scaler=False))
    assert F.find_trace(two, "loss", "loss").mode == "lines"
    # live: the mode changes with the data, in place
    dash = LiveDashboard(display=False, mode="widget", max_redraws_per_s=1000)
    dash._timer = InstantTimer
    recs = make_records(3, scaler=False)
    dash.on_run_start(make_info("fp32", scaler=False, variant="fp32"))
    dash.on_step_end(recs[0])
    assert F.find_trace(dash.figure, "loss", "loss_ema").mode == "lines+markers"
    dash.on_step_end(recs[1])
    dash.refresh()
    assert F.find_trace(dash.figure, "loss", "loss_ema").mode == "lines"
