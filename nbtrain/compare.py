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
import inspect
import math
import platform
import re
import statistics
import sys
import threading
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from . import verdicts as _verdicts
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
_CUT = ("stopped", "interrupted")   # statuses of a run ended early by the user, with the steps it had


class _RunStop(threading.Event):
    """One run's stop flag, which also reads as set once the comparison's ``outer`` one is: a callback's
    StopTraining (the loop sets this flag) ends its own variant only; a stop of the comparison ends them all."""

    def __init__(self, outer=None):
        super().__init__()
        self.outer = outer

    def is_set(self) -> bool:
        return super().is_set() or (self.outer is not None and self.outer.is_set())


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
            repeats: int = 1, callbacks=None, warmup: bool = True, stop=None,
            reference: Optional[str] = None, seeds: Sequence[int] = ()) -> "ComparisonResult":
    """Train ``cfg`` once per variant in this process and return a side-by-side ComparisonResult.

    Without ``variants`` there is one variant per name in ``precisions``. ``variants`` maps a name to
    config overrides (``{"micro2x4": dict(micro_batch_size=2, grad_accum_steps=4)}``); ``precisions`` is
    then ignored. ``subset``/``max_steps`` override cfg's when given. ``reference`` (a variant name; the
    first variant by default) is what speed-ups and loss differences are relative to. A variant that is
    invalid here or fails becomes a row with the reason; the others still run. ``repeats`` > 1 runs every
    variant again, interleaved (A B C, A B C), and reports the median throughput and wall time, and each
    speed-up as the median of the per-repeat ratios with their spread; the curves are the first repeat's.
    ``seeds`` (e.g. ``(0, 1, 2)``) runs the reference again, after the variants, under each seed other than
    its own (other initial weights and data order; no callbacks, no outputs): the spread of those runs' loss
    around the reference's is the noise band a variant's difference is judged against (``band``,
    ``verdicts``); the extra runs are in ``seed_results`` with their wall times. ``callbacks``
    (e.g. one LiveDashboard) see every variant's first repeat; records carry ``.variant``. ``warmup``
    first runs two untimed steps of the first variant, so that the reference does not pay alone for
    what a process does once (lazy imports, kernel and allocator set-up) and look slow. On a GPU the
    models kept in ``results`` are moved to the CPU between variants, so that they do not count in the
    next variant's peak memory. ``stop`` (a ``threading.Event``, set from any thread) ends the comparison:
    the running variant stops after its current step, the later ones never start. An interrupt (Ctrl-C)
    does the same. ``ComparisonResult.completion`` then says which variants finished, were cut or did not run.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"compare() takes a TrainConfig, got {type(cfg).__name__}")
    if int(repeats) < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats!r}")
    seeds = _seed_list(seeds)
    complete_imports(cfg)   # callbacks may start threads (a live figure); the imports are done by then
    base = cfg
    if subset is not None or max_steps is not None:
        given = {"subset": subset, "max_steps": max_steps}
        base = cfg.replace(**{k: v for k, v in given.items() if v is not None})
    outcomes = [_Outcome(name, dict(ov), {**base.to_dict(), **ov})
                for name, ov in _variant_specs(precisions, variants).items()]
    names = [o.name for o in outcomes]
    if reference is not None and str(reference) not in names:
        raise ValueError(f"reference: {reference!r} is not one of the variants {names}")
    wanted = str(reference) if reference is not None else names[0]

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

    # "stopped" or "interrupted" once the user ends the whole comparison; later variants then never start.
    halted = _warm_up(next((o.config for o in outcomes if o.config is not None), None), stop) if warmup else None
    for r in range(int(repeats)):
        for o in outcomes:
            halted = halted or _stop_requested(stop)
            if halted or o.config is None or o.status in ("error", "out_of_memory"):
                continue
            run_cfg = o.config if r == 0 else _unrecorded(o.config)
            try:
                result = _run_variant(o, run_cfg, callbacks if r == 0 else None, first=(r == 0), stop=stop)
            except KeyboardInterrupt:  # before the loop's own handler is in place (data, model building)
                result, halted = None, "interrupted"
                if r == 0:
                    o.status = "interrupted"
                o.notes.append("interrupted before its first step")
            if result is not None:
                reason = result.summary["stopped_reason"]
                if reason == "interrupted":
                    halted = "interrupted"
                halted = halted or _stop_requested(stop)
                # A later repeat cut short by the user would drag the median down: only whole repeats count.
                if r == 0 or not (halted and reason in _CUT):
                    o.timings.append((float(result.summary["tokens_per_s"]), float(result.summary["wall_s"])))
                if r == 0:
                    o.result = result
                    o.status = reason
                    note = _park_model(result)
                    if note:
                        o.notes.append(note)
            del result
            _release_memory()
    # A stop or a kernel interrupt ends the whole comparison: the user asked for it to end, not just one variant.
    for o in outcomes:
        if halted and o.result is None and o.status == "not_run":
            o.notes.append(f"not run: the comparison was {halted}")

    # The reference asked for, unless it has no run to compare with: then the first variant that ran.
    ran = [o.name for o in outcomes if o.result is not None]
    reference = wanted if wanted in ran or not ran else ran[0]
    ref_o = next(o for o in outcomes if o.name == reference)
    seed_runs = _SeedRuns(requested=seeds)
    if seeds and ref_o.result is not None:
        halted = _run_seeds(ref_o, seeds, seed_runs, stop, halted)
    warns = _check_fairness(outcomes, reference)
    for w in warns:
        warnings.warn(w, ComparisonWarning, stacklevel=2)
    return ComparisonResult(outcomes, base, reference, warns, int(repeats), stopped=halted,
                            requested_reference=wanted, seed_runs=seed_runs)


@dataclass
class _SeedRuns:
    """The reference's extra-seed runs: what was asked, what ran (seed -> TrainResult), and notes."""

    requested: tuple[int, ...] = ()
    reference_seed: Optional[int] = None
    results: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _seed_list(seeds) -> tuple[int, ...]:
    """``seeds`` as distinct non-negative ints, in order (None or () for none)."""
    if seeds is None:
        return ()
    if isinstance(seeds, (int, str)) or not isinstance(seeds, Sequence):
        raise ValueError(f"seeds: expected a sequence of seeds, e.g. (0, 1, 2), got {seeds!r}")
    out: list[int] = []
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= int(s) < 2 ** 32:
            raise ValueError(f"seeds: each seed is an int in [0, 2**32), got {s!r}")
        if int(s) not in out:
            out.append(int(s))
    return tuple(out)


def _unrecorded(cfg: TrainConfig, **changes) -> TrainConfig:
    """``cfg`` for a run that is not one of the comparison's results (warm-up, a repeat, a seed run): it writes
    no outputs and reports to no tracker, so a tracker holds one run per variant."""
    return cfg.replace(output_dir=None, report_to=[], **changes)


def _seed_config(cfg: TrainConfig, seed: int) -> TrainConfig:
    """The reference's config under another seed."""
    return _unrecorded(cfg, seed=seed)


def _run_seeds(ref: _Outcome, seeds: tuple[int, ...], runs: _SeedRuns, stop,
               halted: Optional[str]) -> Optional[str]:
    """Run ``ref``'s config under each seed of ``seeds`` but its own, into ``runs``; returns ``halted``."""
    runs.reference_seed = ref.config.seed
    for seed in (s for s in seeds if s != ref.config.seed):
        halted = halted or _stop_requested(stop)
        if halted:
            runs.notes.append(f"seed {seed}: not run, the comparison was {halted}")
            continue
        try:
            res = _loop._run(_seed_config(ref.config, seed), None, stop_event=_RunStop(stop),
                             variant=f"{ref.name} (seed {seed})")
        except KeyboardInterrupt:
            halted = "interrupted"
            runs.notes.append(f"seed {seed}: interrupted before its first step")
            continue
        except Exception as e:  # noqa: BLE001 - a failed seed run narrows the band, it does not end the comparison
            runs.notes.append(f"seed {seed}: failed: {type(e).__name__}: {_first_line(e)}")
            continue
        reason = res.summary["stopped_reason"]
        if reason == "interrupted":
            halted = "interrupted"
        halted = halted or _stop_requested(stop)
        res.model = None   # the band needs the history only; N extra models would stay in memory otherwise
        runs.results[seed] = res
        if reason not in _COMPLETE:
            runs.notes.append(f"seed {seed}: {reason} after {res.summary['steps']} step(s), left out of the band")
        _release_memory()
    return halted


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


def _stop_requested(stop) -> Optional[str]:
    return "stopped" if stop is not None and stop.is_set() else None


def _run_variant(o: _Outcome, cfg: TrainConfig, callbacks, first: bool, stop=None):
    """One run of one variant; an exception becomes the variant's status and note, never the caller's."""
    try:
        return _loop._run(cfg, callbacks, stop_event=_RunStop(stop), variant=o.name, hash_init=first)
    except Exception as e:  # noqa: BLE001 - any failure of one variant must leave the others running
        oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
        o.status = "out_of_memory" if oom else "error"
        o.notes.append(f"{'out of memory' if oom else 'failed'}: {type(e).__name__}: {_first_line(e)}")
        # Keep text, not the exception: its traceback holds the frames, and so the model, in memory.
        o.error = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return None


def _warm_up(cfg: Optional[TrainConfig], stop=None) -> Optional[str]:
    """Two untimed steps of ``cfg``, results discarded; "interrupted" or "stopped" when the user ended them."""
    if cfg is None or _stop_requested(stop):
        return _stop_requested(stop)
    try:
        res = _loop._run(_unrecorded(cfg, max_steps=2, eval_every=None), None,
                         stop_event=_RunStop(stop))
    except KeyboardInterrupt:
        return "interrupted"
    except Exception:  # noqa: BLE001 - the timed run of this variant reports the failure in its row
        return _stop_requested(stop)
    halted = "interrupted" if res.summary["stopped_reason"] == "interrupted" else _stop_requested(stop)
    del res
    _release_memory()
    return halted


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


def _not_run_why(o: _Outcome) -> str:
    """Why a variant has no run to judge, in a few words, from its status and first note."""
    note = o.notes[0] if o.notes else ""
    if o.status == "unsupported":
        return f"unsupported here: {note}" if note else "unsupported here"
    if note.startswith("not run: "):
        return note[len("not run: "):]
    return note or _STATUS_WORDS.get(o.status, o.status.replace("_", " "))


def _speed_columns(sp: Optional[_verdicts.Speed]) -> dict[str, float]:
    if sp is None:
        return {"speedup": math.nan, "speedup_spread": math.nan}
    return {"speedup": sp.ratio, "speedup_spread": sp.spread}


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


def _build_table(outcomes: list[_Outcome], reference: str, notes: Mapping[str, list[str]]) -> pd.DataFrame:
    ref = next((o for o in outcomes if o.name == reference and o.result is not None), None)
    ref_tps = [t for t, _ in ref.timings] if ref is not None else []
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
            # Paired by repeat (repeat r of every variant ran back to back): the median ratio and half its range.
            **_speed_columns(_verdicts.speed([t for t, _ in o.timings], ref_tps)),
            "peak_vram_gib": _float_or_nan(s.get("peak_vram_gib")),
            "peak_host_rss_gib": _float_or_nan(s.get("peak_host_rss_gib")),
            # what the run's own tensors took on a CPU, where RSS is the whole process's (absent in older runs)
            "peak_host_tensors_gib": _float_or_nan(s.get("peak_host_tensors_gib")),
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
            "notes": "; ".join(notes[o.name]),
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
                 "wall_s", "tokens_per_s", "speedup", "speedup_spread", "peak_vram_gib", "peak_host_rss_gib",
                 "peak_host_tensors_gib", "final_loss", "eval_loss", "eval_perplexity", "eval_accuracy", "max_abs_loss_diff",
                 "skipped_steps", "nonfinite_steps", "min_scale", "fair")
MISSING = "—"   # the one marker for "no value" in the HTML views


def _fmt_scale(v: float) -> str:
    # A loss scale is a power of two: 65,536 reads at a glance, 6.554e+04 does not.
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"


def _fmt_diff(v: float) -> str:
    """A loss difference: fixed decimals when it is visible at 3 decimals, else 2 significant digits."""
    if v == 0:
        return "0"
    return f"{v:.3f}" if v >= 0.01 else f"{v:.1e}"


def _cell(v, fmt) -> str:
    return fmt(v) if v is not None and not pd.isna(v) and math.isfinite(v) else MISSING


def _loss_cell(v) -> str:
    # A run's non-finite loss is a result ("nan"), not a missing value: never hide it.
    if v is None:
        return MISSING
    return f"{v:.4f}" if math.isfinite(v) else str(float(v))


def _fmt_gib(v: float) -> str:
    """GiB to 3 significant digits without an exponent (0.0832, 1.74, 12.3, 123)."""
    if v <= 0:
        return "0"
    decimals = min(6, max(0, 2 - math.floor(math.log10(v))))
    return f"{v:.{decimals}f}"


_FORMATS = {"wall_s": "{:.1f}", "wall_s_spread": "{:.1f}", "tokens_per_s": "{:,.0f}",
            "tokens_per_s_spread": "{:,.0f}", "speedup": "{:.2f}x", "speedup_spread": "±{:.2f}",
            "peak_vram_gib": _fmt_gib,
            "peak_host_rss_gib": _fmt_gib, "peak_host_tensors_gib": _fmt_gib, "final_loss": "{:.4f}",
            "eval_loss": "{:.4f}", "eval_perplexity": "{:.1f}", "eval_accuracy": "{:.3f}",
            "max_abs_loss_diff": "{:.2e}", "max_rel_loss_diff": "{:.2e}", "min_scale": _fmt_scale}

# The compact view: its columns and their headers, split in two lines where a header is longer than the values
# under it, so that every column stays narrow and ten of them fit a 968 px notebook output.
_COMPACT_HEADERS = {"variant": ("Variant",), "precision": ("Precision",),
                    "tokens_per_s": ("Tokens/s", "(speed-up)"), "memory": ("Peak memory", "(GiB)"), "final_loss": ("Final", "loss"), "eval": ("Eval", "loss"),
                    "loss_diff": ("Max |Δ loss|", "vs reference"), "skipped": ("Skipped /", "non-finite"),
                    "min_scale": ("Min", "scale"), "fair": ("Fair",)}
_STATUS_WORDS = {"out_of_memory": "out of memory", "nonfinite": "diverged", "not_run": "not run",
                 "callback_error": "callback error"}
_MEMORY_NOTES = {
    "vram": "accelerator memory the run allocated (its peak)",
    "tensors": "what the run's own tensors took at their peak (the process's resident memory, which grows "
               "with every run in this kernel, is in the full table)",
    "rss": "resident memory of the whole process at its peak: it includes what earlier runs in this kernel "
           "left behind, so later variants look bigger",
}


class ComparisonResult:
    """The outcome of compare(): ``verdicts`` (variant -> one-line answer), ``table`` (one row per variant,
    every column), ``compact_table()`` (what a person reads), ``results`` (variant -> TrainResult),
    ``differences`` / ``eval_differences`` (per step, each variant minus the reference), ``band`` (the seed
    noise, from ``seed_results``), ``configs``, ``notes`` (variant -> notes), ``fair``, ``warnings``,
    ``errors`` (tracebacks), ``completion`` (how each variant's run ended) and ``stopped``, ``figure()``,
    ``summary_html()`` and ``to_html(path)``."""

    def __init__(self, outcomes: list[_Outcome], config: TrainConfig, reference: str, warnings_: list[str],
                 repeats: int, stopped: Optional[str] = None, requested_reference: Optional[str] = None,
                 seed_runs: Optional[_SeedRuns] = None):
        self.config = config
        self.reference = reference
        #: the reference compare() was given (or the first variant); ``reference`` differs when that one
        #: did not run
        self.requested_reference = requested_reference or reference
        self.warnings = list(warnings_)
        self.repeats = repeats
        caps = capabilities()
        self.notes = {o.name: _notes(o, caps) for o in outcomes}
        self.table = _build_table(outcomes, reference, self.notes)
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
        self.band = (_verdicts.seed_band(ref.history, whole, self.reference_seed)
                     if ref is not None and whole else None)
        #: variant -> verdicts.Verdict, the one-line answer (``.text``), every number from the runs above
        self.verdicts = {o.name: self._verdict(o) for o in outcomes}

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
            seed_wall_s=self.seed_wall_s)
        if o.fair is False:
            v.parts.append(f"NOT FAIR: not paired with {self.reference} (see its notes)")
        return v

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

    def figure(self, smoothing: float = 0.9):
        """Overlaid loss, grad norm, loss scale and memory per variant, each variant's exact per-step loss
        difference to the reference (eval differences as markers) over the seed-noise band, and bars of
        throughput (with the repeats' range) and peak memory (a plotly Figure)."""
        from .viz.figures import compare_figure

        not_run = {r.variant: r.notes for r in self.table.itertuples() if r.variant not in self.results}
        return compare_figure(
            {n: r.history for n, r in self.results.items()}, reference=self.reference,
            summaries=self.summaries(), eval_histories={n: r.eval_history for n, r in self.results.items()},
            infos={n: r.info for n, r in self.results.items()}, not_run=not_run, smoothing=smoothing,
            band=self.band, throughput_range=self._throughput_range())

    def difference_figure(self):
        """The difference panel alone: each variant's loss minus the reference's per step, eval differences
        as markers, over the seed-noise band (a small plotly Figure, shown by the Panel after a Compare)."""
        from .viz.figures import difference_figure

        return difference_figure({n: r.history for n, r in self.results.items()}, reference=self.reference,
                                 eval_histories={n: r.eval_history for n, r in self.results.items()},
                                 band=self.band)

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

    def _eval_column(self) -> str:
        # Classification is judged by accuracy; a comparison with any causal LM keeps the loss.
        return ("eval_accuracy" if "eval_accuracy" in self.table.columns
                and "eval_perplexity" not in self.table.columns else "eval_loss")

    @staticmethod
    def _memory(r) -> tuple[float, str]:
        """The peak memory a row is compared on and where it comes from ("vram", "tensors" or "rss")."""
        if r.device == "cuda":
            return r.peak_vram_gib, "vram"
        if math.isfinite(r.peak_host_tensors_gib):
            return r.peak_host_tensors_gib, "tensors"
        return r.peak_host_rss_gib, "rss"

    def _compact_rows(self) -> list[tuple[str, str, dict[str, str]]]:
        """``(variant, status words, {compact column: display string})`` per row."""
        eval_col = self._eval_column()
        rows = []
        for r in self.table.itertuples(index=False):
            ran = r.variant in self.results
            s = self.results[r.variant].summary if ran else {}

            tps = _cell(r.tokens_per_s, lambda v: f"{v:,.0f}")
            if tps != MISSING and r.variant == self.reference:
                tps += " (ref)"
            elif tps != MISSING and math.isfinite(r.speedup):
                # With repeats, the ratio's spread goes with it: an ordering inside it is no ranking.
                spread = f" ±{r.speedup_spread:.2f}" if math.isfinite(r.speedup_spread) else ""
                tps += f" ({r.speedup:.2f}x{spread})"
            mem, _ = self._memory(r)
            diff = ("ref" if ran and r.variant == self.reference
                    else _cell(r.max_abs_loss_diff, _fmt_diff) if ran else MISSING)
            cells = {
                "variant": r.variant,
                "precision": str(r.precision_used),
                "tokens_per_s": tps,
                "memory": _cell(mem, _fmt_gib),
                "final_loss": _loss_cell(s.get("final_loss")),
                "eval": (_cell(getattr(r, eval_col), lambda v: f"{v:.1%}") if eval_col == "eval_accuracy"
                         else _loss_cell(s.get("eval_loss"))),
                "loss_diff": diff,
                "skipped": f"{int(r.skipped_steps)} / {int(r.nonfinite_steps)}" if ran else MISSING,
                "min_scale": _cell(r.min_scale, _fmt_scale),
                "fair": MISSING if pd.isna(r.fair) else ("✓" if r.fair else "✗"),
            }
            rows.append((r.variant, self.ended(r.variant), cells))
        return rows

    def _compact_headers(self) -> dict[str, tuple[str, ...]]:
        heads = dict(_COMPACT_HEADERS)
        if self._eval_column() == "eval_accuracy":
            heads["eval"] = ("Eval", "accuracy")
        return heads

    def compact_table(self) -> pd.DataFrame:
        """The table a person reads at a glance: ten columns of display strings, human headers, "—" where
        there is no value. The variant's cell says how a run that did not finish ended. Every column and
        the raw numbers stay in ``table``; the notes are in ``notes``."""
        heads = self._compact_headers()
        data = []
        for name, status, cells in self._compact_rows():
            cells = {**cells, "variant": f"{name} ({status})" if status else name}
            data.append({" ".join(heads[k]): v for k, v in cells.items()})
        return pd.DataFrame(data, columns=[" ".join(h) for h in heads.values()])

    def _compact_html(self) -> str:
        # Inline styles: they hold in a widget, in JupyterLab's sanitised output and in a saved file alike.
        # Cells never wrap, headers break only at their <br>: each column is as wide as its longest line.
        def style(key: str, head: bool = False) -> str:
            align = "left" if key == "variant" else "right"
            rule = "vertical-align:bottom;border-bottom:1px solid #888;" if head else ""
            return f"padding:2px 8px;white-space:nowrap;text-align:{align};{rule}"

        heads = self._compact_headers()
        head = "".join(f'<th style="{style(k, head=True)}">{"<br>".join(html.escape(x) for x in lines)}</th>'
                       for k, lines in heads.items())
        body = []
        for _variant, status, cells in self._compact_rows():
            tds = []
            for k in heads:
                text = html.escape(cells[k])
                if k == "variant":
                    text = f"<b>{text}</b>" + (f'<br><span style="color:#b45309;font-size:11px">'
                                               f"{html.escape(status)}</span>" if status else "")
                tds.append(f'<td style="{style(k)}">{text}</td>')
            body.append('<tr style="border-bottom:1px solid #e4e4e4">' + "".join(tds) + "</tr>")
        return ('<table class="nbt-compare-table" style="border-collapse:collapse;table-layout:auto;width:auto;'
                'font-size:12px;margin:2px 0">'
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")

    def _general_notes(self) -> list[str]:
        """What holds for the whole table: the reference, what the memory column measures, repeats."""
        lines = []
        if self.results:
            if self.reference != self.requested_reference:
                why = f"the first variant that ran ({self.requested_reference!r} did not)"
            else:
                why = "the first variant" if self.reference == self.variants[0] else "as reference= asked"
            lines.append(f"speed-up and loss difference are relative to {self.reference!r}, {why}")
            sources = {self._memory(r)[1] for r in self.table.itertuples(index=False) if r.variant in self.results}
            lines += [f"peak memory: {_MEMORY_NOTES[src]}" for src in ("vram", "tensors", "rss") if src in sources]
        if self.repeats > 1:
            lines.append(f"tokens/s: median of {self.repeats} interleaved repeats; speed-up: median of the "
                         f"per-repeat ratios to {self.reference!r}, ± half their range (an order within it is "
                         "no measurable difference)")
        lines += self._seed_lines()
        if self.stopped:
            done = ", ".join(self.finished) or "none"
            lines.append(f"the comparison was {self.stopped}; finished: {done}")
        return lines

    def _seed_lines(self) -> list[str]:
        """The extra seed runs and what they cost, for the notes under the table."""
        if not self.seeds:
            return []
        if not self.seed_results and not self.seed_notes:
            return [f"noise band: seeds {', '.join(map(str, self.seeds))} asked, but the reference's own seed "
                    f"({self.reference_seed}) is the only one: no extra run"
                    if self.reference_seed is not None else "noise band: no seed run (the reference did not run)"]
        lines = []
        if self.seed_results:
            total = sum(self.seed_wall_s.values())
            each = ", ".join(f"{s}: {t:.1f} s" for s, t in self.seed_wall_s.items())
            plural = "s" if len(self.seed_results) > 1 else ""
            lines.append(f"noise band: {self.reference!r} again under seed{plural} "
                         f"{', '.join(map(str, self.seed_results))} (seed {self.reference_seed} is its own run); "
                         f"seed runs {each}, {total:.1f} s in all")
        return lines + [f"noise band: {n}" for n in self.seed_notes]

    def _verdicts_html(self) -> str:
        """One line per variant, above the table: its verdict, the variant's name in bold."""
        items = []
        for name, v in self.verdicts.items():
            flagged = v.within_noise is False or v.nonfinite_steps or v.skipped_steps or not v.ran
            color = "#b45309" if flagged else "#222"
            rest = v.text[len(name) + 2:]
            items.append(f'<li style="color:{color}"><b>{html.escape(name)}</b>: {html.escape(rest)}</li>')
        return ('<ul class="nbt-verdicts" style="font-size:13px;margin:4px 0 6px 0;padding-left:18px">'
                + "".join(items) + "</ul>")

    def _notes_html(self) -> str:
        per_variant = "".join(
            f"<li><b>{html.escape(name)}</b><ul style='margin:0;padding-left:18px'>"
            + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul></li>"
            for name, notes in self.notes.items() if notes)
        general = "".join(f"<li>{html.escape(n)}</li>" for n in self._general_notes())
        verdict = html.escape(self._fairness_line())
        color = "#2e7d32" if self.fair else "#c62828"
        return ('<div class="nbt-compare-notes" style="font-size:12px;color:#444;max-width:100%">'
                + (f"<ul style='margin:4px 0;padding-left:18px'>{per_variant}</ul>" if per_variant else "")
                + (f"<ul style='margin:4px 0;padding-left:18px;color:#666'>{general}</ul>" if general else "")
                + f'<p class="nbt-compare-verdict" style="margin:4px 0;color:{color}">{verdict}</p></div>')

    def summary_html(self, details: bool = True) -> str:
        """The verdict line of each variant, the compact table, the notes under it (a list per variant), the
        fairness verdict and, with
        ``details``, every column of ``table`` behind a "details" toggle: an HTML fragment for a notebook
        output or a widget."""
        parts = [self._verdicts_html(),
                 f'<div class="nbt-compare" style="max-width:100%;overflow-x:auto">{self._compact_html()}</div>',
                 self._notes_html()]
        if details:
            parts.append(f'<details class="nbt-compare-details"><summary style="cursor:pointer;font-size:12px">'
                         f"details: all {len(self.table.columns)} columns</summary>"
                         f'<div style="overflow-x:auto">{self._table_html()}</div></details>')
        return "<div>" + "".join(parts) + "</div>"

    # -- text and HTML ------------------------------------------------------------------------------------
    def format_table(self) -> str:
        """The table as plain text for a terminal: the verdict lines above it, the notes and the fairness
        verdict below it."""
        # Leave out what says nothing here: settings every variant shares, a status every run reached.
        cols = [c for c in _TEXT_COLUMNS if c in self.table.columns
                and not (c in ("micro_batch", "grad_accum", "method") and self.table[c].nunique() <= 1)
                and not (c == "status" and self.table[c].isin(_COMPLETE).all())]
        lines = [v.text for v in self.verdicts.values()]
        lines += ["", self._formatted(cols).to_string(index=False), ""]
        if self.repeats > 1:
            lines.append(f"tokens_per_s and wall_s: medians of {self.repeats} interleaved repeats; speedup: median "
                         "of the per-repeat ratios, ± half their range (spreads in .table)")
        lines += self._seed_lines()
        for r in self.table.itertuples():
            if r.notes:
                lines.append(f"{r.variant}: {r.notes}")
        lines.append(self._fairness_line())
        return "\n".join(lines)

    def _formatted(self, cols: Sequence[str], missing: str = "-") -> pd.DataFrame:
        """``cols`` of the table as display strings (``missing`` where there is no value); empty columns dropped."""
        out = {}
        for c in cols:
            values = self.table[c]
            if values.isna().all():
                continue
            f = _FORMATS.get(c, "{:.6g}" if values.dtype.kind == "f" else "{}")
            out[c] = [missing if pd.isna(v) else f(v) if callable(f) else f.format(v) for v in values]
        return pd.DataFrame(out)

    def _fairness_line(self) -> str:
        ran = self.table[self.table["init_hash"].notna()]
        if ran.empty:
            return "no variant ran"
        if self.fair:
            return (f"fair: every variant started from the same weights and saw the same batches as "
                    f"{self.reference!r} (init {ran.init_hash.iloc[0]}, data {ran.data_hash.iloc[0]}), "
                    "or differs only by design")
        return "NOT FAIR: " + " | ".join(self.warnings)

    def _table_html(self) -> str:
        """Every column of ``table``, formatted, as an HTML table."""
        return self._formatted(list(self.table.columns), missing=MISSING).to_html(
            index=False, escape=True, classes=["nbtrain-compare", "nbt-compare-full"])

    def _repr_html_(self) -> str:
        return self.summary_html(details=True)

    def __repr__(self) -> str:
        stopped = f", stopped={self.stopped!r}" if self.stopped else ""
        return (f"ComparisonResult(variants={self.variants}, reference={self.reference!r}, fair={self.fair}"
                f"{stopped})")

    def to_html(self, path, title: str = "nbtrain comparison") -> Path:
        """Write one self-contained HTML report (plotly.js inlined, opens offline): the compact table and its
        notes, figures, every column of the table, config and environment."""
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
.nbt-compare-full th, .nbt-compare-full td, .env th, .env td {{ border: 1px solid #ccc; padding: 3px 6px;
  text-align: right; }}
.nbt-compare-full td:last-child {{ text-align: left; min-width: 20em; }}
pre {{ background: #f6f6f6; padding: .6em; overflow-x: auto; }}
.verdict {{ font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{html.escape(self._fairness_line())}</p>
<h2>Results</h2>
{self.summary_html(details=False)}
<h2>Figures</h2>
{fig_html}
<h2>All columns</h2>
<div style="overflow-x:auto">{self._table_html()}</div>
<h2>Configuration</h2>
<p>Base config (every variant is this with its overrides; the first, {html.escape(repr(self.reference))},
is the reference):</p>
<pre>{html.escape(self.config.to_yaml())}</pre>
<p>Variants:</p>
<pre>{html.escape(overrides)}</pre>
<h2>Environment</h2>
<table class="env">{env_rows}</table>
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
