"""What a comparison found: ComparisonResult and the data it is built from.

The runner (run.py) fills one ``_Outcome`` per variant; ComparisonResult turns them into the table (one row per
variant, every column), the per-step differences to the reference, the seed-noise band, the speed's noise
floor and the verdicts. Its views (compact table, notes, HTML, text, figures) are in render.py.
"""

from __future__ import annotations

import inspect
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from .. import verdicts as _verdicts
from ..config import TrainConfig
from ..hardware import capabilities, default_device, resolve_precision
from ..precision import PRECISION_TABLE
from ..engine.doctor import lost_updates_of
from ..engine.sampling import sample_frame, side_by_side
from .render import ComparisonViews

_COMPLETE = ("max_steps", "epochs")
_CUT = ("stopped", "interrupted")   # statuses of a run ended early by the user, with the steps it had
_STATUS_WORDS = {"out_of_memory": "out of memory", "nonfinite": "diverged", "not_run": "not run",
                 "callback_error": "callback error"}


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
    estimate: Any = None                    # memory.MemoryEstimate of ``config`` (or of an unsupported one), or None


@dataclass
class _SeedRuns:
    """The reference's extra-seed runs: what was asked, what ran (seed -> TrainResult), and notes."""

    requested: tuple[int, ...] = ()
    reference_seed: Optional[int] = None
    null: str = "init"                 # what the reruns vary (verdicts.NULLS)
    scale: Optional[float] = None      # the rounding band's relative perturbation
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Schedule:
    """The order the repeats ran in, and the reference's unrecorded A/A copy (``aa=True``)."""

    run_order: list[list[str]] = field(default_factory=list)   # per repeat, the names in the order they started
    aa_name: Optional[str] = None
    aa_timings: list[float] = field(default_factory=list)      # the copy's tokens/s, one per whole repeat
    aa_notes: list[str] = field(default_factory=list)


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


# The engine's GradScaler keeps torch's default factors (precision.make_scaler): a skipped step multiplies the
# scale by this.
_BACKOFF = float(inspect.signature(torch.amp.GradScaler).parameters["backoff_factor"].default)


def _initial_scale(history: pd.DataFrame) -> Optional[float]:
    """The loss scale before step 1: records hold each step's scale after its update, so a skipped first
    step has already cut it once."""
    if history is None or not len(history) or pd.isna(history["scale"].iloc[0]):
        return None
    first = float(history["scale"].iloc[0])
    return first / _BACKOFF if bool(history["skipped"].iloc[0]) else first


def _has_values(frame: Any, column: str) -> bool:
    return frame is not None and column in frame and pd.to_numeric(frame[column], errors="coerce").notna().any()


def _last_value(history: Optional[pd.DataFrame], column: str) -> float:
    """The last step's ``column`` (as final_loss is the last step's loss: a NaN there stays NaN); NaN without one."""
    if history is None or not len(history) or column not in history:
        return math.nan
    return _float_or_nan(pd.to_numeric(pd.Series([history[column].iloc[-1]], dtype=object), errors="coerce")[0])


def _preference(outcomes: Sequence[_Outcome]) -> bool:
    """Whether any variant trains a preference objective (dpo, orpo, simpo): the table then has reward columns."""
    return any(o.settings.get("objective", "lm") != "lm" for o in outcomes)


def _not_run_why(o: _Outcome) -> str:
    """Why a variant has no run to judge, in a few words, from its status and first note."""
    note = o.notes[0] if o.notes else ""
    if o.status == "unsupported":
        return f"unsupported here: {note}" if note else "unsupported here"
    if note.startswith("not run: "):
        return note[len("not run: "):]
    return note or _STATUS_WORDS.get(o.status, o.status.replace("_", " "))


def _speed_columns(sp: Optional[_verdicts.Speed], floor: float) -> dict[str, Any]:
    if sp is None:
        return {"speedup": math.nan, "speedup_low": math.nan, "speedup_high": math.nan, "speedup_spread": math.nan,
                "noise_floor": floor, "speed_measurable": None, "speed_state": None}
    # the half-width this variant was judged against (its own: the rule's, or the A/A copy's where wider)
    return {"speedup": sp.ratio, "speedup_low": sp.low, "speedup_high": sp.high, "speedup_spread": sp.spread,
            "noise_floor": sp.floor if math.isfinite(sp.floor) else floor, "speed_measurable": bool(sp.measurable),
            "speed_state": sp.state}


def _run_notes(o: _Outcome, caps) -> list[str]:
    """Notes a finished run earns: slow precision, skipped / non-finite steps, an early stop."""
    s = o.result.summary
    notes = list(s.get("notes") or [])   # the engine's own: an out-of-memory stop, auto batch size, a resume
    for option in (s["precision_used"], o.config.method, o.config.optimizer):
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


def _notes(o: _Outcome, caps) -> list[str]:
    """Every note of one variant, each once: what its run earned, then what compare() found."""
    return list(dict.fromkeys((_run_notes(o, caps) if o.result is not None else []) + o.notes))


def _completion(o: _Outcome) -> str:
    if o.status in _COMPLETE:
        return "finished"
    if o.status in _CUT:
        return "cut"
    if o.status in ("not_run", "unsupported"):
        return o.status
    return "failed"   # error, out of memory, diverged


def _build_table(outcomes: list[_Outcome], reference: str, notes: Mapping[str, list[str]], floor: float,
                 run_order: Sequence[Sequence[str]], aa_floor: Optional[float] = None) -> pd.DataFrame:
    ref = next((o for o in outcomes if o.name == reference and o.result is not None), None)
    ref_tps = [t for t, _ in ref.timings] if ref is not None else []
    causal = any(o.settings["task"] == "causal-lm" for o in outcomes)
    classify = any(o.settings["task"] != "causal-lm" for o in outcomes)
    preference = _preference(outcomes)
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
            # the precision of every tensor: the optimizer, and the dtype the trainable weights are stored in
            "optimizer": s.get("optimizer") or o.settings.get("optimizer"),
            "weights_dtype": s.get("weights_dtype") or _planned_weights_dtype(o, precision),
            "steps": s.get("steps"),
            # its 1-based position in each repeat (the order rotates from repeat to repeat)
            "order": _positions(o.name, run_order),
            "wall_s": wall,
            "wall_s_spread": _spread([w for _, w in o.timings]),
            "tokens_per_s": tps,
            "tokens_per_s_spread": _spread([t for t, _ in o.timings]),
            # Paired by repeat (repeat r of every variant ran back to back): the median ratio, its range and half it,
            # judged by the speed rule (widened by an A/A copy's half-width), as the verdicts judge it.
            **_speed_columns(_verdicts.speed([t for t, _ in o.timings], ref_tps, aa_floor), floor),
            # model FLOPs per second over the device's peak for the variant's compute dtype (summary["mfu"])
            "mfu": _float_or_nan(s.get("mfu")),
            "peak_vram_gib": _float_or_nan(s.get("peak_vram_gib")),
            "peak_host_rss_gib": _float_or_nan(s.get("peak_host_rss_gib")),
            # what the run's own tensors took on a CPU, where RSS is the whole process's (absent in older runs)
            "peak_host_tensors_gib": _float_or_nan(s.get("peak_host_tensors_gib")),
            # what estimate_memory() puts on each tensor class for this variant (also for one that did not run)
            **_estimate_columns(o.estimate),
            "final_loss": _float_or_nan(s.get("final_loss")),
            "eval_loss": _float_or_nan(s.get("eval_loss")),
        }
        if causal:
            row["eval_perplexity"] = _float_or_nan(s.get("eval_perplexity"))
        if classify:
            row["eval_accuracy"] = _float_or_nan(s.get("eval_accuracy"))
        if preference:
            # the last step's implicit rewards (TRL's names): margin, and the share of its pairs ranked right
            row["reward_margin"] = _last_value(h, "reward_margin")
            row["reward_accuracy"] = _last_value(h, "reward_accuracy")
        row.update({
            "max_abs_loss_diff": diff_abs,
            "max_rel_loss_diff": diff_rel,
            "skipped_steps": s.get("skipped_steps"),
            "nonfinite_steps": s.get("nonfinite_steps"),
            "first_nonfinite_step": s.get("first_nonfinite_step"),
            "min_scale": float(np.nanmin(scales)) if np.isfinite(scales).any() else math.nan,
            # share of the sampled weight updates the weights' dtype lost (NaN where it was not measured)
            "lost_updates": _float_or_nan(s.get("lost_updates")),
            # mean |log p_run - log p_fp32| per answer token on sampled steps: how far the run's dtype moves the
            # log-probs a preference loss takes differences of (NaN for objective="lm" or where not measured)
            "logprob_mismatch": _float_or_nan(s.get("logprob_mismatch")),
            # GRPO: mean |log p_sampler - log p_trainer| per completion token over the run (NaN otherwise)
            "sampler_mismatch": _float_or_nan(s.get("mismatch_mean")),
            "init_hash": s.get("init_hash"),
            "data_hash": s.get("data_hash"),
            "fair": o.fair,
            "repeats": len(o.timings),
            "notes": "; ".join(notes[o.name]),
        })
        rows.append(row)
    table = pd.DataFrame(rows)
    for col in ("micro_batch", "grad_accum", "steps", "skipped_steps", "nonfinite_steps",
                "first_nonfinite_step", "repeats"):
        table[col] = table[col].astype("Int64")   # integers with <NA> for rows that did not run
    table["fair"] = table["fair"].astype("boolean")
    table["speed_measurable"] = table["speed_measurable"].astype("boolean")
    return table



# MemoryEstimate attribute -> table column: the estimate's GiB per tensor class, then its peak. The master weights
# are the part of the weights that is the fp32 copy the optimizer updates (0 under fp32 and bf16-pure): a share of
# est_weights_gib, not added to it.
ESTIMATE_COLUMNS = {"weights_gib": "est_weights_gib", "master_weights_gib": "est_master_weights_gib",
                    "gradients_gib": "est_gradients_gib", "optimizer_gib": "est_optimizer_gib",
                    "activations_gib": "est_activations_gib", "logits_gib": "est_logits_gib",
                    "total_gib": "est_total_gib"}


def _estimate_columns(est: Any) -> dict[str, float]:
    """The estimate's GiB per tensor class as table columns; NaN where there is no estimate (or, for an estimate
    made before issue 27, no master-weights figure)."""
    return {col: _float_or_nan(getattr(est, attr, None)) if est is not None else math.nan
            for attr, col in ESTIMATE_COLUMNS.items()}


def _planned_weights_dtype(o: _Outcome, precision: Optional[str]) -> Optional[str]:
    """The trainable weights' dtype of a variant that did not run: the estimate's, else the precision table's."""
    dtype = getattr(o.estimate, "weights_dtype", None)
    if dtype:
        return str(dtype)
    spec = PRECISION_TABLE.get(precision or "")
    if spec is None:
        return None
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(spec.param_dtype)


def _positions(name: str, run_order: Sequence[Sequence[str]]) -> Optional[str]:
    """``name``'s 1-based position in each repeat it ran in ("1, 3, 2"); None when it never ran."""
    pos = [str(list(order).index(name) + 1) for order in run_order if name in order]
    return ", ".join(pos) if pos else None


# ---------------------------------------------------------------------------------------------------------------
# ComparisonResult
# ---------------------------------------------------------------------------------------------------------------
class ComparisonResult(ComparisonViews):
    """The outcome of compare(): ``verdicts`` (variant -> one-line answer), ``table`` (one row per variant,
    every column), ``compact_table()`` (what a person reads), ``results`` (variant -> TrainResult),
    ``differences`` / ``eval_differences`` (per step, each variant minus the reference), ``band`` (the seed
    noise, from ``seed_results``), ``reward_differences`` / ``reward_bands`` (the same for a preference
    objective's reward margin and accuracy), ``configs``, ``notes`` (variant -> notes), ``fair``, ``warnings``,
    ``errors`` (tracebacks), ``completion`` (how each variant's run ended) and ``stopped``, ``run_order``
    (the order of each repeat), ``noise_floor`` and ``aa_timings`` (the speed's noise), ``figure()``,
    ``summary_html()`` and ``to_html(path)`` (render.py)."""

    def __init__(self, outcomes: list[_Outcome], config: TrainConfig, reference: str, warnings_: list[str],
                 repeats: int, stopped: Optional[str] = None, requested_reference: Optional[str] = None,
                 seed_runs: Optional[_SeedRuns] = None, schedule: Optional[_Schedule] = None):
        self.config = config
        self.reference = reference
        #: the reference compare() was given (or the first variant); ``reference`` differs when that one
        #: did not run
        self.requested_reference = requested_reference or reference
        self.warnings = list(warnings_)
        self.repeats = repeats
        schedule = schedule or _Schedule()
        #: per timed repeat, the names in the order their runs started (the live pass before them is not in it):
        #: repeat r runs the variants rotated by r, so each variant takes each position in turn
        self.run_order = [list(r) for r in schedule.run_order]
        #: the tokens/s of the reference's unrecorded identical copy in each repeat (``aa=True``), else empty
        self.aa_timings = list(schedule.aa_timings)
        #: the copy's name in ``run_order`` (None without ``aa``), and what happened to it
        self.aa_name, self.aa_notes = schedule.aa_name, list(schedule.aa_notes)
        ref_o = next((o for o in outcomes if o.name == reference), None)
        ref_tps = [t for t, _ in ref_o.timings] if ref_o is not None and ref_o.result is not None else []
        #: the smallest speed difference (relative: 0.04 = ±4%) this comparison could rank: the speed rule's
        #: half-width for the A/A copy, or for a variant as noisy as the reference's own repeats
        #: (verdicts.noise_floor); NaN when unknown. Each variant is judged on its own half-width (the table).
        self.noise_floor = float(_verdicts.noise_floor(ref_tps, self.aa_timings))
        caps = capabilities()
        self.notes = {o.name: _notes(o, caps) for o in outcomes}
        aa_floor = self.noise_floor if self.aa_timings else None
        self.table = _build_table(outcomes, reference, self.notes, self.noise_floor, self.run_order, aa_floor)
        self.results = {o.name: o.result for o in outcomes if o.result is not None}
        self.configs = {o.name: o.config for o in outcomes if o.config is not None}
        self.overrides = {o.name: o.overrides for o in outcomes}
        self.errors = {o.name: o.error for o in outcomes if o.error}
        self.timings = {o.name: list(o.timings) for o in outcomes}
        #: None, or "stopped" / "interrupted" when the user ended the comparison before it was through.
        self.stopped = stopped
        #: variant -> "finished" | "cut" (stopped or interrupted mid-run) | "not_run" | "failed" | "unsupported"
        self.completion = {o.name: _completion(o) for o in outcomes}

        seed_runs = seed_runs or _SeedRuns()
        #: the seeds compare() was asked for (``seeds=``), and the reference run's own
        self.seeds, self.reference_seed = seed_runs.requested, seed_runs.reference_seed
        #: extra seed -> TrainResult of the reference under that seed (model not kept)
        self.seed_results = dict(seed_runs.results)
        #: extra seed -> wall time of its run, in seconds: the cost of the noise band
        self.seed_wall_s = {s: float(r.summary["wall_s"]) for s, r in self.seed_results.items()}
        self.seed_notes = list(seed_runs.notes)
        #: what the reruns varied: "init", "data" or "rounding" (compare's ``band``), and the rounding band's scale
        self.null, self.rounding = seed_runs.null, seed_runs.scale
        ref = self.results.get(reference)
        histories = {n: r.history for n, r in self.results.items()}
        evals = {n: r.eval_history for n, r in self.results.items()}
        #: per step of the reference: each variant's loss minus the reference's (NaN where a run has no step)
        self.differences = (_verdicts.differences(histories, reference) if ref is not None
                            else pd.DataFrame(index=pd.Index([], name="step")))
        #: per evaluation of the reference: each variant's eval loss minus the reference's
        self.eval_differences = (_verdicts.differences(evals, reference, "eval_loss") if ref is not None
                                 else pd.DataFrame(index=pd.Index([], name="step")))
        #: the same for eval accuracy (classification), None where no run measured it
        self.eval_accuracy_differences = (
            _verdicts.differences(evals, reference, "eval_accuracy")
            if ref is not None and any(_has_values(e, "eval_accuracy") for e in evals.values()) else None)
        whole = {s: r.history for s, r in self.seed_results.items() if r.summary["stopped_reason"] in _COMPLETE}
        #: the reference's seed-to-seed noise (verdicts.SeedBand), None without seed runs
        self.band = (_verdicts.seed_band(ref.history, whole, self.reference_seed, null=self.null,
                                         scale=self.rounding) if ref is not None and whole else None)
        #: the same for the evaluations ("eval_loss", and "eval_accuracy" for classification) -> SeedBand, where
        #: the reference and its whole seed runs evaluated at common steps: an eval difference inside it is no
        #: better or worse
        self.eval_bands = self._eval_bands(ref, whole)
        #: a preference objective's per-step rewards ("reward_margin", "reward_accuracy") -> per step of the
        #: reference, each variant's value minus the reference's; empty for objective="lm"
        self.reward_differences = ({col: _verdicts.differences(histories, reference, col)
                                    for col in _verdicts.REWARD_COLUMNS if _verdicts.has_values(ref.history, col)}
                                   if ref is not None else {})
        #: the reference's seed noise of each of those columns (verdicts.SeedBand), as ``band`` is the loss's:
        #: what a variant's reward margin and accuracy are judged against; empty without seed runs or rewards
        self.reward_bands = self._column_bands(ref, whole, self.reward_differences)
        #: GRPO: variant -> verdicts.MismatchJudgement, its sampler/trainer mismatch against fp16's (or the
        #: reference's) with their batch-to-batch spreads; empty for the other objectives
        self.mismatch = _verdicts.mismatch_judgements(
            histories, reference, {n: r.summary.get("mismatch_mean") for n, r in self.results.items()},
            [h for h in whole.values()],
            {n: r.config.grpo_iterations for n, r in self.results.items() if r is not None}) if ref is not None else {}
        #: variant -> verdicts.Verdict, the one-line answer (``.text``), every number from the runs above
        self.verdicts = {o.name: self._verdict(o) for o in outcomes}

    def _eval_bands(self, ref, whole: Mapping[int, Any]) -> dict[str, _verdicts.SeedBand]:
        if ref is None or not whole:
            return {}
        out = {}
        for col in ("eval_loss", "eval_accuracy"):
            seeds = {s: self.seed_results[s].eval_history for s in whole
                     if _has_values(self.seed_results[s].eval_history, col)}
            band = (_verdicts.seed_band(ref.eval_history, seeds, self.reference_seed, column=col, null=self.null,
                                        scale=self.rounding) if seeds and _has_values(ref.eval_history, col) else None)
            if band is not None and len(band.width):
                out[col] = band
        return out

    def _column_bands(self, ref, whole: Mapping[int, Any], columns) -> dict[str, _verdicts.SeedBand]:
        """Column -> the seed band of the reference's step history in it, over the whole seed runs that recorded it."""
        out = {}
        for col in columns:
            seeds = {s: h for s, h in whole.items() if _verdicts.has_values(h, col)}
            band = (_verdicts.seed_band(ref.history, seeds, self.reference_seed, column=col, null=self.null,
                                        scale=self.rounding) if seeds else None)
            if band is not None and len(band.width):
                out[col] = band
        return out

    def _verdict(self, o: _Outcome) -> _verdicts.Verdict:
        res, ref = o.result, self.results.get(self.reference)
        if res is None or ref is None or not len(res.history):
            why = self.ended(o.name) if res is not None else _not_run_why(o)
            return _verdicts.not_run_verdict(o.name, self.reference, why)
        scaler = bool(res.info.scaler_enabled) if res.info is not None else None
        v = _verdicts.verdict(
            o.name, self.reference, res.history, ref.history, res.summary,
            timings=[t for t, _ in o.timings], reference_timings=[t for t, _ in self.timings[self.reference]],
            band=self.band, eval_history=res.eval_history, reference_eval_history=ref.eval_history,
            scaler=scaler, initial_scale=_initial_scale(res.history) if scaler else None,
            seed_wall_s=self.seed_wall_s, aa_timings=self.aa_timings, eval_bands=self.eval_bands,
            reward_bands=self.reward_bands, lost_updates_text=lost_updates_of(res))
        if o.name in self.mismatch:   # GRPO: the precision question, said right after the speed
            v.parts.insert(1 if v.speed is not None or v.parts else 0, self.mismatch[o.name].text)
        if o.fair is False:
            v.parts.append(f"NOT FAIR: not paired with {self.reference} (see its notes)")
        return v

    @property
    def advice(self) -> str:
        """How the verdicts word their advice: "code" (compare()'s arguments: "use repeats=5", "seeds=(0, 1, 2)"),
        or "panel" (the Panel's controls: "set repeats to 5", "set seeds to 3"), which the Panel sets."""
        return getattr(self, "_advice", "code")

    @advice.setter
    def advice(self, words: str) -> None:
        if words not in ("code", "panel"):
            raise ValueError(f"advice: must be 'code' or 'panel', got {words!r}")
        self._advice = words
        for v in self.verdicts.values():
            v.advice = words

    @property
    def fair(self) -> bool:
        """True when every variant that ran started from the reference's weights and saw its batches
        (differences that the variant's own settings explain, like LoRA weights, do not count)."""
        return bool(self.table["fair"].fillna(True).all())

    @property
    def variants(self) -> list[str]:
        """The variant names, in run order."""
        return list(self.table["variant"])

    @property
    def finished(self) -> list[str]:
        """The variants whose run went to its end (max_steps or epochs)."""
        return [n for n, c in self.completion.items() if c == "finished"]

    @property
    def cut(self) -> list[str]:
        """The variants stopped mid-run (a stop, Ctrl-C, or a callback's StopTraining); they keep their steps."""
        return [n for n, c in self.completion.items() if c == "cut"]

    @property
    def not_run(self) -> list[str]:
        """The variants that never started because the comparison was stopped or interrupted first."""
        return [n for n, c in self.completion.items() if c == "not_run"]

    @property
    def samples(self) -> pd.DataFrame:
        """Every variant's sample-prompt answers (step, prompt, answer, new_tokens, seconds, variant), in run
        order; empty (with those columns) when the comparison had no sample prompts."""
        frames = []
        for name, res in self.results.items():
            df = getattr(res, "samples", None)
            if df is not None and len(df):
                frames.append(df.assign(variant=name))
        return pd.concat(frames, ignore_index=True) if frames else sample_frame([])

    def samples_table(self, step: Optional[int] = None) -> pd.DataFrame:
        """Each variant's answer to each prompt side by side (prompt rows x variant columns) at ``step``, by
        default the last step they all sampled; ``.attrs["steps"]`` says which step each column shows."""
        return side_by_side(self.samples, step)

    def steps(self, variant: str) -> int:
        """How many optimizer steps ``variant`` took (0 when it did not run)."""
        res = self.results.get(variant)
        return int(res.summary["steps"]) if res is not None else 0

    def summaries(self) -> dict[str, dict]:
        """Variant -> the run's summary, with tokens_per_s and wall_s replaced by the medians over repeats."""
        out = {}
        for name, res in self.results.items():
            row = self.table.loc[self.table.variant == name].iloc[0]
            out[name] = {**res.summary, "tokens_per_s": float(row.tokens_per_s), "wall_s": float(row.wall_s)}
        return out

    def _throughput_range(self) -> dict[str, tuple[float, float]]:
        """Variant -> (lowest, highest) tokens/s over its repeats, where it has more than one."""
        return {n: (min(t for t, _ in ts), max(t for t, _ in ts)) for n, ts in self.timings.items()
                if n in self.results and len(ts) > 1}

    # -- the compact view -------------------------------------------------------------------------------
    def ended(self, variant: str) -> str:
        """How ``variant``'s run ended, in a few words ("cut at step 3", "not run", "out of memory"); "" when
        it finished."""
        how = self.completion[variant]
        if how == "finished":
            return ""
        if how == "cut":
            n = self.steps(variant)
            return f"cut at step {n}" if n else "cut before step 1"
        status = self.table.loc[self.table.variant == variant, "status"].iloc[0]
        return _STATUS_WORDS.get(status, str(status).replace("_", " "))

