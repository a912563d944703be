"""Issue 38: a preference comparison's table has the log-prob mismatch and the last reward margin and accuracy, and
its verdicts judge the reward margin and accuracy against the reference's seed band, as the loss is judged; an
objective="lm" comparison has neither. The runs are synthetic TrainResults (no training): every number asserted
is computed here from the histories given."""

from __future__ import annotations

import html as htmllib
import math

import re

import numpy as np
import pandas as pd
import pytest

import nbtrain as nbt
from nbtrain import verdicts
from nbtrain.compare.result import ComparisonResult, _Outcome, _Schedule, _SeedRuns
from nbtrain.engine.finish import RunSummary, TrainResult, frame
from nbtrain.engine.records import STEP_FIELDS, EvalRecord, RunInfo, StepRecord
from nbtrain.viz.figures import find_trace, find_traces

STEPS = 8
BASE = dict(model="tiny", data="builtin:python-docs", max_steps=STEPS, micro_batch_size=4, lr=1e-3)
STEP = np.arange(1, STEPS + 1)
# the reference's curves, and what the seeds 1 and 2 move them by (the band's width is the larger, per step)
MARGIN = 0.05 * STEP
ACCURACY = np.array([0.5, 0.5, 0.75, 0.75, 0.75, 1.0, 1.0, 1.0])
LOSS = math.log(2) - 0.01 * STEP
SEED_MOVES = {1: (0.02, 0.125, 0.003), 2: (-0.03, -0.125, -0.002)}   # (margin, accuracy, loss)


def history(margin, accuracy, loss=LOSS, *, nonfinite=(), objective="dpo") -> pd.DataFrame:
    recs = []
    for i, s in enumerate(STEP.tolist()):
        bad = s in nonfinite
        rewards = {} if objective == "lm" else dict(
            reward_chosen=math.nan if bad else 0.5 * float(margin[i]),
            reward_rejected=math.nan if bad else -0.5 * float(margin[i]),
            reward_margin=math.nan if bad else float(margin[i]),
            reward_accuracy=0.0 if bad else float(accuracy[i]))
        recs.append(StepRecord(step=s, epoch=s / STEPS, micro_steps=1, tokens=64, loss=math.nan if bad else float(
            loss[i]), lr=1e-3, grad_norm=math.nan if bad else 0.5, clipped=False, scale=None, skipped=False,
            nonfinite=bad, vram_allocated_gib=None, vram_reserved_gib=None, vram_peak_gib=None, host_rss_gib=1.0,
            step_time_s=0.1, tokens_per_s=640.0, elapsed_s=0.1 * s, **rewards))
    return frame(recs, STEP_FIELDS)


def result(name, hist, *, mismatch=None, objective="dpo", precision="fp32") -> TrainResult:
    cfg = nbt.TrainConfig(**BASE, objective=objective, precision="fp32")
    bad = [int(s) for s, f in zip(hist.step, hist.nonfinite) if f]
    summary = RunSummary(steps=len(hist), tokens=64 * len(hist), tokens_per_s=640.0, wall_s=1.0,
                         final_loss=float(hist.loss.iloc[-1]), stopped_reason="max_steps", precision_used=precision,
                         device="cpu", nonfinite_steps=len(bad), first_nonfinite_step=bad[0] if bad else None,
                         init_hash="i", data_hash="d")
    if mismatch is not None or objective != "lm":
        summary["logprob_mismatch"] = mismatch
    info = RunInfo(config=cfg, precision_used=precision, device="cpu", device_name="test", device_total_gib=8.0,
                   scaler_enabled=False, total_steps=STEPS, train_examples=32, eval_examples=0,
                   trainable_params=1, total_params=1, max_grad_norm=1.0, variant=name)
    return TrainResult(history=hist, eval_history=pd.DataFrame(columns=list(EvalRecord.__dataclass_fields__)),
                       summary=summary, model=None, tokenizer=None, config=cfg, info=info)


def comparison(runs: dict, *, seeds: bool = True, objective="dpo") -> ComparisonResult:
    """``runs``: name -> (history, mismatch); the first is the reference, its seed runs move its curves by
    SEED_MOVES (None: no seed runs)."""
    outcomes = []
    for name, (hist, mismatch) in runs.items():
        res = result(name, hist, mismatch=mismatch, objective=objective, precision=name.split()[0])
        outcomes.append(_Outcome(name, {}, res.config.to_dict(), config=res.config, result=res, status="max_steps",
                                 timings=[(640.0, 1.0)], fair=True))
    ref_hist = next(iter(runs.values()))[0]
    seed_runs = _SeedRuns(requested=(0, 1, 2) if seeds else ())
    if seeds:
        seed_runs.reference_seed = 0
        for s, (dm, da, dl) in SEED_MOVES.items():
            moved = history(ref_hist.reward_margin.to_numpy(float) + dm, ref_hist.reward_accuracy.to_numpy(float)
                            + da, ref_hist.loss.to_numpy(float) + dl, objective=objective) \
                if objective != "lm" else history(MARGIN, ACCURACY, LOSS + dl, objective="lm")
            seed_runs.results[s] = result(f"ref (seed {s})", moved, objective=objective)
    names = list(runs)
    return ComparisonResult(outcomes, outcomes[0].config, names[0], [], 1, seed_runs=seed_runs,
                            schedule=_Schedule(run_order=[names]))


@pytest.fixture(scope="module")
def pref():
    """fp32 (the reference); bf16 inside the band; fp16 whose margin and accuracy fall far below from step 3, its
    loss the reference's; bf16-pure with NaN rewards at steps 4-5."""
    fp16_margin = MARGIN.copy()
    fp16_margin[2:] -= 0.5
    fp16_acc = ACCURACY.copy()
    fp16_acc[2:] = 0.0
    return comparison({
        "fp32": (history(MARGIN, ACCURACY), 0.0),
        "bf16": (history(MARGIN + 0.01, ACCURACY), 0.0123456),
        "fp16": (history(fp16_margin, fp16_acc), 3.2e-05),
        "bf16-pure": (history(MARGIN, ACCURACY, nonfinite={4, 5}), None),
    })


# -- the table ----------------------------------------------------------------------------------------------
def test_the_table_has_the_logprob_mismatch_and_the_last_reward_margin_and_accuracy(pref):
    t = pref.table.set_index("variant")
    assert t.loc["bf16", "logprob_mismatch"] == pytest.approx(0.0123456)
    assert t.loc["fp32", "logprob_mismatch"] == 0.0
    assert math.isnan(t.loc["bf16-pure", "logprob_mismatch"])          # not measured: None in its summary
    for name in ("fp32", "bf16", "fp16"):
        h = pref.results[name].history
        assert t.loc[name, "reward_margin"] == pytest.approx(float(h.reward_margin.iloc[-1]))
        assert t.loc[name, "reward_accuracy"] == pytest.approx(float(h.reward_accuracy.iloc[-1]))
    assert t.loc["fp16", "reward_accuracy"] == 0.0 and t.loc["fp16", "reward_margin"] == pytest.approx(0.4 - 0.5)


def test_the_text_table_formats_them_and_marks_a_missing_mismatch(pref):
    text = pref.format_table()
    header = next(line for line in text.splitlines() if "logprob_mismatch" in line)
    assert "reward_margin" in header and "reward_accuracy" in header
    table = pref._formatted(["variant", "reward_margin", "reward_accuracy", "logprob_mismatch"]).set_index("variant")
    assert table.loc["bf16", "logprob_mismatch"] == "0.0123"
    assert table.loc["fp16", "logprob_mismatch"] == "3.2e-05"     # not 0.0000: fp16 moved the log-probs a little
    assert table.loc["fp32", "logprob_mismatch"] == "0"
    assert table.loc["bf16-pure", "logprob_mismatch"] == "-"
    assert table.loc["fp32", "reward_margin"] == f"{MARGIN[-1]:.4f}"
    assert table.loc["fp16", "reward_accuracy"] == "0.000"


def test_the_compact_table_shows_reward_and_mismatch_for_a_preference_comparison(pref):
    compact = pref.compact_table().set_index("Variant")
    assert "Reward margin (accuracy)" in compact.columns and "Log-prob mismatch" in compact.columns
    assert compact.loc["fp32", "Reward margin (accuracy)"] == f"{MARGIN[-1]:.4f} (100%)"
    assert compact.loc["fp16", "Reward margin (accuracy)"] == "-0.1000 (0%)"
    assert compact.loc["bf16", "Log-prob mismatch"] == "0.0123"
    assert compact.loc["bf16-pure", "Log-prob mismatch"] == "—"


def test_a_nan_reward_on_the_last_step_is_shown_as_nan_not_hidden():
    cmp = comparison({"fp32": (history(MARGIN, ACCURACY), 0.0),
                      "fp16": (history(MARGIN, ACCURACY, nonfinite={STEPS}), 0.001)}, seeds=False)
    assert math.isnan(cmp.table.set_index("variant").loc["fp16", "reward_margin"])
    assert cmp.compact_table().set_index("Variant").loc["fp16", "Reward margin (accuracy)"] == "nan (0%)"


# -- the verdicts -------------------------------------------------------------------------------------------
def _band(column):
    """The seed band of ``column`` computed here: per step, the larger |seed - reference| of the two seeds."""
    return np.maximum(*(np.abs(np.full(STEPS, m[k])) for m in SEED_MOVES.values()
                        for k in [{"reward_margin": 0, "reward_accuracy": 1}[column]]))


def test_the_reward_bands_are_the_seed_runs_differences(pref):
    assert set(pref.reward_bands) == {"reward_margin", "reward_accuracy"}   # reward_mean is GRPO's
    for col in ("reward_margin", "reward_accuracy"):
        band = pref.reward_bands[col]
        assert band.column == col and band.seeds == (1, 2)
        np.testing.assert_allclose(band.width.to_numpy(), _band(col))
        ref = pref.results["fp32"].history[col].to_numpy(float)
        np.testing.assert_allclose(pref.reward_differences[col]["fp16"].to_numpy(),
                                   pref.results["fp16"].history[col].to_numpy(float) - ref)


def test_a_variant_far_outside_the_reward_band_is_flagged_where_it_leaves_it(pref):
    v = pref.verdicts["fp16"]
    assert v.within_noise is True and "loss within init noise (mean +0 over" in v.text   # its loss is the ref's
    for col, label in (("reward_margin", "reward margin"), ("reward_accuracy", "reward accuracy")):
        j = v.rewards[col]
        diff = pref.reward_differences[col]["fp16"]
        outside = [int(s) for s, d, w in zip(diff.index, diff.to_numpy(), _band(col)) if abs(d) > w + 1e-9]
        assert outside == list(range(3, STEPS + 1))
        assert j.within_noise is False and j.direction == "lower" and j.leaves_band_at == outside[0]
        assert j.outside == {"lower": outside}
        at = int(diff.index[int(np.argmin(diff.to_numpy()))])   # the first step of the largest drop
        assert at == (3 if col == "reward_margin" else 6)
        assert j.text.startswith(f"{label} lower than fp32 beyond init noise (mean {diff.mean():+.2g} over {STEPS} "
                                 "steps; init noise allows "), j.text
        assert j.text.endswith(f"95%); outside the reruns' range on {len(outside)} of {STEPS} steps "
                               f"(from step 3; largest {diff[at]:+.2g} at step {at})"), j.text
        assert j.text in v.text
    # flagged in the HTML, though its loss is within the band and nothing was skipped
    assert '<li style="color:#b45309"><b>fp16</b>' in pref.summary_html()


def test_a_variant_inside_the_reward_band_is_the_same(pref):
    v = pref.verdicts["bf16"]
    for col, label in (("reward_margin", "reward margin"), ("reward_accuracy", "reward accuracy")):
        assert v.rewards[col].within_noise is True and v.rewards[col].judged_steps == STEPS
        assert f"{label} within init noise (mean" in v.text
    assert '<li style="color:#222"><b>bf16</b>' in pref.summary_html()
    # the reference is the reference: no reward words of its own
    assert not pref.verdicts["fp32"].rewards and "reward" not in pref.verdicts["fp32"].text


def test_non_finite_rewards_are_named_and_never_judged_inside(pref):
    v = pref.verdicts["bf16-pure"]
    j = v.rewards["reward_margin"]
    assert j.nonfinite_at == [4, 5] and j.within_noise is False
    assert j.judged_steps == STEPS - 2          # the NaN steps are not averaged into the band's judgement
    assert re.search(rf"reward margin within init noise \(mean [^)]* over {STEPS - 2} steps; [^)]*\), non-finite at "
                     r"steps 4-5", v.text), v.text
    assert "2 non-finite steps" in v.text


def test_a_variant_whose_rewards_are_all_nan_says_so():
    cmp = comparison({"fp32": (history(MARGIN, ACCURACY), 0.0),
                      "fp16": (history(MARGIN, ACCURACY, nonfinite=set(STEP.tolist())), 0.5)})
    j = cmp.verdicts["fp16"].rewards["reward_margin"]
    assert j.text == f"reward margin non-finite at steps 1-{STEPS}" and j.within_noise is False
    assert j.judged_steps == 0


def test_without_seed_runs_the_reward_verdict_gives_the_largest_difference_only():
    cmp = comparison({"fp32": (history(MARGIN, ACCURACY), 0.0), "bf16": (history(MARGIN + 0.04, ACCURACY), 0.01)},
                     seeds=False)
    assert cmp.reward_bands == {}
    v = cmp.verdicts["bf16"]
    assert v.rewards["reward_margin"].within_noise is None
    assert "reward margin differs from fp32 by at most 0.04 (no seed band to judge it)" in v.text
    assert "reward accuracy differs from fp32 by at most 0 (no seed band to judge it)" in v.text


# -- objective="lm": nothing of the above ---------------------------------------------------------------------
def test_an_lm_comparison_has_no_reward_columns_words_or_panels():
    cmp = comparison({"fp32": (history(MARGIN, ACCURACY, objective="lm"), None),
                      "bf16": (history(MARGIN, ACCURACY, LOSS + 0.5, objective="lm"), None)}, objective="lm")
    assert "reward_margin" not in cmp.table.columns and "reward_accuracy" not in cmp.table.columns
    assert cmp.table["logprob_mismatch"].isna().all()
    assert "logprob_mismatch" not in cmp.format_table()           # an empty column is left out of the text
    assert not any("reward" in c or "mismatch" in c.lower() for c in cmp.compact_table().columns)
    assert cmp.reward_bands == {} and cmp.reward_differences == {}
    v = cmp.verdicts["bf16"]
    assert v.rewards == {} and "reward" not in v.text
    assert v.within_noise is False                               # the loss verdict itself is unchanged
    assert not find_traces(cmp.figure(), panel="reward_margin")


def test_the_comparison_figure_plots_each_variants_rewards(pref):
    fig = pref.figure()
    for col in ("reward_margin", "reward_accuracy"):
        assert len(find_traces(fig, panel=col, kind=col)) == 4
        tr = find_trace(fig, col, col, run="fp16")
        np.testing.assert_array_equal(np.asarray(tr.y, dtype=float),
                                      pref.results["fp16"].history[col].to_numpy(float))
    assert "reward accuracy" in htmllib.unescape(" ".join(a.text for a in fig.layout.annotations))


def test_the_pure_verdict_judges_rewards_only_where_the_reference_has_them():
    ref = history(MARGIN, ACCURACY)
    lm = history(MARGIN, ACCURACY, objective="lm")
    summary = {"stopped_reason": "max_steps"}
    # an lm run beside a preference reference, and a preference run beside an lm reference: no reward words
    assert "reward" not in verdicts.verdict("lm", "ref", lm, ref, summary).text
    assert "reward" not in verdicts.verdict("dpo", "ref", ref, lm, summary).text
    assert "reward margin" in verdicts.verdict("dpo", "ref", history(MARGIN + 1, ACCURACY), ref, summary).text
