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
# A preference objective's runs (dpo, orpo, simpo) add these two, in a row of their own under the four; an
# objective="lm" run has no rewards and never gets them (no empty panels).
REWARD_PANELS: tuple[str, ...] = ("reward_margin", "reward_accuracy")
# Where each panel sits in a run figure's 2 x 2 grid (row, col): four panels side by side in pairs fit one laptop
# screen under the Panel's status line; the reward panels take a third row when a run has rewards, and the
# difference panel of overlaid runs spans the row after the last (DIFF_ROW without rewards).
PANEL_CELLS: dict[str, tuple[int, int]] = {"loss": (1, 1), "grad_norm": (1, 2), "scale": (2, 1), "memory": (2, 2),
                                           "reward_margin": (3, 1), "reward_accuracy": (3, 2)}
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")
# An objective="grpo" run adds these four, in two rows of their own under the 2 x 2 grid (under the preference
# reward row when a figure holds both kinds of run): the reward, the completions' length, the share of clipped
# tokens and the sampler/trainer log-prob mismatch. No other run gets them.
GRPO_PANELS: tuple[str, ...] = ("reward", "completion_len", "clip_ratio", "mismatch")
# (row after the rows above them, column) of each GRPO panel in a run figure; run_cells gives the absolute cells
_GRPO_OFFSETS = {"reward": (0, 1), "completion_len": (0, 2), "clip_ratio": (1, 1), "mismatch": (1, 2)}

_REWARD_COLS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
_GRPO_COLS = ("mismatch_mean", "mismatch_max", "mismatch_kl", "is_ratio_min", "is_ratio_mean", "is_ratio_max",
              "sampler_fp32_gap", "trainer_fp32_gap", "reward_mean", "reward_std", "completion_len_mean",
              "clip_ratio", "frac_zero_std")
_FLOAT_COLS = ("step", "epoch", "tokens", "loss", "lr", "grad_norm", "scale", "vram_allocated_gib",
               "vram_reserved_gib", "vram_peak_gib", "host_rss_gib", "host_tensors_gib", "step_time_s",
               "tokens_per_s", "elapsed_s") + _REWARD_COLS + _GRPO_COLS
_BOOL_COLS = ("clipped", "skipped", "nonfinite")
_EVAL_COLS = ("step", "eval_loss")

_PALETTE = qualitative.Plotly
_SKIP_STYLE = dict(symbol="x", size=9, color="#d62728", line=dict(width=1))
_NONFINITE_STYLE = dict(symbol="diamond-open", size=11, color="#ff7f0e", line=dict(width=2))
# Single-run colours, one per quantity (overlays colour by run instead).
_SOLO = dict(loss="#9ecae1", loss_ema="#1f77b4", eval_loss="#ff7f0e", grad_norm="#2ca02c",
             clip_threshold="#7f7f7f", clipped="#9467bd", scale="#8c564b", vram_allocated="#1f77b4",
             vram_reserved="#17becf", vram_peak="#d62728", device_total="#7f7f7f", host_rss="#1f77b4",
             host_tensors="#1f77b4", host_rss_secondary="#9e9e9e", reward_margin="#cab2d6",
             reward_margin_ema="#6a3d9a", reward_chosen="#2ca02c", reward_rejected="#d62728",
             reward_accuracy="#fdbf6f", reward_accuracy_ema="#ff7f00", reward_mean="#2ca02c",
             completion_len_mean="#8c564b", length_cap="#7f7f7f", clip_ratio="#9467bd", mismatch_mean="#d62728",
             sampler_fp32_gap="#1f77b4", trainer_fp32_gap="#ff7f0e")
# What process RSS is, wherever it is drawn next to the run's own tensors.
RSS_NOTE = "process RSS — whole process, includes earlier runs and libraries"
# The run-tensor count is taken on sampled steps (RunTensorBytes.measures): the line joins those.
TENSORS_NOTE = "run tensors, measured on this step (steps 1-3, every 10th and the last)"
MAX_SCALE_TICKS = 6    # more labels than this on the scale axis crowd into each other
TITLE_FONT = 14        # figure title
SUBPLOT_TITLE_FONT = 16  # make_subplots' default for panel titles
PANEL_TITLE_FONT = 14    # the run grid's panel titles: two side by side in half the width


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
    raw = get("reward_margin") if get else None
    out["rewarded"] = rewarded(raw if raw is not None else [None] * n, out["nonfinite"])
    return out


def rewarded(raw_margins: Sequence[Any], nonfinite: Sequence[bool]) -> np.ndarray:
    """Per step, whether the record carried a reward margin: a finite value, or a non-finite one on a step flagged
    non-finite (the engine's NaN reward, never averaged away). objective="lm" records hold None; a table read back
    from a file holds NaN there instead, on unflagged steps too: there a NaN is no reward, flagged or not."""
    flags = np.asarray(nonfinite, dtype=bool)
    vals = np.array([_num(v) for v in raw_margins], dtype=np.float64)
    given = np.array([v is not None for v in raw_margins], dtype=bool)
    finite = np.isfinite(vals)
    # A run that records rewards has one on every step: a missing or NaN one on an unflagged step says it has none.
    complete = bool((given & (finite | flags)).all()) if len(vals) else False
    return finite | (given & flags & complete)


def has_rewards(c: Mapping[str, np.ndarray], info: Any = None) -> bool:
    """Whether a run's figure gets the reward panels: its config's objective when the run info has one (so a
    preference run has them from before its first step, and keeps them when every reward is NaN), else whether
    any of its records carried a reward."""
    objective = getattr(getattr(info, "config", None), "objective", None)
    if isinstance(objective, str):
        return objective in PREFERENCE_OBJECTIVES
    flags = c.get("rewarded")
    if flags is not None:
        return bool(np.asarray(flags).any())
    return bool(np.isfinite(c.get("reward_margin", np.array([]))).any())


def has_grpo(c: Mapping[str, np.ndarray], info: Any = None) -> bool:
    """Whether a run's figure gets the GRPO panels: its config's objective when the run info has one (so they are
    there before the first step), else whether any of its records carried a GRPO reward or mismatch."""
    objective = getattr(getattr(info, "config", None), "objective", None)
    if isinstance(objective, str):
        return objective == "grpo"
    return any(bool(np.isfinite(c.get(k, np.array([]))).any()) for k in ("reward_mean", "mismatch_mean"))


def run_cells(rewards: bool = False, grpo: bool = False) -> dict[str, tuple[int, int]]:
    """Each panel's (row, col) in a run figure with these optional rows: PANEL_CELLS, and the GRPO panels in the two
    rows after the last one above them."""
    first = 3 + (1 if rewards else 0)
    cells = dict(PANEL_CELLS)
    if grpo:
        cells.update({p: (first + dr, c) for p, (dr, c) in _GRPO_OFFSETS.items()})
    return cells


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
    ema, n, first = 0.0, 0, math.nan
    for i, v in enumerate(y.tolist()):
        if math.isfinite(v):
            ema = s * ema + (1 - s) * v
            n += 1
            first = v if n == 1 else first
        if n:
            # One value averages to itself: (1 - s) * v / (1 - s) misses v by a rounding step in about one case
            # of eight, and a loss line and its EMA a rounding step apart made plotly tick the axis at that
            # spread ("3.573132753372192383") at a run's first point.
            out[i] = first if n == 1 else ema / (1 - s ** n)
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


def _flag_text(c: dict[str, np.ndarray], mask: np.ndarray, grpo: bool = False) -> list[str]:
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
        if "rewarded" in c and c["rewarded"][i] and not math.isfinite(c["reward_margin"][i]):
            parts.append(f"reward_margin={c['reward_margin'][i]}")
        if grpo and not math.isfinite(c["reward_mean"][i]):
            parts.append(f"reward_mean={c['reward_mean'][i]}")
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


def _tensors_measured(c: dict[str, np.ndarray]) -> bool:
    # Older histories (and accelerator runs) have no host_tensors_gib: they fall back to RSS.
    return bool(np.isfinite(c.get("host_tensors_gib", np.array([]))).any())


def _loss_unit(infos: Iterable[Any]) -> str:
    configs = [getattr(i, "config", None) for i in infos]
    tasks = {getattr(c, "task", None) for c in configs}
    if configs and all(getattr(c, "objective", None) == "grpo" for c in configs):
        return GRPO_LOSS_UNIT
    return "nats/example" if "sequence-classification" in tasks else "nats/token"


def _pow2_text(v: float) -> str:
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"


def scale_axis(values: Any) -> dict:
    """Y-axis settings of the loss-scale panel: log, ticks at the powers of two spanning ``values``,
    labelled in full ("65,536"); no labels when there is no scale to show."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return dict(type="log", tickmode="array", tickvals=[], ticktext=[], showticklabels=False)
    lo, hi = math.floor(math.log2(float(v.min()))), math.ceil(math.log2(float(v.max())))
    if lo == hi:   # a constant scale: its neighbours give the single value some context
        lo, hi = lo - 1, hi + 1
    step = max(1, math.ceil((hi - lo + 1) / MAX_SCALE_TICKS))
    # Counted down from the top, so the initial scale (the usual maximum) always gets a label.
    vals = [2.0 ** k for k in reversed(range(hi, lo - 1, -step))]
    return dict(type="log", tickmode="array", tickvals=vals, ticktext=[_pow2_text(x) for x in vals],
                showticklabels=True)


def runs_scale_axis(runs: Mapping[str, tuple]) -> dict:
    """:func:`scale_axis` over every run of ``runs`` (name -> ``(columns, eval, info)``)."""
    vals = [c["scale"] for c, _, _ in runs.values()]
    return scale_axis(np.concatenate(vals) if vals else [])


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
    rewards, grpo = has_rewards(c, info), has_grpo(c, info)
    cells = run_cells(rewards, grpo)

    def add(panel, kind, label, *, legend=True, **kw):
        row, cell_col = cells[panel]
        kw.setdefault("legendgroup", name if overlay else kind)
        if kw.get("mode") == "lines" and _finite_count(kw.get("y")) == 1:
            # plotly draws no line through one point: a run's first point would leave its panel empty
            kw["mode"] = "lines+markers"
        specs.append(dict(row=row, col=cell_col, type="scatter", name=prefix + label,
                          meta={"run": name, "panel": panel, "kind": kind}, showlegend=legend, **kw))

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
    # A run without a GradScaler has nothing to show here: no legend entry for an empty line.
    add("scale", "scale", "loss scale", legend=not overlay and _scaler_used(c, info), x=x, y=c["scale"],
        mode="lines+markers", marker=dict(size=3), line=dict(shape="hv", **line("scale")))

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
    elif _tensors_measured(c):
        # The run's own tensors are what the run costs; RSS also counts earlier runs and libraries.
        # Measured on sampled steps only (None between them): markers at the measured steps, a line through them.
        add("memory", "host_tensors", "run tensors (GiB)", legend=not overlay, x=x, y=c["host_tensors_gib"],
            mode="lines+markers", connectgaps=True, marker=dict(size=4), line=dict(width=2, **line("host_tensors")),
            hovertemplate="step %{x}<br>%{y:.3g} GiB<br>" + TENSORS_NOTE + "<extra></extra>")
        # A run stopped between sampled steps (Stop at step 9: measured 1-3 only) would end its memory line
        # short of the other panels. The last measured value is drawn on to the last step, dotted, and says so:
        # a step's tensors have the same shapes every step (up to the batch's padded length).
        mx, my = _last_finite(x, c["host_tensors_gib"])
        last = float(np.nanmax(x)) if len(x) else math.nan
        carried = mx is not None and last > mx
        add("memory", "host_tensors_carried", "run tensors (last measured)", legend=False,
            x=[mx, last] if carried else [], y=[my, my] if carried else [], mode="lines",
            line=dict(width=2, dash="dot", **line("host_tensors")),
            legendgroup=name if overlay else "host_tensors",
            hovertemplate="step %{x}<br>%{y:.3g} GiB: the last measured value, carried on<br>" + TENSORS_NOTE
            + "<extra></extra>")
        if not overlay:
            add("memory", "host_rss", "process RSS (whole process)", x=x, y=c["host_rss_gib"], mode="lines",
                line=dict(dash="dot", width=1, color=_SOLO["host_rss_secondary"]), opacity=0.8,
                hovertemplate="step %{x}<br>%{y:.2f} GiB<br>" + RSS_NOTE + "<extra></extra>")
        mem_ref = c["host_tensors_gib"]
    else:
        add("memory", "host_rss", "host memory (process RSS)", legend=not overlay, x=x,
            y=c["host_rss_gib"], mode="lines", line=line("host_rss"),
            hovertemplate="step %{x}<br>%{y:.2f} GiB<br>" + RSS_NOTE + "<extra></extra>")
        mem_ref = c["host_rss_gib"]

    # reward panels (preference objectives only) ------------------------------------------------
    if rewards:
        for kind, label in (("reward_margin", "reward margin"), ("reward_accuracy", "reward accuracy")):
            # As the loss: the recorded values thin, their EMA over them (one pair batch's accuracy is coarse).
            fmt = "%{y:.1%}" if kind == "reward_accuracy" else "%{y:.4g}"
            hover = "step %{x}<br>" + label + " " + fmt + "<extra>" + html.escape(name) + "</extra>"
            ema = f"{label} (EMA)" if overlay else f"{label} (EMA {smoothing:g})"
            add(kind, kind, label, legend=not overlay, x=x, y=c[kind], mode="lines",
                opacity=0.3 if overlay else 1.0, line=dict(color=col if overlay else _SOLO[kind], width=1),
                hovertemplate=hover)
            add(kind, kind + "_ema", ema, legend=not overlay, x=x, y=smooth(c[kind], smoothing), mode="lines",
                line=dict(color=col if overlay else _SOLO[kind + "_ema"], width=2), hovertemplate=hover)
        if not overlay:
            # One run: what the margin is the difference of (TRL's rewards/chosen and rewards/rejected).
            for kind, label in (("reward_chosen", "chosen reward"), ("reward_rejected", "rejected reward")):
                add("reward_margin", kind, label, x=x, y=c[kind], mode="lines",
                    line=dict(color=_SOLO[kind], width=1, dash="dot"))

    # GRPO panels (objective="grpo" only) ------------------------------------------------------
    if grpo:
        _grpo_specs(add, c, x, info, name=name, color=col, overlay=overlay)

    # skipped / non-finite markers, in every panel ---------------------------------------------
    nonfinite = c["nonfinite"] | ~np.isfinite(c["loss"]) | ~np.isfinite(c["grad_norm"])
    gn_finite = c["grad_norm"][np.isfinite(c["grad_norm"])]
    gn_top = float(gn_finite.max()) if gn_finite.size else 1.0
    visible = {
        "loss": _fill_visible(c["loss"], 0.0),
        "grad_norm": np.where(np.isfinite(c["grad_norm"]), c["grad_norm"], gn_top),
        "scale": _fill_visible(c["scale"], 1.0),
        "memory": _fill_visible(mem_ref, 0.0),
        "reward_margin": _fill_visible(c["reward_margin"], 0.0),
        "reward_accuracy": _fill_visible(c["reward_accuracy"], 0.0),
        **{panel: _fill_visible(c[field], 0.0) for panel, field in _GRPO_VALUE.items()},
    }
    for kind, mask, label, style in (("nonfinite", nonfinite, "non-finite", _NONFINITE_STYLE),
                                     ("skipped", c["skipped"], "skipped step", _SKIP_STYLE)):
        hover = _flag_text(c, mask, grpo)
        for panel in PANELS + (REWARD_PANELS if rewards else ()) + (GRPO_PANELS if grpo else ()):
            extra = {}
            if kind == "nonfinite" and panel in ("loss", "reward_margin", "reward"):
                # The nan/inf value itself, written where it would have been drawn.
                field = _GRPO_VALUE.get(panel, panel)
                extra = dict(mode="markers+text", textposition="top center",
                             text=[("nan" if math.isnan(v) else str(v)) if not math.isfinite(v) else ""
                                   for v in c[field][mask].tolist()])
            marker = dict(style)
            if overlay:
                marker["color"] = col
            add(panel, kind, label, legend=(panel == "loss" and not overlay),
                x=x[mask], y=visible[panel][mask], mode=extra.pop("mode", "markers"), marker=marker,
                hovertext=hover, hoverinfo="text", **extra)
    return specs


# the column each GRPO panel's main line draws (where its skipped / non-finite markers sit)
_GRPO_VALUE = {"reward": "reward_mean", "completion_len": "completion_len_mean", "clip_ratio": "clip_ratio",
               "mismatch": "mismatch_mean"}
MISMATCH_UNIT = "nats per token"


def _rgba(color: str, alpha: float) -> str:
    """``#rrggbb`` (or ``rgb(r, g, b)``) as an rgba() string with ``alpha``: a band in its line's colour. Any other
    spelling (a CSS name) gives a grey band: see-through matters more than the hue under a line of that colour."""
    try:
        if color.startswith("#") and len(color) == 7:
            r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
        else:
            r, g, b = (int(float(v)) for v in color[color.index("(") + 1:color.index(")")].split(",")[:3])
    except ValueError:
        r = g = b = 110
    return f"rgba({r}, {g}, {b}, {alpha})"


def _grpo_specs(add, c: Mapping[str, np.ndarray], x: np.ndarray, info: Any, *, name: str, color: str,
                overlay: bool) -> None:
    """The GRPO panels' traces of one run, through ``add`` (trace_specs' own): the step's reward mean over a ±std
    band, the completions' mean length (and the max_new_tokens cap), the clipped share of tokens, and the mean
    |delta log p| between sampler and trainer, with the fp32 gaps as markers on the steps that measured them."""
    def line(kind, width=2.0, **kw):
        return dict(color=color if overlay else _SOLO[kind], width=width, **kw)

    who = "<extra>" + html.escape(name) + "</extra>"
    mean, std = c["reward_mean"], c["reward_std"]
    band = _rgba(color if overlay else _SOLO["reward_mean"], 0.12 if overlay else 0.2)
    # The band is two edges, the lower filled up to the upper ("tonexty": the trace just before, in this panel).
    add("reward", "reward_band_high", "reward + std", legend=False, x=x, y=mean + std, mode="lines",
        line=dict(width=0, color=band), hoverinfo="skip", legendgroup=name if overlay else "reward_band")
    add("reward", "reward_band_low", "± std over completions", legend=not overlay, x=x, y=mean - std, mode="lines",
        line=dict(width=0, color=band), fill="tonexty", fillcolor=band, hoverinfo="skip",
        legendgroup=name if overlay else "reward_band")
    add("reward", "reward_mean", "reward (mean)", legend=not overlay, x=x, y=mean, mode="lines",
        line=line("reward_mean"), customdata=np.column_stack([std, c["frac_zero_std"]]),
        hovertemplate="step %{x}<br>reward %{y:.4g} ± %{customdata[0]:.3g}<br>groups with equal rewards: "
                      "%{customdata[1]:.0%}" + who)

    add("completion_len", "completion_len_mean", "completion length (mean)", legend=not overlay, x=x,
        y=c["completion_len_mean"], mode="lines", line=line("completion_len_mean"),
        hovertemplate="step %{x}<br>%{y:.1f} tokens per completion (mean)" + who)
    cap = getattr(getattr(info, "config", None), "max_new_tokens", None)
    if isinstance(cap, (int, float)) and not isinstance(cap, bool):
        # A completion stops at max_new_tokens: a mean at the cap says they were cut, not that they ended. Drawn
        # (empty) before the first step too, so that the first step changes data, not the figure's traces.
        xs = [float(np.nanmin(x)), float(np.nanmax(x))] if len(x) else []
        add("completion_len", "length_cap", f"max_new_tokens {cap:g}", legend=not overlay, x=xs,
            y=[float(cap)] * len(xs), mode="lines", line=line("length_cap", 1.0, dash="dash"), hoverinfo="skip")

    add("clip_ratio", "clip_ratio", "clipped tokens", legend=not overlay, x=x, y=c["clip_ratio"], mode="lines",
        line=line("clip_ratio", 1.5), hovertemplate="step %{x}<br>%{y:.2%} of the tokens clipped" + who)

    add("mismatch", "mismatch_mean", "sampler vs trainer |Δ log p|", legend=not overlay, x=x,
        y=c["mismatch_mean"], mode="lines", line=line("mismatch_mean", 1.5),
        customdata=np.column_stack([c["mismatch_max"], c["mismatch_kl"]]),
        hovertemplate="step %{x}<br>mean |Δ log p| %{y:.3g} " + MISMATCH_UNIT
                      + "<br>largest %{customdata[0]:.3g} · KL %{customdata[1]:.3g}" + who)
    for kind, label, symbol in (("sampler_fp32_gap", "sampler vs fp32", "circle-open"),
                                ("trainer_fp32_gap", "trainer vs fp32", "diamond-open")):
        # measured on sampled steps only (None between them): markers where they were
        has = np.isfinite(c[kind])
        add("mismatch", kind, label, legend=not overlay, x=x[has], y=c[kind][has], mode="markers",
            marker=dict(symbol=symbol, size=7, color=color if overlay else _SOLO[kind], line=dict(width=1.5)),
            hovertemplate="step %{x}<br>" + label + ": %{y:.3g} " + MISMATCH_UNIT + who)


def _finite_count(y: Any) -> int:
    if y is None:
        return 0
    return int(np.isfinite(np.asarray(y, dtype=np.float64)).sum())


def _last_finite(x: np.ndarray, y: np.ndarray) -> tuple[Optional[float], Optional[float]]:
    """The last (x, y) whose y is finite, or (None, None)."""
    ok = np.flatnonzero(np.isfinite(y))
    return (float(x[ok[-1]]), float(y[ok[-1]])) if ok.size else (None, None)


def _spec_trace(spec: dict) -> go.Scatter:
    kw = {k: v for k, v in spec.items() if k not in ("row", "col", "type")}
    return go.Scatter(**kw)


def add_run_traces(fig: go.Figure, history: Any, eval_history: Any = None, info: Any = None, *,
                   name: str = "run", color: Optional[str] = None, overlay: bool = False,
                   smoothing: float = 0.9, max_grad_norm: Optional[float] = None,
                   rows: Optional[Mapping[str, int]] = None, col: int = 1) -> list[go.Scatter]:
    """Add one run's traces to a figure made by :func:`make_run_layout` (or any subplot grid).

    Without ``rows`` each panel goes to its cell of the run layout (:func:`run_cells`); ``rows`` maps panel name to
    a row of column ``col`` of another grid, and a panel missing from it is left out. Returns the traces added.
    """
    added = []
    for spec in trace_specs(history, eval_history, info, name=name, color=color, overlay=overlay,
                            smoothing=smoothing, max_grad_norm=max_grad_norm):
        panel = spec["meta"]["panel"]
        if rows is None:
            where = (spec["row"], spec["col"])   # the run layout's cell (run_cells)
        elif panel in rows:
            where = (rows[panel], col)
        else:
            continue
        tr = _spec_trace(spec)
        fig.add_trace(tr, row=where[0], col=where[1])
        added.append(fig.data[-1])
    return added


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------
SCALE_TITLE = "loss scale (GradScaler)"


def _axis_titles(fig: go.Figure, titles: Mapping[tuple[int, int], str]) -> None:
    for (row, col), text in titles.items():
        fig.update_yaxes(title_text=text, title_font=dict(size=12), automargin=True, row=row, col=col)


DIFF_ROW = 3   # the difference panel of overlaid runs: a third row under the 2 x 2 grid, both columns wide
DIFF_HEIGHT = 150
REWARD_HEIGHT = 230   # the reward row: as tall as each row of the 2 x 2 grid


def diff_row(rewards: bool = False, grpo: bool = False) -> int:
    """The difference panel's row in a run figure: under the reward row and the GRPO rows when there are any."""
    return DIFF_ROW + (1 if rewards else 0) + (2 if grpo else 0)


REWARD_TITLES = {"reward_margin": "reward margin (chosen − rejected)",
                 "reward_accuracy": "reward accuracy (chosen > rejected)"}
ACCURACY_AXIS = dict(range=[-0.05, 1.05], tickformat=".0%", tickvals=[0, 0.25, 0.5, 0.75, 1])
# short enough for a half-width panel, as the others
GRPO_TITLES = {"reward": "reward: mean ± std over completions", "completion_len": "completion length (mean)",
               "clip_ratio": "clipped tokens (ratio outside 1 ± ε)",
               "mismatch": "sampler vs trainer log-prob mismatch"}
GRPO_AXIS_TITLES = {"reward": "reward per completion", "completion_len": "tokens per completion",
                    "clip_ratio": "share of tokens", "mismatch": f"|Δ log p| ({MISMATCH_UNIT})"}
# Shares: a clip ratio of a few per cent must not read as 0% (".0%"), nor 50% as "50.00%"
SHARE_AXIS = dict(tickformat=".2~%", rangemode="tozero")
GRPO_LOSS_UNIT = "policy, per token"   # GRPO's loss is a clipped surrogate of advantages, not a log-likelihood


def _grpo_axes(fig: go.Figure, cells: Mapping[str, tuple[int, int]]) -> None:
    """The GRPO panels' y axes: titles with their units, shares as per cent, counts and gaps from zero."""
    _axis_titles(fig, {cells[p]: GRPO_AXIS_TITLES[p] for p in GRPO_PANELS})
    fig.update_yaxes(row=cells["clip_ratio"][0], col=cells["clip_ratio"][1], **SHARE_AXIS)
    for p in ("completion_len", "mismatch"):
        fig.update_yaxes(rangemode="tozero", row=cells[p][0], col=cells[p][1])
    # an fp32 run's mismatch is ~1e-7: plotly's SI ticks ("110n") read as a unit, powers of ten do not
    fig.update_yaxes(exponentformat="power", row=cells["mismatch"][0], col=cells["mismatch"][1])
# Height of the 2 x 2 grid: with the Panel's status line above it, it fits the output area of a 1440 x 900
# JupyterLab window (about 780 px of notebook), and so does the grid with its difference row.
RUN_HEIGHT = 500


def make_run_layout(*, memory_title: str = "memory (GiB)", height: int = RUN_HEIGHT,
                    loss_unit: str = "nats/token", difference: Optional[str] = None,
                    rewards: bool = False, grpo: bool = False) -> go.Figure:
    """An empty 4-panel figure (loss and grad norm, then loss scale and memory, in a 2 x 2 grid) sharing the step
    axis, each y axis titled with its unit; with ``rewards`` (a preference objective) a row under them holds the
    reward margin and the reward accuracy; with ``grpo`` two rows under those hold GRPO's reward and completion
    length, then its clipped share and sampler/trainer mismatch (:func:`run_cells`); with ``difference`` (a
    reference run's name) a panel below them, both columns wide, holds each run's loss minus that run's, per step."""
    # short enough for a half-width panel: two titles side by side must not run into each other
    titles = ["loss", "grad norm (unscaled, before clipping)", SCALE_TITLE, memory_title]
    specs = [[{}, {}], [{}, {}]]
    heights = [1.0, 1.0]
    if rewards:
        titles += [REWARD_TITLES[p] for p in REWARD_PANELS]
        specs.append([{}, {}])
        heights.append(1.0)
        height += REWARD_HEIGHT
    if grpo:
        titles += [GRPO_TITLES[p] for p in GRPO_PANELS]   # row by row, as run_cells places them
        specs += [[{}, {}], [{}, {}]]
        heights += [1.0, 1.0]
        height += 2 * REWARD_HEIGHT
    if difference is not None:
        titles.append(_diff_title(difference, None))
        specs.append([{"colspan": 2}, None])
        heights.append(0.7)
        height += DIFF_HEIGHT
    row_heights = heights if len(heights) > 2 else None
    rows = len(specs)
    # vertical spacing in pixels, whatever the height: room for a two-line panel title over the next row
    fig = make_subplots(rows=rows, cols=2, specs=specs, shared_xaxes="all", subplot_titles=titles,
                        vertical_spacing=72 / height, horizontal_spacing=0.11, row_heights=row_heights)
    fig.update_annotations(font_size=PANEL_TITLE_FONT)
    r, c = PANEL_CELLS["grad_norm"]
    # labels at 1, 2, 5 of each decade: every digit (plotly's default) crowds a half-width panel
    fig.update_yaxes(type="log", dtick="D2", row=r, col=c)
    fig.update_yaxes(row=PANEL_CELLS["scale"][0], col=PANEL_CELLS["scale"][1], **scale_axis([]))
    if rewards:
        fig.update_yaxes(row=PANEL_CELLS["reward_accuracy"][0], col=PANEL_CELLS["reward_accuracy"][1],
                         **ACCURACY_AXIS)
    if grpo:
        _grpo_axes(fig, run_cells(rewards, grpo))
    diff_unit = " (nats)" if loss_unit.startswith("nats") else ""
    _axis_titles(fig, {PANEL_CELLS["loss"]: f"loss ({loss_unit})", PANEL_CELLS["grad_norm"]: "grad norm (L2)",
                       PANEL_CELLS["scale"]: "loss scale", PANEL_CELLS["memory"]: "memory (GiB)",
                       **({PANEL_CELLS["reward_margin"]: "margin", PANEL_CELLS["reward_accuracy"]: "accuracy"}
                          if rewards else {}),
                       **({(diff_row(rewards, grpo), 1): f"Δ loss{diff_unit}"} if difference else {})})
    # every panel shows its step ticks (a shared axis shows them on the bottom row only otherwise); the bottom
    # row names the axis
    fig.update_xaxes(showticklabels=True)
    for col in ((1,) if difference is not None else (1, 2)):
        fig.update_xaxes(title_text="optimizer step", row=rows, col=col)
    # uirevision keeps the user's zoom across live redraws.
    fig.update_layout(height=height, margin=dict(l=70, r=20, t=60, b=50), hovermode="closest",
                      uirevision="nbtrain", legend=dict(groupclick="togglegroup"),
                      template="plotly_white")
    return fig


def set_title(fig: go.Figure, text: Optional[str]) -> go.Figure:
    """Give ``fig`` a left-aligned title (None or "": none) and a top margin that holds it above the first
    panel titles, so the two never overlap."""
    if not text:
        fig.update_layout(title=dict(text=""))
        return fig
    lines = text.count("<br>") + 1
    pad = 8
    # Title lines, then the first row's panel titles (drawn just above the plot area), then a gap.
    top = pad + math.ceil(lines * TITLE_FONT * 1.5) + math.ceil(SUBPLOT_TITLE_FONT * 1.5) + 8
    fig.update_layout(title=dict(text=text, x=0.01, xanchor="left", y=1, yref="container", yanchor="top",
                                 pad=dict(t=pad), font=dict(size=TITLE_FONT)),
                      margin=dict(t=max(top, fig.layout.margin.t or 0)))
    return fig


def _memory_title(runs: Mapping[str, tuple]) -> str:
    if any(_uses_vram(c, info) for c, _, info in runs.values()):
        return "accelerator memory (GiB)"
    if any(_tensors_measured(c) for c, _, _ in runs.values()):
        return "host memory: run tensors (GiB)"
    return "host memory: process RSS (GiB)"


def _no_scaler_note(fig: go.Figure, runs: Mapping[str, tuple], row: int, col: int = 1) -> None:
    """Say, on the loss-scale panel at (``row``, ``col``), which runs train without a GradScaler, where the
    note covers no line: inside the panel when it is empty, above its plot area otherwise."""
    without = [(name, info) for name, (c, _, info) in runs.items() if not _scaler_used(c, info)]
    if not without:
        return
    precs = sorted({str(getattr(i, "precision_used", "") or "") for _, i in without} - {""})
    sp = fig.get_subplot(row, col)   # axis numbers follow the grid, so ask, not guess
    x, y = sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")
    if len(without) == len(runs):
        what = "/".join(precs) if precs else "this run"
        verb = "do" if len(precs) > 1 else "does"
        # The panel is empty: in its middle the note hides nothing. Two short lines: on one, in a half-width panel
        # of a narrow output, it ran over the next panel's axis title (issue 46).
        fig.add_annotation(text=f"no GradScaler<br>({what} {verb} not need one)", xref=f"{x} domain",
                           yref=f"{y} domain", x=0.5, y=0.5, showarrow=False,
                           font=dict(size=12, color="#555"), name="no_scaler")
        return
    names = [n for n, _ in without]
    # short: it must fit one half-width panel (precisions that need none: said once, "not needed")
    text = "no GradScaler in " + html.escape(", ".join(names)) + " (not needed)"
    # The other runs' scale lines fill the panel, and beside the panel's title a note of four names overprints
    # it in a half-width panel: the note is the title's second line instead, above the plot area (nothing
    # drawn there), and the annotation keeps its name so that it can be found.
    for a in fig.layout.annotations:
        if a.text == SCALE_TITLE and a.xref == "paper":
            a.update(text=f"{SCALE_TITLE}<br><span style='font-size:11px;color:#555'>{text}</span>",
                     name="no_scaler")
            return
    fig.add_annotation(text=text, xref=f"{x} domain", yref=f"{y} domain", x=0, y=1, xanchor="left",
                       yanchor="bottom", showarrow=False, font=dict(size=12, color="#555"), name="no_scaler")


def runs_figure(runs: Mapping[str, Any], *, smoothing: float = 0.9, title: Optional[str] = None,
                colors: Optional[Mapping[str, str]] = None) -> go.Figure:
    """Several runs overlaid in the 4 panels (6 when a run has rewards: :func:`has_rewards`; 4 more when a run is
    GRPO's: :func:`has_grpo`), one colour per run.

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
    overlay = len(norm) > 1
    reference = next(iter(norm)) if overlay else None
    rewards = any(has_rewards(c, i) for c, _, i in norm.values())
    grpo = any(has_grpo(c, i) for c, _, i in norm.values())
    fig = make_run_layout(memory_title=_memory_title(norm), loss_unit=_loss_unit(i for _, _, i in norm.values()),
                          difference=reference, rewards=rewards, grpo=grpo)
    # the figure's cells: a GRPO run overlaid with a preference run has its panels under the reward row
    cells = run_cells(rewards, grpo)
    palette = {}
    for k, (name, (c, e, i)) in enumerate(norm.items()):
        palette[name] = (colors or {}).get(name) or _PALETTE[k % len(_PALETTE)]
        for spec in trace_specs(c, e, i, name=name, color=palette[name], overlay=overlay, smoothing=smoothing):
            row, col = cells[spec["meta"]["panel"]]
            fig.add_trace(_spec_trace(spec), row=row, col=col)
    if overlay:   # last, so that the runs' own traces keep the order trace_specs gives them (live updates)
        for tr in live_difference_traces(norm, palette):
            fig.add_trace(tr, row=diff_row(rewards, grpo), col=1)
    fig.update_yaxes(row=PANEL_CELLS["scale"][0], col=PANEL_CELLS["scale"][1], **runs_scale_axis(norm))
    _no_scaler_note(fig, norm, *PANEL_CELLS["scale"])
    return set_title(fig, title)


def run_figure(history: Any, eval_history: Any = None, info: Any = None, *, smoothing: float = 0.9,
               title: Optional[str] = None) -> go.Figure:
    """One run's 4-panel figure: loss (+EMA, eval), grad norm (+clip), loss scale, memory.

    ``history`` is a list of StepRecord or the ``result.history`` DataFrame.
    """
    name = (getattr(info, "variant", None) if info is not None else None) or "run"
    return runs_figure({name: (history, eval_history, info)}, smoothing=smoothing, title=title)


def _summary_value(summary: Optional[Mapping], key: str) -> float:
    return _num(summary.get(key)) if summary else math.nan


# Where each panel goes in the comparison's 5 x 2 grid (row, col); a preference comparison's reward panels in two
# more rows under it, a GRPO comparison's four panels in four more (compare_grid).
_COMPARE_GRID = {"loss": (1, 1), "loss_diff": (2, 1), "grad_norm": (3, 1), "scale": (4, 1), "memory": (5, 1),
                 "throughput": (1, 2), "peak_memory": (3, 2), "reward_margin": (6, 1), "reward_accuracy": (7, 1)}


def compare_grid(rewards: bool = False, grpo: bool = False) -> dict[str, tuple[int, int]]:
    """Each panel's (row, col) in :func:`compare_figure` with these optional rows: the GRPO panels one a row, in
    the left column, after the last row above them."""
    grid = dict(_COMPARE_GRID)
    if grpo:
        first = 6 + (len(REWARD_PANELS) if rewards else 0)
        grid.update({p: (first + k, 1) for k, p in enumerate(GRPO_PANELS)})
    return grid
COMPARE_HEIGHT = 1050   # five rows; a preference comparison's two reward rows add COMPARE_REWARD_HEIGHT each
COMPARE_REWARD_HEIGHT = 190


_BAND_FILL = "rgba(110, 110, 110, 0.18)"   # light, so the difference lines drawn over it stay readable


def _diff_title(reference: str, band: Any) -> str:
    return f"loss − {reference}, per step" + (f" (grey: {_band_name(band)})" if band is not None else "")


def _band_name(band: Any) -> str:
    """"init noise", "data-order noise" or "rounding noise" (a band from before bands had a null: "seed noise")."""
    return getattr(band, "name", None) or "seed noise"


def difference_traces(histories: Mapping[str, Any], reference: str,
                      eval_histories: Optional[Mapping[str, Any]] = None, band: Any = None,
                      colors: Optional[Mapping[str, str]] = None) -> list[go.Scatter]:
    """The difference panel's traces: the seed-noise band (±``band.width``, a filled area, drawn first so it
    lies behind), then per variant its loss minus the reference's at each step of the reference, exactly
    (:func:`nbtrain.verdicts.differences`, no smoothing), then its eval-loss differences as markers.

    ``histories`` map a name to a history (records or DataFrame); ``band`` is a
    :class:`nbtrain.verdicts.SeedBand` or None. Meta kinds: ``noise_band_high``, ``noise_band_low``,
    ``loss_diff``, ``eval_loss_diff``.
    """
    from ..verdicts import differences

    cols = {str(n): columns(h) for n, h in histories.items()}
    colors = dict(colors or {})
    traces: list[go.Scatter] = []
    if band is not None and len(band.width):
        x = band.width.index.to_numpy()
        w = band.width.to_numpy(dtype=np.float64)
        seeds = ", ".join(map(str, band.seeds))
        meta = {"run": None, "panel": "loss_diff"}
        traces.append(go.Scatter(x=x, y=w, mode="lines", line=dict(width=0, color=_BAND_FILL), hoverinfo="skip",
                                 showlegend=False, name=f"{_band_name(band)} (upper edge)",
                                 meta={**meta, "kind": "noise_band_high"}))
        # fill="tonexty" fills up to the trace just before: the upper edge.
        traces.append(go.Scatter(x=x, y=-w, mode="lines", line=dict(width=0, color=_BAND_FILL), fill="tonexty",
                                 fillcolor=_BAND_FILL, name=f"{_band_name(band)} ({reference}, seeds {seeds})",
                                 customdata=w, legendgroup="noise_band",
                                 hovertemplate=(f"step %{{x}}<br>{_band_name(band)}: reruns' range ±%{{customdata:.3g}} nats"
                                                "<extra>seeds " + seeds + "</extra>"),
                                 meta={**meta, "kind": "noise_band_low"}))
    diff = differences(cols, reference)
    x = diff.index.to_numpy()
    for k, name in enumerate(cols):
        color = colors.get(name) or _PALETTE[k % len(_PALETTE)]
        traces.append(go.Scatter(
            x=x, y=diff[name].to_numpy(dtype=np.float64), mode="lines" if len(x) > 1 else "markers",
            name=f"{name} · Δloss",
            line=dict(color=color, width=1.5, dash="solid" if name != reference else "dot"),
            legendgroup=name, showlegend=False,
            hovertemplate="step %{x}<br>" + html.escape(name) + " − " + html.escape(reference)
                          + ": %{y:.3g}<extra></extra>",
            meta={"run": name, "panel": "loss_diff", "kind": "loss_diff"}))
    evals = {str(n): _eval_frame(e) for n, e in (eval_histories or {}).items() if str(n) in cols}
    if reference in evals and evals[reference] is not None:
        ev = differences(evals, reference, "eval_loss")
        acc = differences(evals, reference, "eval_accuracy")
        for k, name in enumerate(cols):
            if name == reference or name not in ev or not ev[name].notna().any():
                continue
            color = colors.get(name) or _PALETTE[k % len(_PALETTE)]
            # Accuracy is another unit than this panel's nats: it goes in the hover, not on the axis.
            a = acc[name].reindex(ev.index).to_numpy(dtype=np.float64) if name in acc else np.full(len(ev), np.nan)
            text = [f"eval accuracy {v:+.3g}" if math.isfinite(v) else "" for v in a.tolist()]
            traces.append(go.Scatter(
                x=ev.index.to_numpy(), y=ev[name].to_numpy(dtype=np.float64), mode="markers",
                name=f"{name} · Δ eval loss",
                marker=dict(symbol="circle-open", size=9, color=color, line=dict(width=2)),
                legendgroup=name, showlegend=False, text=text,
                hovertemplate="step %{x}<br>eval loss " + html.escape(name) + " − " + html.escape(reference)
                              + ": %{y:.3g}<br>%{text}<extra></extra>",
                meta={"run": name, "panel": "loss_diff", "kind": "eval_loss_diff"}))
    return traces


def live_difference_traces(runs: Mapping[str, tuple], colors: Optional[Mapping[str, str]] = None) -> list:
    """The difference panel of overlaid runs (``name -> (columns, eval, info)``, the first is the reference):
    each run's loss minus the first run's at the steps both recorded, as in the final comparison figure."""
    names = list(runs)
    if len(names) < 2:
        return []
    return difference_traces({n: runs[n][0] for n in names}, names[0],
                             colors=colors or {n: _PALETTE[k % len(_PALETTE)] for k, n in enumerate(names)})


def _eval_frame(eval_history: Any) -> Any:
    """An eval history as something with columns (a DataFrame or a dict of columns pass as they are)."""
    if eval_history is None or hasattr(eval_history, "columns") or isinstance(eval_history, Mapping):
        return eval_history
    import pandas as pd

    return pd.DataFrame([r if isinstance(r, Mapping) else vars(r) for r in eval_history])


def difference_figure(histories: Mapping[str, Any], reference: Optional[str] = None,
                      eval_histories: Optional[Mapping[str, Any]] = None, band: Any = None, *,
                      height: int = 300) -> go.Figure:
    """The difference panel of :func:`compare_figure` on its own (:func:`difference_traces`)."""
    names = [str(n) for n in histories]
    ref = str(reference) if reference is not None else (names[0] if names else "")
    fig = go.Figure()
    if names and ref not in names:
        raise ValueError(f"reference {reference!r} is not one of {names}")
    for tr in difference_traces(histories, ref, eval_histories, band) if names else []:
        if tr.meta["kind"] == "loss_diff" and tr.meta["run"] != ref:
            # Alone, the lines need the legend the loss panel gives them otherwise (the reference's is the 0 line).
            tr.update(showlegend=True, name=f"{tr.meta['run']} − {ref}")
        fig.add_trace(tr)
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=70, r=20, t=40, b=45),
                      hovermode="closest", showlegend=True,
                      legend=dict(orientation="h", x=1, xanchor="right", y=1.02, yanchor="bottom"))
    fig.update_xaxes(title_text="optimizer step")
    fig.update_yaxes(title_text="Δ loss (nats)", title_font=dict(size=12), zeroline=True)
    return set_title(fig, _diff_title(ref, band) if names else "no variant ran")


def compare_figure(histories: Mapping[str, Any], reference: Optional[str] = None,
                   summaries: Optional[Mapping[str, Mapping]] = None,
                   eval_histories: Optional[Mapping[str, Any]] = None,
                   infos: Optional[Mapping[str, Any]] = None,
                   not_run: Optional[Mapping[str, str]] = None, *,
                   smoothing: float = 0.9, title: Optional[str] = None, band: Any = None,
                   throughput_range: Optional[Mapping[str, tuple[float, float]]] = None) -> go.Figure:
    """Variants overlaid: loss, each variant's exact per-step loss difference to ``reference`` (eval
    differences as markers) over the seed-noise ``band`` (:func:`difference_traces`), grad norm, loss scale
    and memory over the steps, and, for a preference objective (:func:`has_rewards`), the reward margin and the
    reward accuracy, for GRPO (:func:`has_grpo`) the reward, completion length, clipped share and sampler/trainer
    mismatch, one row each (:func:`compare_grid`), with bars of throughput and peak memory (the figure of
    ``ComparisonResult.figure()``).
    ``throughput_range`` (name -> (lowest, highest) tokens/s over repeats) draws each bar's range as an error bar.

    ``summaries`` (name -> ``result.summary``) supply ``tokens_per_s`` and ``peak_vram_gib`` (on CPU
    ``peak_host_tensors_gib``, the run's own tensors); without them the bars use the history's median
    tokens/s and its peak VRAM (on CPU its run tensors, or host RSS for histories without them). ``infos``
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
    # On CPU, variants are compared on their own tensors: RSS grows with every run in the process.
    tensors = not vram and (any(_tensors_measured(c) for c, _, _ in runs.values())
                            or any((s or {}).get("peak_host_tensors_gib") is not None
                                   for s in (summaries or {}).values()))
    if vram:
        peak_key, peak_col, peak_label = "peak_vram_gib", "vram_peak_gib", "peak VRAM (GiB)"
    elif tensors:
        peak_key, peak_col, peak_label = "peak_host_tensors_gib", "host_tensors_gib", "peak run tensors (GiB)"
    else:
        peak_key, peak_col, peak_label = "peak_host_rss_gib", "host_rss_gib", "peak host RSS (GiB)"
    rewards = any(has_rewards(c, i) for c, _, i in runs.values())
    grpo = any(has_grpo(c, i) for c, _, i in runs.values())
    grid = compare_grid(rewards, grpo)
    extra = (REWARD_PANELS if rewards else ()) + (GRPO_PANELS if grpo else ())
    rows = 5 + len(extra)
    height = COMPARE_HEIGHT + len(extra) * COMPARE_REWARD_HEIGHT
    fig = make_subplots(
        rows=rows, cols=2, column_widths=[0.72, 0.28], horizontal_spacing=0.1,
        vertical_spacing=0.06 * COMPARE_HEIGHT / height,   # the same gap in pixels, however many rows
        specs=[[{}, {"rowspan": 2}], [{}, None], [{}, {"rowspan": 2}], [{}, None], [{}, None]]
        + [[{}, None]] * (rows - 5),
        subplot_titles=("loss", "throughput (tokens/s)", _diff_title(ref, band), "gradient norm (unscaled)",
                        peak_label, SCALE_TITLE, _memory_title(runs))
        + tuple({**REWARD_TITLES, **GRPO_TITLES}[p] for p in extra))
    palette = {name: _PALETTE[k % len(_PALETTE)] for k, name in enumerate(runs)}
    for tr in difference_traces({n: c for n, (c, _, _) in runs.items()}, ref,
                                {n: ev for n, (_, ev, _) in runs.items()}, band, palette):
        fig.add_trace(tr, row=2, col=1)
    tps, peak = [], []
    for k, (name, (c, ev, info)) in enumerate(runs.items()):
        color = _PALETTE[k % len(_PALETTE)]
        for spec in trace_specs(c, ev, info, name=name, color=color, overlay=True, smoothing=smoothing):
            row, col = grid[spec["meta"]["panel"]]
            fig.add_trace(_spec_trace(spec), row=row, col=col)
        s = (summaries or {}).get(name)
        t = _summary_value(s, "tokens_per_s")
        if not math.isfinite(t):
            f = c["tokens_per_s"][np.isfinite(c["tokens_per_s"])]
            t = float(np.median(f)) if f.size else math.nan
        p = _summary_value(s, peak_key)
        if not math.isfinite(p):
            f = c[peak_col][np.isfinite(c[peak_col])]
            p = float(f.max()) if f.size else math.nan
        tps.append(t)
        peak.append(p)
    colors = [_PALETTE[k % len(_PALETTE)] for k in range(len(names))]
    rng = throughput_range or {}
    # The repeats' range on each bar: two bars whose ranges overlap are not ranked by their heights.
    error = (dict(type="data", symmetric=False, color="#444", thickness=1.5,
                  array=[rng[n][1] - t if n in rng else 0.0 for n, t in zip(names, tps)],
                  arrayminus=[t - rng[n][0] if n in rng else 0.0 for n, t in zip(names, tps)])
             if rng else None)
    fig.add_trace(go.Bar(x=names, y=tps, marker_color=colors, showlegend=False, name="tokens/s",
                         text=[f"{v:,.0f}" if math.isfinite(v) else "n/a" for v in tps], error_y=error,
                         textposition="inside" if rng else "auto", insidetextanchor="start",
                         meta={"run": None, "panel": "throughput", "kind": "tokens_per_s"}),
                  row=1, col=2)
    fig.add_trace(go.Bar(x=names, y=peak, marker_color=colors, showlegend=False, name=peak_label,
                         text=[f"{v:.2f}" if math.isfinite(v) else "n/a" for v in peak],
                         textposition="auto", meta={"run": None, "panel": "peak_memory", "kind": "peak_memory"}),
                  row=3, col=2)
    # One step axis for the whole left column, so zooming one panel zooms all.
    for row in range(2, rows + 1):
        fig.update_xaxes(matches="x", row=row, col=1)
    fig.update_xaxes(showticklabels=True, title_text="optimizer step", row=rows, col=1)
    fig.update_yaxes(type="log", row=3, col=1)
    fig.update_yaxes(row=4, col=1, **runs_scale_axis(runs))
    if rewards:
        fig.update_yaxes(row=grid["reward_accuracy"][0], col=1, **ACCURACY_AXIS)
    if grpo:
        _grpo_axes(fig, grid)
    unit = _loss_unit(i for _, _, i in runs.values())
    _axis_titles(fig, {(1, 1): f"loss ({unit})",
                       (2, 1): f"Δ loss ({unit.split('/')[0]})" if unit.startswith("nats") else "Δ loss",
                       (3, 1): "grad norm (L2)", (4, 1): "loss scale", (5, 1): "memory (GiB)",
                       (1, 2): "tokens/s", (3, 2): "GiB",
                       **({grid["reward_margin"]: "margin", grid["reward_accuracy"]: "accuracy"}
                          if rewards else {})})
    _no_scaler_note(fig, runs, *_COMPARE_GRID["scale"])
    if title is None:
        title = " vs ".join(names) + f" (reference: {ref})" + _not_run_text(not_run)
    fig.update_layout(height=height, margin=dict(l=70, r=20, t=60, b=50), template="plotly_white",
                      hovermode="closest", legend=dict(groupclick="togglegroup"))
    return set_title(fig, title)


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
