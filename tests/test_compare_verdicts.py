"""Issue 21: compare() answers with its noise. The difference panel holds exactly loss(variant) - loss(reference),
the seed-noise band is the recorded seed runs' differences, a worse variant is flagged at the step where it leaves
the band, speed comes with its spread, and one verdict line per variant says it, every number from the runs."""

from __future__ import annotations

import dataclasses
import html as htmllib
import re
import statistics
import threading

import numpy as np
import pandas as pd
import pytest

import nbtrain as nbt
from nbtrain import verdicts
from nbtrain.compare import compare
from nbtrain.viz.figures import find_trace, find_traces

from .helpers import inject_inf

STEPS = 8
SKIPS = 4   # fp16's first steps overflow: it trains SKIPS steps fewer than fp32 and lags behind


def tiny_cfg(**kw):
    # fp32 where precision is not the point: fp16/bf16 autocast is ~10x slower on a CPU without 16-bit units.
    base = dict(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=16, micro_batch_size=4,
                max_steps=STEPS, eval_fraction=0.25, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def judged():
    """fp32 (the reference), fp16 whose first SKIPS steps overflow, an identical copy of fp32, and lr x10; the
    reference again under seeds 1 and 2. Also returns the configs every engine run was given, in order."""
    import nbtrain.engine.loop as loop

    ran = []
    original = loop._run

    def spy(cfg, callbacks=None, **kw):
        ran.append((kw.get("variant"), cfg, callbacks))
        return original(cfg, callbacks, **kw)

    class Seen:
        def __init__(self):
            self.variants = []

        def on_run_start(self, info):
            self.variants.append(info.variant)

    seen = Seen()
    with pytest.MonkeyPatch.context() as mp:
        # fp32 runs training forwards 1..STEPS (one micro-batch a step), so fp16's steps 1..SKIPS follow them.
        inject_inf(mp, on_forward_calls=set(range(STEPS + 1, STEPS + SKIPS + 1)))
        mp.setattr(loop, "_run", spy)
        cmp = compare(tiny_cfg(), variants={"fp32": {}, "fp16": dict(precision="fp16"), "same": {},
                                            "lr10": dict(lr=1e-2)},
                      seeds=(0, 1, 2), warmup=False, callbacks=[seen])
    return cmp, ran, seen


def first_outside(diff: pd.Series, width: pd.Series):
    """The first step where |diff| > width, computed here from the two series (NaN compares as inside)."""
    d = diff.reindex(width.index).to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        out = np.abs(d) > width.to_numpy(dtype=float)
    idx = np.flatnonzero(out)
    return int(width.index[idx[0]]) if len(idx) else None


# -- the difference panel --------------------------------------------------------------------------------------
def test_difference_panel_is_exactly_the_loss_difference_per_step(judged):
    cmp, _, _ = judged
    fig = cmp.figure()
    ref = cmp.results["fp32"].history
    for name in ("fp16", "same", "lr10"):
        h = cmp.results[name].history
        assert list(h.step) == list(ref.step)
        expect = h.loss.to_numpy(dtype=float) - ref.loss.to_numpy(dtype=float)
        tr = find_trace(fig, "loss_diff", "loss_diff", run=name)
        np.testing.assert_array_equal(np.asarray(tr.x, dtype=float), ref.step.to_numpy(dtype=float))
        np.testing.assert_array_equal(np.asarray(tr.y, dtype=float), expect)
        np.testing.assert_array_equal(cmp.differences[name].to_numpy(), expect)
        # The panel alone (the Panel shows it after a Compare) holds the same numbers.
        alone = find_trace(cmp.difference_figure(), "loss_diff", "loss_diff", run=name)
        np.testing.assert_array_equal(np.asarray(alone.y, dtype=float), expect)
    assert (cmp.differences["same"] == 0).all()
    # Eval differences: markers in the same panel, at the evaluated steps.
    ev_ref = cmp.results["fp32"].eval_history
    assert len(ev_ref) >= 1
    ev = cmp.results["lr10"].eval_history
    expect = ev.eval_loss.to_numpy(dtype=float) - ev_ref.eval_loss.to_numpy(dtype=float)
    np.testing.assert_array_equal(cmp.eval_differences["lr10"].to_numpy(), expect)
    marks = find_trace(fig, "loss_diff", "eval_loss_diff", run="lr10")
    np.testing.assert_array_equal(np.asarray(marks.y, dtype=float), expect)
    assert list(marks.x) == list(ev.step)


def test_reference_by_name_and_an_unknown_one_is_refused(monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("no run may start")

    monkeypatch.setattr("nbtrain.engine.loop._run", no_run)
    with pytest.raises(ValueError, match=r"reference: 'fp64' is not one of the variants \['fp32', 'bf16'\]"):
        compare(tiny_cfg(), precisions=("fp32", "bf16"), reference="fp64")


def test_reference_by_name_moves_the_zero_line():
    cmp = compare(tiny_cfg(max_steps=3, eval_fraction=0.0), variants={"slow": dict(lr=1e-4), "fast": {}},
                  reference="fast", warmup=False)
    assert cmp.reference == "fast"
    h_slow, h_fast = cmp.results["slow"].history, cmp.results["fast"].history
    np.testing.assert_array_equal(cmp.differences["slow"].to_numpy(), (h_slow.loss - h_fast.loss).to_numpy())
    assert (cmp.differences["fast"] == 0).all()
    assert cmp.table.set_index("variant").loc["fast", "speedup"] == 1.0
    assert cmp.verdicts["fast"].is_reference and cmp.verdicts["slow"].text.startswith("slow: ")
    assert "relative to 'fast', as reference= asked" in htmllib.unescape(cmp.summary_html())


# -- the seed-noise band ---------------------------------------------------------------------------------------
def test_seed_runs_are_the_reference_under_the_other_seeds(judged):
    cmp, ran, seen = judged
    seed_runs = [(v, c, cb) for v, c, cb in ran if c.seed != 0]
    assert [c.seed for _, c, _ in seed_runs] == [1, 2]                   # seed 0 is the reference run itself
    ref_cfg = cmp.configs["fp32"]
    for _, c, cb in seed_runs:
        assert cb is None and c.output_dir is None                        # no user callbacks, nothing written
        # the default band: other initial weights (seed), the reference's data order held (data_seed)
        assert c.data_seed == ref_cfg.data_order_seed == 0
        assert c.replace(seed=0).to_dict() == {**ref_cfg.to_dict(), "output_dir": None, "data_seed": 0}
    assert ran[-2:] == seed_runs                                          # after the variants
    assert seen.variants == ["fp32", "fp16", "same", "lr10"]              # the user's callbacks saw variants only
    assert set(cmp.seed_results) == {1, 2} and cmp.reference_seed == 0
    assert cmp.seed_wall_s == {s: r.summary["wall_s"] for s, r in cmp.seed_results.items()}
    for r in cmp.seed_results.values():
        assert r.history.loss.iloc[0] != cmp.results["fp32"].history.loss.iloc[0]   # other weights
        assert r.summary["data_hash"] == cmp.results["fp32"].summary["data_hash"]   # the same batches
        assert r.summary["init_hash"] != cmp.results["fp32"].summary["init_hash"]


def test_band_is_the_recorded_seed_runs_differences_and_drawn_as_plus_minus_width(judged):
    cmp, _, _ = judged
    ref = cmp.results["fp32"].history.set_index("step").loss
    band = cmp.band
    assert band.seeds == (1, 2)
    for s, r in cmp.seed_results.items():
        expect = r.history.set_index("step").loss - ref
        np.testing.assert_array_equal(band.runs[s].to_numpy(), expect.to_numpy())
    width = np.maximum(np.abs(band.runs[1].to_numpy()), np.abs(band.runs[2].to_numpy()))
    np.testing.assert_array_equal(band.width.to_numpy(), width)
    assert (width > 0).all()
    fig = cmp.figure()
    high = find_trace(fig, "loss_diff", "noise_band_high")
    low = find_trace(fig, "loss_diff", "noise_band_low")
    np.testing.assert_array_equal(np.asarray(high.y, dtype=float), width)
    np.testing.assert_array_equal(np.asarray(low.y, dtype=float), -width)
    assert list(high.x) == list(band.width.index) and low.fill == "tonexty"
    # Behind the difference lines: drawn before them.
    kinds = [t.meta["kind"] for t in find_traces(fig, panel="loss_diff")]
    assert kinds.index("noise_band_low") < kinds.index("loss_diff")
    # The cost is visible: under the table and in the reference's verdict.
    each = ", ".join(f"{s}: {t:.1f} s" for s, t in cmp.seed_wall_s.items())
    assert f"seed runs {each}" in htmllib.unescape(cmp.summary_html())
    assert f"seed runs {each}" in cmp.format_table()
    total = sum(cmp.seed_wall_s.values())
    assert cmp.verdicts["fp32"].text == ("fp32: the reference (init noise from reruns with other initial weights, the "
                                         f"same batches: seeds 1, 2, {total:.1f} s)")


def test_worse_variants_leave_the_band_at_the_step_computed_here_and_identical_is_within_noise(judged):
    cmp, _, _ = judged
    width = cmp.band.width
    for name in ("fp16", "lr10"):
        step = first_outside(cmp.differences[name], width)
        assert step is not None, name                                     # the test's premise: it does leave
        v = cmp.verdicts[name]
        assert v.within_noise is False and v.leaves_band_at == step, (name, step, v.text)
        d = cmp.differences[name].reindex(width.index)
        out = d.abs() > width + verdicts.EDGE_TOL
        low, high = list(d.index[out & (d < 0)]), list(d.index[out & (d > 0)])
        # the direction is the mean difference's, against the reference's and its reruns' mean differences
        null = [0.0, *(cmp.band.runs[c].mean() for c in cmp.band.runs.columns)]
        direction = "lower" if d.mean() < np.mean(null) else "higher"
        mine = low if direction == "lower" else high
        assert v.direction == direction
        judged = int(d.notna().sum())   # the steps both runs and the band have
        assert f"loss {direction} than fp32 beyond init noise (mean {d.mean():+.2g} over {judged} steps" in v.text
        assert f"outside the reruns' range on {len(mine)} of {judged} steps" in v.text
    same = cmp.verdicts["same"]
    assert same.within_noise is True and same.leaves_band_at is None and same.max_abs_diff == 0.0
    assert f"loss within init noise (mean +0 over {same.judged_steps} steps" in same.text


def test_overflow_verdict_states_the_skipped_steps_and_the_scale_drop(judged):
    cmp, _, _ = judged
    h = cmp.results["fp16"].history
    s = cmp.results["fp16"].summary
    assert s["skipped_steps"] == int(h.skipped.sum()) == SKIPS
    v = cmp.verdicts["fp16"]
    # The scale before step 1 is the GradScaler's initial one: step 1 was skipped, so its record holds half of it.
    initial = float(h.scale.iloc[0]) * 2
    assert bool(h.skipped.iloc[0]) and initial == 65536.0
    assert (v.skipped_steps, v.scale_first, v.scale_min) == (SKIPS, initial, float(h.scale.min()))
    assert f"{SKIPS} skipped steps (scale {initial:,.0f} → {h.scale.min():,.0f})" in v.text
    assert "skipped" not in cmp.verdicts["lr10"].text                   # no GradScaler, nothing to say


def test_verdicts_are_above_the_table_in_every_view(judged, tmp_path):
    cmp, _, _ = judged
    doc = cmp.summary_html()
    assert doc.index('class="nbt-verdicts"') < doc.index('class="nbt-compare-table"')
    for name, v in cmp.verdicts.items():
        assert f"<b>{name}</b>: {htmllib.escape(v.text[len(name) + 2:])}" in doc
    text = cmp.format_table()
    lines = text.splitlines()
    assert lines[:4] == [v.text for v in cmp.verdicts.values()]
    assert lines[5].split()[:2] == ["variant", "precision_used"]
    report = cmp.to_html(tmp_path / "r.html").read_text(encoding="utf-8")
    assert report.index('class="nbt-verdicts"') < report.index('class="nbt-compare-table"')
    assert htmllib.escape(cmp.verdicts["fp16"].text.split(": ", 1)[1]) in report


def test_variants_that_did_not_run_get_a_verdict_too():
    stop = threading.Event()

    class StopAt:
        def on_step_end(self, rec):
            if rec.variant == "a" and rec.step == 1:
                stop.set()

    cmp = compare(tiny_cfg(max_steps=3, eval_fraction=0.0), variants={"a": {}, "b": {}}, seeds=(0, 1),
                  callbacks=[StopAt()], warmup=False, stop=stop)
    assert cmp.completion == {"a": "cut", "b": "not_run"}
    assert cmp.seed_results == {} and cmp.band is None                    # a stop ends the seed runs too
    assert "seed 1: not run, the comparison was stopped" in cmp.format_table()
    v = cmp.verdicts["b"]
    assert not v.ran and v.text == "b: not run (the comparison was stopped)"
    assert cmp.verdicts["a"].text.startswith("a: the reference") and "ended: stopped" in cmp.verdicts["a"].text


# -- speed with its spread -------------------------------------------------------------------------------------
def _timed(monkeypatch, factors):
    """compare() of two identical fp32 variants over 3 repeats, a's tokens/s set to 1,000 and b's to 1,000 times
    ``factors[r]`` in repeat r (the machine's own timings are too noisy to test an ordering on; the order of a
    and b rotates from repeat to repeat, so b cannot read a's timing of its repeat)."""
    import nbtrain.engine.loop as loop

    original, runs = loop._run, {"b": 0}

    def spy(cfg, callbacks=None, **kw):
        res = original(cfg, callbacks, **kw)
        v = kw.get("variant")
        tps = 1000.0 if v == "a" else 1000.0 * factors[runs["b"]]
        runs["b"] += v == "b"
        # a timed run's speed is its steps' tokens over their step times (compare.run._tokens_per_s)
        res.records[:] = [dataclasses.replace(r, tokens_per_s=tps, step_time_s=1.0) for r in res.records]
        return res

    monkeypatch.setattr(loop, "_run", spy)
    return compare(tiny_cfg(max_steps=2, eval_fraction=0.0), variants={"a": {}, "b": {}}, repeats=3,
                   warmup=False)


@pytest.mark.parametrize("factors", [(1.10, 0.90, 1.05), (1.30, 1.20, 1.25)], ids=["flips", "agrees"])
def test_speed_is_a_paired_ratio_with_its_spread_and_a_flip_is_no_ranking(monkeypatch, factors):
    cmp = _timed(monkeypatch, factors)
    ratios = [b / a for (a, _), (b, _) in zip(cmp.timings["a"], cmp.timings["b"])]
    assert ratios == pytest.approx(list(factors))
    assert cmp.run_order == [["a", "b"], ["b", "a"], ["a", "b"]]
    v = cmp.verdicts["b"]
    assert v.speed.ratio == pytest.approx(statistics.median(ratios))
    spread = (max(ratios) - min(ratios)) / 2
    assert v.speed.spread == pytest.approx(spread)
    cell = cmp.compact_table().set_index("Variant").loc["b", "Tokens/s (speed-up)"]
    # the range first, then the median: never a ± that can be wider than the value
    assert cell.endswith(f"({min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x)")
    assert "±" not in cell
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x" in cmp.format_table()
    t = cmp.table.set_index("variant")
    assert t.loc["b", "speedup"] == pytest.approx(statistics.median(ratios))
    assert t.loc["b", "speedup_spread"] == pytest.approx(spread)
    assert (t.loc["b", "speedup_low"], t.loc["b", "speedup_high"]) == pytest.approx((min(ratios), max(ratios)))
    if min(ratios) < 1 < max(ratios):   # three repeats that disagree on the order: no claim either way
        assert v.speed.state == "too noisy" and "speed too noisy to judge here" in v.text
        assert "faster" not in v.text and "slower" not in v.text and "no measurable" not in v.text
    else:
        assert v.speed.state == "faster" and "faster" in v.text
    # a's timings are all alike: the comparison's floor is the minimum effect; b is judged on its own half-width
    # (the rule's, from both sides' repeats), in the table and in the verdict alike
    assert cmp.noise_floor == pytest.approx(verdicts.MIN_EFFECT)
    alone = verdicts.speed(factors, [1.0] * 3)   # the same ratios (the unit of the timings does not matter)
    assert (v.speed.state, v.speed.floor, v.speed.ratio) == (alone.state, pytest.approx(alone.floor),
                                                            pytest.approx(alone.ratio))
    assert t.loc["b", "noise_floor"] == pytest.approx(v.speed.floor)
    if not min(ratios) < 1 < max(ratios):
        assert v.text.startswith(f"b: faster than a ({min(ratios):.2f}-{max(ratios):.2f}x, median "
                                 f"{statistics.median(ratios):.2f}x over 3 repeats; noise ±{v.speed.floor:.0%}")
    assert bool(t.loc["b", "speed_measurable"]) is (not min(ratios) < 1 < max(ratios))
    # The figure's throughput bars carry the repeats' range.
    bars = find_traces(cmp.figure(), kind="tokens_per_s")[0]
    tps_b = [t for t, _ in cmp.timings["b"]]
    b_at = list(bars.x).index("b")
    assert bars.y[b_at] + bars.error_y.array[b_at] == pytest.approx(max(tps_b))
    assert bars.y[b_at] - bars.error_y.arrayminus[b_at] == pytest.approx(min(tps_b))


def test_one_timing_is_never_a_ranking(judged):
    cmp, _, _ = judged
    for name in ("fp16", "same", "lr10"):
        text = cmp.verdicts[name].text
        assert "one timing, spread unknown" in text and "faster" not in text and "slower" not in text
    cell = cmp.compact_table().set_index("Variant").loc["same", "Tokens/s (speed-up)"]
    assert "±" not in cell and cell.endswith(f"({cmp.verdicts['same'].speed.ratio:.2f}x, one timing)")


# -- the Panel and the command line ----------------------------------------------------------------------------
def test_panel_noise_band_control_runs_the_seeds_and_shows_verdicts_and_the_difference_panel():
    pytest.importorskip("ipywidgets")
    from nbtrain.ui.panel import Panel

    from .test_ui import TIMEOUT

    panel = Panel(tiny_cfg(max_steps=2, eval_fraction=0.0, seed=5), debounce_s=0)
    assert panel.seeds_control.value == 0 and panel.seeds_control in panel.runner.buttons_row.children[-1].children
    for p, box in panel.compare_choices.items():
        box.value = p == "fp32"
    panel.seeds_control.value = 1
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp is not None and cmp.seeds == (5, 6) and list(cmp.seed_results) == [6]
    assert cmp.band is not None and cmp.seed_results[6].config.seed == 6
    assert 'class="nbt-verdicts"' in panel.verdicts.value
    assert "init noise from reruns with other initial weights, the same batches: seeds 6" in panel.verdicts.value
    assert panel.summary_area.children == (panel.verdicts, panel.comparison_table)
    # one variant: the live figure had no difference row; the difference panel comes after it, with the band,
    # and the table's notes (under the figure, so that the answer fits the screen) last
    children = panel.dashboard_area.children
    assert panel.difference_view in children[1:] and children[-1] is panel.runner.table_notes
    data = panel.difference_view.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    kinds = [t["meta"]["kind"] for t in data["data"]]
    assert kinds[:2] == ["noise_band_high", "noise_band_low"]


def test_panel_advice_names_its_own_controls():
    """A Panel comparison's verdicts advise the Panel's controls ("set repeats to 5"), not compare()'s arguments."""
    pytest.importorskip("ipywidgets")
    from nbtrain.ui.panel import Panel

    from .test_ui import TIMEOUT

    panel = Panel(tiny_cfg(max_steps=2, eval_fraction=0.0), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p in ("fp32", "bf16")
    panel.compare_button.click()
    cmp = panel.wait(TIMEOUT)
    assert cmp.advice == "panel" and "set repeats to 5" in panel.verdicts.value, panel.verdicts.value
    assert "repeats=5" not in panel.verdicts.value


def test_cli_compare_takes_seeds(tmp_path, capsys):
    from nbtrain.cli import main

    cfg_path = tmp_path / "cfg.yaml"
    tiny_cfg(max_steps=2, eval_fraction=0.0).to_yaml(cfg_path)
    assert main(["compare", str(cfg_path), "--precisions", "fp32", "--seeds", "0,1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^fp32: the reference \(init noise from reruns with other initial weights, the same batches: "
                     r"seeds 1, \d+\.\d s\)$", out, re.M)
    assert re.search(r"noise band \(init noise: .*\): 'fp32' again under seed 1 .*seed runs 1: \d+\.\d s", out)
    with pytest.raises(SystemExit):
        main(["compare", str(cfg_path), "--seeds", "0,x"])
    assert main(["compare", str(cfg_path), "--precisions", "fp32", "--seeds", "0,1", "--band", "rounding",
                 "--rounding", "0.001"]) == 0
    assert "rounding noise from reruns with each initial weight moved by up to ±0.001" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["compare", str(cfg_path), "--band", "seed"])


def test_seeds_must_be_ints():
    with pytest.raises(ValueError, match="seeds"):
        compare(tiny_cfg(), seeds=(0, "1"))
    with pytest.raises(ValueError, match="seeds"):
        compare(tiny_cfg(), seeds=3)
