"""The speed rule (nbtrain.verdicts.speed) on simulated timings, fed to the real function: its false-ranking rate
on identical variants, how often it finds a real 1.3x difference, that more repeats never find less, and what it
says when the data cannot support a claim. Seeded: the same draws every run (benchmarks/speed_rule.py has the
simulation and the full table, benchmarks/results/speed_rule_sim.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nbtrain import verdicts as V

from .helpers import load_benchmark

N = 3000   # comparisons per cell: a rate of 1% is then known within about ±0.2%


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("speed_rule")


def share(sim, repeats, ratio, scenario, seed):
    return sim.ranked_share(np.random.default_rng(seed), N, repeats, ratio, scenario, right_way=ratio != 1.0)


@pytest.mark.parametrize("repeats", [3, 4, 5, 7])
@pytest.mark.parametrize("scenario", ["quiet", "disturbed 5-20%", "disturbed 20%"])
def test_identical_variants_are_ranked_in_at_most_one_percent_of_comparisons(sim, repeats, scenario):
    rate = share(sim, repeats, 1.0, scenario, seed=repeats)
    assert rate <= V.FALSE_RANKING_RATE, (repeats, scenario, rate)


@pytest.mark.parametrize("ratio", [1.3, 1 / 1.3])
def test_a_real_difference_is_found(sim, ratio):
    assert share(sim, 5, ratio, "disturbed 8%", seed=11) >= 0.90
    assert share(sim, 3, ratio, "quiet", seed=12) >= 0.85


@pytest.mark.parametrize("scenario", ["quiet", "disturbed 8%", "disturbed 5-20%"])
def test_more_repeats_never_find_less(sim, scenario):
    for ratio in (1.1, 1.3):
        found = [share(sim, n, ratio, scenario, seed=20 + n) for n in (3, 5, 7)]
        assert found == sorted(found), (scenario, ratio, found)


def test_one_disturbed_run_does_not_hide_a_difference_from_four_repeats_on():
    rng = np.random.default_rng(3)
    for n in (4, 5, 7):
        ref = list(100 * np.exp(rng.normal(0, 0.02, n)))
        var = list(130 * np.exp(rng.normal(0, 0.02, n)))
        assert V.speed(var, ref).state == "faster"
        for i in range(n):   # whichever run is slowed 2.5x, on either side
            for side in ("var", "ref"):
                v, r = list(var), list(ref)
                (v if side == "var" else r)[i] /= 2.5
                assert V.speed(v, r).state == "faster", (n, i, side)


def test_when_the_data_cannot_support_a_claim_the_verdict_says_so_and_how_to_get_one():
    # three repeats, one of the variant's runs disturbed: the median says 1.2x, the spread cannot rule out 1.0x
    s = V.speed([120, 60, 121], [100, 101, 99])
    assert s.state == "too noisy" and not s.measurable and s.floor > V.JUDGEABLE
    text = V._speed_text(s, "a")
    # the range first, then the median, then the rule's error rate; a half-width this wide (> NOISE_SHOWN) is no
    # figure a person can use: it is said to be that wide, never printed ("noise 73.1x either way")
    assert s.floor > V.NOISE_SHOWN
    assert text.startswith(f"speed too noisy to judge here ({s.low:.2f}-{s.high:.2f}x, median {s.ratio:.2f}x over 3 "
                           f"repeats; timing noise beyond ±50%, {V.FALSE_RANKING_RATE:.0%} false-ranking rule)")
    assert "either way" not in text and f"{s.floor:.0%}" not in text
    assert "rerun with repeats=5 on a quiet machine" in text
    assert "no measurable" not in text and "faster" not in text and "slower" not in text
    # a quiet A/A: nothing beyond a small half-width, said as a measured "no difference"
    same = V.speed([100.5, 99.8, 100.2, 100.1, 99.9], [100, 100.3, 99.9, 100.2, 100])
    assert same.state == "same" and same.floor <= V.JUDGEABLE
    assert V._speed_text(same, "a").startswith("no measurable speed difference from a (1.00x in all 5 repeats; a "
                                               f"difference beyond ±{V.MIN_EFFECT:.0%} would have been ranked")
    # fewer than three repeats never rank, and say what to do
    assert V.speed([150, 151], [100, 100]).state == "too few"
    assert V._speed_text(V.speed([150, 151], [100, 100]), "a") == (
        "speed not ranked against a (1.50-1.51x, median 1.50x over 2 timings: too few to rank, use repeats=5)")


def test_the_rule_is_symmetric_and_scale_free():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(3, 8))
        ref = 100 * np.exp(rng.normal(0, 0.04, n))
        var = ref * np.exp(rng.normal(math.log(1.2), 0.05, n))
        a, b = V.speed(list(var), list(ref)), V.speed(list(ref), list(var))
        assert a.measurable == b.measurable and a.ratio == pytest.approx(1 / b.ratio)
        assert a.floor == pytest.approx(b.floor)
        c = V.speed(list(7 * var), list(7 * ref))   # the unit of the timings does not matter
        assert (c.state, c.floor) == (a.state, pytest.approx(a.floor))
