"""LiveDashboard: a callback that draws a run live, in a notebook or a terminal.

Three layers, as in transformers' notebook progress callback: the pure figure builders
(:mod:`nbtrain.viz.figures`), a tracker that keeps the records and says when and what to draw
(:mod:`nbtrain.viz.tracker`), and a view that shows it (:mod:`nbtrain.viz.views`). The dashboard feeds
the tracker, keeps the figure current, and hands it to the view.

Where it draws (``mode``), decided once when the dashboard is made:

1. ``mode=`` or the ``NBTRAIN_DASHBOARD`` environment variable: ``widget`` | ``html`` | ``text``.
2. Outside an IPython kernel (a script, a terminal, terminal IPython): ``text``, the command line's tqdm bar.
3. In Colab (``google.colab`` is loaded): ``html``. Colab renders ipywidgets' own widgets but not plotly's
   ``FigureWidget`` (googlecolab/colab-cdn-widget-manager#51, googlecolab/colabtools#5889, both open).
4. In a kernel without ipywidgets/anywidget: ``html``.
5. In a kernel whose frontend renders widgets: ``widget``, a live plotly ``FigureWidget``. A frontend
   is recognised by what starts its kernels: a Jupyter server (JupyterLab, Notebook 7, Voila, Hub)
   sets ``JPY_SESSION_NAME``; VS Code defines ``__vsc_ipynb_file__``.
6. Any other kernel (nbclient/papermill executing headless, jupyter console, qtconsole): ``html``,
   the figure shown through a display handle updated in place (at most once a second).

``nbt.Panel()`` lives in widgets, so its live figure is a ``FigureWidget`` wherever one renders; in Colab (or
with ``NBTRAIN_DASHBOARD=html``) it is the ``html`` figure in a widget output area instead (:func:`panel_mode`).

In ``widget`` and ``html`` mode the end of each run replaces the live view, through the same display
handle, by a static copy, titled in one line with the runs' names and precisions (the summary is the
status line above it, its one place): the plotly JSON (``application/vnd.plotly.v1+json``, drawn by the
plotly renderer in JupyterLab/Notebook 7/VS Code with no network and no notebook trust) plus ``text/html``
that loads plotly.js from its CDN (``static_plotlyjs="cdn"``, about 10 kB per figure; pass
``"inline"`` to embed plotly.js, ~4.6 MB per figure, for HTML viewers without network) and a
text summary. A saved and reopened notebook therefore shows the result although widget state is
gone. ``clear_output`` is never called.

A ``FigureWidget`` whose live view was replaced that way is never written to again: plotly's front end keeps
the removed view's listeners on the widget's model, and every later message to that model reaches the
purged graph div and fails in the browser ("Error setting state: gd.data must be an array"). The next run
draws on a new ``FigureWidget``, built complete before it is shown; the old one is closed.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from . import figures
from .text import figure_title
from .tracker import Tracker
from .views import HtmlView, TextView, WidgetView
from .widget import live_figure_widget

ENV_VAR = "NBTRAIN_DASHBOARD"
MODES = ("widget", "html", "text")

_HTML_MIN_INTERVAL = 1.0   # html mode resends the whole figure: at most once a second
# what a redraw between rebuilds changes in a trace (mode: a line of one point is drawn with its marker;
# customdata: the per-step values a hover shows beside y, as GRPO's reward std and mismatch max)
_LIVE_PROPS = ("x", "y", "hovertext", "text", "mode", "customdata")


def _same(old: Any, new: Any) -> bool:
    """Whether a trace property already holds ``new``: arrays compared by value, NaN equal to NaN."""
    if old is None or new is None:
        return old is None and new is None
    try:
        a, b = np.asarray(old), np.asarray(new)
    except (TypeError, ValueError):
        return False
    if a.shape != b.shape:
        return False
    if a.dtype.kind in "fiu" and b.dtype.kind in "fiu":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a.astype(object), b.astype(object)))


_FITS_AFTER_REBUILD = 3    # redraws after a rebuild that size the widget's views to their output (LiveFigureWidget)
# Seconds after a run's first point at which the widget's views are asked again to fit their output. The view that
# shows the first point is drawn after that point's redraw (the Panel reveals the figure then; a new widget is shown
# as the run starts), at plotly.js's default 700 px while the page lays it out, and a run held at a slow step or a
# busy kernel sends no other redraw meanwhile (measured in JupyterLab: 700 px in a 1,008 px output, issue 46).
_LATE_FITS_S = (0.5, 1.5, 4.0)


# ------------------------------------------------------------------------------------------------
# Frontend detection
# ------------------------------------------------------------------------------------------------
def _kernel_shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    return ip if ip is not None and getattr(ip, "kernel", None) is not None else None


def _widgets_importable() -> bool:
    try:
        import anywidget  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _frontend_renders_widgets(shell) -> bool:
    if os.environ.get("JPY_SESSION_NAME"):
        return True
    ns = getattr(shell, "user_ns", None) or {}
    return "__vsc_ipynb_file__" in ns


def in_colab() -> bool:
    """Whether this is a Colab kernel (it loads ``google.colab``): widgets render there, ``FigureWidget`` does not."""
    return "google.colab" in sys.modules


def _forced_mode() -> str:
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced and forced not in MODES:
        raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(MODES)}")
    return forced


def detect_mode() -> str:
    """``widget``, ``html`` or ``text``: where a dashboard made now would draw (see module doc)."""
    forced = _forced_mode()
    if forced:
        return forced
    shell = _kernel_shell()
    if shell is None:
        return "text"
    if in_colab() or not _widgets_importable():
        return "html"
    return "widget" if _frontend_renders_widgets(shell) else "html"


def panel_mode() -> str:
    """``widget`` or ``html``: how ``nbt.Panel()`` draws its live figure. A ``FigureWidget`` (``widget``), except
    in Colab, which does not render one, and where ``NBTRAIN_DASHBOARD`` says ``html`` (or ``text``: the Panel has
    no text view); ``NBTRAIN_DASHBOARD=widget`` keeps the ``FigureWidget`` even in Colab."""
    forced = _forced_mode()
    if forced:
        return "widget" if forced == "widget" else "html"
    return "html" if in_colab() else "widget"


# ------------------------------------------------------------------------------------------------
# The callback
# ------------------------------------------------------------------------------------------------
class LiveDashboard:
    """Live loss / grad-norm / loss-scale / memory plots of a run; a callback for train()/start()/compare().

    ``dashboard.figure`` is the figure kept up to date (a ``FigureWidget`` in widget mode, else a
    ``go.Figure``), ``dashboard.records`` the StepRecords received, ``dashboard.redraws`` the number
    of redraws so far, ``dashboard.tracker`` the records per run and the redraw throttle. Redraws happen
    inside ``figure.batch_update()``, at most ``max_redraws_per_s`` a second and never more than ~2% of
    the wall time; each run ends with a full redraw. ``display=False`` keeps the figure current without
    showing anything (to embed ``dashboard.widget`` or ``dashboard.figure`` elsewhere). Several runs
    (``info.variant``) are overlaid, one colour each. Safe to call from the training thread of ``nbt.start``.
    """

    def __init__(self, total_steps: Optional[int] = None, max_redraws_per_s: float = 5,
                 display: bool = True, *, mode: Optional[str] = None, smoothing: float = 0.9,
                 static_plotlyjs: Any = "cdn"):
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
        if static_plotlyjs not in ("cdn", "inline", True, False):
            raise ValueError(f"static_plotlyjs must be 'cdn', 'inline' or False, got {static_plotlyjs!r}")
        self.mode = mode or detect_mode()
        self.tracker = Tracker(max_redraws_per_s, total_steps=total_steps,
                               min_interval=_HTML_MIN_INTERVAL if self.mode == "html" else 0.0)
        self.total_steps = total_steps
        self.max_redraws_per_s = float(max_redraws_per_s)
        self.display = bool(display)
        self.smoothing = float(smoothing)
        self.static_plotlyjs = static_plotlyjs
        self.redraws = 0
        self._scale_axis: Optional[dict] = None   # the loss-scale ticks last sent to the figure
        self._fits = 0   # redraws since the last rebuild that asked the widget's views to fit their width
        self._draw_lock = threading.Lock()    # one redraw at a time
        self._timer = threading.Timer   # what schedules the late fits (tests replace it)
        if self.mode == "widget":
            self.figure = live_figure_widget(figures.make_run_layout())
            self.view = WidgetView(self.figure, self.display, static_plotlyjs)
        else:
            self.figure = figures.make_run_layout()
            self.view = (HtmlView(self.display, static_plotlyjs) if self.mode == "html"
                         else TextView(self.display, total_steps, self.max_redraws_per_s))
        self.widget = self.view.widget
        self.samples: list = []   # every SampleRecord received (all runs)

    # -- what was received --------------------------------------------------------------------
    @property
    def records(self) -> list:
        """Every StepRecord received, in order (all runs)."""
        return self.tracker.records

    @property
    def eval_records(self) -> list:
        """Every EvalRecord received (all runs)."""
        return self.tracker.eval_records

    @property
    def runs(self) -> dict:
        """Run name -> RunInfo (None for records that arrived without on_run_start)."""
        return self.tracker.infos()

    # -- callback protocol ------------------------------------------------------------------
    def on_run_start(self, info: Any) -> None:
        """Start a new run (a new colour when others are already drawn) and show the live view."""
        self.tracker.start(info)
        if self.view.live:
            self._redraw(force=True)
        self.view.run_start(self.figure, self.tracker.status(), info)

    def on_step_end(self, record: Any) -> None:
        """Record one step; redraw when the throttle allows (a run's first step always)."""
        run = self.tracker.add(record)
        self.view.step(record)
        if self.view.live and self.tracker.due():
            self._redraw()
        if len(run.records) == 1 and self.view.live and hasattr(self.figure, "fit_width"):
            self._fit_later(self.figure)

    def _fit_later(self, fig) -> None:
        for delay in _LATE_FITS_S:
            t = self._timer(delay, self._late_fit, args=(fig,))
            t.daemon = True   # never keeps the interpreter alive
            t.start()

    def _late_fit(self, fig) -> None:
        if not self._draw_lock.acquire(blocking=False):
            return   # a redraw is going on: the next late fit (or the redraws' own) asks instead
        try:
            # a figure replaced since (a new run, a static copy) gets nothing: its view may be gone
            if fig is self.figure and not self.view.retired:
                fig.fit_width()
        finally:
            self._draw_lock.release()
        # a step that arrived meanwhile found the lock held by this fit and skipped its redraw: draw it now
        if self.tracker.due():
            self._redraw()

    def on_eval(self, record: Any) -> None:
        """Record an evaluation (drawn with the next redraw)."""
        self.tracker.add_eval(record)
        self.view.eval(record)

    def on_sample(self, record: Any) -> None:
        """A sample prompt's answer: the block under the plots shows each run's latest answers (text mode
        prints it)."""
        self.samples.append(record)
        self.view.samples(self.samples_html(), self.samples)

    def samples_html(self) -> str:
        """Each run's latest answers, prompt rows x run columns, as HTML ("" before the first answer)."""
        from ..engine.sampling import sample_frame, side_by_side
        from .text import samples_html

        return samples_html(side_by_side(sample_frame(self.samples), own_last=True), title="latest answers")

    def on_run_end(self, result: Any = None) -> None:
        """Draw every point, then leave the static copy (or the printed summary) in the output."""
        run = self.tracker.end(result)
        self._redraw(force=True)
        current = (run.summary(), run.result) if run is not None else None
        # Under the draw lock: a late fit (a timer thread) checks `retired` and then writes to the figure, and
        # one that checked just before the live view was replaced wrote to the purged view ("Error setting
        # state: Cannot read properties of undefined (reading '_guiEditing')" in the browser, one CI run).
        with self._draw_lock:
            self.view.run_end(self.figure, self.tracker.summaries(), current,
                              title=figure_title(self.tracker.infos()))

    # -- drawing ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw now, whatever the throttle."""
        self._redraw(force=True)

    def _redraw(self, force: bool = False) -> bool:
        if not self._draw_lock.acquire(blocking=force):
            return False  # another thread is drawing; it will pick up this record
        try:
            if not force and not self.tracker.due():
                return False
            t0 = time.perf_counter()
            rebuilt = self._update_figure(self.tracker.snapshot())
            self.redraws += 1
            self.view.redraw(self.figure, self.tracker.status())
            # A rebuild is a one-off (a run started); only routine redraws set the pace.
            self.tracker.drawn(0.0 if rebuilt else time.perf_counter() - t0)
            return True
        finally:
            self._draw_lock.release()

    def _update_figure(self, snap: dict) -> bool:
        specs, rebuild = self.tracker.plan(snap, self.smoothing)
        axis = figures.runs_scale_axis(snap)
        if self.view.retired:
            # The widget's live view was replaced by a static copy; messages to it would reach that dead
            # view (see the module doc). A new widget, complete before anyone shows it, takes its place.
            self.figure = self.view.replace_figure(
                live_figure_widget(figures.runs_figure(snap, smoothing=self.smoothing)))
            self._scale_axis = axis
            return True
        fig = self.figure
        if rebuild:
            # Rebuilt in place, so that a displayed FigureWidget stays the same object.
            new = figures.runs_figure(snap, smoothing=self.smoothing)
            with fig.batch_update():
                fig.data = ()
                fig.add_traces(list(new.data))
                fig.layout = new.layout
            self._scale_axis = axis
            self._fits = 0
            return True
        # The difference panel's traces follow the runs' own (runs_figure adds them last).
        diffs = figures.live_difference_traces(snap, {n: figures._PALETTE[k % len(figures._PALETTE)]
                                                      for k, n in enumerate(snap)})
        # Only what changed is sent, in one batch per set of changed properties. In a batch plotly fills the
        # properties a trace did not change with "undefined", which plotly.js's restyle takes as "remove": measured
        # in JupyterLab, an all-NaN scale line (NaN != NaN: its y always "changed") and a difference line whose
        # steps were complete lost their x, drawn at 0, 1, 2, ... while the kernel's figure kept it.
        wanted = [(tr, {k: spec[k] for k in _LIVE_PROPS if k in spec}) for tr, spec in zip(fig.data, specs)]
        wanted += [(tr, {"x": new.x, "y": new.y}) for tr, new in zip(fig.data[len(specs):], diffs)]
        groups: dict[tuple, list] = {}
        for tr, props in wanted:
            changed = {k: v for k, v in props.items() if not _same(tr[k], v)}
            if changed:
                groups.setdefault(tuple(sorted(changed)), []).append((tr, changed))
        for batch in groups.values():
            with fig.batch_update():
                for tr, changed in batch:
                    for k, v in changed.items():
                        tr[k] = v
        with fig.batch_update():
            if axis != self._scale_axis:   # a skipped step halved the scale: label the new power of two
                yaxis = fig.get_subplot(*figures.PANEL_CELLS["scale"]).yaxis
                for key, value in axis.items():   # item by item: update() would open a batch of its own
                    yaxis[key] = value
                self._scale_axis = axis
        if self._fits < _FITS_AFTER_REBUILD and hasattr(fig, "fit_width"):
            # The view of a figure shown as the run starts is drawn before the page holds it, at a default width:
            # the first redraws after, when it is on the page, size it to the output's width.
            fig.fit_width()
            self._fits += 1
        return False

    def __repr__(self) -> str:
        return (f"LiveDashboard(mode={self.mode!r}, runs={list(self.tracker.runs)}, "
                f"records={len(self.tracker.records)}, redraws={self.redraws})")
