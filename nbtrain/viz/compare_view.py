"""The comparison figure of ``ComparisonResult.figure()``.

:func:`nbtrain.viz.figures.compare_figure` draws loss, loss difference, grad norm, loss scale and the
throughput / peak-memory bars; this adds the memory-over-steps panel per variant (a fifth row), the
variants that did not run, and a note on runs without a GradScaler. Its traces are moved, not redrawn,
so every trace keeps the ``meta`` that :func:`~nbtrain.viz.figures.find_traces` looks up.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .figures import compare_figure, find_traces, trace_specs

# Where each panel of compare_figure goes in the 5-row grid (row, col).
_POSITION = {"loss": (1, 1), "loss_diff": (2, 1), "grad_norm": (3, 1), "scale": (4, 1), "memory": (5, 1),
             "throughput": (1, 2), "peak_memory": (3, 2)}


def comparison_figure(histories: Mapping[str, Any], reference: Optional[str] = None,
                      summaries: Optional[Mapping[str, Mapping]] = None,
                      eval_histories: Optional[Mapping[str, Any]] = None,
                      infos: Optional[Mapping[str, Any]] = None,
                      not_run: Optional[Mapping[str, str]] = None, *, smoothing: float = 0.9) -> go.Figure:
    """Variants overlaid: loss, loss − reference, grad norm, loss scale and memory over the steps, with
    bars of throughput and peak memory; ``not_run`` (name -> reason) is listed under the title."""
    infos = infos or {}
    not_run = dict(not_run or {})
    if not histories:
        fig = go.Figure()
        fig.update_layout(template="plotly_white", height=300,
                          title=dict(text="no variant ran" + _not_run_text(not_run), x=0.01))
        return fig
    base = compare_figure(histories, reference=reference, summaries=summaries, eval_histories=eval_histories,
                          smoothing=smoothing)
    on_gpu = (any(str(getattr(i, "device", "")).startswith("cuda") for i in infos.values() if i is not None)
              or any((s or {}).get("peak_vram_gib") is not None for s in (summaries or {}).values()))
    # compare_figure's six subplot titles, in the same row-major grid order as ours
    titles = [a.text for a in base.layout.annotations][:6]
    mem_title = "accelerator memory (GiB)" if on_gpu else "host memory: process RSS (GiB, CPU run)"
    fig = make_subplots(
        rows=5, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.1, vertical_spacing=0.06,
        specs=[[{}, {"rowspan": 2}], [{}, None], [{}, {"rowspan": 2}], [{}, None], [{}, None]],
        subplot_titles=(*titles, mem_title))
    for tr in base.data:
        row, col = _POSITION[(tr.meta or {}).get("panel", "loss")]
        fig.add_trace(tr, row=row, col=col)
    if not find_traces(base, panel="memory"):
        for name, hist in histories.items():
            color = _run_color(base, name)
            for spec in trace_specs(hist, None, infos.get(name), name=str(name), color=color, overlay=True,
                                    smoothing=smoothing):
                if spec["meta"]["panel"] == "memory":
                    fig.add_trace(go.Scatter(**{k: v for k, v in spec.items() if k not in ("row", "type")}),
                                  row=5, col=1)
    # One step axis for the whole left column (rows 1-5), so zooming one panel zooms all.
    for row in range(2, 6):
        fig.update_xaxes(matches="x", row=row, col=1)
    fig.update_xaxes(showticklabels=True, title_text="optimizer step", row=5, col=1)
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_yaxes(type="log", row=4, col=1)
    fig.update_yaxes(title_text="GiB", row=5, col=1)
    _note_no_scaler(fig, histories, infos)
    ref = reference if reference is not None else next(iter(histories))
    title = " vs ".join(map(str, histories)) + f" (reference: {ref})" + _not_run_text(not_run)
    fig.update_layout(height=1050, margin=dict(l=60, r=20, t=90, b=50), template="plotly_white",
                      hovermode="closest", legend=dict(groupclick="togglegroup"),
                      title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)))
    return fig


def _run_color(fig: go.Figure, name: str) -> Optional[str]:
    """The colour compare_figure gave ``name`` (its loss line), so the memory lines match it."""
    for tr in find_traces(fig, run=str(name), panel="loss"):
        color = getattr(getattr(tr, "line", None), "color", None)
        if color:
            return color
    return None


def _not_run_text(not_run: Mapping[str, str]) -> str:
    if not not_run:
        return ""
    # A title does not wrap: shorten each reason (the table has it in full); escape only what plotly's
    # HTML subset would read as markup.
    parts = [html.escape(f"{n}: {_shorten(str(r or 'did not run'))}", quote=False) for n, r in not_run.items()]
    return "<br><sup>not run: " + " | ".join(parts) + "</sup>"


def _shorten(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _note_no_scaler(fig: go.Figure, histories: Mapping[str, Any], infos: Mapping[str, Any]) -> None:
    """Say which variants have no scale line because they train without a GradScaler."""
    without = [str(n) for n in histories if infos.get(n) is not None and not infos[n].scaler_enabled]
    if without:
        sp = fig.get_subplot(4, 1)   # the scale panel; axis numbers follow the grid, so ask, not guess
        x, y = sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")
        fig.add_annotation(text="no GradScaler (no loss scale): " + ", ".join(without), xref=f"{x} domain",
                           yref=f"{y} domain", x=0.5, y=0.5, showarrow=False,
                           font=dict(size=12, color="#555"), name="no_scaler")
