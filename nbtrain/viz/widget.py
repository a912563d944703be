"""The live figure widget: plotly's ``FigureWidget`` without its merging of the front end's computed defaults.

After every restyle, plotly.js sends back each trace's and the layout's "deltas": the values it computed
that Python did not set. ``BaseFigureWidget`` stores them and then deletes from the Python figure every
property the deltas also name (``_remove_overlapping_props``), and tells the front end to delete it too.
For the dashboard's figures that is wrong twice over (measured in JupyterLab with plotly 7.1):

* a trace whose y is all NaN (the loss scale of a run without GradScaler) comes back with its x as a typed
  array that the comm serialises as an index-keyed dict; the merge recurses into the Python x, a numpy
  array, and raises ``ValueError: The truth value of an array ... is ambiguous`` in the kernel, once per
  redraw (44 times in one Panel session);
* a property the front end echoes in another spelling (the clipping line's y ``[1.0, 1.0]`` comes back as
  ``[1, 1]``) is popped from the trace, and the front end drops it too: lines lost their x and were drawn at
  0, 1, 2, ... instead of at their steps.

nbtrain sets every property it draws, so the computed defaults are not needed on the Python side. The
deltas are acknowledged (plotly's edit bookkeeping, which ``batch_update`` and change callbacks wait on,
is completed exactly as plotly does it) and otherwise dropped: no property is ever removed.

plotly.js sends its layout delta as ``_js2py_widget_layoutDelta`` (plotly 7.1's widget bundle), a name the stock
widget has no trait for, so its layout edits never complete there. This widget takes that name too, which lets
:meth:`LiveFigureWidget.close_when_answered` close a widget only after the front end's last answer has arrived:
closed earlier, every answer still on its way (they wait while a cell runs) reached the kernel as a message to a
comm it no longer knew, logged "No such comm" in JupyterLab's log console (notebook 04, every run).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _widget_class():
    # Built on first use: importing plotly's FigureWidget needs anywidget and ipywidgets, which a script or a
    # text-mode dashboard never loads.
    import plotly.graph_objects as go
    from plotly.serializers import custom_serializers
    from traitlets import Dict, observe

    class LiveFigureWidget(go.FigureWidget):
        """A ``FigureWidget`` that keeps every property Python set (see the module doc)."""

        # the name plotly.js's widget sends its layout deltas under (see the module doc)
        _js2py_widget_layoutDelta = Dict(allow_none=True).tag(sync=True, **custom_serializers)
        _close_pending = False

        @observe("_js2py_traceDeltas")
        def _handler_js2py_traceDeltas(self, change):
            msg = change["new"]
            if not msg:
                return
            # cleared first: a waiting callback may close the widget (close_when_answered)
            self._js2py_traceDeltas = None
            if msg.get("trace_edit_id") == self._last_trace_edit_id:
                self._trace_edit_in_process = False
                self._run_waiting_callbacks()

        @observe("_js2py_layoutDelta", "_js2py_widget_layoutDelta")
        def _handler_js2py_layoutDelta(self, change):
            msg = change["new"]
            if not msg:
                return
            setattr(self, change["name"], None)
            if msg.get("layout_edit_id") == self._last_layout_edit_id:
                self._layout_edit_in_process = False
                self._run_waiting_callbacks()

        def close_when_answered(self) -> None:
            """Close this widget once the front end has answered every edit sent to it (at once when none waits
            for an answer). plotly.js answers each edit with its trace deltas, then its layout delta: closed
            before those arrive, each reaches the kernel as a message to an unknown comm ("No such comm").
            A widget that is never answered (no front end showed it) stays open."""
            if self._close_pending:
                return
            self._close_pending = True
            self.on_edits_completed(self.close)

        def fit_width(self) -> None:
            """Ask every view to size the figure to its container again (a ``relayout`` of ``autosize``). A view
            drawn before the browser attached it to the page gets plotly.js's default 700 px (measured in
            JupyterLab: the Panel's figure stood 460 px wide beside 300 px of nothing until the run ended), and
            plotly's widget resizes only on a window resize; sent unconditionally, as nothing in Python says
            whether it changed."""
            if self.layout.width is None:
                self._send_relayout_msg({"autosize": True})

        def _run_waiting_callbacks(self) -> None:
            # what plotly runs once neither a trace nor a layout edit is pending (waiting_edit_callbacks)
            if not self._trace_edit_in_process and not self._layout_edit_in_process:
                while self._waiting_edit_callbacks:
                    self._waiting_edit_callbacks.pop()()

    return LiveFigureWidget


def live_figure_widget(figure=None):
    """A :class:`LiveFigureWidget` of ``figure`` (a ``go.Figure`` or its dict; None: empty)."""
    return _widget_class()(figure)
