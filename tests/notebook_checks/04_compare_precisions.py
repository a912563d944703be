"""Library checks of notebooks/04_compare_precisions.ipynb, run in its kernel after the named cells."""
# %% after: 04-32
assert answer_runs == 3 + 3 * 3 + 2    # exercise 1: three drawn live, three variants x three repeats, two seeds
# %% after: 04-07
# numbers that mean something: no speed half-width past ±50% is printed as a figure, in any verdict or table
import re as _re
_said = [v.text for v in cmp.verdicts.values()] + cmp.compact_table().astype(str).values.ravel().tolist()
assert not [t for t in _said if any(float(x) > 50 for x in _re.findall(r"±([\d.]+)%", t)) or "either way" in t], _said
import math
import statistics

from nbtrain import verdicts

assert v16.test.null == vb16.test.null == "init" and v16.test.runs == 3
assert "loss within init noise (mean" in v16.text and "loss within init noise (mean" in vb16.text
assert vb16.skipped_steps == 0 and f"{v16.skipped_steps} skipped step" in v16.text   # only fp16 has a GradScaler
if cmp.results["fp16"].summary["device"] == "cpu":   # where the run trained, whatever capabilities() says
    assert v16.skipped_steps == vb16.skipped_steps == 0 and "0 skipped steps" in v16.text   # no fp16 overflow here
# Speed: the words agree with the rule, recomputed here from the timings, whatever this machine measured.
for name in ("fp16", "bf16"):
    v = cmp.verdicts[name]
    ratios = [t / r for (t, _), (r, _) in zip(cmp.timings[name], cmp.timings["fp32"])]
    assert v.speed.n == 3 and (v.speed.low, v.speed.high) == (min(ratios), max(ratios))
    assert math.isclose(v.speed.ratio, statistics.median(ratios))
    assert v.speed == verdicts.speed([t for t, _ in cmp.timings[name]], [r for r, _ in cmp.timings["fp32"]])
    if v.speed.state in ("faster", "slower"):   # ranked: the median beyond the half-width, all three repeats agree
        assert (min(ratios) > 1 or max(ratios) < 1) and abs(math.log(v.speed.ratio)) > math.log1p(v.speed.floor)
        # the word, then the repeats' range and median (verdicts.speed_span), then the half-width
        assert f"{v.speed.state} than fp32 ({verdicts.speed_span(v.speed)} " in v.text
    else:
        # no ranking ("slower than fp32"); a too-noisy verdict may still say which way the repeats went ("slower in
        # all 3"), which is a description of the timings, not a claim
        assert "faster than fp32" not in v.text and "slower than fp32" not in v.text
        assert ("no measurable speed difference" in v.text if v.speed.state == "same"
                else "speed too noisy to judge here" in v.text)
# %% after: 04-36
assert largest_diff == {n: cmp.verdicts[n].max_abs_diff for n in ("fp16", "bf16")}
assert all(0 < d < cmp.band.width.min() for d in largest_diff.values())   # both far inside the init-noise band
# %% after: 04-22
for scale, rc in rounding.items():
    assert rc.null == "rounding" and rc.rounding == scale and rc.band.null == "rounding"
    assert f"rounding noise from reruns with each initial weight moved by up to ±{scale:.2g}" in rc.verdicts["fp32"].text
    for name in ("fp16", "bf16"):
        v = rc.verdicts[name]
        # the rule recomputed here: the reference's 0 and the reruns' mean differences, t(0.975, 2) = 4.303
        null = [0.0, *(rc.band.runs[c].mean() for c in rc.band.runs.columns)]
        half = 4.303 * np.std(null, ddof=1) * np.sqrt(1 + 1 / 3)
        d = rc.differences[name].reindex(rc.band.runs.index)
        assert abs(v.test.limit - half) <= 1e-3 * half
        assert v.within_noise == (abs(d.mean() - np.mean(null)) <= half * (1 + 1e-6))
        assert ("within rounding noise" in v.text) == v.within_noise
# the same weights and batches as the variants: the rounding reruns' hashes
for rc in rounding.values():
    ref_s = rc.results["fp32"].summary
    assert all(r.summary["data_hash"] == ref_s["data_hash"] for r in rc.seed_results.values())
# %% after: 04-10
from nbtrain import verdicts

assert list(t.index) == ["fp32", "fp16", "bf16"] and (t["status"] == "max_steps").all()
assert t["precision_used"].tolist() == ["fp32", "fp16", "bf16"]     # each ran in the precision it names
assert (t["steps"] == cfg.max_steps).all() and (t["repeats"] == 3).all()
assert np.isnan(t.loc[["fp32", "bf16"], "min_scale"]).all()          # only fp16 scales
if cmp.results["fp16"].summary["device"] == "cpu":   # measured on a CPU: no overflow, so the scale never left its start
    assert (t["skipped_steps"] == 0).all() and t.loc["fp16", "min_scale"] == 2.0**16
assert t.loc["fp32", "speedup"] == 1.0                               # the reference
# The table's speed-up is the verdict's: the repeats' range, then their median (never a ± wider than the value).
speed_cells = cmp.compact_table().set_index("Variant")["Tokens/s (speed-up)"]
for name in ("fp16", "bf16"):
    s = cmp.verdicts[name].speed
    assert t.loc[name, "speedup"] == s.ratio and speed_cells[name].endswith(f"({verdicts.speed_span(s)})")
    assert (t.loc[name, "speedup_low"], t.loc[name, "speedup_high"]) == (s.low, s.high) and "±" not in speed_cells[name]
# %% after: 04-13
from nbtrain.viz.figures import find_trace, iter_runs

assert {"fp32", "fp16", "bf16"} <= set(iter_runs(fig))
for name in ("fp16", "bf16"):
    diff = cmp.results[name].history.loss.to_numpy() - ref
    assert np.array_equal(find_trace(fig, "loss_diff", "loss_diff", run=name).y, diff)   # the panel holds exactly this
    assert np.array_equal(cmp.differences[name].to_numpy(), diff)
    assert (np.abs(diff) <= width).all()                             # inside the band at every step
assert sorted(cmp.seed_results) == [1, 2]
assert np.array_equal(find_trace(fig, "loss_diff", "noise_band_high").y, width)
assert np.array_equal(find_trace(fig, "loss_diff", "noise_band_low").y, -width)
# %% after: 04-40
assert answer_side == lr.verdicts["lr 1e-2"].direction
if lr.results["lr 1e-2"].summary["device"] == "cpu":
    assert answer_side == "lower"        # measured on a CPU: the 10x rate gets further down in 8 steps
# %% after: 04-16
assert outside, "the 10x learning rate should leave the init-noise band"
lower, higher = [s for s in outside if diff[s] < 0], [s for s in outside if diff[s] > 0]
# the side of the mean difference, judged against the reference's and its reruns' means
null = [0.0, *(lr.band.runs[c].mean() for c in lr.band.runs.columns)]
way = "lower" if diff.reindex(band.index).mean() < np.mean(null) else "higher"
mine = lower if way == "lower" else higher
judged = int(diff.reindex(band.index).notna().sum())
assert v.direction == way and f"loss {way} than lr 1e-3 beyond init noise (mean" in v.text
assert f"outside the reruns' range on {len(mine)} of {judged} steps" in v.text
# %% after: 04-18
import html
import re

assert text.startswith("<!DOCTYPE html>") and "fp16" in text and "bf16" in text
assert html.escape(cmp.config.to_yaml()) in text                     # the config it ran
assert text.index('class="nbt-verdicts"') < text.index('class="nbt-compare-table"')   # the answer comes first
assert all(html.escape(v.text.split(": ", 1)[1]) in text for v in cmp.verdicts.values())
# Self-contained: no script or stylesheet is fetched from the network.
assert not re.search(r'<script[^>]+src=["\']https?:', text) and not re.search(r'<link[^>]+href=["\']https?:', text)
assert "Plotly" in text                                              # plotly.js is inside the file
