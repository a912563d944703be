"""Where a :class:`~nbtrain.viz.dashboard.LiveDashboard` draws: a widget, display-handle HTML, or text.

Each view gets the dashboard's figure and status line and knows nothing of records or throttling.
``widget`` and ``html`` end each run by replacing the live view, through the same display handles, with a
static copy (:func:`static_bundle`, titled in one short line) under the runs' summaries, notes and advice;
``clear_output`` is never called. A view whose live widget was replaced says so (``retired``) and takes a
new one (``replace_figure``) rather than have the old one written to again. ``text`` is the command line's
tqdm bar, with the summary printed when the run ends.
"""

from __future__ import annotations

import html
import json
from typing import Any

from .progress import ProgressBar
from .text import notes_html, notes_text, run_notes, said_once, samples_text


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


def _status_bundle(text: str) -> dict:
    return {"text/html": f"<div><code>{html.escape(text)}</code></div>", "text/plain": text}


class _NotebookView:
    """What the widget and HTML views share: two display handles (status, figure) and the static end."""

    live = True   # the figure is redrawn while the run goes
    retired = False  # whether the live figure's view was replaced (then it must not be written to)
    _retires_figure = False  # whether replacing the live view leaves the figure unusable (a widget's does)

    def __init__(self, display: bool, static_plotlyjs: Any):
        self.display = display
        self.static_plotlyjs = static_plotlyjs
        self.widget = None
        self._status_handle = None
        self._fig_handle = None
        self._samples_handle = None
        self._live_shown = False

    def step(self, record: Any) -> None:
        pass

    def samples(self, block: str, records: list) -> None:
        """Show the latest answers (``block``, HTML) under the figure: a display handle of its own, made at the
        first answer (a run without sample prompts shows nothing) and updated in place after it."""
        if not self.display:
            return
        from IPython.display import display

        bundle = {"text/html": block, "text/plain": samples_text(records)}
        if self._samples_handle is None:
            self._samples_handle = display(bundle, raw=True, display_id=True)
        else:
            self._samples_handle.update(bundle, raw=True)

    def eval(self, record: Any) -> None:
        pass

    def run_end(self, figure, summaries: list, current=None, title: str = "") -> None:
        """Replace the live view by a static copy with a one-line ``title``; every run's summary, with its
        notes, goes in the status line above it (the one place for it)."""
        if not self.display or self._fig_handle is None:
            return
        # a note every run has (the model's conversion, the data's cuts) once, above the runs: not once per run
        shared, rest = said_once({str(i): run_notes(res)[0] for i, (_, res) in enumerate(summaries)},
                                 [str(i) for i in range(len(summaries))], word="runs")
        text = "\n".join(filter(None, [*(f"note: {n}" for n in shared), *(
            part for i, (t, res) in enumerate(summaries) for part in (t, notes_text(res, notes=rest[str(i)])))]))
        js = self.static_plotlyjs if self.static_plotlyjs else False
        self._status_handle.update({"text/html": "<div>" + "".join(
            f"<div style='color:#555'>note: {html.escape(n)}</div>" for n in shared) + "".join(
            f"<div><code>{html.escape(t)}</code>{notes_html(res, notes=rest[str(i)])}</div>"
            for i, (t, res) in enumerate(summaries)) + "</div>", "text/plain": text}, raw=True)
        import plotly.graph_objects as go

        from .figures import set_title

        static = set_title(go.Figure(figure), html.escape(title.replace("\n", " ")))
        # retired before the live view goes: nothing may be written to the figure from the moment it starts to
        self._live_shown = False
        self.retired = self._retires_figure
        self._fig_handle.update(static_bundle(static, js, text=text), raw=True)


class WidgetView(_NotebookView):
    """A status line over a live plotly ``FigureWidget`` (``widget`` holds both)."""

    def __init__(self, figure, display: bool, static_plotlyjs: Any):
        import ipywidgets as widgets

        super().__init__(display, static_plotlyjs)
        self.status = widgets.HTML(value="<i>waiting for the first step…</i>")
        self.answers = widgets.HTML(value="")   # the latest sample answers, under the figure
        self.widget = widgets.VBox([self.status, figure, self.answers])
        self.figure = figure

    def samples(self, block: str, records: list) -> None:
        """The latest answers in the widget, under the figure (shown with it, or wherever ``widget`` is)."""
        self.answers.value = block

    # plotly's front end leaves a removed view's listeners on the FigureWidget's model (they purge the graph
    # div but stay subscribed), so once run_end has replaced the widget's output it must get no message.
    _retires_figure = True

    def replace_figure(self, new):
        """Take ``new`` (a FigureWidget not shown yet) as the live figure; the retired one is closed once the
        front end has answered its last redraw (``close_when_answered``), never before: the answers of a run's
        last redraw wait in the kernel's queue while the cell runs, and the next run starts first."""
        old, self.figure = self.figure, new
        self.widget.children = (self.status, new, self.answers)
        self.retired = False
        if hasattr(old, "close_when_answered"):
            old.close_when_answered()
        else:
            old.close()
        return new

    def run_start(self, figure, status: str, info: Any = None) -> None:
        if not self.display:
            return
        from IPython.display import display

        if self._fig_handle is None:
            self._status_handle = display(self.status, display_id=True)
            self._fig_handle = display(self.figure, display_id=True)
        else:
            self._status_handle.update(self.status)
            self._fig_handle.update(self.figure)
        self._live_shown = True

    def redraw(self, figure, status: str) -> None:
        self.status.value = f"<code>{html.escape(status)}</code>"


class HtmlView(_NotebookView):
    """The figure as plotly JSON + HTML through a display handle, resent on each redraw."""

    def _live_bundle(self, figure, status: str) -> dict:
        # Live updates never embed plotly.js (megabytes each time); only the final copy may.
        js = "cdn" if self.static_plotlyjs else False
        return static_bundle(figure, js, text=status)

    def run_start(self, figure, status: str, info: Any = None) -> None:
        if not self.display:
            return
        from IPython.display import display

        status = status or "starting…"
        if self._fig_handle is None:
            self._status_handle = display(_status_bundle(status), raw=True, display_id=True)
            self._fig_handle = display(self._live_bundle(figure, status), raw=True, display_id=True)
        else:
            self._status_handle.update(_status_bundle(status), raw=True)
            self._fig_handle.update(self._live_bundle(figure, status), raw=True)
        self._live_shown = True

    def redraw(self, figure, status: str) -> None:
        if self._live_shown and self.display:
            self._fig_handle.update(self._live_bundle(figure, status), raw=True)
            self._status_handle.update(_status_bundle(status), raw=True)


class TextView:
    """The command line's progress bar while a run goes; its summary, notes and advice printed at the end."""

    live = False   # the figure is only brought up to date when a run ends
    retired = False
    widget = None

    def __init__(self, display: bool, total_steps=None, max_per_s: float = 5):
        self.display = display
        self.bar = ProgressBar(total=total_steps, mininterval=1.0 / max_per_s)

    def run_start(self, figure, status: str, info: Any = None) -> None:
        if self.display:
            self.bar.on_run_start(info)

    def redraw(self, figure, status: str) -> None:
        pass

    def step(self, record: Any) -> None:
        if self.display:
            self.bar.on_step_end(record)

    def eval(self, record: Any) -> None:
        if self.display:
            self.bar.on_eval(record)

    def samples(self, block: str, records: list) -> None:
        """Print the newest answers (the bar keeps its line)."""
        if self.display and records:
            self.bar.write(samples_text(records[-1:]))

    def run_end(self, figure, summaries: list, current=None, title: str = "") -> None:
        self.bar.on_run_end(None)
        if self.display and current is not None:
            text, result = current
            notes = notes_text(result)
            print(text + ("\n" + notes if notes else ""), flush=True)
