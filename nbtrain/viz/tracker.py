"""The dashboard's state: records in, what to draw and when out. No display, no widgets.

A :class:`Tracker` keeps the records per run (one run per variant), decides whether a redraw is due
(at most ``max_per_s`` a second, never more than ~2% of wall time, never faster than ``min_interval``),
and turns its runs into trace specs, saying whether the figure's structure changed since the last draw.
Every method is safe to call from the training thread while another thread reads.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from . import figures
from .figures import _BOOL_COLS, _FLOAT_COLS, Columns, _num
from .text import RATE_WINDOW, status_line, summary_text

COST_FACTOR = 50.0   # a redraw may take at most ~1/COST_FACTOR of wall time (2% overhead)


class RunTrack:
    """Records of one run (one variant), as records and as growing columns."""

    def __init__(self, name: str, info: Any, variant: Optional[str] = None):
        self.name = name
        self.info = info
        self.variant = variant
        self.records: list = []
        self.evals: list = []
        self.cols: dict[str, list] = {c: [] for c in _FLOAT_COLS + _BOOL_COLS}
        self.done = False
        self.result = None

    def add(self, rec) -> None:
        self.records.append(rec)
        for c, lst in self.cols.items():
            lst.append(getattr(rec, c, None))

    def snapshot(self) -> tuple:
        """``(columns, eval columns, info)``, the form :func:`~nbtrain.viz.figures.runs_figure` takes."""
        cols = Columns()
        for c in _FLOAT_COLS:
            cols[c] = np.array(self.cols[c], dtype=np.float64)  # None -> nan
        for c in _BOOL_COLS:
            cols[c] = np.array([bool(v) for v in self.cols[c]], dtype=bool)
        # from the raw values: None (objective="lm") and a NaN reward are both NaN in the float column
        cols["rewarded"] = figures.rewarded(self.cols["reward_margin"], cols["nonfinite"])
        evals = {"step": np.array([e.step for e in self.evals], dtype=np.float64),
                 "eval_loss": np.array([_num(e.eval_loss) for e in self.evals], dtype=np.float64)}
        return cols, evals, self.info

    def summary(self) -> str:
        return summary_text(self.records, self.evals, self.info, self.result, self.name)


class Tracker:
    """Runs and their records, the redraw throttle, and the traces to draw."""

    def __init__(self, max_per_s: float = 5, *, min_interval: float = 0.0, total_steps: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic):
        if max_per_s <= 0:
            raise ValueError(f"max_redraws_per_s must be > 0, got {max_per_s!r}")
        self.max_per_s = float(max_per_s)
        self.min_interval = float(min_interval)
        self.total_steps = total_steps
        self.clock = clock
        self.runs: dict[str, RunTrack] = {}
        self.current: Optional[RunTrack] = None
        self.next_draw = 0.0
        self._signature: Optional[tuple] = None
        self._lock = threading.RLock()

    # -- records in -------------------------------------------------------------------------
    def start(self, info: Any) -> RunTrack:
        """A new run (a new colour when others are already drawn); the next redraw is due at once."""
        with self._lock:
            run = self._new_run(info, getattr(info, "variant", None))
        self.next_draw = 0.0
        return run

    def add(self, record: Any) -> RunTrack:
        with self._lock:
            run = self._run_for(getattr(record, "variant", None))
            run.add(record)
            if len(run.records) == 1:
                # A run's first point is drawn at once: the throttle would hold it back behind the redraw
                # that the run's start made, and a slow first step then leaves an empty figure for seconds.
                self.next_draw = 0.0
            return run

    def add_eval(self, record: Any) -> RunTrack:
        with self._lock:
            run = self._run_for(getattr(record, "variant", None))
            run.evals.append(record)
            return run

    def end(self, result: Any) -> Optional[RunTrack]:
        with self._lock:
            run = self.current
            if run is not None:
                run.done = True
                run.result = result
            return run

    def _new_run(self, info: Any, variant: Optional[str]) -> RunTrack:
        base = str(variant) if variant else "run"
        name, k = base, 2
        while name in self.runs:
            name, k = f"{base} {k}", k + 1
        run = RunTrack(name, info, variant)
        self.runs[name] = run
        self.current = run
        return run

    def _run_for(self, variant: Optional[str]) -> RunTrack:
        cur = self.current
        if cur is not None and (variant is None or cur.variant == variant):
            return cur
        for run in reversed(list(self.runs.values())):
            if run.variant == variant:
                return run
        return self._new_run(None, variant)

    # -- state out --------------------------------------------------------------------------
    @property
    def records(self) -> list:
        with self._lock:
            return [r for run in self.runs.values() for r in run.records]

    @property
    def eval_records(self) -> list:
        with self._lock:
            return [r for run in self.runs.values() for r in run.evals]

    def infos(self) -> dict:
        with self._lock:
            return {k: r.info for k, r in self.runs.items()}

    def snapshot(self) -> dict:
        """Run name -> ``(columns, eval columns, info)``, copied under the lock."""
        with self._lock:
            return {name: run.snapshot() for name, run in self.runs.items()}

    def status(self) -> str:
        """The status line of the current run ("" before any)."""
        run = self.current
        if run is None:
            return ""
        with self._lock:
            recs = list(run.records[-RATE_WINDOW:])
        return status_line(recs, run.info, self.total_steps, run.name)

    def summaries(self) -> list[tuple[str, Any]]:
        """``(summary line, result)`` of every run, in order."""
        with self._lock:
            return [(run.summary(), run.result) for run in self.runs.values()]

    # -- when and what to draw ----------------------------------------------------------------
    def due(self) -> bool:
        return self.clock() >= self.next_draw

    def drawn(self, cost_s: float) -> None:
        """A redraw that took ``cost_s`` happened: the next one waits long enough to keep the overhead small."""
        interval = max(1.0 / self.max_per_s, cost_s * COST_FACTOR, self.min_interval)
        self.next_draw = self.clock() + interval

    def plan(self, snap: dict, smoothing: float) -> tuple[list[dict], bool]:
        """The trace specs of ``snap`` and whether the figure must be rebuilt (a run started, the memory
        kind or the scaler became known) rather than its traces' data replaced."""
        overlay = len(snap) > 1
        specs: list[dict] = []
        palette = figures._PALETTE
        for k, (name, (cols, evals, info)) in enumerate(snap.items()):
            specs += figures.trace_specs(cols, evals, info, name=name, color=palette[k % len(palette)],
                                         overlay=overlay, smoothing=smoothing)
        sig = tuple((s["meta"]["run"], s["meta"]["panel"], s["meta"]["kind"]) for s in specs) + (
            tuple(figures._scaler_used(c, i) for c, _, i in snap.values()),
            tuple(figures._uses_vram(c, i) for c, _, i in snap.values()))
        rebuild = sig != self._signature
        self._signature = sig
        return specs, rebuild
