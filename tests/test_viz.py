"""Figures and the LiveDashboard: exact values, markers, throttling, threads, fallbacks, headless notebooks."""

import base64
import dataclasses
import math
import threading
import time

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from nbtrain.engine.records import EvalRecord, RunInfo, StepRecord
from nbtrain.viz import dashboard as D
from nbtrain.viz import figures as F
from nbtrain.viz import text as T
from nbtrain.viz.dashboard import LiveDashboard

PANELS = ("loss", "grad_norm", "scale", "memory")


# ------------------------------------------------------------------------------------------------
# Synthetic runs
# ------------------------------------------------------------------------------------------------
def make_records(n=30, *, nan_loss=(), inf_grad=(), skip=(), scaler=True, vram=False, variant=None,
                 clip=1.0, seed=0):
    """A plausible run: decaying loss, noisy grad norms, a halving scale on skipped steps."""
    rng = np.random.default_rng(seed)
    scale = 2.0 ** 16
    recs = []
    for s in range(1, n + 1):
        skipped = s in skip
        if skipped and scaler:
            scale /= 2
        loss = math.nan if s in nan_loss else 4.0 * math.exp(-s / 40) + 0.05 * rng.random()
        gn = math.inf if s in inf_grad else float(0.3 + 1.5 * rng.random())
        nonfinite = not (math.isfinite(loss) and math.isfinite(gn))
        recs.append(StepRecord(
            step=s, epoch=s / n, micro_steps=2, tokens=500 + s, loss=loss, lr=1e-3, grad_norm=gn,
            clipped=bool(clip) and math.isfinite(gn) and gn > clip and not skipped,
            scale=scale if scaler else None, skipped=skipped, nonfinite=nonfinite,
            vram_allocated_gib=1.0 + 0.01 * s if vram else None,
            vram_reserved_gib=2.0 + 0.01 * s if vram else None,
            vram_peak_gib=1.5 + 0.01 * s if vram else None,
            host_rss_gib=0.7 + 0.001 * s, step_time_s=0.1, tokens_per_s=5000.0 + s, elapsed_s=0.1 * s,
            variant=variant))
    return recs


class _Cfg:
    micro_batch_size = 4
    grad_accum_steps = 2
    method = "lora"


def make_info(precision="fp16", *, scaler=True, device="cpu", total_steps=30, variant=None, clip=1.0):
    return RunInfo(config=_Cfg(), precision_used=precision, device=device, device_name="test",
                   device_total_gib=24.0, scaler_enabled=scaler, total_steps=total_steps,
                   train_examples=100, eval_examples=10, trainable_params=10, total_params=100,
                   max_grad_norm=clip, variant=variant)


def frame(records):
    return pd.DataFrame([r.to_dict() for r in records])


def col(records, name):
    return np.array([math.nan if getattr(r, name) is None else getattr(r, name) for r in records],
                    dtype=float)


def steps_where(records, pred):
    return [r.step for r in records if pred(r)]


def assert_same(a, b):
    np.testing.assert_array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float))


def decode(v):
    """A trace array as plotly's JSON writes it (base64 'bdata') or as a plain list."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
    return np.asarray(v, dtype=float)


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_frame", [False, True])
def test_run_figure_traces_hold_the_recorded_values(as_frame):
    recs = make_records(40, nan_loss={7}, inf_grad={7, 8}, skip={7, 8})
    evals = [EvalRecord(step=20, eval_loss=2.5, eval_tokens=100), EvalRecord(step=40, eval_loss=2.0,
                                                                              eval_tokens=100)]
    hist = frame(recs) if as_frame else recs
    ev = pd.DataFrame([e.to_dict() for e in evals]) if as_frame else evals
    fig = F.run_figure(hist, ev, make_info())
    steps = col(recs, "step")
    for panel, kind, field in [("loss", "loss", "loss"), ("grad_norm", "grad_norm", "grad_norm"),
                               ("scale", "scale", "scale"), ("memory", "host_rss", "host_rss_gib")]:
        tr = F.find_trace(fig, panel, kind)
        assert_same(tr.x, steps)
        assert_same(tr.y, col(recs, field))  # nan stays nan, inf stays inf
    assert math.isnan(F.find_trace(fig, "loss", "loss").y[6])
    ev_tr = F.find_trace(fig, "loss", "eval_loss")
    assert_same(ev_tr.x, [20, 40]) and assert_same(ev_tr.y, [2.5, 2.0])
    clipped = F.find_trace(fig, "grad_norm", "clipped")
    assert_same(clipped.x, steps_where(recs, lambda r: r.clipped))
    assert_same(clipped.y, [r.grad_norm for r in recs if r.clipped])
    thr = F.find_trace(fig, "grad_norm", "clip_threshold")
    assert list(thr.y) == [1.0, 1.0] and list(thr.x) == [1, 40]
    ema = F.find_trace(fig, "loss", "loss_ema")
    assert_same(ema.y, F.smooth(col(recs, "loss"), 0.9))


def test_skipped_and_nonfinite_steps_are_marked_in_every_panel():
    recs = make_records(30, nan_loss={5}, inf_grad={5, 12}, skip={5, 12})
    fig = F.run_figure(recs, None, make_info())
    for panel in PANELS:
        sk = F.find_trace(fig, panel, "skipped")
        nf = F.find_trace(fig, panel, "nonfinite")
        assert_same(sk.x, [5, 12])
        assert_same(nf.x, [5, 12])
        # Markers sit where they can be seen, and say what happened.
        assert np.isfinite(np.asarray(sk.y, dtype=float)).all()
        assert np.isfinite(np.asarray(nf.y, dtype=float)).all()
        assert "skipped" in sk.hovertext[0] and "loss=nan" in sk.hovertext[0]
        assert "grad_norm=inf" in nf.hovertext[1]
    nan_marker = F.find_trace(fig, "loss", "nonfinite")
    assert list(nan_marker.text) == ["nan", ""]
    assert nan_marker.y[0] == pytest.approx(recs[3].loss)       # at the last finite loss
    gn_top = max(r.grad_norm for r in recs if math.isfinite(r.grad_norm))
    assert F.find_trace(fig, "grad_norm", "nonfinite").y[0] == pytest.approx(gn_top)
    assert F.find_trace(fig, "scale", "skipped").y[0] == recs[4].scale  # the halved scale


def test_smooth_is_a_debiased_ema_that_holds_over_nonfinite_values():
    y = [2.0, 4.0, math.nan, 6.0, math.inf]
    s = 0.5
    ema, n, want = 0.0, 0, []
    for v in y:
        if math.isfinite(v):
            ema, n = s * ema + (1 - s) * v, n + 1
        want.append(ema / (1 - s ** n))
    assert_same(F.smooth(y, s), want)
    assert F.smooth([1.0, 2.0], 0.9)[0] == pytest.approx(1.0)  # debiased: starts at the first value
    assert math.isnan(F.smooth([math.nan, 1.0], 0.9)[0])
    assert_same(F.smooth([3.0, math.nan, 5.0], 0.0), [3.0, 3.0, 5.0])
    with pytest.raises(ValueError):
        F.smooth([1.0], 1.0)


def test_bf16_run_says_no_scaler_and_cpu_memory_is_host_memory():
    recs = make_records(10, scaler=False)
    fig = F.run_figure(recs, None, make_info("bf16", scaler=False))
    notes = [a.text for a in fig.layout.annotations if a.name == "no_scaler"]
    assert notes and "no GradScaler" in notes[0] and "bf16" in notes[0]
    assert np.isnan(np.asarray(F.find_trace(fig, "scale", "scale").y, dtype=float)).all()
    titles = [a.text for a in fig.layout.annotations]
    assert any("host memory" in t for t in titles)
    assert F.find_trace(fig, "memory", "host_rss").name.startswith("host memory")
    assert not F.find_traces(fig, panel="memory", kind="vram_allocated")
    # An fp16 run carries no such note.
    fig16 = F.run_figure(make_records(10), None, make_info("fp16"))
    assert not [a for a in fig16.layout.annotations if a.name == "no_scaler"]


def test_vram_panel_draws_allocated_reserved_peak_and_device_total():
    recs = make_records(12, vram=True)
    fig = F.run_figure(recs, None, make_info(device="cuda"))
    for kind, field in [("vram_allocated", "vram_allocated_gib"), ("vram_reserved", "vram_reserved_gib"),
                        ("vram_peak", "vram_peak_gib")]:
        assert_same(F.find_trace(fig, "memory", kind).y, col(recs, field))
    total = F.find_trace(fig, "memory", "device_total")
    assert list(total.y) == [24.0, 24.0]
    assert not F.find_traces(fig, panel="memory", kind="host_rss")


def test_overlay_and_compare_figures():
    a = make_records(20, seed=1)
    b = make_records(20, seed=2, skip={4}, inf_grad={4})
    fig = F.runs_figure({"fp32": (a, None, make_info("fp32", scaler=False)), "fp16": (b, None, make_info())})
    assert F.iter_runs(fig) == ["fp32", "fp16"]
    la, lb = (F.find_trace(fig, "loss", "loss", run=r) for r in ("fp32", "fp16"))
    assert la.line.color != lb.line.color
    assert_same(lb.y, col(b, "loss"))
    assert_same(F.find_trace(fig, "scale", "skipped", run="fp16").x, [4])
    assert "no GradScaler in fp32 (not needed)" in [x.text for x in fig.layout.annotations
                                                            if x.name == "no_scaler"][0]

    summaries = {"fp32": {"tokens_per_s": 100.0, "peak_vram_gib": None}, "fp16": {"tokens_per_s": 250.0}}
    cmp = F.compare_figure({"fp32": frame(a), "fp16": frame(b)}, reference="fp32", summaries=summaries)
    diff_ref = F.find_trace(cmp, "loss_diff", "loss_diff", run="fp32")
    assert np.allclose(diff_ref.y, 0.0)
    diff = F.find_trace(cmp, "loss_diff", "loss_diff", run="fp16")
    assert_same(diff.y, np.asarray(col(b, "loss")) - np.asarray(col(a, "loss")))   # exact, per step: no EMA
    bars = F.find_traces(cmp, kind="tokens_per_s")[0]
    assert list(bars.x) == ["fp32", "fp16"] and list(bars.y) == [100.0, 250.0]
    peak = F.find_traces(cmp, kind="peak_memory")[0]  # no VRAM here: the host RSS peak from the history
    assert list(peak.y) == [pytest.approx(max(col(a, "host_rss_gib"))), pytest.approx(max(col(b, "host_rss_gib")))]
    with pytest.raises(ValueError):
        F.compare_figure({"a": frame(a)}, reference="zzz")


def test_add_run_traces_on_a_custom_grid():
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=4, cols=1)
    added = F.add_run_traces(fig, make_records(5), name="x", rows={"loss": 1, "scale": 3})
    assert {t.yaxis for t in added} == {"y", "y3"}
    assert {t.meta["panel"] for t in added} == {"loss", "scale"}
    assert len(fig.data) == len(added)


# ------------------------------------------------------------------------------------------------
# Dashboard
# ------------------------------------------------------------------------------------------------
class FakeHandle:
    def __init__(self, obj, raw):
        self.history = [(obj, raw)]

    def update(self, obj, raw=False):
        self.history.append((obj, raw))

    @property
    def last(self):
        return self.history[-1][0]


@pytest.fixture
def fake_display(monkeypatch):
    """Capture IPython display calls; fail if anything tries to clear the cell."""
    import IPython.display

    shown = []

    def display(obj, raw=False, display_id=None, **kw):
        assert display_id is True, "the dashboard must display through handles"
        h = FakeHandle(obj, raw)
        shown.append(h)
        return h

    def clear_output(*a, **k):
        raise AssertionError("clear_output must never be called")

    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(IPython.display, "clear_output", clear_output)
    return shown


def count_redraws(dash, clock=None):
    """Wrap the dashboard's figure update to count (and timestamp) redraws (a redraw may send several batches:
    one per set of changed trace properties)."""
    calls = []
    original = dash._update_figure

    def counting(snap):
        calls.append(clock() if clock else time.monotonic())
        return original(snap)

    dash._update_figure = counting
    return calls


def feed(dash, info, recs, evals=(), sleep=0.0):
    dash.on_run_start(info)
    for r in recs:
        dash.on_step_end(r)
        if sleep:
            time.sleep(sleep)
    for e in evals:
        dash.on_eval(e)
    dash.on_run_end(None)


def test_thousand_fast_steps_redraw_at_most_5_per_second_and_end_complete():
    recs = make_records(1000, nan_loss={100}, skip={100, 500}, inf_grad={100, 500})
    dash = LiveDashboard(mode="widget", display=False)
    assert isinstance(dash.figure, go.FigureWidget)
    calls = count_redraws(dash)
    t0 = time.monotonic()
    feed(dash, make_info(total_steps=1000), recs, sleep=0.002)
    elapsed = time.monotonic() - t0
    assert dash.redraws == len(calls)
    # run start + run end are forced; in between at most one every 1/5 s.
    assert 3 <= dash.redraws <= 5 * elapsed + 2, (dash.redraws, elapsed)
    assert_same(F.find_trace(dash.figure, "loss", "loss").y, col(recs, "loss"))
    assert_same(F.find_trace(dash.figure, "grad_norm", "grad_norm").y, col(recs, "grad_norm"))
    assert_same(F.find_trace(dash.figure, "scale", "skipped").x, [100, 500])
    assert len(dash.records) == 1000


def test_throttle_spacing_with_a_controlled_clock():
    now = [0.0]
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=5)
    dash.tracker.clock = lambda: now[0]
    calls = count_redraws(dash, clock=lambda: now[0])
    dash.on_run_start(make_info(total_steps=1000))
    start_draws = len(calls)
    for r in make_records(1000):
        now[0] += 0.01            # 100 steps/s for 10 s
        dash.on_step_end(r)
    mid = calls[start_draws:]
    assert 3 <= len(mid) <= 10 * 5 + 1
    assert all(b - a >= 0.2 - 1e-9 for a, b in zip(mid, mid[1:]))
    dash.on_run_end(None)
    assert len(F.find_trace(dash.figure, "loss", "loss").y) == 1000


def test_each_runs_first_point_is_drawn_at_once():
    # Issue 46: the redraw a run's start makes held its first step back behind the throttle; a slow first step
    # (seconds on a real model) then left the figure empty.
    now = [0.0]
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=5)
    dash.tracker.clock = lambda: now[0]
    dash._timer = _NoTimer   # the late fits run on real time; here only the throttle's clock counts
    calls = count_redraws(dash, clock=lambda: now[0])
    for name in ("fp32", "bf16"):
        first, second = make_records(2, variant=name)
        dash.on_run_start(make_info(variant=name))
        started = len(calls)
        now[0] += 0.01   # well inside the throttle's 0.2 s after the start's redraw
        dash.on_step_end(first)
        assert len(calls) == started + 1, f"{name}: the first point was not drawn at once"
        assert list(F.find_trace(dash.figure, "loss", "loss", run=name).x) == [1.0]
        now[0] += 0.01
        dash.on_step_end(second)   # later steps keep the throttle
        assert len(calls) == started + 1
        dash.on_run_end(None)


class _NoTimer:
    def __init__(self, *args, **kwargs):
        self.daemon = True

    def start(self):
        pass


def test_a_first_point_that_arrives_during_a_late_fit_is_still_drawn():
    # The late fit holds the draw lock; a redraw finding it held skips (it never blocks the training thread), so
    # the fit draws what arrived meanwhile: else a first point could wait for the next step (it did in one suite run).
    now = [0.0]
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=5)
    dash.tracker.clock = lambda: now[0]
    dash._timer = _NoTimer
    calls = count_redraws(dash, clock=lambda: now[0])
    dash.on_run_start(make_info(variant="a"))
    first, = make_records(1, variant="a")
    fig, started = dash.figure, len(calls)
    fig.fit_width = lambda: dash.on_step_end(first)   # the step lands while the fit holds the lock
    now[0] += 0.01
    dash._late_fit(fig)
    assert len(calls) == started + 1 and list(F.find_trace(dash.figure, "loss", "loss", run="a").x) == [1.0]


def test_one_value_averages_to_itself_so_a_first_point_gets_readable_ticks():
    # (1 - s) * v / (1 - s) missed v by a rounding step for about one loss in eight: the loss line and its EMA
    # a rounding step apart made plotly tick the axis at that spread ("3.573132753372192383", issue 46).
    vals = np.random.default_rng(0).uniform(0.1, 20, 2000).tolist() + [3.5731327533721924]
    assert [F.smooth([v])[0] for v in vals] == vals
    assert_same(F.smooth([math.nan, 3.5731327533721924, math.inf], 0.9),
                [math.nan, 3.5731327533721924, 3.5731327533721924])
    fig = F.run_figure([dataclasses.replace(make_records(1)[0], loss=3.5731327533721924)])
    loss, ema = F.find_trace(fig, "loss", "loss"), F.find_trace(fig, "loss", "loss_ema")
    assert list(loss.y) == list(ema.y) == [3.5731327533721924]


def test_dashboard_from_a_background_thread_while_the_main_thread_reads():
    recs = make_records(400, skip={50}, inf_grad={50})
    dash = LiveDashboard(mode="widget", display=False, max_redraws_per_s=50)
    errors = []

    def train():
        try:
            feed(dash, make_info(total_steps=400), recs, sleep=0.0005)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    th = threading.Thread(target=train)
    th.start()
    while th.is_alive():       # a user poking at the dashboard from the notebook meanwhile
        dash.refresh()
        _ = dash.records
        time.sleep(0.01)
    th.join()
    assert not errors
    assert_same(F.find_trace(dash.figure, "loss", "loss").y, col(recs, "loss"))
    assert_same(F.find_trace(dash.figure, "memory", "skipped").x, [50])


def test_variants_share_one_dashboard_in_their_own_colours():
    dash = LiveDashboard(mode="html", display=False)
    a = make_records(15, variant="fp32", scaler=False)
    b = make_records(15, variant="fp16", skip={3}, inf_grad={3})
    feed(dash, make_info("fp32", scaler=False, variant="fp32"), a)
    feed(dash, make_info("fp16", variant="fp16"), b)
    assert list(dash.runs) == ["fp32", "fp16"]
    assert F.iter_runs(dash.figure) == ["fp32", "fp16"]
    assert_same(F.find_trace(dash.figure, "loss", "loss", run="fp32").y, col(a, "loss"))
    assert_same(F.find_trace(dash.figure, "loss", "loss", run="fp16").y, col(b, "loss"))
    c32 = F.find_trace(dash.figure, "loss", "loss_ema", run="fp32").line.color
    c16 = F.find_trace(dash.figure, "loss", "loss_ema", run="fp16").line.color
    assert c32 != c16


def test_html_fallback_updates_in_place_and_leaves_a_static_copy(fake_display):
    recs = make_records(50, nan_loss={10}, skip={10}, inf_grad={10})
    dash = LiveDashboard(mode="html")
    assert not isinstance(dash.figure, go.FigureWidget)
    feed(dash, make_info(), recs, evals=[EvalRecord(step=50, eval_loss=1.5, eval_tokens=10)], sleep=0.001)
    assert len(fake_display) == 2          # displayed once: a status line above a figure
    status, fig = fake_display
    final = fig.last
    assert fig.history[-1][1] is True
    assert "plotly" in final["text/html"] and "cdn.plot.ly" in final["text/html"]
    data = final["application/vnd.plotly.v1+json"]["data"]
    loss = next(t for t in data if t["meta"] == {"run": "run", "panel": "loss", "kind": "loss"})
    assert_same(decode(loss["y"]), col(recs, "loss"))
    assert "50 steps" in final["text/plain"] and "1 skipped" in final["text/plain"]
    assert "eval loss 1.5" in status.last["text/plain"]
    live_status = status.history[0][0]["text/plain"]
    assert "step" in live_status


def test_widget_mode_shows_the_widget_then_replaces_it_by_a_static_copy(fake_display):
    dash = LiveDashboard(mode="widget")
    recs = make_records(20)
    dash.on_run_start(make_info(total_steps=20))
    status, fig = fake_display
    assert fig.last is dash.figure and status.last is dash.view.status
    for r in recs:
        dash.on_step_end(r)
    dash.on_run_end(None)
    assert "step 20/20" in dash.view.status.value and "micro 4 × accum 2 = 8" in dash.view.status.value
    assert "lora" in dash.view.status.value and "fp16 + GradScaler" in dash.view.status.value
    assert isinstance(fig.last, dict) and "application/vnd.plotly.v1+json" in fig.last
    # A second run on the same dashboard brings the live widget back, in the same place.
    dash.on_run_start(make_info(variant="again"))
    assert fig.last is dash.figure and len(fake_display) == 2
    dash.on_run_end(None)
    assert isinstance(fig.last, dict)


def test_text_mode_prints_a_bar_and_a_summary(capsys):
    dash = LiveDashboard(mode="text", max_redraws_per_s=1000)
    recs = make_records(25, skip={3}, inf_grad={3})
    feed(dash, make_info(total_steps=25), recs)
    out, err = capsys.readouterr()
    assert "25/25" in err and "loss=" in err
    assert "25 steps" in out and "1 skipped" in out
    # The figure is complete after the run even though text mode never drew it live.
    assert_same(F.find_trace(dash.figure, "loss", "loss").y, col(recs, "loss"))


def test_status_line_contents():
    recs = make_records(10)
    line = T.status_line(recs, make_info(total_steps=40), None)
    assert line.startswith("step 10/40")
    assert "tok/s" in line and "ETA 0:03" in line and "elapsed 0:01" in line
    assert "micro 4 × accum 2 = 8" in line and "lora" in line and "fp16 + GradScaler" in line
    no_tokens = [StepRecord(**{**r.to_dict(), "tokens_per_s": 0.0}) for r in recs]
    assert "0.10 s/step" in T.status_line(no_tokens, None, 20)


def test_mode_detection_rules(monkeypatch):
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setenv(D.ENV_VAR, "html")
    assert D.detect_mode() == "html"
    monkeypatch.setenv(D.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="NBTRAIN_DASHBOARD"):
        D.detect_mode()
    monkeypatch.delenv(D.ENV_VAR)
    assert D.detect_mode() == "text"          # pytest runs outside a kernel

    class Shell:
        kernel = object()
        user_ns = {}

    monkeypatch.setattr(D, "_kernel_shell", lambda: Shell)
    assert D.detect_mode() == "html"           # a kernel nobody is known to draw widgets for
    monkeypatch.setenv("JPY_SESSION_NAME", "/tmp/x.ipynb")
    assert D.detect_mode() == "widget"         # started by a Jupyter server
    monkeypatch.delenv("JPY_SESSION_NAME")
    Shell.user_ns = {"__vsc_ipynb_file__": "x.ipynb"}
    assert D.detect_mode() == "widget"         # VS Code
    monkeypatch.setattr(D, "_widgets_importable", lambda: False)
    assert D.detect_mode() == "html"
    with pytest.raises(ValueError):
        LiveDashboard(mode="nope")


def test_colab_gets_the_display_handle_mode(monkeypatch):
    """issue 25: Colab renders ipywidgets but not plotly's FigureWidget (googlecolab/colab-cdn-widget-manager#51,
    googlecolab/colabtools#5889): a dashboard made there draws through a display handle (html)."""
    import importlib.machinery
    import sys
    import types

    class Shell:
        kernel = object()
        user_ns = {}

    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.setattr(D, "_kernel_shell", lambda: Shell)
    monkeypatch.setattr(D, "_widgets_importable", lambda: True)
    monkeypatch.setenv("JPY_SESSION_NAME", "/content/x.ipynb")   # even with a Jupyter-server hint
    assert D.detect_mode() == "widget" and D.panel_mode() == "widget"    # JupyterLab: the FigureWidget
    colab = types.ModuleType("google.colab")
    colab.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)   # find_spec() reads it, as in Colab
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    assert D.in_colab()
    assert D.detect_mode() == "html" and D.panel_mode() == "html"
    dash = LiveDashboard(display=False)
    assert dash.mode == "html" and not isinstance(dash.figure, go.FigureWidget) and dash.widget is None
    assert LiveDashboard(display=False, mode="widget").mode == "widget"   # an explicit mode still wins
    assert isinstance(LiveDashboard(display=False, mode="widget").figure, go.FigureWidget)
    assert LiveDashboard(display=False, mode="text").mode == "text"
    monkeypatch.setenv(D.ENV_VAR, "widget")                               # and so does the environment
    assert D.detect_mode() == "widget" and D.panel_mode() == "widget"
    monkeypatch.setenv(D.ENV_VAR, "text")
    assert D.detect_mode() == "text" and D.panel_mode() == "html"         # the Panel has no text view
    monkeypatch.delenv(D.ENV_VAR)
    monkeypatch.delitem(sys.modules, "google.colab")
    assert D.detect_mode() == "widget"


# ------------------------------------------------------------------------------------------------
# With the engine
# ------------------------------------------------------------------------------------------------
def test_forced_inf_fp16_run_is_drawn_exactly(tiny_cfg, monkeypatch):
    import nbtrain as nbt

    from .helpers import inject_inf

    cfg = tiny_cfg.replace(precision="fp16", max_steps=4, subset=32, max_seq_len=24)
    inject_inf(monkeypatch, on_forward_calls={2})
    dash = nbt.LiveDashboard(mode="widget", display=False)
    r = nbt.train(cfg, callbacks=[dash])
    h = r.history
    assert bool(h.skipped[1]) and not math.isfinite(h.loss[1])
    fig = dash.figure
    assert_same(F.find_trace(fig, "loss", "loss").y, h.loss)
    assert_same(F.find_trace(fig, "grad_norm", "grad_norm").y, h.grad_norm)
    assert_same(F.find_trace(fig, "scale", "scale").y, h.scale)
    for panel in PANELS:
        assert_same(F.find_trace(fig, panel, "skipped").x, [2])
        assert_same(F.find_trace(fig, panel, "nonfinite").x, [2])
    assert list(F.find_trace(fig, "loss", "nonfinite").text) == ["nan"]
    # result.figure() draws the same values from the DataFrame.
    again = r.figure()
    assert_same(F.find_trace(again, "loss", "loss").y, h.loss)
    assert_same(F.find_trace(again, "scale", "skipped").x, [2])


def test_dashboard_under_start_in_a_background_thread(tiny_cfg):
    import nbtrain as nbt

    dash = nbt.LiveDashboard(mode="widget", display=False)
    run = nbt.start(tiny_cfg.replace(max_steps=3), callbacks=[dash])
    r = run.wait()
    assert run.done and len(dash.records) == 3
    assert_same(F.find_trace(dash.figure, "loss", "loss").y, r.history.loss)
    assert "step 3/3" in dash.view.status.value


NOTEBOOK_CELLS = [
    """import nbtrain as nbt
from nbtrain.viz.dashboard import detect_mode
print("mode:", detect_mode())
cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=16, max_seq_len=32,
                      micro_batch_size=4, max_steps=3, eval_fraction=0.0, precision="fp32")
dash = nbt.LiveDashboard()
result = nbt.train(cfg, callbacks=[dash])""",
    # The widget path, replayed from the same records: it too must leave a static copy.
    """wdash = nbt.LiveDashboard(mode="widget")
wdash.on_run_start(result.info)
for rec in result.records:
    wdash.on_step_end(rec)
wdash.on_run_end(result)""",
]


@pytest.mark.slow
def test_headless_notebook_leaves_a_static_figure(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={
        "metadata": {"path": str(tmp_path)}})
    client.execute()
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, path)
    saved = nbformat.read(path, as_version=4)
    for i, cell in enumerate(saved.cells):
        outs = cell.outputs
        assert not any(o.get("output_type") == "error" for o in outs), outs
        datas = [o.get("data", {}) for o in outs if o.get("output_type") == "display_data"]
        figs = [d for d in datas if "application/vnd.plotly.v1+json" in d]
        assert len(figs) == 1, (i, [list(d) for d in datas])
        assert "plotly" in figs[0]["text/html"]
        assert "3 steps" in figs[0]["text/plain"]
        assert not any("application/vnd.jupyter.widget-view+json" in d for d in datas)
        loss = next(t for t in figs[0]["application/vnd.plotly.v1+json"]["data"]
                    if t.get("meta", {}).get("kind") == "loss")
        assert len(decode(loss["y"])) == 3
    printed = "".join(o.get("text", "") for o in saved.cells[0].outputs if o.get("output_type") == "stream")
    assert "mode: html" in printed
