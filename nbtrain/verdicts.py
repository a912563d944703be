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


# The nulls a variant's difference can be held against: what the reference's reruns vary (compare(band=...)).
#   init: other initial weights, the same batches and eval set (the default: what a paired difference leaves free)
#   data: other batch orders and eval splits, the same initial weights
#   rounding: the same initial weights perturbed by a relative ±scale (a format's unit roundoff), the same batches
NULLS = ("init", "data", "rounding")
NULL_NAMES = {"init": "init noise", "data": "data-order noise", "rounding": "rounding noise"}
# bf16's unit roundoff (2^-8): the rounding band's default scale, what rounding the initial weights to bf16 moves them
ROUNDING_SCALE = 2.0 ** -8
# The loss rule's false-call rate: a variant drawn as the band's runs are is called beyond noise in this share of
# comparisons (exact for normally distributed run means; measured by benchmarks/loss_rule.py, by simulation and
# on real A/A draws of tiny).
LOSS_ALPHA = 0.05
# Student's t, 97.5% quantile, by degrees of freedom (two-sided 5%); beyond 30, 1.96 + 2.4/df (within 0.002)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t 97.5% quantile for ``df`` >= 1 degrees of freedom."""
    if df < 1:
        return math.inf
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


def null_words(null: str, scale: Optional[float] = None) -> str:
    """What a band's reruns varied, in a course reader's words."""
    if null == "data":
        return "reruns with other batch orders and eval splits, the same initial weights"
    if null == "rounding":
        s = ROUNDING_SCALE if scale is None else scale
        return (f"reruns with each initial weight moved by up to ±{s:.2g} of itself (as rounding to a format of that "
                "unit roundoff would), the same batches")
    return "reruns with other initial weights, the same batches"


@dataclass
class SeedBand:
    """The noise of the reference's reruns: ``runs`` holds, per rerun (by its seed), its loss minus the reference
    run's loss at each step; ``width`` is the band's half-width, the largest of their absolute values (drawn, and
    where a run is described as outside it). ``null`` says what the reruns varied (NULLS); the verdict's rule
    (:func:`loss_test`) holds a variant's mean difference against the reruns' mean differences."""

    reference_seed: int
    seeds: tuple[int, ...]
    runs: pd.DataFrame            # index step, one column per extra seed
    width: pd.Series              # index step
    column: str = "loss"          # what it is the band of: "loss", "eval_loss" or "eval_accuracy"
    null: str = "init"            # what the reruns varied: "init", "data" or "rounding"
    scale: Optional[float] = None   # the rounding band's relative perturbation

    @property
    def name(self) -> str:
        """"init noise", "data-order noise" or "rounding noise"."""
        return NULL_NAMES.get(self.null, "seed noise")

    def contains(self, diff: pd.Series) -> pd.Series:
        """Per common step, whether ``diff`` lies inside the band (NaN steps count as inside)."""
        w = self.width.reindex(diff.index)
        return ~(diff.abs() > w + EDGE_TOL)


def seed_band(reference_history: Any, seed_histories: Mapping[int, Any], reference_seed: int,
              column: str = "loss", null: str = "init", scale: Optional[float] = None) -> Optional[SeedBand]:
    """The band of ``column`` differences between the reference run and its reruns (``null`` says what they
    varied: NULLS), on the steps all of them recorded; None without reruns."""
    if not seed_histories:
        return None
    ref = _series(reference_history, column)
    runs = pd.DataFrame({int(s): _series(h, column).reindex(ref.index) - ref for s, h in seed_histories.items()},
                        index=ref.index).dropna()
    return SeedBand(int(reference_seed), tuple(int(s) for s in seed_histories), runs,
                    runs.abs().max(axis=1).rename("width"), column, null, scale)


@dataclass
class LossTest:
    """The rule a loss (or reward) verdict decides by: the variant's mean per-step difference from the reference,
    against a 95% prediction interval of the same mean for a run drawn as the band's are.

    The reference and its k reruns are k + 1 draws of the null (what the reruns vary, nothing else); their mean
    differences from the reference are 0 (its own) and the reruns'. A new draw falls outside
    ``center ± t(0.975, k) * sd * sqrt(1 + 1/(k + 1))`` in 5% of comparisons when run means are normal, whatever k;
    the prediction interval already widens for a small k. Over steps, the mean uses every judged step, so no
    multiple-step comparison inflates the rate (the old "any step outside the max-of-k band" called an A/A draw
    beyond noise in most comparisons)."""

    null: str
    mean_diff: float               # the variant's mean difference over the judged steps
    null_means: tuple[float, ...]  # the reference's (0.0) and each rerun's mean difference, the same steps
    center: float                  # their mean
    limit: float                   # the interval's half-width
    steps: int                     # judged steps
    beyond: bool

    @property
    def runs(self) -> int:
        """Runs of the null: the reference and its reruns."""
        return len(self.null_means)


def loss_test(diff: pd.Series, band: SeedBand, alpha: float = LOSS_ALPHA) -> Optional[LossTest]:
    """The variant's ``diff`` (per step, variant minus reference) held against ``band`` (:class:`LossTest`), on the
    steps both have finite values; None without a step or a rerun. ``alpha`` is 0.05 only (the t table's)."""
    if alpha != LOSS_ALPHA:
        raise ValueError(f"alpha: only {LOSS_ALPHA} is tabulated, got {alpha!r}")
    runs = band.runs.reindex(diff.index).dropna()
    d = diff.reindex(runs.index)
    keep = np.isfinite(d.to_numpy(dtype=float))
    runs, d = runs[keep], d[keep]
    if not len(d) or runs.shape[1] == 0:
        return None
    null = (0.0, *(float(runs[c].mean()) for c in runs.columns))
    n = len(null)
    center = statistics.fmean(null)
    sd = statistics.stdev(null)
    limit = t975(n - 1) * sd * math.sqrt(1 + 1 / n)
    mean = float(d.mean())
    return LossTest(band.null, mean, null, center, limit, int(len(d)), abs(mean - center) > limit + EDGE_TOL)


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
# The share of comparisons of identical variants the rule below ranks, at most (measured by simulation:
# tests/test_speed_rule.py, benchmarks/speed_rule.py).
FALSE_RANKING_RATE = 0.01
# Per number of repeats n, the multiple of s / sqrt(n) the median log-ratio must exceed. Calibrated by simulation
# (benchmarks/speed_rule.py) so that identical variants are ranked in at most ~0.6% of comparisons under
# log-normal jitter of 2-5% per run with 0-20% of runs slowed 1.2-2.5x; beyond 10 repeats the last one holds.
SPEED_K = {3: 5.25, 4: 4.0, 5: 3.5, 6: 3.25, 7: 3.25, 8: 3.0, 9: 3.0, 10: 3.0}
# Above this half-width (relative) a comparison that ranks nothing says it cannot judge, rather than "no
# measurable difference": a 10% difference could hide in it.
JUDGEABLE = 0.10
# The widest speed half-width (relative) ever printed: beyond ±50% a figure says nothing a person can use ("noise
# 73.1x either way", "±7207%"), so the words say the repeats vary too much and show their range instead.
NOISE_SHOWN = 0.50
# 1.4826 x the median absolute deviation estimates a normal's standard deviation.
_MAD_TO_SD = 1.4826
# The least noise a pair of timings is credited with (0.5%): clocks and schedulers never do better.
_MIN_SCALE = 0.005


def _finite(values: Sequence[Optional[float]]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v) and v > 0]


def _k(n: int) -> float:
    return SPEED_K.get(n, SPEED_K[max(SPEED_K)]) if n >= MIN_RANKED_REPEATS else math.inf


def _pooled_sd(*arms: Sequence[float]) -> float:
    """The standard deviation of log-timings about each arm's own mean, pooled over the arms."""
    ss = sum(sum((x - statistics.fmean(a)) ** 2 for x in a) for a in arms)
    df = sum(len(a) - 1 for a in arms)
    return math.sqrt(ss / df) if df > 0 else math.nan


def _pair_scale(logs: Sequence[Sequence[float]], d: Sequence[float] = ()) -> float:
    """The noise of one log-ratio of two runs, from the arms' own log-timings ``logs`` (and the paired log-ratios
    ``d`` when given), robust to a disturbed run from four repeats on.

    With three repeats one of three deviations from their median is zero by construction, so a median
    absolute deviation says little: the pooled standard deviation of the arms (two degrees of freedom each) is
    used, and a disturbed run widens it (the verdict is then "too noisy", not wrong). From four on: 1.4826 x the
    median of every within-arm pairwise |difference| (a difference of two runs, like a log-ratio), and of the
    log-ratios' own absolute deviations from their median, whichever is wider."""
    n = min(len(a) for a in logs)
    if n < 2:
        return math.nan
    if n < 4:
        return max(math.sqrt(2) * _pooled_sd(*logs), _MIN_SCALE)
    within = [abs(a[i] - a[j]) for a in logs for i in range(len(a)) for j in range(i + 1, len(a))]
    s = _MAD_TO_SD * statistics.median(within)
    if d:
        m = statistics.median(d)
        s = max(s, _MAD_TO_SD * statistics.median(abs(x - m) for x in d))
    return max(s, _MIN_SCALE)


def noise_floor(reference_timings: Sequence[float], aa_timings: Sequence[float] = ()) -> float:
    """The smallest speed difference (relative, 0.04 = ±4%) a comparison can rank here; NaN when unknown.

    With ``aa_timings`` (an unrecorded copy of the reference, timed in every repeat beside it) it is the half-width
    the speed rule finds for that copy against the reference; else, with at least MIN_RANKED_REPEATS repeats, the
    half-width a variant as noisy as the reference's own repeats would get. Never below MIN_EFFECT."""
    if any(a is not None and math.isfinite(a) and a > 0 for a in aa_timings):
        aa = speed(aa_timings, reference_timings)
        return max(MIN_EFFECT, aa.floor) if aa is not None and math.isfinite(aa.floor) else math.nan
    t = _finite(reference_timings)
    if len(t) < MIN_RANKED_REPEATS:
        return math.nan
    logs = [math.log(x) for x in t]
    half = _k(len(t)) * _pair_scale([logs, logs]) / math.sqrt(len(t))
    return max(MIN_EFFECT, math.expm1(half))


@dataclass
class Speed:
    """Throughput of a variant relative to the reference, from the per-repeat ratios (repeat r of each ran in the
    same round): ``ratio`` is their median, ``low``/``high`` their range, ``n`` the repeats, ``floor`` the
    rule's half-width (relative, 0.2 = ±20%: a difference inside it is not ranked; NaN when unknown) and
    ``state`` the answer: "faster" | "slower" | "same" (nothing beyond a half-width of at most JUDGEABLE) |
    "too noisy" (the data cannot support a claim) | "too few" (under MIN_RANKED_REPEATS repeats)."""

    ratio: float
    low: float
    high: float
    n: int
    floor: float = math.nan
    state: str = "too few"

    @property
    def spread(self) -> float:
        """Half the range of the per-repeat ratios (NaN with one repeat)."""
        return (self.high - self.low) / 2 if self.n > 1 else math.nan

    @property
    def measurable(self) -> bool:
        """True when the rule ranks the two (``state`` is "faster" or "slower"): at most FALSE_RANKING_RATE of
        comparisons of identical variants are."""
        return self.state in ("faster", "slower")


def speed(timings: Sequence[float], reference_timings: Sequence[float],
          floor: Optional[float] = None) -> Optional[Speed]:
    """Tokens/s of a variant over the reference's, paired by repeat; None when no repeat has both timings.

    The rule, on the per-repeat log-ratios d: their median m against a noise scale s (``_pair_scale``: robust to a
    disturbed run from four repeats on). The variant is ranked when |m| > SPEED_K[n] x s / sqrt(n) (the
    half-width, calibrated to rank identical variants in at most FALSE_RANKING_RATE of comparisons) and
    |m| > MIN_EFFECT, when each side's fastest repeat agrees on the direction (a run is only ever slowed by a
    disturbance, so the fastest is the least disturbed), and, with three repeats, when all three agree.
    ``floor`` (e.g. an A/A copy's half-width, ``noise_floor``) widens the half-width where it is wider."""
    pairs = [(a, b) for a, b in zip(timings, reference_timings)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0]
    if not pairs:
        return None
    ratios = [a / b for a, b in pairs]
    n = len(pairs)
    m = statistics.median(math.log(r) for r in ratios)
    out = Speed(math.exp(m), min(ratios), max(ratios), n)
    if n < MIN_RANKED_REPEATS:
        return out
    la, lb = [math.log(a) for a, _ in pairs], [math.log(b) for _, b in pairs]
    d = [x - y for x, y in zip(la, lb)]
    half = _k(n) * _pair_scale([la, lb], d) / math.sqrt(n)
    if floor is not None and math.isfinite(floor) and floor > 0:
        half = max(half, math.log1p(floor))
    out.floor = math.expm1(half)
    least = math.log1p(MIN_EFFECT)
    best = max(la) - max(lb)
    beyond = abs(m) > half and abs(m) > least
    agree = (best * m > 0 and abs(best) > least
             and (n > MIN_RANKED_REPEATS or all(x * m > 0 for x in d)))
    if beyond and agree:
        out.state = "faster" if m > 0 else "slower"
    elif beyond or out.floor > JUDGEABLE:
        out.state = "too noisy"
    else:
        out.state = "same"
    return out


# The per-step quantities of a preference objective (dpo, orpo, simpo) a variant is judged on beside its loss, each
# against the reference's seed band of that column, as the loss is; objective="lm" records have none.
REWARD_COLUMNS = ("reward_margin", "reward_accuracy", "reward_mean")   # reward_mean: GRPO's total reward


@dataclass
class BandJudgement:
    """How one per-step quantity of a variant (``column``: "reward_margin", "reward_accuracy") held against the
    reference's seed band of it, as a verdict judges the loss: the same fields, and the words in ``text``."""

    column: str
    max_abs_diff: float = math.nan          # max |value - reference value| over the common finite steps
    within_noise: Optional[bool] = None     # None without a seed band (or no step to judge)
    leaves_band_at: Optional[int] = None
    direction: Optional[str] = None         # "lower" | "higher"
    outside: dict[str, list[int]] = field(default_factory=dict)
    judged_steps: int = 0
    nonfinite_at: list[int] = field(default_factory=list)   # steps whose value is NaN/inf: never judged inside
    test: Optional[LossTest] = None         # the rule's numbers (loss_test), None without a band
    text: str = ""


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
    leaves_band_at: Optional[int] = None    # first step outside the band, on either side
    direction: Optional[str] = None         # "lower" | "higher": the side most steps outside the band lie on
    outside: dict[str, list[int]] = field(default_factory=dict)   # "lower"/"higher" -> steps outside on that side
    judged_steps: int = 0                   # steps held against the band (both runs and the band have a value)
    test: Optional[LossTest] = None         # the rule's numbers (loss_test): null, mean difference, limit
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
    # preference objectives: column in REWARD_COLUMNS -> its judgement against the seed band (empty for "lm")
    rewards: dict[str, BandJudgement] = field(default_factory=dict)
    parts: list[str] = field(default_factory=list)
    # "code": advice names compare()'s arguments ("use repeats=5"); "panel": the Panel's controls ("set repeats to 5")
    advice: str = "code"

    @property
    def text(self) -> str:
        """The verdict line, e.g. "bf16: 1.6x faster (±0.1), loss within init noise (mean ...), 0 skipped"."""
        panel = self.advice == "panel"
        return f"{self.variant}: " + ", ".join(getattr(p, "panel", p) if panel else p for p in self.parts)

    def __str__(self) -> str:
        return self.text


def _int_or_zero(v: Any) -> int:
    try:
        return 0 if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
    except (TypeError, ValueError):
        return 0


def _scale_text(v: float) -> str:
    return f"{v:,.0f}" if v >= 1 else f"{v:.3g}"


def _x(v: float) -> str:
    """A speed ratio: two decimals, or two significant digits below 0.095 (0.034x, not 0.03x)."""
    return f"{v:.2f}" if v >= 0.095 else f"{v:.2g}"


def speed_span(s: Speed) -> str:
    """The repeats' range with their median, "0.03-0.33x, median 0.09x" ("0.09x, one timing"; "0.95x in all 3"
    when they agree to two decimals): how a speed ratio is shown everywhere, the range first, so that a spread
    wider than the value is seen as one."""
    if s.n == 1:
        return f"{_x(s.ratio)}x, one timing"
    if _x(s.low) == _x(s.high):
        return f"{_x(s.ratio)}x in all {s.n}"
    return f"{_x(s.low)}-{_x(s.high)}x, median {_x(s.ratio)}x"


def _noise(floor: float) -> str:
    # Beyond NOISE_SHOWN the half-width is no number a person can use: say only that it is that wide.
    return f"noise ±{floor:.0%}" if floor <= NOISE_SHOWN else f"noise beyond ±{NOISE_SHOWN:.0%}"


def half_width_text(floor: float, digits: int = 1) -> str:
    """A speed half-width as the tables and notes print it: "±4.2%", or "beyond ±50%" past NOISE_SHOWN, where no
    figure means anything ("±7207%" would only mislead); "—" when unknown."""
    if floor is None or not math.isfinite(floor):
        return "—"
    return f"±{floor:.{digits}%}" if floor <= NOISE_SHOWN else f"beyond ±{NOISE_SHOWN:.0%}"


class Words(str):
    """A verdict part as compare()'s arguments name things (``str`` itself), with ``panel``: the same advice in the
    words of the Panel's controls ("set repeats to 5"), which ``Verdict.text`` uses when its ``advice`` is
    "panel"."""

    panel: str

    def __new__(cls, code: str, panel: Optional[str] = None) -> "Words":
        # panel is optional so that pickle and copy, which rebuild a str subclass from its text alone, work
        obj = super().__new__(cls, code)
        obj.panel = code if panel is None else panel
        return obj


def _one_direction(s: Speed) -> str:
    """", slower in all 3" when every repeat's ratio falls on one side of 1 (else ""): said when the verdict cannot
    rank, so that a variant slower every time is not read as a coin toss."""
    if s.n < 2 or s.low <= 1 <= s.high:
        return ""
    return f", {'slower' if s.high < 1 else 'faster'} in all {s.n}"


def _speed_text(s: Optional[Speed], reference: str) -> str:
    if s is None:
        return "speed not measured"
    if s.n == 1:
        return Words(f"{_x(s.ratio)}x the speed of {reference} (one timing, spread unknown: use repeats=5)",
                     f"{_x(s.ratio)}x the speed of {reference} (one timing, spread unknown: set repeats to 5)")
    span = speed_span(s)
    if s.n < MIN_RANKED_REPEATS:
        head = f"speed not ranked against {reference} ({span} over {s.n} timings: too few to rank, "
        return Words(head + "use repeats=5)", head + "set repeats to 5)")
    span += " repeats" if span.endswith(f"all {s.n}") else f" over {s.n} repeats"
    rule = f"{FALSE_RANKING_RATE:.0%} false-ranking rule"
    if s.state == "same":
        # the rule never ranks under MIN_EFFECT, however narrow its half-width
        return (f"no measurable speed difference from {reference} ({span}; a difference beyond "
                f"±{max(s.floor, MIN_EFFECT):.0%} would have been ranked, {rule})")
    if s.state == "too noisy":
        if s.floor > NOISE_SHOWN:
            # no half-width worth printing: the repeats' range, and which way they all went if they agree
            head = (f"speed too noisy to judge here ({span}{_one_direction(s)}; timing noise beyond "
                    f"±{NOISE_SHOWN:.0%}, {rule}): ")
        else:
            head = f"speed too noisy to judge here ({span}; {_noise(s.floor)}, {rule}): "
        if s.n < 5:
            return Words(head + "rerun with repeats=5 on a quiet machine",
                         head + "set repeats to 5 and rerun on a quiet machine")
        return Words(head + f"rerun with repeats={2 * s.n} or on a quieter machine",
                     head + f"rerun on a quieter machine (or with compare(..., repeats={2 * s.n}) from code: "
                            "the Panel's repeats go up to 5)")
    return f"{s.state} than {reference} ({span}; {_noise(s.floor)}, {rule})"


# Which way an eval difference (variant - reference) is better: accuracy up, loss down.
_EVAL_BETTER = {"eval_accuracy": 1.0, "eval_loss": -1.0}
# Without a seed band, an eval difference is called better or worse only beyond one unit of the last digit the
# comparison's table prints (eval loss to 4 decimals, accuracy to 0.1%): below it the table shows the two as
# equal, and for a loss of a few nats it is ~1000x float32's rounding (1.2e-7 relative), far more than summing
# the eval tokens' losses in another order or another kernel moves it. "eval loss -1.3e-06 (better)" is rounding.
EVAL_ROUNDING = {"eval_loss": 1e-4, "eval_accuracy": 1e-3}


def eval_limit(band: SeedBand, step: int) -> Optional[tuple[float, float]]:
    """(center, half-width) of the 95% prediction interval of an eval difference at ``step``, from the reference
    (0) and its reruns' differences there (:class:`LossTest`'s rule on one value per run); None without them."""
    if band is None or step not in band.runs.index:
        return None
    null = [0.0, *(float(x) for x in band.runs.loc[step] if math.isfinite(float(x)))]
    if len(null) < 2:
        return None
    n = len(null)
    return statistics.fmean(null), t975(n - 1) * statistics.stdev(null) * math.sqrt(1 + 1 / n)


def _eval_text(column: str, diff: float, reference: str, band: Optional[SeedBand] = None,
               step: Optional[int] = None) -> str:
    """``diff`` called better or worse only beyond the band's 95% limit at that evaluation (:func:`eval_limit`),
    and never within rounding (EVAL_ROUNDING). A data-order band's reruns held out other examples: an eval
    difference is not judged against them (only runs on one eval set compare)."""
    better = "better" if diff * _EVAL_BETTER[column] > 0 else "worse"
    tol = EVAL_ROUNDING[column]
    lim = eval_limit(band, step) if band is not None and band.null != "data" else None
    if lim is not None:
        center, width = lim
        word = (f"{better}, beyond {band.name} {_center(center, width)} ± {width:.2g}"
                if abs(diff - center) > width + EDGE_TOL and abs(diff) > tol
                else f"within {band.name} {_center(center, width)} ± {width:.2g}")
    else:
        word = better if abs(diff) > tol else "same within rounding"
        if band is not None and band.null == "data":
            word += "; not judged against the data-order reruns, which held out other examples"
    return f"{column.replace('_', ' ')} {diff:+.3g} ({word}) vs {reference}"


def _steps_text(steps: Sequence[int], most: int = 3) -> str:
    """"step 2", "steps 2-4, 9", "steps 1, 3, 5 and 2 more": runs of consecutive steps joined."""
    groups: list[list[int]] = []
    for k in steps:
        if groups and k == groups[-1][-1] + 1:
            groups[-1].append(k)
        else:
            groups.append([k])
    parts = [f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups]
    more = len(groups) - most
    text = ", ".join(parts[:most]) + (f" and {more} more" if more > 0 else "")
    return ("step " if len(steps) == 1 else "steps ") + text


def _center(center: float, limit: float) -> str:
    """A null's center as the words print it: 0 when it is under 1% of the limit (a sum's rounding, -3.7e-17)."""
    return "0" if abs(center) < 0.01 * limit else f"{center:+.2g}"


def _loss_text(v: Any, judged: pd.Series, band: SeedBand, reference: str, label: str = "loss") -> str:
    """The ``label`` headline against the band (the loss's, or a reward's) and ``v``'s fields set from it
    (``v``: a Verdict, or a BandJudgement).

    The decision is :func:`loss_test`'s (the mean difference against a 95% prediction interval of the reruns', a
    5% false-call rate); the headline names the null and gives both numbers. Beyond it, the words then say where
    the run left the reruns' range (the band drawn in the figure): on how many steps, from which, and the largest
    signed difference on that side; steps outside on the other side are named after it, "briefly" when they are
    at most half as many."""
    out = ~band.contains(judged)
    sides = {"lower": [int(k) for k in judged.index if out[k] and judged[k] < 0],
             "higher": [int(k) for k in judged.index if out[k] and judged[k] > 0]}
    v.outside = {k: st for k, st in sides.items() if st}
    v.judged_steps = len(judged)
    test = loss_test(judged, band)
    v.test = test
    noise = band.name
    if test is None:
        v.within_noise = None
        return f"{label}: no step to hold against the {noise} band"
    numbers = (f"mean {test.mean_diff:+.2g} over {test.steps} step{'s' if test.steps != 1 else ''}; {noise} allows "
               f"{_center(test.center, test.limit)} ± {test.limit:.2g}, 95%")
    if not test.beyond:
        v.within_noise = True
        return f"{label} within {noise} ({numbers})"
    v.within_noise = False
    v.direction = "lower" if test.mean_diff < test.center else "higher"
    text = f"{label} {v.direction} than {reference} beyond {noise} ({numbers})"
    mine = sides[v.direction]
    if not mine:
        return text
    v.leaves_band_at = min(st[0] for st in v.outside.values())
    peak = max(mine, key=lambda k: (abs(judged[k]), -k))
    where = (f"step {mine[0]}: {judged[peak]:+.2g}" if len(mine) == 1
             else f"from step {mine[0]}; largest {judged[peak]:+.2g} at step {peak}")
    text += f"; outside the reruns' range on {len(mine)} of {len(judged)} steps ({where})"
    other_side = "higher" if v.direction == "lower" else "lower"
    other = sides[other_side]
    if other:
        how = "briefly" if 2 * len(other) <= len(mine) else "also"
        ends = ", where it ends" if other[-1] == int(judged.index[-1]) else ""
        text += f"; {how} {other_side} at {_steps_text(other)}{ends}"
    return text


def has_values(history: Any, column: str) -> bool:
    """Whether ``history`` (a DataFrame or a dict of columns) holds a finite value of ``column`` anywhere."""
    s = _series(history, column)
    return bool(np.isfinite(s.to_numpy(dtype=float)).any())


def recorded_steps(history: Any, column: str) -> tuple[list[int], list[int]]:
    """``(steps with a finite value of column, steps whose value is non-finite)`` in ``history``. A non-finite value
    counts where the step is flagged ``nonfinite`` (the engine's NaN reward) and every other step has a finite one; a
    missing one (None: objective="lm"; NaN on an unflagged step of a table read back from a file) is in neither."""
    if history is None or column not in history or "step" not in history:
        return [], []
    raw = list(history[column])
    steps = [int(k) for k in history["step"]]
    flags = list(history["nonfinite"]) if "nonfinite" in history else [False] * len(raw)
    finite, bad, complete = [], [], True
    for k, v, flag in zip(steps, raw, flags):
        try:
            x = math.nan if v is None else float(v)
        except (TypeError, ValueError):
            x = math.nan
        if math.isfinite(x):
            finite.append(k)
        elif v is not None and bool(flag) and flag == flag:
            bad.append(k)
        else:
            complete = False
    # A run that records rewards has one on every step: a missing or NaN one on an unflagged step says it has none
    # (as the figures read it: viz.figures.rewarded).
    return finite, bad if complete else []


def reward_judgement(column: str, name: str, reference: str, history: Any, reference_history: Any,
                     band: Optional[SeedBand] = None) -> BandJudgement:
    """``name``'s ``column`` (a reward) per step minus the reference's, held against ``band`` (the reference's seed
    band of that column) as the loss is; without a band, the largest difference only. Steps whose value is
    non-finite are named and make it not within noise: a NaN reward is never averaged away or judged inside."""
    label = column.replace("_", " ")
    j = BandJudgement(column)
    diff = differences({reference: reference_history, name: history}, reference, column)[name]
    finite = diff[np.isfinite(diff)]
    j.max_abs_diff = float(finite.abs().max()) if len(finite) else math.nan
    _, j.nonfinite_at = recorded_steps(history, column)
    judged = diff.reindex(band.width.index).dropna() if band is not None else diff.iloc[:0]
    texts = []
    if band is not None and len(judged):
        texts.append(_loss_text(j, judged, band, reference, label))
    elif len(finite) and band is not None:
        texts.append(f"{label}: no step to hold against the {band.name} band")
    elif len(finite):
        texts.append(f"{label} differs from {reference} by at most {j.max_abs_diff:.2g} (no seed band to judge it)")
    if j.nonfinite_at:
        j.within_noise = False
        where = f"non-finite at {_steps_text(j.nonfinite_at)}"
        if texts:   # "reward margin within init noise (mean ... over 6 steps ...), non-finite at steps 4-5"
            texts[-1] = texts[-1] + ", " + where
        else:
            texts.append(f"{label} {where}")
    j.text = "; ".join(texts) or f"{label}: no step in common with {reference}"
    return j


def verdict(name: str, reference: str, history: Any, reference_history: Any, summary: Mapping[str, Any],
            *, timings: Sequence[float] = (), reference_timings: Sequence[float] = (),
            band: Optional[SeedBand] = None, eval_history: Any = None,
            reference_eval_history: Any = None, scaler: Optional[bool] = None,
            initial_scale: Optional[float] = None, seed_wall_s: Optional[Mapping[int, float]] = None,
            aa_timings: Sequence[float] = (), lost_updates_text: Optional[str] = None,
            eval_bands: Optional[Mapping[str, SeedBand]] = None,
            reward_bands: Optional[Mapping[str, SeedBand]] = None) -> Verdict:
    """The verdict of one variant that ran, against the reference run (and the seed band when given).

    ``initial_scale`` is the loss scale before the first step (the history holds each step's scale after its
    update); ``seed_wall_s`` (seed -> seconds) is what the reference's seed runs cost, stated in its verdict;
    ``aa_timings`` (an identical copy of the reference timed in each repeat) sets the speed's noise floor.
    ``lost_updates_text`` (engine.doctor.lost_updates_line of the run, None when too few updates were lost to
    report) is said after the loss: it is why a loss of bf16-pure weights can stand still. ``eval_bands``
    (column -> the band of the reference's seed runs' eval differences) is what an eval difference must exceed to
    be called better or worse; without one it must exceed rounding (EVAL_ROUNDING). ``reward_bands`` (column of
    REWARD_COLUMNS -> the band of the reference's seed runs' differences in it) judges a preference objective's reward
    margin and accuracy as the loss is judged (:func:`reward_judgement`).
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
            v.parts.append(f"the reference ({band.name} from {null_words(band.null, band.scale)}: seeds "
                           f"{', '.join(map(str, v.seed_wall_s))}, {cost:.1f} s)")
        else:
            v.parts.append("the reference" + (f" ({band.name} from {null_words(band.null, band.scale)}: seeds "
                                              f"{', '.join(map(str, band.seeds))})" if band is not None else ""))
    else:
        # an A/A copy's half-width widens the variant's own (without one the rule's calibration stands alone)
        aa = noise_floor(reference_timings, aa_timings) if _finite(aa_timings) else None
        v.speed = speed(timings, reference_timings, aa)
        v.parts.append(_speed_text(v.speed, reference))
        diff = differences({reference: reference_history, name: history}, reference)[name]
        finite = diff[np.isfinite(diff)]
        v.max_abs_diff = float(finite.abs().max()) if len(finite) else math.nan
        # Steps where both runs have a loss and the band a width: a run cut before them has nothing to judge.
        judged = diff.reindex(band.width.index).dropna() if band is not None else diff.iloc[:0]
        if band is not None and len(judged):
            v.parts.append(_loss_text(v, judged, band, reference))
        elif band is not None:
            v.parts.append(f"no step to hold against the {band.name} band")
        elif math.isfinite(v.max_abs_diff):
            head = f"loss differs from {reference} by at most {v.max_abs_diff:.2g} (no seed band to judge it: "
            v.parts.append(Words(head + "seeds=(0, 1, 2))", head + "set seeds to 3)"))
        for col in ("eval_accuracy", "eval_loss"):
            ev = differences({reference: reference_eval_history, name: eval_history}, reference, col)[name] \
                if eval_history is not None and reference_eval_history is not None else pd.Series([], dtype=float)
            ev = ev.dropna()
            if len(ev):
                v.eval_diff = (col, float(ev.iloc[-1]))
                v.parts.append(_eval_text(col, v.eval_diff[1], reference, (eval_bands or {}).get(col),
                                          int(ev.index[-1])))
                break
        # A preference objective's rewards, judged like the loss; objective="lm" runs record none (no words).
        for col in REWARD_COLUMNS:
            if has_values(reference_history, col) and any(recorded_steps(history, col)):
                j = reward_judgement(col, name, reference, history, reference_history, (reward_bands or {}).get(col))
                v.rewards[col] = j
                v.parts.append(j.text)
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


@dataclass
class MismatchJudgement:
    """A GRPO variant's sampler/trainer mismatch (mean |delta log p| per completion token) against another
    variant's: its run mean, its band over the rollout batches (the spread of the per-step values: each step draws
    new prompts and completions, so this is the sampling noise of the figure), the ratio, and whether the two bands
    are apart."""

    variant: str
    mean: float
    low: float
    high: float
    batches: int
    partner: Optional[str] = None
    ratio: Optional[float] = None
    beyond_noise: Optional[bool] = None
    text: str = ""


def nats(v: float) -> str:
    """A log-prob figure in nats: 3 significant digits, scientific below 0.001 (fp32's 2e-06 is not 0)."""
    if v == 0:
        return "0"
    return f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.1e}"


def _mismatch_values(history: Any, extra: Sequence[Any] = (), iterations: int = 1) -> list[float]:
    out = []
    for h in (history, *extra):
        if has_values(h, "mismatch_mean"):
            # a rollout batch trained on for several steps reports its mismatch on each: count it once
            first = (pd.to_numeric(h["step"], errors="coerce") - 1) % max(1, iterations) == 0
            col = pd.to_numeric(h["mismatch_mean"], errors="coerce")[first].dropna()
            out.extend(float(v) for v in col)
    return [v for v in out if math.isfinite(v)]


def mismatch_judgements(histories: Mapping[str, Any], reference: str, means: Mapping[str, Optional[float]] = None,
                        seed_histories: Sequence[Any] = (),
                        iterations: Mapping[str, int] = None) -> dict[str, MismatchJudgement]:
    """Each GRPO variant's mismatch, held against fp16's when a variant is called "fp16" (the precision the
    mismatch is smallest in short of fp32), else against the reference's; ``means``: the runs' token-weighted means
    (summary.mismatch_mean), ``seed_histories``: the reference's seed runs, whose batches join its band;
    ``iterations``: each run's grpo_iterations (steps per rollout batch)."""
    vals = {n: _mismatch_values(h, seed_histories if n == reference else (), (iterations or {}).get(n, 1))
            for n, h in histories.items()}
    vals = {n: v for n, v in vals.items() if v}
    out: dict[str, MismatchJudgement] = {}
    for n, v in vals.items():
        mean = (means or {}).get(n)
        mean = float(mean) if mean is not None and math.isfinite(mean) else statistics.fmean(v)
        out[n] = MismatchJudgement(n, mean, min(v), max(v), len(v))
    for n, j in out.items():
        partner = "fp16" if "fp16" in out and n != "fp16" else (reference if reference in out and n != reference
                                                                  else None)
        words = (f"sampler/trainer mismatch {nats(j.mean)} nats per token ({nats(j.low)}-{nats(j.high)} over "
                 f"{j.batches} rollout batch{'es' if j.batches != 1 else ''})")
        if partner is not None:
            p = out[partner]
            j.partner = partner
            j.ratio = j.mean / p.mean if p.mean > 0 else math.inf
            j.beyond_noise = j.low > p.high or j.high < p.low
            times = f"{j.ratio:.2g}x" if j.ratio < 10 else f"{j.ratio:,.0f}x"
            words += (f", {times} {partner}'s, " + ("beyond" if j.beyond_noise else "within") +
                      " their batch-to-batch spread")
        j.text = words
    return out


def not_run_verdict(name: str, reference: str, why: str) -> Verdict:
    """The verdict of a variant that did not run (unsupported here, failed, or cut before its first step)."""
    return Verdict(name, reference, ran=False, parts=[f"not run ({why})" if why else "not run"])
