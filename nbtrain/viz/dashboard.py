"""LiveDashboard: a callback that draws a run live, in a notebook or a terminal.

Three layers, as in transformers' notebook progress callback: the pure figure builders
(:mod:`nbtrain.viz.figures`), a small tracker here that keeps the records per run, and the callback
methods that feed it and redraw at a bounded rate.

Where it draws (``mode``), decided once when the dashboard is made:

1. ``mode=`` or the ``NBTRAIN_DASHBOARD`` environment variable: ``widget`` | ``html`` | ``text``.
2. Outside an IPython kernel (a script, a terminal, terminal IPython): ``text``, a tqdm bar.
3. In a kernel without ipywidgets/anywidget: ``html``.
4. In a kernel whose frontend renders widgets: ``widget``, a live plotly ``FigureWidget``. A frontend
   is recognised by what starts its kernels: a Jupyter server (JupyterLab, Notebook 7, Voila, Hub)
   sets ``JPY_SESSION_NAME``; VS Code defines ``__vsc_ipynb_file__``; Colab loads ``google.colab``.
5. Any other kernel (nbclient/papermill executing headless, jupyter console, qtconsole): ``html``,
   the figure shown through a display handle updated in place (at most once a second).

In ``widget`` and ``html`` mode the end of each run replaces the live view, through the same display
handle, by a static copy: the plotly JSON (``application/vnd.plotly.v1+json``, drawn by the plotly
renderer in JupyterLab/Notebook 7/VS Code with no network and no notebook trust) plus ``text/html``
that loads plotly.js from its CDN (``static_plotlyjs="cdn"``, about 10 kB per figure; pass
``"inline"`` to embed plotly.js, ~4.6 MB per figure, for HTML viewers without network) and a
text summary. A saved and reopened notebook therefore shows the result although widget state is
gone. ``clear_output`` is never called.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from . import figures as F

ENV_VAR = "NBTRAIN_DASHBOARD"
MODES = ("widget", "html", "text")

_COST_FACTOR = 50.0        # a redraw may take at most ~1/50 of wall time (2% overhead)
_HTML_MIN_INTERVAL = 1.0   # html mode resends the whole figure: at most once a second
_RATE_WINDOW = 20          # steps averaged for tokens/s and ETA in the status line


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
    if "__vsc_ipynb_file__" in ns:
        return True
    return "google.colab" in sys.modules


def detect_mode() -> str:
    """``widget``, ``html`` or ``text``: where a dashboard made now would draw (see module doc)."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"{ENV_VAR}={forced!r}: expected one of {', '.join(MODES)}")
        return forced
    shell = _kernel_shell()
    if shell is None:
        return "text"
    if not _widgets_importable():
        return "html"
    return "widget" if _frontend_renders_widgets(shell) else "html"


# ------------------------------------------------------------------------------------------------
# Status line and summary
# ------------------------------------------------------------------------------------------------
def _hms(seconds: float) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _batch_text(info: Any, micro_steps: Optional[int]) -> Optional[str]:
    cfg = getattr(info, "config", None)
    micro = getattr(cfg, "micro_batch_size", None)
    accum = getattr(cfg, "grad_accum_steps", None) or micro_steps
    if micro is None:
        return f"accum {accum}" if accum else None
    accum = accum or 1
    return f"micro {micro} × accum {accum} = {micro * accum}"


def status_line(records: list, info: Any = None, total_steps: Optional[int] = None,
                run: Optional[str] = None) -> str:
    """One line: step/total, tokens/s, elapsed, ETA, precision, micro × accum = effective batch, method."""
    last = records[-1] if records else None
    total = total_steps or getattr(info, "total_steps", None)
    parts = []
    if run and run != "run":
        parts.append(run)
    step = last.step if last is not None else 0
    parts.append(f"step {step}/{total}" if total else f"step {step}")
    recent = records[-_RATE_WINDOW:]
    dts = [r.step_time_s for r in recent if r.step_time_s and math.isfinite(r.step_time_s)]
    dt = sum(dts)
    if recent:
        toks = sum((r.tokens_per_s or 0) * (r.step_time_s or 0) for r in recent
                   if r.tokens_per_s is not None and math.isfinite(r.tokens_per_s)
                   and r.step_time_s is not None and math.isfinite(r.step_time_s))
        if toks > 0 and dt > 0:
            parts.append(f"{toks / dt:,.0f} tok/s")
        elif dts:
            parts.append(f"{dt / len(dts):.2f} s/step")
    if last is not None:
        parts.append(f"elapsed {_hms(last.elapsed_s)}")
        if total and dts:
            parts.append(f"ETA {_hms(max(0, total - step) * dt / len(dts))}")
    if info is not None:
        prec = str(getattr(info, "precision_used", "") or "")
        if prec:
            parts.append(prec + (" + GradScaler" if getattr(info, "scaler_enabled", False) else ""))
    batch = _batch_text(info, last.micro_steps if last is not None else None)
    if batch:
        parts.append(batch)
    method = getattr(getattr(info, "config", None), "method", None)
    if method:
        parts.append(str(method))
    if last is not None and not math.isfinite(last.loss if last.loss is not None else math.nan):
        parts.append(f"loss {last.loss}")
    elif last is not None:
        parts.append(f"loss {last.loss:.4g}")
    return " · ".join(parts)


def summary_text(records: list, evals: list, info: Any = None, result: Any = None,
                 run: Optional[str] = None) -> str:
    """The end-of-run line left in the output next to the static figure."""
    summ = getattr(result, "summary", None) or {}
    n = len(records)
    head = f"{run}: " if run and run != "run" else ""
    if not n:
        return head + "no steps recorded" + (f" ({summ['stopped_reason']})" if summ.get("stopped_reason") else "")
    last = records[-1]
    losses = [r.loss for r in records if r.loss is not None and math.isfinite(r.loss)]
    parts = [f"{head}{last.step} steps in {_hms(last.elapsed_s)}"]
    if losses:
        parts.append(f"final loss {losses[-1]:.4g}")
    if evals:
        parts.append(f"eval loss {evals[-1].eval_loss:.4g}")
    skipped = sum(bool(r.skipped) for r in records)
    nonfin = sum(bool(r.nonfinite) or not math.isfinite(r.loss if r.loss is not None else math.nan)
                 for r in records)
    parts.append(f"{skipped} skipped")
    parts.append(f"{nonfin} non-finite")
    peaks = [r.vram_peak_gib for r in records if r.vram_peak_gib is not None]
    if peaks:
        parts.append(f"peak VRAM {max(peaks):.2f} GiB")
    else:
        rss = [r.host_rss_gib for r in records if r.host_rss_gib is not None]
        if rss:
            parts.append(f"host RSS {max(rss):.2f} GiB")
    tps = summ.get("tokens_per_s")
    if tps is None:
        tt = sum((r.tokens_per_s or 0) * (r.step_time_s or 0) for r in records
                 if r.tokens_per_s is not None and math.isfinite(r.tokens_per_s))
        st = sum(r.step_time_s or 0 for r in records)
        tps = tt / st if st > 0 and tt > 0 else None
    if tps:
        parts.append(f"{tps:,.0f} tok/s")
    if info is not None and getattr(info, "precision_used", None):
        parts.append(str(info.precision_used))
    if summ.get("stopped_reason"):
        parts.append(f"stopped: {summ['stopped_reason']}")
    return " · ".join(parts)


_MAX_ADVICE = 3   # the first few changes are the ones that matter; the rest stay in summary["advice"]


def run_notes(result: Any) -> tuple[list[str], list[str]]:
    """``(notes, advice)`` of a finished run: the engine's ``summary["notes"]`` and, after an out-of-memory
    stop, the first few changes of ``summary["advice"]`` (with a pointer to the rest)."""
    summ = getattr(result, "summary", None) or {}
    notes = [str(n) for n in (summ.get("notes") or [])]
    advice = [str(a) for a in (summ.get("advice") or [])]
    if len(advice) > _MAX_ADVICE:
        advice = advice[:_MAX_ADVICE] + [f"… {len(advice) - _MAX_ADVICE} more in result.summary['advice']"]
    return notes, advice


def notes_text(result: Any, indent: str = "  ") -> str:
    """The run's notes and advice as indented plain-text lines ("" when it has none)."""
    notes, advice = run_notes(result)
    lines = [f"{indent}note: {n}" for n in notes]
    if advice:
        lines.append(f"{indent}to fit in memory, try:")
        lines += [f"{indent}  - {a}" for a in advice]
    return "\n".join(lines)


def notes_html(result: Any) -> str:
    """The run's notes and advice as a short HTML list ("" when it has none)."""
    notes, advice = run_notes(result)
    if not notes and not advice:
        return ""
    items = [f"<li>{html.escape(n)}</li>" for n in notes]
    if advice:
        items.append("<li><span style='color:#ef6c00'>to fit in memory, try:</span><ul style='margin:0;"
                     "padding-left:18px'>" + "".join(f"<li>{html.escape(a)}</li>" for a in advice)
                     + "</ul></li>")
    return ("<ul style='margin:2px 0;padding-left:18px;color:#555;font-size:0.92em'>"
            + "".join(items) + "</ul>")


def static_bundle(fig, include_plotlyjs: Any = "cdn", text: str = "") -> dict:
    """A display bundle that survives a saved notebook: plotly JSON, HTML and plain text."""
    import plotly.io as pio

    js = {"cdn": "cdn", "inline": True, True: True}.get(include_plotlyjs, include_plotlyjs)
    fig_json = json.loads(pio.to_json(fig, validate=False))
    fig_json.setdefault("config", {"responsive": True, "displaylogo": False})
    body = fig.to_html(full_html=False, include_plotlyjs=js, config={"responsive": True,
                                                                       "displaylogo": False})
    return {"application/vnd.plotly.v1+json": fig_json,
            "text/html": body,
            "text/plain": text or "<nbtrain figure>"}


# ------------------------------------------------------------------------------------------------
# Tracker
# ------------------------------------------------------------------------------------------------
class _Run:
    """Records of one run (one variant), as records and as growing columns."""

    def __init__(self, name: str, info: Any):
        self.name = name
        self.info = info
        self.variant: Optional[str] = None
        self.records: list = []
        self.evals: list = []
        self.cols: dict[str, list] = {c: [] for c in F._FLOAT_COLS + F._BOOL_COLS}
        self.done = False
        self.result = None

    def add(self, rec) -> None:
        self.records.append(rec)
        for c, lst in self.cols.items():
            lst.append(getattr(rec, c, None))

    def snapshot(self) -> tuple:
        cols = F.Columns()
        for c in F._FLOAT_COLS:
            cols[c] = np.array(self.cols[c], dtype=np.float64)  # None -> nan
        for c in F._BOOL_COLS:
            cols[c] = np.array([bool(v) for v in self.cols[c]], dtype=bool)
        evals = {"step": np.array([e.step for e in self.evals], dtype=np.float64),
                 "eval_loss": np.array([F._num(e.eval_loss) for e in self.evals], dtype=np.float64)}
        return cols, evals, self.info


# ------------------------------------------------------------------------------------------------
# The callback
# ------------------------------------------------------------------------------------------------
class LiveDashboard:
    """Live loss / grad-norm / loss-scale / memory plots of a run; a callback for train()/start()/compare().

    ``dashboard.figure`` is the figure kept up to date (a ``FigureWidget`` in widget mode, else a
    ``go.Figure``), ``dashboard.records`` the StepRecords received, ``dashboard.redraws`` the number
    of redraws so far. Redraws happen inside ``figure.batch_update()``, at most
    ``max_redraws_per_s`` a second and never more than ~2% of the wall time; each run ends with a
    full redraw. ``display=False`` keeps the figure current without showing anything (to embed
    ``dashboard.widget`` or ``dashboard.figure`` elsewhere). Several runs (``info.variant``) are
    overlaid, one colour each. Safe to call from the training thread of ``nbt.start``.
    """

    def __init__(self, total_steps: Optional[int] = None, max_redraws_per_s: float = 5,
                 display: bool = True, *, mode: Optional[str] = None, smoothing: float = 0.9,
                 static_plotlyjs: Any = "cdn"):
        if max_redraws_per_s <= 0:
            raise ValueError(f"max_redraws_per_s must be > 0, got {max_redraws_per_s!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
        if static_plotlyjs not in ("cdn", "inline", True, False):
            raise ValueError(f"static_plotlyjs must be 'cdn', 'inline' or False, got {static_plotlyjs!r}")
        self.mode = mode or detect_mode()
        self.total_steps = total_steps
        self.max_redraws_per_s = float(max_redraws_per_s)
        self.display = bool(display)
        self.smoothing = float(smoothing)
        self.static_plotlyjs = static_plotlyjs
        self.redraws = 0
        self._clock = time.monotonic
        self._lock = threading.RLock()        # guards the tracker
        self._draw_lock = threading.Lock()    # one redraw at a time
        self._runs: dict[str, _Run] = {}
        self._current: Optional[_Run] = None
        self._signature: Optional[tuple] = None
        self._next_draw = 0.0
        self._fig_handle = None
        self._status_handle = None
        self._live_shown = False
        self._bar = None
        self._status_widget = None
        self.widget = None
        if self.mode == "widget":
            import ipywidgets as widgets
            import plotly.graph_objects as go

            self.figure = go.FigureWidget(F.make_run_layout())
            self._status_widget = widgets.HTML(value="<i>waiting for the first step…</i>")
            self.widget = widgets.VBox([self._status_widget, self.figure])
        else:
            self.figure = F.make_run_layout()

    # -- tracker ----------------------------------------------------------------------------
    @property
    def records(self) -> list:
        """Every StepRecord received, in order (all runs)."""
        with self._lock:
            return [r for run in self._runs.values() for r in run.records]

    @property
    def eval_records(self) -> list:
        """Every EvalRecord received (all runs)."""
        with self._lock:
            return [r for run in self._runs.values() for r in run.evals]

    @property
    def runs(self) -> dict:
        """Run name -> RunInfo (None for records that arrived without on_run_start)."""
        with self._lock:
            return {k: r.info for k, r in self._runs.items()}

    def _new_run(self, info: Any, variant: Optional[str]) -> _Run:
        base = str(variant) if variant else "run"
        name, k = base, 2
        while name in self._runs:
            name, k = f"{base} {k}", k + 1
        run = _Run(name, info)
        run.variant = variant
        self._runs[name] = run
        self._current = run
        return run

    def _run_for(self, variant: Optional[str]) -> _Run:
        cur = self._current
        if cur is not None and (variant is None or cur.variant == variant):
            return cur
        for run in reversed(list(self._runs.values())):
            if run.variant == variant:
                return run
        return self._new_run(None, variant)

    # -- callback protocol ------------------------------------------------------------------
    def on_run_start(self, info: Any) -> None:
        """Start a new run (a new colour when others are already drawn) and show the live view."""
        with self._lock:
            run = self._new_run(info, getattr(info, "variant", None))
        self._next_draw = 0.0
        if self.mode == "text":
            self._open_bar(run)
        else:
            self._redraw(force=True)
            self._show_live()

    def on_step_end(self, record: Any) -> None:
        """Record one step; redraw when the throttle allows."""
        with self._lock:
            run = self._run_for(getattr(record, "variant", None))
            run.add(record)
        if self.mode == "text":
            self._tick_bar(run, record)
        elif self._clock() >= self._next_draw:
            self._redraw()

    def on_eval(self, record: Any) -> None:
        """Record an evaluation (drawn with the next redraw)."""
        with self._lock:
            self._run_for(getattr(record, "variant", None)).evals.append(record)

    def on_run_end(self, result: Any = None) -> None:
        """Draw every point, then leave the static copy and a summary in the output."""
        with self._lock:
            run = self._current
            if run is not None:
                run.done = True
                run.result = result
        self._redraw(force=True)
        if self.mode == "text":
            self._close_bar(run)
        else:
            self._show_static(run)

    # -- drawing ----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Redraw now, whatever the throttle."""
        self._redraw(force=True)

    def _snapshot(self):
        with self._lock:
            return {name: run.snapshot() for name, run in self._runs.items()}

    def _redraw(self, force: bool = False) -> bool:
        if not self._draw_lock.acquire(blocking=force):
            return False  # another thread is drawing; it will pick up this record
        try:
            if not force and self._clock() < self._next_draw:
                return False
            t0 = time.perf_counter()
            rebuilt = self._update_figure(self._snapshot())
            self.redraws += 1
            if self.mode == "html" and self._live_shown and self.display:
                self._fig_handle.update(self._live_bundle(), raw=True)
            self._update_status()
            # A rebuild is a one-off (a run started); only routine redraws set the pace.
            cost = 0.0 if rebuilt else time.perf_counter() - t0
            interval = max(1.0 / self.max_redraws_per_s, cost * _COST_FACTOR,
                           _HTML_MIN_INTERVAL if self.mode == "html" else 0.0)
            self._next_draw = self._clock() + interval
            return True
        finally:
            self._draw_lock.release()

    def _update_figure(self, snap: dict) -> bool:
        overlay = len(snap) > 1
        specs = []
        palette = F._PALETTE
        for k, (name, (cols, evals, info)) in enumerate(snap.items()):
            specs += F.trace_specs(cols, evals, info, name=name, color=palette[k % len(palette)],
                                   overlay=overlay, smoothing=self.smoothing)
        sig = tuple((s["meta"]["run"], s["meta"]["panel"], s["meta"]["kind"]) for s in specs) + (
            tuple(F._scaler_used(c, i) for c, _, i in snap.values()),
            tuple(F._uses_vram(c, i) for c, _, i in snap.values()))
        fig = self.figure
        if sig != self._signature:
            # Structure changed (a run started, memory kind known): rebuild once, in place, so
            # that a displayed FigureWidget stays the same object.
            new = F.runs_figure(snap, smoothing=self.smoothing)
            with fig.batch_update():
                fig.data = ()
                fig.add_traces(list(new.data))
                fig.layout = new.layout
            self._signature = sig
            return True
        with fig.batch_update():
            for tr, spec in zip(fig.data, specs):
                tr.x = spec["x"]
                tr.y = spec["y"]
                if "hovertext" in spec:
                    tr.hovertext = spec["hovertext"]
                if "text" in spec:
                    tr.text = spec["text"]
        return False

    def _status_for(self, run: Optional[_Run]) -> str:
        if run is None:
            return ""
        with self._lock:
            recs = list(run.records[-_RATE_WINDOW:])
        return status_line(recs, run.info, self.total_steps, run.name)

    def _update_status(self) -> None:
        text = self._status_for(self._current)
        if self._status_widget is not None:
            self._status_widget.value = f"<code>{html.escape(text)}</code>"
        elif self.mode == "html" and self._live_shown and self.display:
            self._status_handle.update(self._status_bundle(text), raw=True)

    @staticmethod
    def _status_bundle(text: str) -> dict:
        return {"text/html": f"<div><code>{html.escape(text)}</code></div>", "text/plain": text}

    def _live_bundle(self) -> dict:
        # Live updates never embed plotly.js (megabytes each time); only the final copy may.
        js = "cdn" if self.static_plotlyjs else False
        return static_bundle(self.figure, js, text=self._status_for(self._current))

    # -- output -----------------------------------------------------------------------------
    def _show_live(self) -> None:
        if not self.display:
            return
        from IPython.display import display

        status = self._status_for(self._current) or "starting…"
        if self.mode == "widget":
            live_status, live_fig = self._status_widget, self.figure
            if self._fig_handle is None:
                self._status_handle = display(live_status, display_id=True)
                self._fig_handle = display(live_fig, display_id=True)
            else:
                self._status_handle.update(live_status)
                self._fig_handle.update(live_fig)
        else:
            if self._fig_handle is None:
                self._status_handle = display(self._status_bundle(status), raw=True, display_id=True)
                self._fig_handle = display(self._live_bundle(), raw=True, display_id=True)
            else:
                self._status_handle.update(self._status_bundle(status), raw=True)
                self._fig_handle.update(self._live_bundle(), raw=True)
        self._live_shown = True

    def _show_static(self, run: Optional[_Run]) -> None:
        if not self.display or self._fig_handle is None:
            return
        with self._lock:
            runs = [(summary_text(r.records, r.evals, r.info, r.result, r.name), r.result)
                    for r in self._runs.values()]
        texts = [t for t, _ in runs]
        # Each run's notes and out-of-memory advice go right under its summary line.
        text = "\n".join(filter(None, (part for t, res in runs for part in (t, notes_text(res)))))
        js = self.static_plotlyjs if self.static_plotlyjs else False
        self._status_handle.update({"text/html": "<div>" + "".join(
            f"<div><code>{html.escape(t)}</code>{notes_html(res)}</div>" for t, res in runs) + "</div>",
            "text/plain": text}, raw=True)
        import plotly.graph_objects as go

        static = go.Figure(self.figure)
        static.update_layout(title=dict(text="<br>".join(html.escape(t) for t in texts), x=0.01,
                                        xanchor="left", font=dict(size=12)),
                             margin=dict(t=40 + 18 * len(texts)))
        self._fig_handle.update(static_bundle(static, js, text=text), raw=True)
        self._live_shown = False

    # -- text mode --------------------------------------------------------------------------
    def _open_bar(self, run: _Run) -> None:
        if not self.display:
            return
        from tqdm import tqdm

        total = self.total_steps or getattr(run.info, "total_steps", None)
        self._bar = tqdm(total=total, desc=run.name if run.name != "run" else "train", unit="step",
                         dynamic_ncols=True, mininterval=1.0 / self.max_redraws_per_s)

    def _tick_bar(self, run: _Run, record: Any) -> None:
        if self._bar is None:
            if not self.display:
                return
            self._open_bar(run)
        now = self._clock()
        if now >= self._next_draw:
            self._bar.set_postfix_str(self._status_postfix(run, record), refresh=False)
            self._next_draw = now + 1.0 / self.max_redraws_per_s
        self._bar.update(1)

    @staticmethod
    def _status_postfix(run: _Run, record: Any) -> str:
        loss = record.loss
        bits = [f"loss={loss:.4g}" if loss is not None and math.isfinite(loss) else f"loss={loss}"]
        if record.tokens_per_s:
            bits.append(f"{record.tokens_per_s:,.0f} tok/s")
        if record.skipped:
            bits.append("skipped")
        if record.scale is not None:
            bits.append(f"scale={record.scale:g}")
        return " ".join(bits)

    def _close_bar(self, run: Optional[_Run]) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.display and run is not None:
            notes = notes_text(run.result)
            print(summary_text(run.records, run.evals, run.info, run.result, run.name)
                  + ("\n" + notes if notes else ""), flush=True)

    def __repr__(self) -> str:
        return (f"LiveDashboard(mode={self.mode!r}, runs={list(self._runs)}, "
                f"records={sum(len(r.records) for r in self._runs.values())}, redraws={self.redraws})")
