"""A/B answers with their noise: per-step differences to the reference, the seed-noise band, speed ratios with
their spread, and one verdict line per variant.

Pure functions of histories and timings (no runs, no drawing), so that every number a verdict states can be
recomputed from the result object that holds them (``ComparisonResult.verdicts``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

# Differences are of losses of a few nats, computed in float64: a band edge is compared with this much slack
# so that a difference equal to a seed run's is "inside", not outside by a rounding error.
EDGE_TOL = 1e-9


def _series(history: Any, column: str = "loss") -> pd.Series:
    """``column`` of a history (a DataFrame, or a dict of columns, with a ``step`` column) indexed by step,
    as floats (None -> NaN)."""
    if history is None or column not in history or "step" not in history:
        return pd.Series([], dtype=float, name=column)
    values = pd.to_numeric(pd.Series(history[column], dtype=object), errors="coerce").to_numpy(dtype=float)
    steps = pd.Series(history["step"]).to_numpy(dtype=np.int64)
    s = pd.Series(values, index=pd.Index(steps, name="step"), name=column)
    return s[~s.index.duplicated(keep="last")]


def differences(histories: Mapping[str, Any], reference: str, column: str = "loss") -> pd.DataFrame:
    """Per step, each variant's ``column`` minus the reference's (a column per variant, the reference's all 0).

    Only steps the reference recorded appear; a variant without that step (it stopped earlier) has NaN there.
    Works for the eval history too (``column="eval_loss"`` or ``"eval_accuracy"``).
    """
    if reference not in histories:
        raise KeyError(f"reference: {reference!r} is not one of the runs {sorted(histories)}")
    ref = _series(histories[reference], column)
    out = {name: _series(h, column).reindex(ref.index) - ref for name, h in histories.items()}
    return pd.DataFrame(out, index=ref.index)


@dataclass
class SeedBand:
    """The seed-to-seed noise of the reference: ``runs`` holds, per extra seed, its loss minus the reference
    run's loss at each step; ``width`` is the band's half-width, the largest of their absolute values."""

    reference_seed: int
    seeds: tuple[int, ...]
    runs: pd.DataFrame            # index step, one column per extra seed
    width: pd.Series              # index step

    def contains(self, diff: pd.Series) -> pd.Series:
        """Per common step, whether ``diff`` lies inside the band (NaN steps count as inside)."""
        w = self.width.reindex(diff.index)
        return ~(diff.abs() > w + EDGE_TOL)


def seed_band(reference_history: Any, seed_histories: Mapping[int, Any], reference_seed: int,
              column: str = "loss") -> Optional[SeedBand]:
    """The band of ``column`` differences between the reference run and the same variant under other seeds
    (other initial weights and data order), on the steps all of them recorded; None without extra seeds."""
    if not seed_histories:
        return None
    ref = _series(reference_history, column)
    runs = pd.DataFrame({int(s): _series(h, column).reindex(ref.index) - ref for s, h in seed_histories.items()},
                        index=ref.index).dropna()
    return SeedBand(int(reference_seed), tuple(int(s) for s in seed_histories), runs,
                    runs.abs().max(axis=1).rename("width"))


def leaves_band(diff: pd.Series, band: SeedBand) -> Optional[int]:
    """The first step at which ``diff`` is outside the band (|diff| > width), or None if it never is."""
    w = band.width
    d = diff.reindex(w.index)
    out = d.abs() > w + EDGE_TOL
    steps = out[out.fillna(False)].index
    return int(steps[0]) if len(steps) else None


# Fewer repeats than this never rank two variants, however their timings fall.
MIN_RANKED_REPEATS = 3
# The smallest speed difference ever reported (3%), however quiet the machine looked: below it, what two
# identical runs differ by (allocator state, caches, the process's growth) is of the same size.
MIN_EFFECT = 0.03


def _finite(values: Sequence[Optional[float]]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]


# A ratio of two runs carries the noise of both: sqrt(2) times one run's spread.
RATIO_NOISE = math.sqrt(2)


def run_spread(timings: Sequence[float]) -> float:
    """One run's repeat-to-repeat noise: the range of ``timings`` relative to their median (NaN with fewer
    than MIN_RANKED_REPEATS finite ones)."""
    t = _finite(timings)
    return (max(t) - min(t)) / statistics.median(t) if len(t) >= MIN_RANKED_REPEATS else math.nan


def noise_floor(reference_timings: Sequence[float], aa_timings: Sequence[float] = ()) -> float:
    """How far (relative, 0.04 = ±4%) the throughputs of two identical runs differ on this machine; NaN when
    unknown.

    With ``aa_timings`` (an unrecorded copy of the reference, timed in every repeat beside it) the floor is the
    largest |copy / reference - 1| over the repeats, a ratio measured as such; else, with at least
    MIN_RANKED_REPEATS repeats, RATIO_NOISE times the reference's own range over its repeats relative to its
    median (a ratio of two runs varies by both). Never below MIN_EFFECT."""
    pairs = [(a, b) for a, b in zip(aa_timings, reference_timings)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    if pairs:
        floor = max(max(a / b, b / a) - 1 for a, b in pairs)
    else:
        floor = RATIO_NOISE * run_spread(reference_timings)
        if math.isnan(floor):
            return math.nan
    return max(MIN_EFFECT, floor)


@dataclass
class Speed:
    """Throughput of a variant relative to the reference: the median of the paired per-repeat ratios and
    their range. ``n`` repeats; with one the spread is unknown (``low``/``high`` equal the ratio). ``floor`` is
    the noise floor it is judged against (``noise_floor``; NaN when unknown)."""

    ratio: float
    low: float
    high: float
    n: int
    floor: float = math.nan

    @property
    def spread(self) -> float:
        """Half the range of the per-repeat ratios (NaN with one repeat)."""
        return (self.high - self.low) / 2 if self.n > 1 else math.nan

    @property
    def measurable(self) -> bool:
        """True when at least MIN_RANKED_REPEATS repeats all order the two the same way (the whole range is
        above or below 1) and the median ratio is further from 1 than the noise floor (and MIN_EFFECT), in
        either direction (1.05x faster and 1.05x slower alike)."""
        if self.n < MIN_RANKED_REPEATS or not (self.low > 1.0 or self.high < 1.0):
            return False
        floor = self.floor if math.isfinite(self.floor) else MIN_EFFECT
        return max(self.ratio, 1 / self.ratio) - 1 > max(floor, MIN_EFFECT)


def speed(timings: Sequence[float], reference_timings: Sequence[float],
          floor: Optional[float] = None) -> Optional[Speed]:
    """Tokens/s of a variant over the reference's, paired by repeat (repeat r of each ran in the same round,
    under the same machine conditions); None when either has no finite timing. ``floor`` defaults to
    ``noise_floor(reference_timings)``; the variant's own spread (``RATIO_NOISE * run_spread(timings)``) raises
    it where that is wider."""
    pairs = [(a, b) for a, b in zip(timings, reference_timings)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and b > 0]
    if not pairs:
        return None
    ratios = [a / b for a, b in pairs]
    if floor is None:
        floor = noise_floor(reference_timings)
    own = RATIO_NOISE * run_spread(timings)
    if math.isfinite(floor) and math.isfinite(own):
        # The variant's own repeats are a second look at the machine's noise: three timings of the reference
        # alone sometimes fall close together by chance (a floor at the 3% minimum, A/A ratios of 0.966).
        floor = max(floor, own)
    return Speed(statistics.median(ratios), min(ratios), max(ratios), len(ratios), float(floor))


@dataclass
class Verdict:
    """One variant's answer, every number taken from the comparison's own records."""

    variant: str
    reference: str
    is_reference: bool = False
    ran: bool = True
    speed: Optional[Speed] = None
    max_abs_diff: float = math.nan          # max |loss - reference loss| over the common steps
    within_noise: Optional[bool] = None     # None without a seed band
    leaves_band_at: Optional[int] = None    # first step outside the band
    direction: Optional[str] = None         # "lower" | "higher": the loss's side of the band at that step
    skipped_steps: int = 0
    nonfinite_steps: int = 0
    scale_first: Optional[float] = None
    scale_last: Optional[float] = None
    scale_min: Optional[float] = None
    eval_diff: Optional[tuple[str, float]] = None   # ("eval_loss" | "eval_accuracy", variant - reference)
    stopped_reason: Optional[str] = None
    lost_updates: Optional[float] = None    # share of the sampled weight updates the weights' dtype lost
    lost_updates_text: Optional[str] = None  # the sentence about them (engine.doctor.lost_updates_line), if reported
    seed_wall_s: dict[int, float] = field(default_factory=dict)   # the reference's: what its seed runs took
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        """The verdict line, e.g. "bf16: 1.6x faster (±0.1), loss within seed noise at every step, 0 skipped"."""
        return f"{self.variant}: " + ", ".join(self.parts)

    def __str__(self) -> str:
        return self.text


def _int_or_zero(v: Any) -> int:
    try:
        return 0 if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
    except (TypeError, ValueError):
        return 0


def _scale_text(v: float) -> str:
    return f"{v:,.0f}" if v >= 1 else f"{v:.3g}"


def _speed_text(s: Optional[Speed], reference: str) -> str:
    if s is None:
        return "speed not measured"
    if s.n == 1:
        return f"{s.ratio:.2f}x the speed of {reference} (one timing, spread unknown: use repeats=3)"
    if s.n < MIN_RANKED_REPEATS:
        return (f"{s.ratio:.2f}x the speed of {reference} (±{s.spread:.2f} over {s.n} timings: too few to rank, "
                f"use repeats={MIN_RANKED_REPEATS})")
    floor = s.floor if math.isfinite(s.floor) else MIN_EFFECT
    if not s.measurable:
        return f"no measurable speed difference ({s.ratio:.2f}x, within ±{floor:.2f} noise)"
    # measurable means at least MIN_EFFECT away from 1, so two decimals never read "1.00x faster"
    if s.ratio >= 1:
        return f"{s.ratio:.2f}x faster (±{s.spread:.2f}, noise ±{floor:.2f})"
    return f"{1 / s.ratio:.2f}x slower (±{s.spread / s.ratio ** 2:.2f}, noise ±{floor:.2f})"


# Which way an eval difference (variant - reference) is better: accuracy up, loss down.
_EVAL_BETTER = {"eval_accuracy": 1.0, "eval_loss": -1.0}


def _eval_text(column: str, diff: float, reference: str) -> str:
    word = ("same" if diff == 0 else "better" if diff * _EVAL_BETTER[column] > 0 else "worse")
    return f"{column.replace('_', ' ')} {diff:+.3g} ({word}) vs {reference}"


def verdict(name: str, reference: str, history: Any, reference_history: Any, summary: Mapping[str, Any],
            *, timings: Sequence[float] = (), reference_timings: Sequence[float] = (),
            band: Optional[SeedBand] = None, eval_history: Any = None,
            reference_eval_history: Any = None, scaler: Optional[bool] = None,
            initial_scale: Optional[float] = None, seed_wall_s: Optional[Mapping[int, float]] = None,
            aa_timings: Sequence[float] = (), lost_updates_text: Optional[str] = None) -> Verdict:
    """The verdict of one variant that ran, against the reference run (and the seed band when given).

    ``initial_scale`` is the loss scale before the first step (the history holds each step's scale after its
    update); ``seed_wall_s`` (seed -> seconds) is what the reference's seed runs cost, stated in its verdict;
    ``aa_timings`` (an identical copy of the reference timed in each repeat) sets the speed's noise floor.
    ``lost_updates_text`` (engine.doctor.lost_updates_line of the run, None when too few updates were lost to
    report) is said after the loss: it is why a loss of bf16-pure weights can stand still.
    """
    v = Verdict(name, reference, is_reference=(name == reference))
    v.stopped_reason = summary.get("stopped_reason")
    v.skipped_steps = _int_or_zero(summary.get("skipped_steps"))
    v.nonfinite_steps = _int_or_zero(summary.get("nonfinite_steps"))
    lost = summary.get("lost_updates")
    v.lost_updates = float(lost) if lost is not None and math.isfinite(float(lost)) else None
    v.lost_updates_text = lost_updates_text or None
    scales = _series(history, "scale").dropna()
    if len(scales):
        v.scale_first, v.scale_last = float(scales.iloc[0]), float(scales.iloc[-1])
        v.scale_min = float(scales.min())
        if initial_scale is not None and math.isfinite(initial_scale):
            v.scale_first = float(initial_scale)
    if v.is_reference:
        v.seed_wall_s = {int(k): float(t) for k, t in (seed_wall_s or {}).items()}
        if band is not None and v.seed_wall_s:
            cost = sum(v.seed_wall_s.values())
            v.parts.append(f"the reference (seed noise from seed runs {', '.join(map(str, v.seed_wall_s))}: "
                           f"{cost:.1f} s)")
        else:
            v.parts.append("the reference" + (f" (seed noise from seeds {', '.join(map(str, band.seeds))})"
                                              if band is not None else ""))
    else:
        v.speed = speed(timings, reference_timings, noise_floor(reference_timings, aa_timings))
        v.parts.append(_speed_text(v.speed, reference))
        diff = differences({reference: reference_history, name: history}, reference)[name]
        finite = diff[np.isfinite(diff)]
        v.max_abs_diff = float(finite.abs().max()) if len(finite) else math.nan
        # Steps where both runs have a loss and the band a width: a run cut before them has nothing to judge.
        judged = diff.reindex(band.width.index).dropna() if band is not None else diff.iloc[:0]
        if band is not None and len(judged):
            v.leaves_band_at = leaves_band(diff, band)
            v.within_noise = v.leaves_band_at is None
            if v.within_noise:
                v.parts.append("loss within seed noise at every step")
            else:
                v.direction = "lower" if diff.loc[v.leaves_band_at] < 0 else "higher"
                text = f"loss {v.direction} than {reference} beyond seed noise from step {v.leaves_band_at}"
                # A run that leaves on one side and ends outside on the other says both.
                last = judged.index[-1]
                end = "lower" if judged.loc[last] < 0 else "higher"
                if end != v.direction and not band.contains(judged.loc[[last]]).iloc[0]:
                    text += f", {end} at its last step ({last})"
                v.parts.append(text)
        elif band is not None:
            v.parts.append("no step to hold against the seed noise band")
        elif math.isfinite(v.max_abs_diff):
            v.parts.append(f"loss differs from {reference} by at most {v.max_abs_diff:.2g} "
                           "(no seed band to judge it: seeds=(0, 1, 2))")
        for col in ("eval_accuracy", "eval_loss"):
            ev = differences({reference: reference_eval_history, name: eval_history}, reference, col)[name] \
                if eval_history is not None and reference_eval_history is not None else pd.Series([], dtype=float)
            ev = ev.dropna()
            if len(ev):
                v.eval_diff = (col, float(ev.iloc[-1]))
                v.parts.append(_eval_text(col, v.eval_diff[1], reference))
                break
    if v.lost_updates_text:
        v.parts.append(v.lost_updates_text)
    if scaler or v.scale_first is not None:
        drop = (f" (scale {_scale_text(v.scale_first)} → {_scale_text(v.scale_min)})"
                if v.scale_first is not None and v.scale_min is not None and v.scale_min < v.scale_first else "")
        v.parts.append(f"{v.skipped_steps} skipped step{'s' if v.skipped_steps != 1 else ''}{drop}")
    elif v.skipped_steps:
        v.parts.append(f"{v.skipped_steps} skipped step{'s' if v.skipped_steps != 1 else ''}")
    if v.nonfinite_steps and v.nonfinite_steps != v.skipped_steps:
        v.parts.append(f"{v.nonfinite_steps} non-finite step{'s' if v.nonfinite_steps != 1 else ''}")
    if v.stopped_reason not in (None, "max_steps", "epochs"):
        v.parts.append(f"ended: {v.stopped_reason}")
    return v


def not_run_verdict(name: str, reference: str, why: str) -> Verdict:
    """The verdict of a variant that did not run (unsupported here, failed, or cut before its first step)."""
    return Verdict(name, reference, ran=False, parts=[f"not run ({why})" if why else "not run"])
