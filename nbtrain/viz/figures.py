"""Pure figure builders: run records in, plotly figures out. No IPython, no widgets, no state.

Every trace carries ``meta = {"run": name, "panel": panel, "kind": kind}`` so tests, the live
dashboard and the comparison figure can find it (:func:`find_traces`). Data traces hold the recorded
values exactly (a nan loss stays nan in the ``loss`` trace, where plotly leaves a gap); what would be
invisible there (non-finite values, skipped steps) gets its own marker traces placed at a visible y.
"""

from __future__ import annotations

import html
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

PANELS: tuple[str, ...] = ("loss", "grad_norm", "scale", "memory")
PANEL_ROWS: dict[str, int] = {p: i + 1 for i, p in enumerate(PANELS)}

_FLOAT_COLS = ("step", "epoch", "tokens", "loss", "lr", "grad_norm", "scale", "vram_allocated_gib",
               "vram_reserved_gib", "vram_peak_gib", "host_rss_gib", "step_time_s", "tokens_per_s",
               "elapsed_s")
_BOOL_COLS = ("clipped", "skipped", "nonfinite")
_EVAL_COLS = ("step", "eval_loss")

_PALETTE = qualitative.Plotly
_SKIP_STYLE = dict(symbol="x", size=9, color="#d62728", line=dict(width=1))
_NONFINITE_STYLE = dict(symbol="diamond-open", size=11, color="#ff7f0e", line=dict(width=2))
# Single-run colours, one per quantity (overlays colour by run instead).
_SOLO = dict(loss="#9ecae1", loss_ema="#1f77b4", eval_loss="#ff7f0e", grad_norm="#2ca02c",
             clip_threshold="#7f7f7f", clipped="#9467bd", scale="#8c564b", vram_allocated="#1f77b4",
             vram_reserved="#17becf", vram_peak="#d62728", device_total="#7f7f7f", host_rss="#1f77b4")


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------
def _num(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


class Columns(dict):
    """What :func:`columns` returns: field name -> numpy column, already normalised."""


def columns(history: Any) -> "Columns":
    """Normalise a history (StepRecord list, dict list, DataFrame, or dict of columns) to numpy columns.

    Numbers become float64 with None -> nan (so a run without a scaler has an all-nan ``scale``);
    flags become bool. Missing fields are filled with nan / False.
    """
    if isinstance(history, Columns):
        return history
    if history is None:
        n, get = 0, None
    elif hasattr(history, "columns") and hasattr(history, "to_numpy"):  # a DataFrame
        n = len(history)

        def get(col):
            return history[col].tolist() if col in history.columns else None
    elif isinstance(history, Mapping):
        first = next(iter(history.values()), [])
        n = len(first)

        def get(col):
            return history.get(col)
    else:
        recs = list(history)
        n = len(recs)

        def get(col):
            if not recs:
                return []
            if isinstance(recs[0], Mapping):
                return [r.get(col) for r in recs]
            if not hasattr(recs[0], col):
                return None
            return [getattr(r, col) for r in recs]

    out = Columns()
    for col in _FLOAT_COLS:
        vals = get(col) if get else None
        out[col] = (np.full(n, np.nan) if vals is None
                    else np.fromiter((_num(v) for v in vals), dtype=np.float64, count=n))
    for col in _BOOL_COLS:
        vals = get(col) if get else None
        out[col] = (np.zeros(n, dtype=bool) if vals is None
                    else np.fromiter((bool(v) if v is not None and v == v else False for v in vals),
                                     dtype=bool, count=n))
    return out


def eval_columns(eval_history: Any) -> dict[str, np.ndarray]:
    """Like :func:`columns` for EvalRecords: ``step`` and ``eval_loss``."""
    if eval_history is None:
        return {c: np.array([], dtype=np.float64) for c in _EVAL_COLS}
    cols = {}
    if hasattr(eval_history, "columns"):
        for c in _EVAL_COLS:
            cols[c] = np.array([_num(v) for v in eval_history[c].tolist()] if c in eval_history.columns
                               else [], dtype=np.float64)
        return cols
    if isinstance(eval_history, Mapping):
        return {c: np.array([_num(v) for v in eval_history.get(c, [])], dtype=np.float64)
                for c in _EVAL_COLS}
    recs = list(eval_history)
    for c in _EVAL_COLS:
        cols[c] = np.array([_num(r.get(c) if isinstance(r, Mapping) else getattr(r, c, None))
                            for r in recs], dtype=np.float64)
    return cols


def smooth(values: Sequence[float], smoothing: float = 0.9) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard style) over the finite values.

    A non-finite value does not enter the average; the line holds its last value there instead.
    ``smoothing=0`` returns the finite values unchanged.
    """
    y = np.asarray(values, dtype=np.float64)
    out = np.full(y.shape, np.nan)
    s = float(smoothing)
    if not 0 <= s < 1:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    ema, n = 0.0, 0
    for i, v in enumerate(y.tolist()):
        if math.isfinite(v):
            ema = s * ema + (1 - s) * v
            n += 1
        if n:
            out[i] = ema / (1 - s ** n)
    return out


def _fill_visible(y: np.ndarray, fallback: float) -> np.ndarray:
    """Replace non-finite entries by the last finite value before (else the first after, else fallback)."""
    out = y.copy()
    finite = np.isfinite(out)
    if not finite.any():
        out[:] = fallback
        return out
    idx = np.where(finite, np.arange(len(out)), -1)
    np.maximum.accumulate(idx, out=idx)
    first = int(np.argmax(finite))
    idx[idx < 0] = first
    return out[idx]


def _flag_text(c: dict[str, np.ndarray], mask: np.ndarray) -> list[str]:
    texts = []
    for i in np.flatnonzero(mask).tolist():
        parts = [f"step {int(c['step'][i])}"]
        if c["skipped"][i]:
            parts.append("optimizer step skipped")
        loss, gn = c["loss"][i], c["grad_norm"][i]
        if not math.isfinite(loss):
            parts.append(f"loss={loss}")
        if not math.isfinite(gn):
            parts.append(f"grad_norm={gn}")
        if math.isfinite(c["scale"][i]):
            parts.append(f"scale now {c['scale'][i]:g}")
        texts.append("<br>".join(parts))
    return texts


def _uses_vram(c: dict[str, np.ndarray], info: Any) -> bool:
    if np.isfinite(c["vram_allocated_gib"]).any() or np.isfinite(c["vram_peak_gib"]).any():
        return True
    dev = str(getattr(info, "device", "") or "")
    return dev.startswith("cuda")


def _scaler_used(c: dict[str, np.ndarray], info: Any) -> bool:
    if info is not None and getattr(info, "scaler_enabled", None) is not None:
        return bool(info.scaler_enabled)
    return bool(np.isfinite(c["scale"]).any())


# ------------------------------------------------------------------------------------------------
# Trace specs (plain dicts, cheap: the live dashboard copies their data into existing traces)
# ------------------------------------------------------------------------------------------------
def trace_specs(history: Any, eval_history: Any = None, info: Any = None, *, name: str = "run",
                color: Optional[str] = None, overlay: bool = False, smoothing: float = 0.9,
                max_grad_norm: Optional[float] = None) -> list[dict]:
    """The traces of one run as plain dicts (``row`` = panel row, the rest go.Scatter arguments).

    ``overlay=True`` draws a reduced set in one colour per run (for several runs in one figure).
    ``max_grad_norm`` defaults to ``info.max_grad_norm``.
    """
    c = columns(history)
    ev = eval_columns(eval_history)
    x = c["step"]
    if max_grad_norm is None and info is not None:
        max_grad_norm = getattr(info, "max_grad_norm", None)
    col = color or _PALETTE[0]
    prefix = f"{name} · " if overlay else ""
    specs: list[dict] = []

    def add(panel, kind, label, *, legend=True, **kw):
        specs.append(dict(row=PANEL_ROWS[panel], type="scatter", name=prefix + label,
                          meta={"run": name, "panel": panel, "kind": kind},
                          legendgroup=name if overlay else kind,
                          showlegend=legend, **kw))

    def line(kind):
        return dict(color=col if overlay else _SOLO[kind])

    # loss panel -----------------------------------------------------------------------------
    if overlay:
        add("loss", "loss", "loss", legend=False, x=x, y=c["loss"], mode="lines", opacity=0.3,
            line=dict(color=col, width=1))
        add("loss", "loss_ema", "loss (EMA)", x=x, y=smooth(c["loss"], smoothing), mode="lines",
            line=dict(color=col, width=2))
    else:
        add("loss", "loss", "loss", x=x, y=c["loss"], mode="lines", line=dict(color=_SOLO["loss"], width=1))
        add("loss", "loss_ema", f"loss (EMA {smoothing:g})", x=x, y=smooth(c["loss"], smoothing),
            mode="lines", line=dict(color=_SOLO["loss_ema"], width=2))
    add("loss", "eval_loss", "eval loss", legend=not overlay, x=ev["step"], y=ev["eval_loss"],
        mode="markers+lines", marker=dict(symbol="circle", size=8, **line("eval_loss")),
        line=dict(dash="dot", **line("eval_loss")))

    # grad-norm panel ------------------------------------------------------------------------
    add("grad_norm", "grad_norm", "grad norm", legend=not overlay, x=x, y=c["grad_norm"], mode="lines",
        line=dict(width=1.5, **line("grad_norm")))
    if max_grad_norm:
        xs = [float(np.nanmin(x)), float(np.nanmax(x))] if len(x) else []
        add("grad_norm", "clip_threshold", f"clip at {max_grad_norm:g}", legend=not overlay, x=xs,
            y=[float(max_grad_norm)] * len(xs), mode="lines", line=dict(dash="dash", width=1, **line(
                "clip_threshold")), hoverinfo="skip")
    clipped = c["clipped"]
    add("grad_norm", "clipped", "clipped", legend=not overlay, x=x[clipped], y=c["grad_norm"][clipped],
        mode="markers", marker=dict(symbol="triangle-down", size=6, **line("clipped")))

    # scale panel ----------------------------------------------------------------------------
    add("scale", "scale", "loss scale", legend=not overlay, x=x, y=c["scale"], mode="lines+markers",
        marker=dict(size=3), line=dict(shape="hv", **line("scale")))

    # memory panel ---------------------------------------------------------------------------
    if _uses_vram(c, info):
        mem_kinds = (("vram_peak", "vram_peak_gib", "VRAM peak (window)"),) if overlay else (
            ("vram_allocated", "vram_allocated_gib", "VRAM allocated"),
            ("vram_reserved", "vram_reserved_gib", "VRAM reserved"),
            ("vram_peak", "vram_peak_gib", "VRAM peak (window)"))
        for kind, field, label in mem_kinds:
            add("memory", kind, label, legend=not overlay, x=x, y=c[field], mode="lines",
                line=dict(dash="dot" if kind == "vram_peak" and not overlay else "solid", **line(kind)))
        mem_ref = c["vram_peak_gib"] if overlay else c["vram_allocated_gib"]
        total = getattr(info, "device_total_gib", None) if info is not None else None
        if total and len(x):
            add("memory", "device_total", f"device total {total:.1f} GiB", legend=not overlay,
                x=[float(np.nanmin(x)), float(np.nanmax(x))], y=[float(total)] * 2, mode="lines",
                line=dict(dash="dash", width=1, **line("device_total")), hoverinfo="skip")
    else:
        add("memory", "host_rss", "host memory (process RSS)", legend=not overlay, x=x,
            y=c["host_rss_gib"], mode="lines", line=line("host_rss"))
        mem_ref = c["host_rss_gib"]

    # skipped / non-finite markers, in every panel ---------------------------------------------
    nonfinite = c["nonfinite"] | ~np.isfinite(c["loss"]) | ~np.isfinite(c["grad_norm"])
    gn_finite = c["grad_norm"][np.isfinite(c["grad_norm"])]
    gn_top = float(gn_finite.max()) if gn_finite.size else 1.0
    visible = {
        "loss": _fill_visible(c["loss"], 0.0),
        "grad_norm": np.where(np.isfinite(c["grad_norm"]), c["grad_norm"], gn_top),
        "scale": _fill_visible(c["scale"], 1.0),
        "memory": _fill_visible(mem_ref, 0.0),
    }
    for kind, mask, label, style in (("nonfinite", nonfinite, "non-finite", _NONFINITE_STYLE),
                                     ("skipped", c["skipped"], "skipped step", _SKIP_STYLE)):
        hover = _flag_text(c, mask)
        for panel in PANELS:
            extra = {}
            if kind == "nonfinite" and panel == "loss":
                # The nan/inf loss itself, written where it would have been drawn.
                extra = dict(mode="markers+text", textposition="top center",
                             text=[("nan" if math.isnan(v) else str(v)) if not math.isfinite(v) else ""
                                   for v in c["loss"][mask].tolist()])
            marker = dict(style)
            if overlay:
                marker["color"] = col
            add(panel, kind, label, legend=(panel == "loss" and not overlay),
                x=x[mask], y=visible[panel][mask], mode=extra.pop("mode", "markers"), marker=marker,
                hovertext=hover, hoverinfo="text", **extra)
    return specs


def _spec_trace(spec: dict) -> go.Scatter:
    kw = {k: v for k, v in spec.items() if k not in ("row", "type")}
    return go.Scatter(**kw)


def add_run_traces(fig: go.Figure, history: Any, eval_history: Any = None, info: Any = None, *,
                   name: str = "run", color: Optional[str] = None, overlay: bool = False,
                   smoothing: float = 0.9, max_grad_norm: Optional[float] = None,
                   rows: Optional[Mapping[str, int]] = None, col: int = 1) -> list[go.Scatter]:
    """Add one run's traces to a figure made by :func:`make_run_layout` (or any 4-row subplot grid).

    ``rows`` maps panel name to subplot row (default: loss 1, grad_norm 2, scale 3, memory 4); a
    panel missing from ``rows`` is left out. Returns the traces added.
    """
    rows = dict(PANEL_ROWS if rows is None else rows)
    inv = {v: k for k, v in PANEL_ROWS.items()}
    added = []
    for spec in trace_specs(history, eval_history, info, name=name, color=color, overlay=overlay,
                            smoothing=smoothing, max_grad_norm=max_grad_norm):
        panel = inv[spec["row"]]
        if panel not in rows:
            continue
        tr = _spec_trace(spec)
        fig.add_trace(tr, row=rows[panel], col=col)
        added.append(fig.data[-1])
    return added


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------
def make_run_layout(*, memory_title: str = "memory (GiB)", height: int = 820) -> go.Figure:
    """An empty 4-panel figure (loss, grad norm, loss scale, memory) sharing the step axis."""
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("loss", "gradient norm (unscaled, before clipping)",
                                        "loss scale (GradScaler)", memory_title))
    fig.update_yaxes(type="log", row=2, col=1)
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_yaxes(title_text="GiB", row=4, col=1)
    fig.update_xaxes(title_text="optimizer step", row=4, col=1)
    # uirevision keeps the user's zoom across live redraws.
    fig.update_layout(height=height, margin=dict(l=60, r=20, t=60, b=50), hovermode="closest",
                      uirevision="nbtrain", legend=dict(groupclick="togglegroup"),
                      template="plotly_white")
    return fig


def _memory_title(runs: Mapping[str, tuple]) -> str:
    if any(_uses_vram(c, info) for c, _, info in runs.values()):
        return "accelerator memory (GiB)"
    return "host memory: process RSS (GiB, CPU run)"


def _no_scaler_note(fig: go.Figure, runs: Mapping[str, tuple], row: int) -> None:
    """Say, on the loss-scale panel in ``row``, which runs have no scale line: they train without a GradScaler."""
    without = [(name, info) for name, (c, _, info) in runs.items() if not _scaler_used(c, info)]
    if not without:
        return
    if len(without) == len(runs):
        precs = sorted({str(getattr(i, "precision_used", "") or "") for _, i in without} - {""})
        what = "/".join(precs) if precs else "this run"
        text = f"no GradScaler: {what} trains without loss scaling"
    else:
        text = "no GradScaler in: " + ", ".join(n for n, _ in without)
    sp = fig.get_subplot(row, 1)   # axis numbers follow the grid, so ask, not guess
    x, y = sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")
    fig.add_annotation(text=text, xref=f"{x} domain", yref=f"{y} domain", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=13, color="#555"), name="no_scaler")


def runs_figure(runs: Mapping[str, Any], *, smoothing: float = 0.9, title: Optional[str] = None,
                colors: Optional[Mapping[str, str]] = None) -> go.Figure:
    """Several runs overlaid in the 4 panels, one colour per run.

    ``runs`` maps a name to a history, or to a dict/tuple ``(history, eval_history, info)``. One run
    is drawn in full detail (allocated/reserved/peak memory, per-quantity colours).
    """
    norm: dict[str, tuple] = {}
    for name, v in runs.items():
        if isinstance(v, tuple):
            h, e, i = (tuple(v) + (None, None))[:3]
        elif isinstance(v, Mapping) and "history" in v:
            h, e, i = v.get("history"), v.get("eval_history"), v.get("info")
        else:
            h, e, i = v, None, None
        norm[str(name)] = (columns(h), e, i)
    fig = make_run_layout(memory_title=_memory_title(norm))
    overlay = len(norm) > 1
    for k, (name, (c, e, i)) in enumerate(norm.items()):
        color = (colors or {}).get(name) or _PALETTE[k % len(_PALETTE)]
        for spec in trace_specs(c, e, i, name=name, color=color, overlay=overlay, smoothing=smoothing):
            fig.add_trace(_spec_trace(spec), row=spec["row"], col=1)
    _no_scaler_note(fig, norm, PANEL_ROWS["scale"])
    if title:
        fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)))
    return fig


def run_figure(history: Any, eval_history: Any = None, info: Any = None, *, smoothing: float = 0.9,
               title: Optional[str] = None) -> go.Figure:
    """One run's 4-panel figure: loss (+EMA, eval), grad norm (+clip), loss scale, memory.

    ``history`` is a list of StepRecord or the ``result.history`` DataFrame.
    """
    name = (getattr(info, "variant", None) if info is not None else None) or "run"
    return runs_figure({name: (history, eval_history, info)}, smoothing=smoothing, title=title)


def _summary_value(summary: Optional[Mapping], key: str) -> float:
    return _num(summary.get(key)) if summary else math.nan


# Where each panel goes in the comparison's 5 x 2 grid (row, col).
_COMPARE_GRID = {"loss": (1, 1), "loss_diff": (2, 1), "grad_norm": (3, 1), "scale": (4, 1), "memory": (5, 1),
                 "throughput": (1, 2), "peak_memory": (3, 2)}


def compare_figure(histories: Mapping[str, Any], reference: Optional[str] = None,
                   summaries: Optional[Mapping[str, Mapping]] = None,
                   eval_histories: Optional[Mapping[str, Any]] = None,
                   infos: Optional[Mapping[str, Any]] = None,
                   not_run: Optional[Mapping[str, str]] = None, *,
                   smoothing: float = 0.9, title: Optional[str] = None) -> go.Figure:
    """Variants overlaid: loss, loss difference to ``reference`` (EMA, same steps), grad norm, loss scale
    and memory over the steps, with bars of throughput and peak memory (the figure of
    ``ComparisonResult.figure()``).

    ``summaries`` (name -> ``result.summary``) supply ``tokens_per_s`` and ``peak_vram_gib``; without
    them the bars use the history's median tokens/s and its peak VRAM (or host RSS on CPU). ``infos``
    (name -> RunInfo) say which runs had a GradScaler and which device they used; ``not_run`` (name ->
    reason) lists the variants that did not run under the title. No histories: a figure that says so.
    """
    infos = infos or {}
    not_run = dict(not_run or {})
    if not histories:
        fig = go.Figure()
        fig.update_layout(template="plotly_white", height=300,
                          title=dict(text="no variant ran" + _not_run_text(not_run), x=0.01))
        return fig
    names = [str(n) for n in histories]
    ref = str(reference) if reference is not None else names[0]
    if ref not in names:
        raise ValueError(f"reference {reference!r} is not one of {names}")
    runs = {str(n): (columns(h), (eval_histories or {}).get(n), infos.get(n)) for n, h in histories.items()}
    vram = (any(_uses_vram(c, i) for c, _, i in runs.values())
            or any((s or {}).get("peak_vram_gib") is not None for s in (summaries or {}).values()))
    peak_label = "peak VRAM (GiB)" if vram else "peak host RSS (GiB)"
    fig = make_subplots(
        rows=5, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.1, vertical_spacing=0.06,
        specs=[[{}, {"rowspan": 2}], [{}, None], [{}, {"rowspan": 2}], [{}, None], [{}, None]],
        subplot_titles=("loss", "throughput (tokens/s)", f"loss − {ref} (EMA)", "gradient norm (unscaled)",
                        peak_label, "loss scale", _memory_title(runs)))
    ref_c = runs[ref][0]
    ref_at = dict(zip(ref_c["step"].tolist(), smooth(ref_c["loss"], smoothing).tolist()))
    tps, peak = [], []
    for k, (name, (c, ev, info)) in enumerate(runs.items()):
        color = _PALETTE[k % len(_PALETTE)]
        for spec in trace_specs(c, ev, info, name=name, color=color, overlay=True, smoothing=smoothing):
            row, col = _COMPARE_GRID[spec["meta"]["panel"]]
            fig.add_trace(_spec_trace(spec), row=row, col=col)
        ema = smooth(c["loss"], smoothing)
        both = [i for i, s in enumerate(c["step"].tolist()) if s in ref_at]
        diff = np.array([ema[i] - ref_at[c["step"][i]] for i in both], dtype=np.float64)
        fig.add_trace(go.Scatter(x=c["step"][both], y=diff, mode="lines", name=f"{name} · Δloss",
                                 line=dict(color=color, dash="solid" if name != ref else "dot"),
                                 legendgroup=name, showlegend=False,
                                 meta={"run": name, "panel": "loss_diff", "kind": "loss_diff"}),
                      row=2, col=1)
        s = (summaries or {}).get(name)
        t = _summary_value(s, "tokens_per_s")
        if not math.isfinite(t):
            f = c["tokens_per_s"][np.isfinite(c["tokens_per_s"])]
            t = float(np.median(f)) if f.size else math.nan
        p = _summary_value(s, "peak_vram_gib")
        if not math.isfinite(p):
            src = c["vram_peak_gib"] if vram else c["host_rss_gib"]
            f = src[np.isfinite(src)]
            p = float(f.max()) if f.size else math.nan
        tps.append(t)
        peak.append(p)
    colors = [_PALETTE[k % len(_PALETTE)] for k in range(len(names))]
    fig.add_trace(go.Bar(x=names, y=tps, marker_color=colors, showlegend=False, name="tokens/s",
                         text=[f"{v:,.0f}" if math.isfinite(v) else "n/a" for v in tps],
                         textposition="auto", meta={"run": None, "panel": "throughput", "kind": "tokens_per_s"}),
                  row=1, col=2)
    fig.add_trace(go.Bar(x=names, y=peak, marker_color=colors, showlegend=False, name=peak_label,
                         text=[f"{v:.2f}" if math.isfinite(v) else "n/a" for v in peak],
                         textposition="auto", meta={"run": None, "panel": "peak_memory", "kind": "peak_memory"}),
                  row=3, col=2)
    # One step axis for the whole left column, so zooming one panel zooms all.
    for row in range(2, 6):
        fig.update_xaxes(matches="x", row=row, col=1)
    fig.update_xaxes(showticklabels=True, title_text="optimizer step", row=5, col=1)
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_yaxes(type="log", row=4, col=1)
    fig.update_yaxes(title_text="GiB", row=5, col=1)
    _no_scaler_note(fig, runs, _COMPARE_GRID["scale"][0])
    if title is None:
        title = " vs ".join(names) + f" (reference: {ref})" + _not_run_text(not_run)
    fig.update_layout(height=1050, margin=dict(l=60, r=20, t=90, b=50), template="plotly_white",
                      hovermode="closest", legend=dict(groupclick="togglegroup"),
                      title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)))
    return fig


def _not_run_text(not_run: Mapping[str, str]) -> str:
    if not not_run:
        return ""
    # A title does not wrap: shorten each reason (the table has it in full); escape only what plotly's
    # HTML subset would read as markup.
    parts = [html.escape(f"{n}: {_shorten(str(r or 'did not run'))}", quote=False) for n, r in not_run.items()]
    return "<br><sup>not run: " + " | ".join(parts) + "</sup>"


def _shorten(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def find_traces(fig: go.Figure, *, run: Any = ..., panel: Optional[str] = None,
                kind: Optional[str] = None) -> list:
    """The traces of ``fig`` whose meta matches (``run=...`` means any run)."""
    out = []
    for tr in fig.data:
        meta = tr.meta if isinstance(tr.meta, dict) else {}
        if panel is not None and meta.get("panel") != panel:
            continue
        if kind is not None and meta.get("kind") != kind:
            continue
        if run is not ... and meta.get("run") != run:
            continue
        out.append(tr)
    return out


def find_trace(fig: go.Figure, panel: str, kind: str, run: Any = ...):
    """The single trace for (panel, kind[, run]); raises KeyError when absent or ambiguous."""
    found = find_traces(fig, run=run, panel=panel, kind=kind)
    if len(found) != 1:
        raise KeyError(f"expected one trace panel={panel!r} kind={kind!r} run={run!r}, found {len(found)}")
    return found[0]


def iter_runs(fig: go.Figure) -> Iterable[str]:
    """Names of the runs drawn in ``fig``, in drawing order."""
    seen: dict[str, None] = {}
    for tr in fig.data:
        meta = tr.meta if isinstance(tr.meta, dict) else {}
        if meta.get("run") is not None:
            seen.setdefault(meta["run"], None)
    return list(seen)
