"""nbtrain.verdicts on hand-made histories: every number a verdict states is recomputed here."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from nbtrain import verdicts as V


def hist(loss, scale=None, start=1):
    steps = np.arange(start, start + len(loss))
    return pd.DataFrame({"step": steps, "loss": loss,
                         "scale": scale if scale is not None else [None] * len(loss)})


def test_differences_are_exact_per_step_and_nan_where_a_run_stopped():
    ref = hist([5.0, 4.0, 3.0, 2.5])
    short = hist([5.5, 4.25])
    d = V.differences({"a": ref, "b": short}, "a")
    assert list(d.index) == [1, 2, 3, 4]
    assert d["a"].tolist() == [0.0] * 4
    assert d["b"].iloc[:2].tolist() == [0.5, 0.25] and d["b"].iloc[2:].isna().all()
    with pytest.raises(KeyError, match="reference: 'zz'"):
        V.differences({"a": ref}, "zz")


def test_seed_band_is_the_recorded_seed_differences_and_its_envelope():
    ref = hist([5.0, 4.0, 3.0])
    band = V.seed_band(ref, {1: hist([5.1, 3.9, 3.05]), 2: hist([4.8, 4.05, 3.0])}, reference_seed=0)
    assert band.seeds == (1, 2) and band.reference_seed == 0
    np.testing.assert_allclose(band.runs[1], [0.1, -0.1, 0.05], atol=1e-12)
    np.testing.assert_allclose(band.runs[2], [-0.2, 0.05, 0.0], atol=1e-12)
    np.testing.assert_allclose(band.width, [0.2, 0.1, 0.05], atol=1e-12)
    assert V.seed_band(ref, {}, 0) is None


def test_leaves_band_names_the_first_step_outside():
    ref = hist([5.0, 4.0, 3.0, 2.0])
    band = V.seed_band(ref, {1: hist([5.1, 4.1, 3.1, 2.1])}, 0)
    assert V.leaves_band(pd.Series([0.05, -0.1, 0.09, 0.0], index=[1, 2, 3, 4]), band) is None   # edge: inside
    assert V.leaves_band(pd.Series([0.0, 0.05, 0.2, 0.0], index=[1, 2, 3, 4]), band) == 3


def test_speed_ratio_pairs_repeats_and_says_when_it_is_noise():
    s = V.speed([160, 150, 170], [100, 100, 100])
    assert s.ratio == pytest.approx(1.6) and (s.low, s.high, s.n) == (1.5, 1.7, 3)
    assert s.spread == pytest.approx(0.1) and s.measurable and s.state == "faster"
    # the half-width: k(3) x the pooled log-timing sd (x sqrt 2, a ratio of two runs) / sqrt(3)
    sd = np.std(np.log([160, 150, 170]), ddof=1)
    half = V.SPEED_K[3] * math.sqrt(2) * math.sqrt(sd ** 2 / 2) / math.sqrt(3)
    assert s.floor == pytest.approx(math.expm1(half))
    flat = V.speed([105, 95, 101], [100, 100, 100])
    assert not flat.measurable and flat.state in ("same", "too noisy")   # the repeats disagree on the order
    one = V.speed([150], [100])
    assert one.n == 1 and math.isnan(one.spread) and not one.measurable and one.state == "too few"
    assert V.speed([], []) is None and V.speed([float("nan")], [100]) is None


def test_verdict_lines_state_speed_noise_and_skips_from_the_records():
    ref = hist([5.0, 4.0, 3.0, 2.0])
    band = V.seed_band(ref, {1: hist([5.1, 4.1, 3.1, 2.1]), 2: hist([4.95, 3.95, 2.95, 1.95])}, 0)
    good = V.verdict("bf16", "fp32", hist([5.0, 4.02, 3.01, 2.05]), ref,
                     {"skipped_steps": 0, "nonfinite_steps": 0, "stopped_reason": "max_steps"},
                     timings=[160, 150, 170], reference_timings=[100, 100, 100], band=band)
    assert good.within_noise and good.leaves_band_at is None
    assert good.max_abs_diff == pytest.approx(0.05)
    # the null's run means: the reference's 0 and the reruns' +0.1 and -0.05; t(0.975, 2 df) = 4.303
    center, half = np.mean([0, 0.1, -0.05]), 4.303 * np.std([0, 0.1, -0.05], ddof=1) * np.sqrt(1 + 1 / 3)
    assert (good.test.center, good.test.limit) == (pytest.approx(center), pytest.approx(half, rel=1e-3))
    assert good.test.mean_diff == pytest.approx(0.02) and good.test.steps == 4 and good.test.null == "init"
    assert good.text == (f"bf16: faster than fp32 (1.50-1.70x, median 1.60x over 3 repeats; noise "
                         f"±{good.speed.floor:.0%}, 1% false-ranking rule), loss within init noise (mean +0.02 over "
                         "4 steps; init noise allows +0.017 ± 0.38, 95%)")
    assert good.speed == V.speed([160, 150, 170], [100, 100, 100])

    fp16 = hist([5.0, 5.0, 5.0, 3.5], scale=[65536.0, 32768.0, 16384.0, 8192.0])
    bad = V.verdict("fp16", "fp32", fp16, ref,
                    {"skipped_steps": 3, "nonfinite_steps": 3, "stopped_reason": "max_steps"},
                    timings=[105, 95, 101], reference_timings=[100, 100, 100], band=band, scaler=True)
    assert bad.leaves_band_at == 2 and bad.within_noise is False
    assert (bad.scale_first, bad.scale_min) == (65536.0, 8192.0)
    assert bad.direction == "higher"
    assert bad.speed.state == "too noisy"   # three repeats that disagree, ±9% jitter: no claim either way
    assert bad.text == (f"fp16: speed too noisy to judge here (0.95-1.05x, median 1.01x over 3 repeats; noise "
                        f"±{bad.speed.floor:.0%}, 1% false-ranking rule): rerun with repeats=5 on a quiet machine, "
                        "loss higher than fp32 beyond init noise (mean +1.1 over 4 steps; init noise allows +0.017 ± "
                        "0.38, 95%); outside the reruns' range on 3 of 4 steps (from step 2; largest +2 at step 3), "
                        "3 skipped steps (scale 65,536 → 8,192)")

    ref_v = V.verdict("fp32", "fp32", ref, ref, {"skipped_steps": 0}, band=band)
    assert ref_v.is_reference and ref_v.text == ("fp32: the reference (init noise from reruns with other initial "
                                                 "weights, the same batches: seeds 1, 2)")


def test_verdict_without_a_band_says_how_to_get_one_and_never_ranks_one_timing():
    ref = hist([5.0, 4.0])
    v = V.verdict("bf16", "fp32", hist([5.0, 4.0001]), ref, {"skipped_steps": 0},
                  timings=[130], reference_timings=[100])
    assert v.within_noise is None
    assert "one timing, spread unknown" in v.text and "faster" not in v.text
    assert "at most 0.0001" in v.text and "seeds=(0, 1, 2)" in v.text


def test_eval_difference_is_in_the_verdict():
    ref = hist([5.0, 4.0])
    ev_ref = pd.DataFrame({"step": [2], "eval_loss": [4.5], "eval_accuracy": [0.5]})
    ev = pd.DataFrame({"step": [2], "eval_loss": [4.4], "eval_accuracy": [0.75]})
    v = V.verdict("lora", "full", hist([5.0, 3.9]), ref, {}, eval_history=ev, reference_eval_history=ev_ref)
    assert v.eval_diff == ("eval_accuracy", 0.25) and "eval accuracy +0.25 (better) vs full" in v.text
    worse = V.verdict("lora", "full", hist([5.0, 3.9]), ref, {}, eval_history=ev.assign(eval_accuracy=[0.25]),
                      reference_eval_history=ev_ref)
    assert "eval accuracy -0.25 (worse) vs full" in worse.text
    loss_only = V.verdict("lora", "full", hist([5.0, 3.9]), ref, {}, eval_history=ev[["step", "eval_loss"]],
                          reference_eval_history=ev_ref[["step", "eval_loss"]])
    assert "eval loss -0.1 (better) vs full" in loss_only.text


def test_an_eval_difference_is_better_or_worse_only_beyond_rounding_or_the_seed_band():
    ref = hist([5.0, 4.0])
    ev_ref = pd.DataFrame({"step": [2], "eval_loss": [4.5]})
    def say(diff, **kw):
        return V.verdict("bf16", "fp32", hist([5.0, 4.0]), ref, {}, eval_history=ev_ref.assign(eval_loss=4.5 + diff),
                         reference_eval_history=ev_ref, **kw).text
    # no band: a difference the table's 4 decimals cannot show is rounding, not better
    assert "eval loss -1.3e-06 (same within rounding) vs fp32" in say(-1.3e-6)
    assert "better" not in say(-1.3e-6) and "worse" not in say(+9e-5)
    assert "eval loss +0.002 (worse) vs fp32" in say(0.002)
    # a band of the reruns' eval differences: inside its 95% limit (the reference's 0 and the reruns' +0.03 and
    # -0.02: center +0.0033, half-width 4.303 x sd x sqrt(4/3) = 0.125), neither better nor worse
    seeds = {1: ev_ref.assign(eval_loss=4.53), 2: ev_ref.assign(eval_loss=4.48)}
    band = V.seed_band(ev_ref, seeds, 0, column="eval_loss")
    assert band.column == "eval_loss" and band.width.loc[2] == pytest.approx(0.03)
    assert V.eval_limit(band, 2)[1] == pytest.approx(4.303 * np.std([0, 0.03, -0.02], ddof=1) * np.sqrt(4 / 3),
                                                     rel=1e-3)
    inside = say(-0.1, eval_bands={"eval_loss": band})
    assert "eval loss -0.1 (within init noise +0.0033 ± 0.13) vs fp32" in inside
    assert "better" not in inside and "worse" not in inside
    assert "eval loss -0.2 (better, beyond init noise +0.0033 ± 0.13) vs fp32" in say(-0.2, eval_bands={"eval_loss": band})
    # a data-order band's reruns held out other examples: not judged against them
    data = V.seed_band(ev_ref, seeds, 0, column="eval_loss", null="data")
    assert "eval loss -0.2 (better; not judged against the data-order reruns, which held out other examples)" in \
        say(-0.2, eval_bands={"eval_loss": data})
    # a band of another column says nothing of this one
    assert "(better) vs fp32" in say(-0.05, eval_bands={"eval_accuracy": band})
    # accuracy: one unit of the table's 0.1% is the rounding
    acc_ref = pd.DataFrame({"step": [2], "eval_loss": [4.5], "eval_accuracy": [0.5]})
    acc = V.verdict("b", "a", hist([5.0, 4.0]), ref, {}, eval_history=acc_ref.assign(eval_accuracy=0.5 + 4e-4),
                    reference_eval_history=acc_ref)
    assert "eval accuracy +0.0004 (same within rounding) vs a" in acc.text


def test_two_agreeing_repeats_are_too_few_to_rank():
    """Two identical variants order the same way in two repeats half the time: no ranking below three."""
    two = V.speed([105, 104], [100, 100])
    assert not two.measurable and two.state == "too few"
    v = V.verdict("b", "a", hist([5.0, 4.0]), hist([5.0, 4.0]), {}, timings=[105, 104],
                  reference_timings=[100, 100])
    assert "too few to rank" in v.text and "faster" not in v.text
    assert V.speed([105, 104, 103], [100, 100, 100]).measurable


def test_noise_floor_is_the_rules_half_width_for_the_reference_or_the_aa_copy_never_below_the_minimum():
    ref = [100, 110, 95]
    sd = np.std(np.log(ref), ddof=1)
    assert V.noise_floor(ref) == pytest.approx(math.expm1(V.SPEED_K[3] * math.sqrt(2) * sd / math.sqrt(3)))
    assert V.noise_floor([100, 100.01, 100]) == V.MIN_EFFECT
    assert math.isnan(V.noise_floor([100, 101]))                        # two repeats say nothing of the noise
    # an explicit A/A copy: the rule's half-width for it against the reference
    aa = [104, 100, 95]
    assert V.noise_floor([100, 100, 100], aa_timings=aa) == pytest.approx(V.speed(aa, [100, 100, 100]).floor)
    # all three ratios above 1, but inside the noise of the runs: no ranking, and said as such
    noisy = V.speed([110, 120, 105], [100, 110, 95])
    assert noisy.low > 1 and not noisy.measurable and noisy.state == "too noisy"
    v = V.verdict("b", "a", hist([5.0, 4.0]), hist([5.0, 4.0]), {}, timings=[110, 120, 105],
                  reference_timings=[100, 110, 95])
    assert f"speed too noisy to judge here (1.09-1.11x, median 1.10x over 3 repeats; noise ±{noisy.floor:.0%}" in v.text
    # agreeing repeats, a quiet machine, but 2% is under the minimum effect: a measured "no difference"
    quiet = V.speed([102, 102, 102], [100, 100, 100])
    assert quiet.state == "same" and V._speed_text(quiet, "a").startswith(
        "no measurable speed difference from a (1.02x in all 3 repeats; a difference beyond")
    # the same difference stated as slower is judged alike (1/0.95 - 1 > 3%)
    slow = V.verdict("b", "a", hist([5.0, 4.0]), hist([5.0, 4.0]), {}, timings=[95, 95, 95],
                     reference_timings=[100, 100, 100])
    assert slow.speed.measurable and slow.text.startswith("b: slower than a (0.95x in all 3 repeats; noise ±")
    # an A/A copy that strayed 6%: its half-width widens the variant's, and 5% is no longer ranked
    aa = V.verdict("b", "a", hist([5.0, 4.0]), hist([5.0, 4.0]), {}, timings=[95, 95, 95],
                   reference_timings=[100, 100, 100], aa_timings=[100, 106, 100])
    assert not aa.speed.measurable and aa.speed.floor == pytest.approx(V.noise_floor([100] * 3, [100, 106, 100]))


def test_no_ratio_of_one_is_ever_called_faster_or_slower():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 6))
        ref = list(100 * (1 + rng.normal(0, 0.02, n)))
        var = list(np.array(ref) * (1 + rng.normal(0, 0.03, n)))
        text = V._speed_text(V.speed(var, ref), "a")
        s = V.speed(var, ref)
        assert ("faster" in text or "slower" in text) == s.measurable, text
        if s.measurable:   # ranked means at least MIN_EFFECT away from 1: the median never reads 1.00x
            assert f"median {s.ratio:.2f}x" in text and f"{s.ratio:.2f}" != "1.00", text


def test_the_loss_verdict_says_which_way_the_loss_went():
    ref = hist([5.0, 4.0, 3.0, 2.0])
    # reruns +0.1 and -0.1 at every step: the null's means 0, +0.1, -0.1; 95% limit 0 ± 4.303 x 0.1 x sqrt(4/3)
    band = V.seed_band(ref, {1: hist([5.1, 4.1, 3.1, 2.1]), 2: hist([4.9, 3.9, 2.9, 1.9])}, 0)
    lower = V.verdict("lr10", "a", hist([5.0, 3.5, 2.0, 1.0]), ref, {}, band=band)
    assert lower.test.limit == pytest.approx(4.303 * 0.1 * np.sqrt(4 / 3), rel=1e-3)
    assert lower.direction == "lower" and lower.leaves_band_at == 2 and lower.judged_steps == 4
    assert ("loss lower than a beyond init noise (mean -0.62 over 4 steps; init noise allows 0 ± 0.5, 95%); "
            "outside the reruns' range on 3 of 4 steps (from step 2; largest -1 at step 3)") in lower.text
    assert lower.outside == {"lower": [2, 3, 4]}
    higher = V.verdict("lr1000", "a", hist([5.0, 4.05, 7.0, 9.0]), ref, {}, band=band)
    assert higher.direction == "higher" and higher.leaves_band_at == 3
    assert "outside the reruns' range on 2 of 4 steps (from step 3; largest +7 at step 4)" in higher.text
    assert ";" not in higher.text.split("(from step 3; ")[1]   # nothing on the other side to name
    # the direction is the mean's; a step outside on the other side is named after it
    both = V.verdict("x", "a", hist([5.0, 3.5, 3.0, 5.0]), ref, {}, band=band)
    assert both.direction == "higher" and both.leaves_band_at == 2
    assert "on 1 of 4 steps (step 4: +3); also lower at step 2" in both.text
    # within the limit: no direction, whatever single steps did
    small = V.verdict("z", "a", hist([5.0, 3.5, 3.0, 2.0]), ref, {}, band=band)
    assert small.within_noise and small.direction is None and small.outside == {"lower": [2]}
    assert "loss within init noise (mean -0.12 over 4 steps" in small.text
    # mostly lower, but the last step is above the band: said, with where it ends
    r6 = hist([5.0, 4.0, 3.0, 2.0, 1.5, 1.0])
    ends = V.verdict("y", "a", hist([5.0, 3.0, 2.0, 1.0, 0.5, 1.5]), r6, {},
                     band=V.seed_band(r6, {1: hist([5.1, 4.1, 3.1, 2.1, 1.6, 1.1]),
                                           2: hist([4.9, 3.9, 2.9, 1.9, 1.4, 0.9])}, 0))
    assert ends.direction == "lower"
    assert ends.text.endswith("on 4 of 6 steps (from step 2; largest -1 at step 2); briefly higher at step 6, "
                              "where it ends")


def test_the_rule_holds_the_mean_against_a_prediction_interval_of_the_null():
    """loss_test's numbers on fixed inputs: the null is the reference (0) and the reruns' mean differences over the
    judged steps, and the decision is |mean - center| > t(0.975, k) x sd x sqrt(1 + 1/(k+1))."""
    idx = pd.Index([1, 2, 3], name="step")
    runs = pd.DataFrame({1: [0.1, 0.2, 0.3], 2: [-0.1, 0.0, -0.2], 3: [0.0, 0.1, 0.2]}, index=idx)
    band = V.SeedBand(0, (1, 2, 3), runs, runs.abs().max(axis=1))
    means = [0.0, 0.2, -0.1, 0.1]
    half = 3.182 * np.std(means, ddof=1) * np.sqrt(1 + 1 / 4)
    at = V.loss_test(pd.Series([0.0, 0.0, 0.0], index=idx) + np.mean(means) + half * 0.99, band)
    assert at.null_means == pytest.approx(tuple(means)) and at.runs == 4 and at.limit == pytest.approx(half, rel=1e-3)
    assert not at.beyond
    assert V.loss_test(pd.Series([1.0, 1.0, 1.0], index=idx) * (np.mean(means) + half * 1.01), band).beyond
    # a step the variant did not record (NaN) is left out of every run's mean alike
    part = V.loss_test(pd.Series([np.nan, 0.0, 0.0], index=idx), band)
    assert part.steps == 2 and part.null_means == pytest.approx((0.0, 0.25, -0.1, 0.15))
    assert V.t975(1) == 12.706 and V.t975(2) == 4.303 and V.t975(100) == pytest.approx(1.984, abs=0.002)


def test_steps_are_named_in_runs():
    assert V._steps_text([2]) == "step 2"
    assert V._steps_text([2, 3, 4, 9]) == "steps 2-4, 9"
    assert V._steps_text([1, 3, 5, 7, 9]) == "steps 1, 3, 5 and 2 more"
