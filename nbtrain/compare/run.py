"""compare(): one training per variant in this process, fair by construction, in a balanced order.

Fair means: every variant starts from the same initial weights and sees the same batches in the same
order. The engine builds each model from ``cfg.seed`` and orders the data by the seed alone, so this
holds by construction; compare() also *checks* it, with the hash of the initial weights and the hash
of the unpadded token ids of every step that each run records, and says in the table what differs and why.

Balanced means: with repeats, repeat r runs the variants rotated by r (A B C, B C A, C A B), so that no variant
always runs first or last and a position effect (allocator state, caches, the process's growth) is not paired
into every speed ratio. What the runs found becomes a ComparisonResult (result.py).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import re
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ..config import ConfigError, TrainConfig
from ..data import DataError
from ..engine import loop as _loop  # module, not function: tests wrap _loop._run to watch the run order
from ..engine.threads import complete_imports
from .. import verdicts as _verdicts
from ..hardware import check_runnable
from ..models import ModelError
from .result import _COMPLETE, _CUT, ComparisonResult, _Outcome, _Schedule, _SeedRuns

# Config fields that change the initial weights on purpose (a LoRA adapter adds weights, QLoRA
# quantises them, another model is another model). A differing init hash they explain is expected.
# precision, optimizer and stochastic_rounding are not here: the engine hashes the weights before it casts them to
# bf16 (bf16-pure) or converts their linears to float8 (fp8), and the optimizer never touches the initial weights,
# so such variants share the reference's init hash, and one that does not is NOT FAIR.
INIT_FIELDS = ("model", "task", "data", "label_column", "method", "lora_r", "lora_alpha", "lora_targets",
               "quant_bits")
# Config fields that change the examples of the optimizer steps on purpose. The engine's data hash covers
# the unpadded token ids of each step, so 8 x 1 and 2 x 4 hash alike; micro_batch_size and grad_accum_steps
# are here because their product, the examples per step, changes what a step holds.
DATA_FIELDS = ("model", "task", "data", "text_column", "label_column", "max_seq_len", "subset", "packing",
               "eval_fraction", "micro_batch_size", "grad_accum_steps", "max_steps", "epochs", "data_format",
               "columns", "chat_template")
# Fields that unpair the runs when they change the data order (TrainConfig.data_order_seed): data_seed, or seed
# while data_seed is blank. A seed changed with the data order held changes the initial weights only, on purpose
# (an A/A draw of the default noise band: the same batches, other initial weights).
UNPAIRING_FIELDS = ("seed", "data_seed")

# The fields a bad input can depend on: a DataError or ModelError of the first run is every variant's when no
# variant sets one of these (or the field the message starts with, "lora_targets: ...") differently.
INPUT_FIELDS = {
    DataError: ("model", "task", "data", "text_column", "label_column", "image_column", "max_seq_len", "subset",
                "packing", "eval_fraction", "seed", "data_seed", "data_format", "columns", "chat_template", "train_on"),
    ModelError: ("model", "task", "data", "label_column", "method", "quant_bits", "lora_targets"),
}
# What a message's first word names when it is not a field: a batch is cut by the micro batch size.
_TOPIC_FIELDS = {"collate": ("micro_batch_size", "grad_accum_steps")}


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


# ---------------------------------------------------------------------------------------------------------------
# compare()
# ---------------------------------------------------------------------------------------------------------------
def compare(cfg: TrainConfig, precisions: Sequence[str] = ("fp32", "fp16", "bf16"),
            subset: Optional[int] = None, max_steps: Optional[int] = None,
            variants: Optional[Mapping[str, Mapping[str, Any]]] = None,
            repeats: int = 1, callbacks=None, warmup: bool = True, stop=None,
            reference: Optional[str] = None, seeds: Sequence[int] = (), aa: bool = False,
            progress: Optional[Callable[[dict], None]] = None, band: str = "init",
            rounding: float = _verdicts.ROUNDING_SCALE) -> ComparisonResult:
    """Train ``cfg`` once per variant in this process and return a side-by-side ComparisonResult.

    Without ``variants`` there is one variant per name in ``precisions``. ``variants`` maps a name to
    config overrides (``{"micro2x4": dict(micro_batch_size=2, grad_accum_steps=4)}``); ``precisions`` is
    then ignored. ``subset``/``max_steps`` override cfg's when given. ``reference`` (a variant name; the
    first variant by default) is what speed-ups and loss differences are relative to. A variant that is
    invalid here or fails becomes a row with the reason; the others still run; a bad input that every variant
    shares (data or a model that does not load, set alike in all of them) is raised once, before any training.
    ``repeats`` > 1 runs every variant again, each repeat in the order of the one before rotated by one (A B C,
    B C A, C A B: every variant takes every position in turn; ``run_order`` and the table's ``order`` column
    say which), and reports the median throughput and wall time, and each speed-up as the median of the
    per-repeat ratios with their spread; the curves, callbacks and kept results are the first repeat's. A speed
    difference counts only outside the noise floor: the reference's own range over 3 or more repeats, or, with
    ``aa=True``, how far an unrecorded identical copy of the reference, run in every repeat inside the rotation,
    differs from it (``aa_timings``).
    ``seeds`` (e.g. ``(0, 1, 2)``) runs the reference again, after the variants, once per seed other than its
    own (no callbacks, no outputs): the spread of those reruns' loss around the reference's is the noise a
    variant's difference is judged against (``band``, ``verdicts``: its mean difference against a 95% prediction
    interval of theirs, a 5% false-call rate). ``band`` says what the reruns vary: "init" (the default) their
    initial weights only (``seed``; the same batches and eval set, as the variants share them), "data" their batch
    order and eval split only (``data_seed``: "does this matter more than the data order does?"), "rounding" none
    of that but each initial weight moved by a relative ±``rounding`` drawn per seed (default 2^-8, bf16's unit
    roundoff: "did this change the learning more than rounding that size would?"). The reruns are in
    ``seed_results`` with their wall times. ``callbacks``
    (e.g. one LiveDashboard) see every variant's recorded run; records carry ``.variant``. ``warmup`` keeps
    cold and drawn steps out of the speed: each timed run's first step (what a process or a precision does once:
    lazy imports, allocator set-up, first kernels) is not in its tokens/s, and with ``repeats`` >= 2 the recorded
    run, drawn live by the callbacks, is a pass of its own before the timed repeats and is not timed (a live
    figure slows the steps it draws); with one repeat the recorded run is the timing. ``warmup=False`` times
    every step of every run, the recorded run as repeat 1. On a GPU the
    models kept in ``results`` are moved to the CPU between variants, so that they do not count in the
    next variant's peak memory. ``stop`` (a ``threading.Event``, set from any thread) ends the comparison:
    the running variant stops after its current step, the later ones never start. An interrupt (Ctrl-C)
    does the same. ``ComparisonResult.completion`` then says which variants finished, were cut or did not run.
    transformers' load report of a checkpoint (its newly initialised head) is shown once per comparison.
    ``progress`` (a function of one dict) hears every run's phase as it comes, the runs no callback sees included
    (later repeats, seed runs): ``{"phase": "live" | "run" | "seed", "variant", "k", "n", "repeat", "repeats",
    "event": "load" | "start" | "step", ...}`` ("live": the recorded pass before timed repeats; "load": before its
    data and model load; "start" adds ``total`` and ``eval_examples``; "step" adds ``step``, ``total``,
    ``step_time_s``). A recorded run tells "load" only: its callbacks see the rest.
    """
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"compare() takes a TrainConfig, got {type(cfg).__name__}")
    if int(repeats) < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats!r}")
    repeats = int(repeats)
    seeds = _seed_list(seeds)
    if band not in _verdicts.NULLS:
        raise ValueError(f"band: one of {list(_verdicts.NULLS)}, got {band!r}")
    if not (isinstance(rounding, (int, float)) and not isinstance(rounding, bool) and 0 < rounding < 1):
        raise ValueError(f"rounding: a relative perturbation in (0, 1), e.g. 2**-8 (bf16's unit roundoff), "
                         f"got {rounding!r}")
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
        _configure(o, base)
    runnable = [o for o in outcomes if o.config is not None]
    schedule = _Schedule()
    copy = _aa_copy(next(o for o in outcomes if o.name == wanted), names, schedule) if aa else None
    if copy is not None and repeats < 2:
        schedule.aa_notes.append("not run: it needs repeats >= 2")
        copy, schedule.aa_name = None, None

    with _load_reports_once(), _older_objects_frozen():
        # "stopped" or "interrupted" once the user ends the whole comparison; later variants then never start.
        # With repeats, the recorded runs (drawn live) go first, untimed; the timed repeats find every variant warm.
        live = warmup and repeats > 1
        halted = _run_live(runnable, callbacks, stop, repeats, progress) if live else None
        halted = _run_repeats(runnable, copy, wanted, repeats, callbacks, stop, halted, schedule,
                              recorded_first=not live, skip_first_step=warmup, progress=progress)
        # A stop or a kernel interrupt ends the whole comparison: the user asked for it to end, not one variant.
        for o in outcomes:
            if halted and o.result is None and o.status == "not_run":
                o.notes.append(f"not run: the comparison was {halted}")

        # The reference asked for, unless it has no run to compare with: then the first variant that ran.
        ran = [o.name for o in outcomes if o.result is not None]
        reference = wanted if wanted in ran or not ran else ran[0]
        ref_o = next(o for o in outcomes if o.name == reference)
        if copy is not None:
            schedule.aa_timings = [t for t, _ in copy.timings] if reference == wanted else []
            schedule.aa_notes += copy.notes
        seed_runs = _SeedRuns(requested=seeds, null=band, scale=float(rounding) if band == "rounding" else None)
        if seeds and ref_o.result is not None:
            halted = _run_seeds(ref_o, seeds, seed_runs, stop, halted, progress)
    warns = _check_fairness(outcomes, reference)
    for w in warns:
        warnings.warn(w, ComparisonWarning, stacklevel=2)
    return ComparisonResult(outcomes, base, reference, warns, repeats, stopped=halted,
                            requested_reference=wanted, seed_runs=seed_runs, schedule=schedule)


def _configure(o: _Outcome, base: TrainConfig) -> None:
    """``o.config``: the base with the variant's overrides, or status "unsupported" and the reason; and
    ``o.estimate``, the memory estimate of that config (also of one this device cannot run)."""
    try:
        run_cfg = base.replace(**o.overrides)
    except ConfigError as e:
        o.status = "unsupported"
        o.notes.append(_config_reason(e))
        return
    o.estimate = _estimate(run_cfg)
    try:
        check_runnable(run_cfg)   # a precision, method or optimizer this device cannot run is a row, not a failure
    except ConfigError as e:
        o.status = "unsupported"
        o.notes.append(_config_reason(e))
        return
    o.config = run_cfg
    if base.output_dir:  # one folder per variant, or they would overwrite each other's outputs
        o.config = run_cfg.replace(output_dir=str(Path(base.output_dir) / _slug(o.name)))


def _estimate(cfg: TrainConfig):
    """The memory estimate of ``cfg`` by tensor class (weights, master weights, gradients, optimizer state,
    activations, logits), from its model config alone; None when there is none (a model whose config cannot be
    read here, a model kind the estimator does not know): the run then says what is wrong, not the estimate."""
    try:
        from ..memory import estimate_memory

        return estimate_memory(cfg)
    except Exception:  # noqa: BLE001 - an estimate is a column of the table, never a reason for a run to fail
        return None


def _aa_copy(ref: _Outcome, names: list[str], schedule: _Schedule) -> Optional[_Outcome]:
    """The reference's A/A copy: its config, unrecorded (no callbacks, outputs or tracker); not a variant."""
    name = f"{ref.name} (A/A)"
    while name in names:
        name += "'"
    schedule.aa_name = name
    if ref.config is None:
        schedule.aa_notes.append(f"not run: the reference {ref.name!r} cannot run here")
        return None
    return _Outcome(name, dict(ref.overrides), dict(ref.settings), config=_unrecorded(ref.config))


def _rotated(slots: list, r: int) -> list:
    """Repeat ``r``'s order: ``slots`` rotated left by ``r`` (a Latin square over len(slots) repeats)."""
    k = r % len(slots) if slots else 0
    return slots[k:] + slots[:k]


def _run_repeats(runnable: list[_Outcome], copy: Optional[_Outcome], reference: str, repeats: int, callbacks,
                 stop, halted: Optional[str], schedule: _Schedule, recorded_first: bool, skip_first_step: bool,
                 progress=None) -> Optional[str]:
    """Every timed repeat of every variant (and the A/A ``copy``), repeat r in the order rotated by r; returns
    ``halted``. With ``recorded_first`` repeat 0 is also the recorded one (callbacks, the init hash, the kept
    result), and the first run's bad input is raised when every variant shares it."""
    ref = next((o for o in runnable if o.name == reference), None)
    slots = runnable + ([copy] if copy is not None else [])
    for r in range(repeats):
        started = []
        for k, o in enumerate(_rotated(slots, r), 1):
            halted = halted or _stop_requested(stop)
            if halted or o.status in ("error", "out_of_memory"):
                continue
            if o is copy and (ref is None or ref.status in ("error", "out_of_memory")):
                continue   # a copy of a reference that fails measures nothing
            started.append(o.name)
            shared = runnable if recorded_first and r == 0 and len(started) == 1 else None
            phase = dict(phase="run", variant=o.name, k=k, n=len(slots), repeat=r + 1, repeats=repeats)
            halted = _run_once(o, recorded=(recorded_first and r == 0 and o is not copy), callbacks=callbacks,
                               stop=stop, halted=halted, shared_with=shared, progress=_Phases(progress, phase),
                               timed=True, skip_first_step=skip_first_step,
                               timing=f"repeat {r + 1} of {repeats}" + (", timed from step 2" if skip_first_step else ""))
        if started:
            schedule.run_order.append(started)
    return halted


def _run_live(runnable: list[_Outcome], callbacks, stop, repeats: int, progress=None) -> Optional[str]:
    """The recorded run of every variant, in the given order, before the timed repeats: drawn by the callbacks,
    kept as the result, not timed. The first run's bad input is raised when every variant shares it."""
    halted = None
    for k, o in enumerate(runnable, 1):
        halted = halted or _stop_requested(stop)
        if halted:
            break
        phase = dict(phase="live", variant=o.name, k=k, n=len(runnable))
        halted = _run_once(o, recorded=True, callbacks=callbacks, stop=stop, halted=halted,
                           shared_with=runnable if k == 1 else None, progress=_Phases(progress, phase), timed=False,
                           timing=f"drawn live, untimed: the speed is from {repeats} timed repeats")
    return halted


def _run_once(o: _Outcome, recorded: bool, callbacks, stop, halted: Optional[str],
              shared_with: Optional[list[_Outcome]] = None, progress: Optional["_Phases"] = None,
              timed: bool = True, skip_first_step: bool = False, timing: Optional[str] = None) -> Optional[str]:
    """One run of ``o`` (``recorded``: with the callbacks, its result kept); when ``timed`` its timing goes to
    ``o.timings`` (without its first step when ``skip_first_step``). Returns ``halted``."""
    run_cfg = o.config if recorded else _unrecorded(o.config)
    progress = progress or _Phases(None, {})
    progress.tell("load")
    try:
        result = _run_variant(o, run_cfg, callbacks if recorded else progress.callbacks(), first=recorded, stop=stop,
                              shared_with=shared_with, timing=timing)
    except KeyboardInterrupt:  # before the loop's own handler is in place (data, model building)
        result, halted = None, "interrupted"
        if recorded:
            o.status = "interrupted"
        o.notes.append("interrupted before its first step")
    if result is not None:
        reason = result.summary["stopped_reason"]
        if reason == "interrupted":
            halted = "interrupted"
        halted = halted or _stop_requested(stop)
        # A later repeat cut short by the user would drag the median down: only whole repeats count.
        if timed and (recorded or not (halted and reason in _CUT)):
            o.timings.append((_tokens_per_s(result, skip_first_step), float(result.summary["wall_s"])))
        if recorded:
            o.result = result
            o.status = reason
            note = _park_model(result)
            if note:
                o.notes.append(note)
    del result
    _release_memory()
    return halted


def _run_variant(o: _Outcome, cfg: TrainConfig, callbacks, first: bool, stop=None,
                 shared_with: Optional[list[_Outcome]] = None, timing: Optional[str] = None):
    """One run of one variant; an exception becomes the variant's status and note, never the caller's, unless
    it is a bad input that every variant of ``shared_with`` shares."""
    try:
        return _loop._run(cfg, callbacks, stop_event=_RunStop(stop), variant=o.name, hash_init=first, timing=timing)
    except Exception as e:  # noqa: BLE001 - any failure of one variant must leave the others running
        shared = _shared_input_error(e, o.config, shared_with) if shared_with else None
        if shared is not None:
            raise shared from e
        oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
        o.status = "out_of_memory" if oom else "error"
        o.notes.append(f"{'out of memory' if oom else 'failed'}: {type(e).__name__}: {_first_line(e)}")
        # Keep text, not the exception: its traceback holds the frames, and so the model, in memory.
        o.error = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return None


def _tokens_per_s(result, skip_first_step: bool) -> float:
    """A timed run's speed: its steps' tokens over their step times, without the first step when
    ``skip_first_step`` and there are others (the first meets what a process or a precision does once: lazy
    imports, allocator set-up, first kernels); the run's own tokens/s when it has no step records."""
    records = list(getattr(result, "records", None) or [])
    if skip_first_step and len(records) > 1:
        records = records[1:]
    steps = [(r.tokens_per_s * r.step_time_s, r.step_time_s) for r in records
             if r.step_time_s and math.isfinite(r.step_time_s) and math.isfinite(r.tokens_per_s)]
    seconds = sum(t for _, t in steps)
    if not steps or seconds <= 0:
        return float(result.summary["tokens_per_s"])
    return sum(n for n, _ in steps) / seconds


class _Phases:
    """What one run tells ``compare(progress=...)``: "load" before it, and for a run that no callback sees (a later
    repeat, a seed run) its start and steps, through the callback ``callbacks()`` gives."""

    def __init__(self, progress: Optional[Callable[[dict], None]], phase: dict):
        self.progress, self.phase = progress, phase
        self.total = None

    def tell(self, event: str, **more) -> None:
        if self.progress is not None:
            self.progress({**self.phase, "event": event, **more})

    def callbacks(self) -> Optional[list]:
        return [self] if self.progress is not None else None

    def on_run_start(self, info) -> None:
        self.total = info.total_steps
        self.tell("start", total=info.total_steps, eval_examples=info.eval_examples)

    def on_step_end(self, record) -> None:
        self.tell("step", step=record.step, total=self.total, step_time_s=record.step_time_s)


def _shared_input_error(e: Exception, failed: TrainConfig, runnable: list[_Outcome]) -> Optional[Exception]:
    """``e`` as the error of the whole comparison when it is a bad input (DataError, ModelError) and no runnable
    variant sets the fields it can depend on differently from ``failed``'s; else None (a row's failure)."""
    kind = next((k for k in INPUT_FIELDS if isinstance(e, k)), None)
    if kind is None:
        return None
    fields = list(INPUT_FIELDS[kind])
    head = re.match(r"[A-Za-z_]\w*", str(e))
    if head:   # "lora_targets: ...", "gradient_checkpointing: ...", "collate: ..."
        word = head.group()
        fields += [word] if word in TrainConfig.model_fields else list(_TOPIC_FIELDS.get(word, ()))
    if any(getattr(o.config, f) != getattr(failed, f) for o in runnable for f in fields):
        return None
    others = len(runnable) - 1
    # The field stays first ("data: ..."): the Panel marks the field an error starts with.
    message = (f"{e} [every variant of this comparison shares this input"
               + (f" (the {others} other{'s' if others > 1 else ''} set it alike)" if others else "")
               + ", so none was trained]")
    try:
        return type(e)(message)
    except Exception:  # noqa: BLE001 - an error type with arguments of its own: raised as it is, once
        return e


class _RepeatedLoadReport(logging.Filter):
    """Drops a transformers "LOAD REPORT" (the keys a checkpoint lacked, e.g. a new classifier head) that this
    comparison has already shown, word for word; another thread's records and any other line pass."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()
        self.shown: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread:
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is not ours to hide
            return True
        if "LOAD REPORT" not in text:
            return True
        if text in self.shown:
            return False
        self.shown.add(text)
        return True


# transformers 5 logs the report from modeling_utils (loading_report's own logger when none is passed)
_LOAD_REPORT_LOGGERS = ("transformers.modeling_utils", "transformers.utils.loading_report")


@contextlib.contextmanager
def _load_reports_once():
    """While a comparison runs: each distinct load report once (the first run's), not once per run."""
    once = _RepeatedLoadReport()
    loggers = [logging.getLogger(name) for name in _LOAD_REPORT_LOGGERS]
    for log in loggers:
        log.addFilter(once)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(once)


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
    """``cfg`` for a run that is not one of the comparison's results (a timed repeat, a seed run): it writes
    no outputs, reports to no tracker (a tracker holds one run per variant) and answers no sample prompts (no one
    reads them; the recorded run's are the variant's)."""
    return cfg.replace(output_dir=None, report_to=[], sample_prompts=[], **changes)


def _seed_config(cfg: TrainConfig, seed: int, null: str = "init") -> TrainConfig:
    """The reference's config for its rerun under ``seed``: other initial weights on the same data order ("init"),
    another data order on the same initial weights ("data"), or the same config ("rounding": the rerun perturbs its
    initial weights instead)."""
    if null == "init":
        return _unrecorded(cfg, seed=seed, data_seed=cfg.data_order_seed)
    if null == "data":
        return _unrecorded(cfg, data_seed=seed)
    return _unrecorded(cfg)


def _run_seeds(ref: _Outcome, seeds: tuple[int, ...], runs: _SeedRuns, stop,
               halted: Optional[str], progress=None) -> Optional[str]:
    """Run ``ref``'s config under each seed of ``seeds`` but its own, into ``runs``; returns ``halted``."""
    runs.reference_seed = ref.config.data_order_seed if runs.null == "data" else ref.config.seed
    others = [s for s in seeds if s != runs.reference_seed]
    for k, seed in enumerate(others, 1):
        halted = halted or _stop_requested(stop)
        if halted:
            runs.notes.append(f"seed {seed}: not run, the comparison was {halted}")
            continue
        phases = _Phases(progress, dict(phase="seed", variant=ref.name, seed=seed, k=k, n=len(others)))
        phases.tell("load")
        try:
            res = _loop._run(_seed_config(ref.config, seed, runs.null), phases.callbacks(), stop_event=_RunStop(stop),
                             variant=f"{ref.name} (seed {seed})", hash_init=True,
                             perturb_init=(runs.scale, seed) if runs.null == "rounding" else None)
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




def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


@contextlib.contextmanager
def _older_objects_frozen():
    """While the comparison runs, what the process held before it (its imports, the notebook's objects: often half a
    million) sits in the collector's permanent generation, so the full collection after each run walks only what
    the comparison made: the runs' own garbage is freed as before, in milliseconds instead of 0.2-0.5 s per run.
    Nothing is frozen when something else already froze objects (``gc.freeze`` is one global state); at the end
    it is as before, and a collection the process owes then runs as usual."""
    mine = gc.get_freeze_count() == 0
    if mine:
        gc.freeze()
    try:
        yield
    finally:
        if mine:
            gc.unfreeze()


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


def _unpairing(ref: TrainConfig, other: TrainConfig) -> list[str]:
    """The field that changes ``other``'s data order from ``ref``'s ([] when the order is the same)."""
    if ref.data_order_seed == other.data_order_seed:
        return []
    return ["data_seed" if ref.data_seed != other.data_seed else "seed"]


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
        unpaired = _unpairing(ref.config, o.config)
        problems = []
        for what, key, by_design in (("initial weights", "init_hash", INIT_FIELDS + ("seed",)),
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
