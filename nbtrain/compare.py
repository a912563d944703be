"""compare(): one training per variant in this process, fair by construction, and ComparisonResult.

Fair means: every variant starts from the same initial weights and sees the same batches in the same
order. The engine builds each model from ``cfg.seed`` and orders the data by the seed alone, so this
holds by construction; compare() also *checks* it, with the hash of the initial weights and the hash
of the unpadded token ids of every step that each run records, and says in the table what differs and why.

Plotting, widgets and IPython are imported only inside the methods that draw (DESIGN rule 1).
"""

from __future__ import annotations

import gc
import html
import math
import platform
import re
import statistics
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from .config import ConfigError, TrainConfig
from .engine import loop as _loop  # module, not function: tests wrap _loop._run to watch the run order
from ._version import __version__
from .engine.threads import complete_imports
from .hardware import capabilities, check_runnable, default_device, resolve_precision

# Config fields that change the initial weights on purpose (a LoRA adapter adds weights, QLoRA
# quantises them, another model is another model). A differing init hash they explain is expected.
INIT_FIELDS = ("model", "task", "data", "label_column", "method", "lora_r", "lora_alpha", "lora_targets",
               "quant_bits")
# Config fields that change the examples of the optimizer steps on purpose. The engine's data hash covers
# the unpadded token ids of each step, so 8 x 1 and 2 x 4 hash alike; micro_batch_size and grad_accum_steps
# are here because their product, the examples per step, changes what a step holds.
DATA_FIELDS = ("model", "task", "data", "text_column", "label_column", "max_seq_len", "subset", "packing",
               "eval_fraction", "micro_batch_size", "grad_accum_steps", "max_steps", "epochs")
# Fields that never explain a difference: changing them unpairs the runs.
UNPAIRING_FIELDS = ("seed",)

_COMPLETE = ("max_steps", "epochs")


class ComparisonWarning(UserWarning):
    """A comparison is not fair: the variants did not start from the same weights or see the same data."""


@dataclass
class _Outcome:
    """Everything compare() learns about one variant; the table is built from these."""

    name: str
    overrides: dict
    settings: dict                          # base config fields with the overrides, valid or not
    config: Optional[TrainConfig] = None
    result: Any = None                      # the first repeat's TrainResult
    status: str = "not_run"
    notes: list[str] = field(default_factory=list)
    error: Optional[str] = None             # formatted traceback of a run that raised
    timings: list[tuple[float, float]] = field(default_factory=list)   # (tokens_per_s, wall_s) per repeat
    fair: Optional[bool] = None


# ---------------------------------------------------------------------------------------------------------------
# compare()
# ---------------------------------------------------------------------------------------------------------------
def compare(cfg: TrainConfig, precisions: Sequence[str] = ("fp32", "fp16", "bf16"),
            subset: Optional[int] = None, max_steps: Optional[int] = None,
            variants: Optional[Mapping[str, Mapping[str, Any]]] = None,
            repeats: int = 1, callbacks=None, warmup: bool = True) -> "ComparisonResult":
    """Train ``cfg`` once per variant in this process and return a side-by-side ComparisonResult.

    Without ``variants`` there is one variant per name in ``precisions``. ``variants`` maps a name to
    config overrides (``{"micro2x4": dict(micro_batch_size=2, grad_accum_steps=4)}``); ``precisions`` is
    then ignored. ``subset``/``max_steps`` override cfg's when given. The first variant is the reference
    for speedup and loss differences. A variant that is invalid here or fails becomes a row with the
    reason; the others still run. ``repeats`` > 1 runs every variant again, interleaved (A B C, A B C),
    and reports the median throughput and wall time; the curves are the first repeat's. ``callbacks``
    (e.g. one LiveDashboard) see every variant's first repeat; records carry ``.variant``. ``warmup``
    first runs two untimed steps of the first variant, so that the reference does not pay alone for
    what a process does once (lazy imports, kernel and allocator set-up) and look slow. On a GPU the
    models kept in ``results`` are moved to the CPU between variants, so that they do not count in the
    next variant's peak memory. An interrupt (Ctrl-C) ends the comparison with the rows so far.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"compare() takes a TrainConfig, got {type(cfg).__name__}")
    if int(repeats) < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats!r}")
    complete_imports(cfg)   # callbacks may start threads (a live figure); the imports are done by then
    base = cfg
    if subset is not None or max_steps is not None:
        given = {"subset": subset, "max_steps": max_steps}
        base = cfg.replace(**{k: v for k, v in given.items() if v is not None})
    outcomes = [_Outcome(name, dict(ov), {**base.to_dict(), **ov})
                for name, ov in _variant_specs(precisions, variants).items()]

    for o in outcomes:
        try:
            run_cfg = base.replace(**o.overrides)
            check_runnable(run_cfg)   # a precision or method this device cannot run is a row, not a failure
            o.config = run_cfg
        except ConfigError as e:
            o.status = "unsupported"
            o.notes.append(_config_reason(e))
            continue
        if base.output_dir:  # one folder per variant, or they would overwrite each other's outputs
            o.config = o.config.replace(output_dir=str(Path(base.output_dir) / _slug(o.name)))

    interrupted = bool(warmup) and _warm_up(next((o.config for o in outcomes if o.config is not None), None))
    for r in range(int(repeats)):
        for o in outcomes:
            if interrupted or o.config is None or o.status in ("error", "out_of_memory"):
                continue
            run_cfg = o.config if r == 0 else o.config.replace(output_dir=None)
            try:
                result = _run_variant(o, run_cfg, callbacks if r == 0 else None, first=(r == 0))
            except KeyboardInterrupt:  # before the loop's own handler is in place (data, model building)
                result, interrupted = None, True
                if r == 0:
                    o.status = "interrupted"
                o.notes.append("interrupted before its first step")
            if result is not None:
                o.timings.append((float(result.summary["tokens_per_s"]), float(result.summary["wall_s"])))
                if r == 0:
                    o.result = result
                    o.status = result.summary["stopped_reason"]
                    note = _park_model(result)
                    if note:
                        o.notes.append(note)
                interrupted = result.summary["stopped_reason"] == "interrupted"
            del result
            _release_memory()
    # A kernel interrupt ends the whole comparison: the user asked for it to stop, not just one variant.
    for o in outcomes:
        if interrupted and o.result is None and o.status == "not_run":
            o.notes.append("not run: the comparison was interrupted")

    reference = next((o.name for o in outcomes if o.result is not None), outcomes[0].name)
    warns = _check_fairness(outcomes, reference)
    for w in warns:
        warnings.warn(w, ComparisonWarning, stacklevel=2)
    return ComparisonResult(outcomes, base, reference, warns, int(repeats))


def _variant_specs(precisions, variants) -> dict[str, dict]:
    if variants is None:
        if isinstance(precisions, str):
            precisions = [p.strip() for p in precisions.split(",") if p.strip()]
        names = list(precisions)
        if not names:
            raise ValueError("precisions: give at least one precision, e.g. ('fp32', 'bf16')")
        if len(set(names)) != len(names):
            raise ValueError(f"precisions: each precision once, got {names}")
        return {str(p): {"precision": p} for p in names}
    if not isinstance(variants, Mapping) or not variants:
        raise ValueError("variants: expected a non-empty dict of name -> config overrides, "
                         "e.g. {'bs8': dict(micro_batch_size=8)}")
    specs = {}
    for name, ov in variants.items():
        if not isinstance(ov, Mapping):
            raise ValueError(f"variants[{name!r}]: expected a dict of TrainConfig overrides, got {ov!r}")
        # A misspelt field is a mistake in the caller's code, not something this device cannot run.
        unknown = [k for k in ov if k not in TrainConfig.model_fields]
        if unknown:
            raise ConfigError(f"variants[{name!r}]: {unknown} are not TrainConfig fields", field=unknown[0])
        specs[str(name)] = dict(ov)
    return specs


def _config_reason(e: ConfigError) -> str:
    return "; ".join(f"{x['field']}: {x['message']}" if x.get("field") else x["message"] for x in e.errors)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "variant"


def _run_variant(o: _Outcome, cfg: TrainConfig, callbacks, first: bool):
    """One run of one variant; an exception becomes the variant's status and note, never the caller's."""
    try:
        return _loop._run(cfg, callbacks, variant=o.name, hash_init=first)
    except Exception as e:  # noqa: BLE001 - any failure of one variant must leave the others running
        oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
        o.status = "out_of_memory" if oom else "error"
        o.notes.append(f"{'out of memory' if oom else 'failed'}: {type(e).__name__}: {_first_line(e)}")
        # Keep text, not the exception: its traceback holds the frames, and so the model, in memory.
        o.error = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return None


def _warm_up(cfg: Optional[TrainConfig]) -> bool:
    """Two untimed steps of ``cfg``, results discarded; True when the user interrupted them."""
    if cfg is None:
        return False
    try:
        res = _loop._run(cfg.replace(max_steps=2, eval_every=None, output_dir=None), None)
    except KeyboardInterrupt:
        return True
    except Exception:  # noqa: BLE001 - the timed run of this variant reports the failure in its row
        return False
    interrupted = res.summary["stopped_reason"] == "interrupted"
    del res
    _release_memory()
    return interrupted


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _release_memory() -> None:
    """Return what the finished run no longer holds before the next one starts (fair peak memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _park_model(result) -> Optional[str]:
    """Move a kept model off the accelerator so it does not count in the next variant's peak memory."""
    model = getattr(result, "model", None)
    if model is None or result.summary.get("device") != "cuda":
        return None
    try:
        model.to("cpu")
        return None
    except Exception as e:  # noqa: BLE001 - quantised models refuse .to(); then the model is dropped
        result.model = None
        return f"model not kept (it cannot leave the GPU: {type(e).__name__})"


# ---------------------------------------------------------------------------------------------------------------
# Fairness
# ---------------------------------------------------------------------------------------------------------------
def _changed_fields(a: TrainConfig, b: TrainConfig) -> list[str]:
    da, db = a.to_dict(), b.to_dict()
    return [k for k in da if k != "output_dir" and da[k] != db[k]]


def _check_fairness(outcomes: list[_Outcome], reference: str) -> list[str]:
    """Compare each run's init and data hash with the reference's; set ``fair`` and notes, return warnings."""
    ref = next((o for o in outcomes if o.name == reference and o.result is not None), None)
    warns: list[str] = []
    if ref is None:
        return warns
    ref_s = ref.result.summary
    ref.fair = True
    for o in outcomes:
        if o.result is None or o is ref:
            continue
        s = o.result.summary
        changed = _changed_fields(ref.config, o.config)
        unpaired = [f for f in changed if f in UNPAIRING_FIELDS]
        problems = []
        for what, key, by_design in (("initial weights", "init_hash", INIT_FIELDS),
                                     ("batches", "data_hash", DATA_FIELDS)):
            if s.get(key) == ref_s.get(key):
                continue
            explained = [f for f in changed if f in by_design]
            if key == "data_hash" and s["steps"] != ref_s["steps"] and not unpaired:
                # The data hash covers the steps a run took; a run that stopped early has a shorter one.
                o.notes.append(f"data hash not comparable: {s['steps']} steps vs {ref_s['steps']}")
            elif explained and not unpaired:
                verb = "differs" if len(explained) == 1 else "differ"
                o.notes.append(f"{what} differ by design ({', '.join(explained)} {verb})")
            else:
                cause = (f"{', '.join(unpaired)} differs from {reference!r}" if unpaired
                         else "no config difference explains it")
                problems.append(f"{what} differ ({key} {s.get(key)} vs {ref_s.get(key)}; {cause})")
        o.fair = not problems and not unpaired
        if unpaired and not problems:
            problems.append(f"{', '.join(unpaired)} differs from {reference!r}, so the runs are not paired")
        if problems:
            o.notes.append("NOT FAIR: " + "; ".join(problems))
            warns.append(f"variant {o.name!r} is not comparable with {reference!r}: " + "; ".join(problems))
    return warns


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------
def loss_difference(history: pd.DataFrame, reference: pd.DataFrame) -> tuple[float, float]:
    """(max |loss - reference loss|, max of that relative to |reference loss|) over the steps both
    runs recorded with finite losses; NaN when they share none."""
    a = history.set_index("step")["loss"].astype(float)
    b = reference.set_index("step")["loss"].astype(float)
    common = a.index.intersection(b.index)
    a, b = a.loc[common].to_numpy(), b.loc[common].to_numpy()
    ok = np.isfinite(a) & np.isfinite(b)
    if not ok.any():
        return math.nan, math.nan
    d = np.abs(a[ok] - b[ok])
    return float(d.max()), float((d / np.maximum(np.abs(b[ok]), 1e-30)).max())


def _float_or_nan(v) -> float:
    return math.nan if v is None else float(v)


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if len(values) > 1 else math.nan


def _run_notes(o: _Outcome, caps) -> list[str]:
    """Notes a finished run earns: slow precision, skipped / non-finite steps, an early stop."""
    s = o.result.summary
    notes = list(s.get("notes") or [])   # the engine's own: an out-of-memory stop, auto batch size, a resume
    for option in (s["precision_used"], o.config.method):
        if caps.notes.get(option):   # name the option unless the variant is already named after it
            notes.append(caps.notes[option] if option == o.name else f"{option}: {caps.notes[option]}")
    if s["nonfinite_steps"]:
        notes.append(f"{s['nonfinite_steps']} non-finite step(s), the first at step "
                     f"{s['first_nonfinite_step']}"
                     + (f"; {s['skipped_steps']} skipped by the GradScaler" if o.result.info
                        and o.result.info.scaler_enabled else ""))
    reason = s["stopped_reason"]
    if reason == "nonfinite":
        notes.append(f"diverged: stopped at step {s['first_nonfinite_step']} (non-finite loss or gradients)")
    elif reason == "out_of_memory" and s.get("advice"):
        notes.append("to fit: " + "; ".join(s["advice"]))
    elif reason in ("stopped", "interrupted"):
        notes.append(f"{reason} after {s['steps']} step(s)")
    return notes


def _build_table(outcomes: list[_Outcome], reference: str) -> pd.DataFrame:
    caps = capabilities()
    ref = next((o for o in outcomes if o.name == reference and o.result is not None), None)
    ref_tps = statistics.median(t for t, _ in ref.timings) if ref is not None and ref.timings else math.nan
    causal = any(o.settings["task"] == "causal-lm" for o in outcomes)
    classify = any(o.settings["task"] != "causal-lm" for o in outcomes)
    rows = []
    for o in outcomes:
        res = o.result
        s = res.summary if res is not None else {}
        h = res.history if res is not None else None
        tps = statistics.median(t for t, _ in o.timings) if o.timings else math.nan
        wall = statistics.median(w for _, w in o.timings) if o.timings else math.nan
        diff_abs, diff_rel = (loss_difference(h, ref.result.history) if res is not None and ref is not None
                              else (math.nan, math.nan))
        scales = h["scale"].astype(float) if h is not None and len(h) else pd.Series([], dtype=float)
        precision = s.get("precision_used") or resolve_precision(o.settings["precision"])
        row = {
            "variant": o.name,
            "status": o.status,
            "precision_used": precision,
            "device": s.get("device") or default_device(),
            # what the run used (auto_batch_size may change it), else what was asked for
            "micro_batch": s.get("micro_batch_size", o.settings["micro_batch_size"]),
            "grad_accum": s.get("grad_accum_steps", o.settings["grad_accum_steps"]),
            "method": o.settings["method"],
            "steps": s.get("steps"),
            "wall_s": wall,
            "wall_s_spread": _spread([w for _, w in o.timings]),
            "tokens_per_s": tps,
            "tokens_per_s_spread": _spread([t for t, _ in o.timings]),
            "speedup": tps / ref_tps if ref_tps and math.isfinite(ref_tps) else math.nan,
            "peak_vram_gib": _float_or_nan(s.get("peak_vram_gib")),
            "peak_host_rss_gib": _float_or_nan(s.get("peak_host_rss_gib")),
            "final_loss": _float_or_nan(s.get("final_loss")),
            "eval_loss": _float_or_nan(s.get("eval_loss")),
        }
        if causal:
            row["eval_perplexity"] = _float_or_nan(s.get("eval_perplexity"))
        if classify:
            row["eval_accuracy"] = _float_or_nan(s.get("eval_accuracy"))
        row.update({
            "max_abs_loss_diff": diff_abs,
            "max_rel_loss_diff": diff_rel,
            "skipped_steps": s.get("skipped_steps"),
            "nonfinite_steps": s.get("nonfinite_steps"),
            "first_nonfinite_step": s.get("first_nonfinite_step"),
            "min_scale": float(np.nanmin(scales)) if np.isfinite(scales).any() else math.nan,
            "init_hash": s.get("init_hash"),
            "data_hash": s.get("data_hash"),
            "fair": o.fair,
            "repeats": len(o.timings),
            "notes": "; ".join(dict.fromkeys((_run_notes(o, caps) if res is not None else []) + o.notes)),
        })
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in ("micro_batch", "grad_accum", "steps", "skipped_steps", "nonfinite_steps",
                "first_nonfinite_step", "repeats"):
        table[col] = table[col].astype("Int64")   # integers with <NA> for rows that did not run
    table["fair"] = table["fair"].astype("boolean")
    return table


# ---------------------------------------------------------------------------------------------------------------
# ComparisonResult
# ---------------------------------------------------------------------------------------------------------------
_TEXT_COLUMNS = ("variant", "status", "precision_used", "micro_batch", "grad_accum", "method", "steps",
                 "wall_s", "tokens_per_s", "speedup", "peak_vram_gib", "peak_host_rss_gib", "final_loss",
                 "eval_loss", "eval_perplexity", "eval_accuracy", "max_abs_loss_diff", "skipped_steps",
                 "nonfinite_steps", "min_scale", "fair")
_FORMATS = {"wall_s": "{:.1f}", "wall_s_spread": "{:.1f}", "tokens_per_s": "{:,.0f}",
            "tokens_per_s_spread": "{:,.0f}", "speedup": "{:.2f}x", "peak_vram_gib": "{:.2f}",
            "peak_host_rss_gib": "{:.2f}", "final_loss": "{:.4f}", "eval_loss": "{:.4f}",
            "eval_perplexity": "{:.1f}", "eval_accuracy": "{:.3f}",
            "max_abs_loss_diff": "{:.2e}", "max_rel_loss_diff": "{:.2e}", "min_scale": "{:g}"}


class ComparisonResult:
    """The outcome of compare(): ``table`` (one row per variant), ``results`` (variant -> TrainResult),
    ``configs``, ``fair``, ``warnings``, ``errors`` (tracebacks), ``figure()`` and ``to_html(path)``."""

    def __init__(self, outcomes: list[_Outcome], config: TrainConfig, reference: str, warnings_: list[str],
                 repeats: int):
        self.config = config
        self.reference = reference
        self.warnings = list(warnings_)
        self.repeats = repeats
        self.table = _build_table(outcomes, reference)
        self.results = {o.name: o.result for o in outcomes if o.result is not None}
        self.configs = {o.name: o.config for o in outcomes if o.config is not None}
        self.overrides = {o.name: o.overrides for o in outcomes}
        self.errors = {o.name: o.error for o in outcomes if o.error}
        self.timings = {o.name: list(o.timings) for o in outcomes}

    @property
    def fair(self) -> bool:
        """True when every variant that ran started from the reference's weights and saw its batches
        (differences that the variant's own settings explain, like LoRA weights, do not count)."""
        return bool(self.table["fair"].fillna(True).all())

    @property
    def variants(self) -> list[str]:
        """The variant names, in run order."""
        return list(self.table["variant"])

    def summaries(self) -> dict[str, dict]:
        """Variant -> the run's summary, with tokens_per_s and wall_s replaced by the medians over repeats."""
        out = {}
        for name, res in self.results.items():
            row = self.table.loc[self.table.variant == name].iloc[0]
            out[name] = {**res.summary, "tokens_per_s": float(row.tokens_per_s), "wall_s": float(row.wall_s)}
        return out

    def figure(self, smoothing: float = 0.9):
        """Overlaid loss, grad norm, loss scale and memory per variant, the loss difference to the
        reference, and bars of throughput and peak memory (a plotly Figure)."""
        from .viz.figures import compare_figure

        not_run = {r.variant: r.notes for r in self.table.itertuples() if r.variant not in self.results}
        return compare_figure(
            {n: r.history for n, r in self.results.items()}, reference=self.reference,
            summaries=self.summaries(), eval_histories={n: r.eval_history for n, r in self.results.items()},
            infos={n: r.info for n, r in self.results.items()}, not_run=not_run, smoothing=smoothing)

    # -- text and HTML ------------------------------------------------------------------------------------
    def format_table(self) -> str:
        """The table as plain text for a terminal, with the notes and the fairness verdict below it."""
        # Leave out what says nothing here: settings every variant shares, a status every run reached.
        cols = [c for c in _TEXT_COLUMNS if c in self.table.columns
                and not (c in ("micro_batch", "grad_accum", "method") and self.table[c].nunique() <= 1)
                and not (c == "status" and self.table[c].isin(_COMPLETE).all())]
        lines = [self._formatted(cols).to_string(index=False), ""]
        if self.repeats > 1:
            lines.append(f"tokens_per_s and wall_s: medians of {self.repeats} interleaved repeats "
                         "(spread in .table)")
        for r in self.table.itertuples():
            if r.notes:
                lines.append(f"{r.variant}: {r.notes}")
        lines.append(self._fairness_line())
        return "\n".join(lines)

    def _formatted(self, cols: Sequence[str]) -> pd.DataFrame:
        """``cols`` of the table as display strings ("-" where there is no value); empty columns dropped."""
        out = {}
        for c in cols:
            values = self.table[c]
            if values.isna().all():
                continue
            f = _FORMATS.get(c, "{:.6g}" if values.dtype.kind == "f" else "{}")
            out[c] = ["-" if pd.isna(v) else f.format(v) for v in values]
        return pd.DataFrame(out)

    def _fairness_line(self) -> str:
        ran = self.table[self.table["init_hash"].notna()]
        if ran.empty:
            return "no variant ran"
        if self.fair:
            return (f"fair: every variant started from the weights and saw the batches of {self.reference!r} "
                    f"(init {ran.init_hash.iloc[0]}, data {ran.data_hash.iloc[0]}) or differs only by design")
        return "NOT FAIR: " + " | ".join(self.warnings)

    def _table_html(self) -> str:
        return self._formatted(list(self.table.columns)).to_html(index=False, escape=True,
                                                                 classes="nbtrain-compare")

    def _repr_html_(self) -> str:
        verdict = html.escape(self._fairness_line())
        return f"{self._table_html()}<p>{verdict}</p>"

    def __repr__(self) -> str:
        return (f"ComparisonResult(variants={self.variants}, reference={self.reference!r}, fair={self.fair})")

    def to_html(self, path, title: str = "nbtrain comparison") -> Path:
        """Write one self-contained HTML report (plotly.js inlined, opens offline): config, environment,
        table and figures."""
        path = Path(path)
        fig = self.figure()
        fig_html = fig.to_html(full_html=False, include_plotlyjs=True, include_mathjax=False,
                               config={"displaylogo": False})
        overrides = "\n".join(f"{name}: {ov}" for name, ov in self.overrides.items())
        env_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                           for k, v in environment().items())
        errors = "".join(f"<h3>{html.escape(n)}</h3><pre>{html.escape(t)}</pre>"
                         for n, t in self.errors.items())
        doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
td:last-child {{ text-align: left; max-width: 40em; }}
pre {{ background: #f6f6f6; padding: .6em; overflow-x: auto; }}
.verdict {{ font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{html.escape(self._fairness_line())}</p>
<h2>Results</h2>
{self._table_html()}
<h2>Figures</h2>
{fig_html}
<h2>Configuration</h2>
<p>Base config (every variant is this with its overrides; the first, {html.escape(repr(self.reference))},
is the reference):</p>
<pre>{html.escape(self.config.to_yaml())}</pre>
<p>Variants:</p>
<pre>{html.escape(overrides)}</pre>
<h2>Environment</h2>
<table>{env_rows}</table>
{"<h2>Errors</h2>" + errors if errors else ""}
</body></html>
"""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        return path


def environment() -> dict[str, str]:
    """Library versions and the device, for a report that says where its numbers come from."""
    from importlib import metadata

    env = {"python": sys.version.split()[0], "platform": platform.platform(), "nbtrain": __version__}
    for lib in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "numpy", "pandas", "plotly"):
        try:
            env[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            env[lib] = "not installed"
    caps = capabilities()
    env.update(device=caps.device, device_name=caps.name, device_memory_gib=f"{caps.total_memory_gib:.1f}",
               torch_threads=str(torch.get_num_threads()))
    if caps.device == "cuda":
        env["cuda"] = str(torch.version.cuda)
        env["compute_capability"] = ".".join(map(str, caps.compute_capability or ()))
    return env
