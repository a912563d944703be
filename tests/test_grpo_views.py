"""Issue 47, item 6: a GRPO run seen live. Its dashboard, the comparison figure and the words of the status and
summary lines show the reward (mean over a ±std band), the completions' length, the clipped share of tokens and the
sampler/trainer log-prob mismatch (the fp32 gaps as markers on the steps that measured them); an lm or preference
run's figure does not change. Synthetic records only: no training."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest

from nbtrain.config import TrainConfig
from nbtrain.engine.finish import frame
from nbtrain.engine.records import STEP_FIELDS, RunInfo
from nbtrain.viz import figures as F
from nbtrain.viz import text as T
from nbtrain.viz.dashboard import LiveDashboard
from nbtrain.viz.progress import ProgressBar

from .test_viz import make_info, make_records
from .test_viz_pref import pref_info, pref_records

GRPO = F.GRPO_PANELS
MAIN = {"reward": "reward_mean", "completion_len": "completion_len_mean", "clip_ratio": "clip_ratio",
        "mismatch": "mismatch_mean"}
SAMPLED = {1, 2, 3, 10}   # the steps that measured the fp32 gaps (the engine's sampled steps, up to 12)


def grpo_records(n=12, *, seed=0, variant=None, nan_reward=(), skip=(), scaler=False):
    """A GRPO-like run: the reward climbs, the completions lengthen, the mismatch is small and noisy, and the fp32
    gaps are there on SAMPLED steps only (None on the others, as the engine leaves them); ``nan_reward`` steps have
    a NaN reward and loss and are flagged non-finite."""
    recs = make_records(n, skip=set(skip), variant=variant, seed=seed, scaler=scaler, nan_loss=set(nan_reward))
    rng = np.random.default_rng(200 + seed)
    for r in recs:
        r.reward_mean = 0.05 * r.step + 0.01 * rng.random()
        r.reward_std = 0.2 + 0.02 * rng.random()
        r.completion_len_mean = 20.0 + r.step + rng.random()
        r.clip_ratio = 0.002 * rng.random()
        r.frac_zero_std = 0.25 * int(rng.integers(0, 3))
        r.mismatch_mean = 1e-3 * (1 + seed) * (1 + rng.random())
        r.mismatch_max = 10 * r.mismatch_mean
        r.mismatch_kl = r.mismatch_mean ** 2 / 2
        r.is_ratio_min, r.is_ratio_mean, r.is_ratio_max = 0.9, 1.0, 1.1
        if r.step in SAMPLED:
            r.sampler_fp32_gap = 2e-3 * (1 + seed)
            r.trainer_fp32_gap = 1e-3 * (1 + seed)
        if r.step in nan_reward:
            r.reward_mean = r.reward_std = math.nan
            r.nonfinite = True
    return recs


def grpo_info(variant=None, precision="fp32", **cfg):
    config = TrainConfig(**{"objective": "grpo", "reward": "length:16", **cfg})
    return RunInfo(config=config, precision_used=precision, device="cpu", device_name="test", device_total_gib=24.0,
                   scaler_enabled=False, total_steps=12, train_examples=100, eval_examples=0, trainable_params=10,
                   total_params=100, max_grad_norm=1.0, variant=variant)


def values(recs, field):
    return np.array([math.nan if getattr(r, field) is None else getattr(r, field) for r in recs], dtype=float)


def ys(trace):
    return np.asarray(trace.y, dtype=float)


def panels_of(fig):
    return {tr.meta["panel"] for tr in fig.data if isinstance(tr.meta, dict)}


def titles_of(fig):
    return [a.text for a in fig.layout.annotations]


def axes_of(fig, trace):
    return trace.xaxis, trace.yaxis


def cell_axes(fig, row, col):
    sp = fig.get_subplot(row, col)
    return sp.xaxis.plotly_name.replace("axis", ""), sp.yaxis.plotly_name.replace("axis", "")


# -- one run ----------------------------------------------------------------------------------------------------------
def test_a_grpo_run_has_four_panels_holding_exactly_the_recorded_values():
    recs = grpo_records(12)
    fig = F.run_figure(recs, None, grpo_info())
    assert set(GRPO) <= panels_of(fig)
    assert not panels_of(fig) & set(F.REWARD_PANELS)    # a GRPO run has no preference margin or accuracy
    steps = np.arange(1, 13)
    for panel, field in MAIN.items():
        tr = F.find_trace(fig, panel, field)
        np.testing.assert_array_equal(np.asarray(tr.x, dtype=float), steps)
        np.testing.assert_array_equal(ys(tr), values(recs, field))
    # the reward's band: mean ± std, the lower edge filled up to the upper one drawn just before it
    mean, std = values(recs, "reward_mean"), values(recs, "reward_std")
    high, low = F.find_trace(fig, "reward", "reward_band_high"), F.find_trace(fig, "reward", "reward_band_low")
    np.testing.assert_allclose(ys(high), mean + std)
    np.testing.assert_allclose(ys(low), mean - std)
    assert low.fill == "tonexty" and high.fill is None
    data = list(fig.data)
    assert data.index(low) == data.index(high) + 1
    # the hover says the std and the share of groups whose rewards were all equal, per step
    main = F.find_trace(fig, "reward", "reward_mean")
    np.testing.assert_allclose(np.asarray(main.customdata, dtype=float)[:, 0], std)
    np.testing.assert_allclose(np.asarray(main.customdata, dtype=float)[:, 1], values(recs, "frac_zero_std"))
    assert "groups with equal rewards" in main.hovertemplate


def test_the_fp32_gaps_are_markers_on_the_sampled_steps_only():
    recs = grpo_records(12)
    fig = F.run_figure(recs, None, grpo_info())
    for kind in ("sampler_fp32_gap", "trainer_fp32_gap"):
        tr = F.find_trace(fig, "mismatch", kind)
        assert tr.mode == "markers"
        assert sorted(int(v) for v in tr.x) == sorted(SAMPLED)
        np.testing.assert_array_equal(ys(tr), [getattr(r, kind) for r in recs if r.step in SAMPLED])
    # a run that never sampled has empty marker traces, never NaN points
    for r in recs:
        r.sampler_fp32_gap = r.trainer_fp32_gap = None
    fig = F.run_figure(recs, None, grpo_info())
    assert len(F.find_trace(fig, "mismatch", "sampler_fp32_gap").x) == 0


def test_the_panels_sit_in_their_cells_titled_with_units():
    fig = F.run_figure(grpo_records(8), None, grpo_info())
    cells = F.run_cells(rewards=False, grpo=True)
    assert [cells[p] for p in GRPO] == [(3, 1), (3, 2), (4, 1), (4, 2)]
    for panel, field in MAIN.items():
        assert axes_of(fig, F.find_trace(fig, panel, field)) == cell_axes(fig, *cells[panel])
        assert F.GRPO_TITLES[panel] in titles_of(fig)
    y = {p: fig.get_subplot(*cells[p]).yaxis for p in GRPO}
    assert y["mismatch"].title.text == "|Δ log p| (nats per token)"
    assert y["completion_len"].title.text == "tokens per completion"
    assert y["reward"].title.text == "reward per completion"
    assert y["clip_ratio"].title.text == "share of tokens" and "%" in y["clip_ratio"].tickformat
    # GRPO's loss is no log-likelihood: its axis does not say nats
    assert fig.get_subplot(*F.PANEL_CELLS["loss"]).yaxis.title.text == "loss (policy, per token)"
    assert fig.layout.height == F.RUN_HEIGHT + 2 * F.REWARD_HEIGHT
    # the completions' cap: a dashed line at max_new_tokens
    cap = F.find_trace(fig, "completion_len", "length_cap")
    assert set(ys(cap)) == {64.0} and cap.line.dash == "dash"


def test_the_panels_are_there_before_the_first_step():
    fig = F.run_figure([], None, grpo_info())
    assert set(GRPO) <= panels_of(fig)


def test_a_history_without_run_info_draws_the_same_panels():
    recs = grpo_records(8)
    fig = F.run_figure(frame(recs, STEP_FIELDS))
    assert set(GRPO) <= panels_of(fig)
    np.testing.assert_array_equal(ys(F.find_trace(fig, "reward", "reward_mean")), values(recs, "reward_mean"))


@pytest.mark.parametrize("as_frame", [False, True])
def test_lm_and_preference_runs_get_no_grpo_panel(as_frame):
    lm = make_records(10, skip={3})
    pref = pref_records(10)
    for recs, info, rewards in ((lm, make_info(), False), (lm, None, False), (pref, pref_info(), True)):
        history = frame(recs, STEP_FIELDS) if as_frame else recs
        fig = F.run_figure(history, None, info)
        assert not panels_of(fig) & set(GRPO)
        assert not any(t in titles_of(fig) for t in F.GRPO_TITLES.values())
        assert fig.layout.height == F.RUN_HEIGHT + (F.REWARD_HEIGHT if rewards else 0)
        assert fig.get_subplot(*F.PANEL_CELLS["loss"]).yaxis.title.text == "loss (nats/token)"
    assert not F.has_grpo(F.columns(lm), make_info()) and not F.has_grpo(F.columns(lm))
    assert not F.has_grpo(F.columns(pref), pref_info())


def test_has_grpo_and_has_rewards_follow_the_objective_then_the_records():
    c = F.columns(grpo_records(4))
    assert F.has_grpo(c) and F.has_grpo(c, grpo_info())
    assert not F.has_rewards(c, grpo_info()) and not F.has_rewards(c)   # GRPO's rewards are no DPO margin
    assert F.has_grpo(F.columns(make_records(4)), grpo_info())            # from the config, before any record
    assert F.has_grpo(c, make_info())   # an info whose config names no objective: the records decide
    assert not F.has_grpo(c, pref_info("lm"))


def test_non_finite_and_skipped_steps_are_marked_on_the_grpo_panels():
    recs = grpo_records(12, nan_reward={5}, skip={3, 5})
    fig = F.run_figure(recs, None, grpo_info())
    for panel in ("loss",) + GRPO:
        nf = F.find_trace(fig, panel, "nonfinite")
        assert list(nf.x) == [5] and all(math.isfinite(v) for v in nf.y)
        assert list(F.find_trace(fig, panel, "skipped").x) == [3, 5]
    nf = F.find_trace(fig, "reward", "nonfinite")
    assert list(nf.text) == ["nan"] and "reward_mean=nan" in nf.hovertext[0]
    assert nf.y[0] == pytest.approx(recs[3].reward_mean)   # at the last finite mean (step 4)
    assert math.isnan(F.find_trace(fig, "reward", "reward_mean").y[4])   # the data keeps the NaN


# -- overlaid runs ----------------------------------------------------------------------------------------------------
def test_overlaid_variants_get_one_trace_each_in_their_own_colour():
    runs = {p: grpo_records(10, seed=k, variant=p) for k, p in enumerate(("fp32", "bf16", "fp16"))}
    fig = F.runs_figure({n: (r, None, grpo_info(n, n)) for n, r in runs.items()})
    for panel, field in MAIN.items():
        assert len(F.find_traces(fig, panel=panel, kind=field)) == 3
        for name, recs in runs.items():
            tr = F.find_trace(fig, panel, field, run=name)
            np.testing.assert_array_equal(ys(tr), values(recs, field))
            assert tr.line.color == F.find_trace(fig, "loss", "loss_ema", run=name).line.color
            assert not tr.showlegend   # the run's one legend entry is its loss
    assert len({F.find_trace(fig, "reward", "reward_mean", run=n).line.color for n in runs}) == 3
    # each variant's band right after its own upper edge, in its colour
    data = list(fig.data)
    for name in runs:
        high = F.find_trace(fig, "reward", "reward_band_high", run=name)
        low = F.find_trace(fig, "reward", "reward_band_low", run=name)
        assert data.index(low) == data.index(high) + 1 and low.fill == "tonexty"
    # the difference panel moves under the GRPO rows
    diff = F.find_trace(fig, "loss_diff", "loss_diff", run="bf16")
    assert diff.yaxis == cell_axes(fig, F.diff_row(False, True), 1)[1]


def test_a_grpo_run_overlaid_with_a_preference_run_goes_under_the_reward_row():
    fig = F.runs_figure({"dpo": (pref_records(6), None, pref_info()),
                         "grpo": (grpo_records(6), None, grpo_info("grpo"))})
    cells = F.run_cells(rewards=True, grpo=True)
    assert cells["reward"] == (4, 1) and cells["mismatch"] == (5, 2)
    for panel, field in MAIN.items():
        (tr,) = F.find_traces(fig, panel=panel, kind=field)
        assert tr.meta["run"] == "grpo" and axes_of(fig, tr) == cell_axes(fig, *cells[panel])
    (margin,) = F.find_traces(fig, panel="reward_margin", kind="reward_margin")
    assert margin.meta["run"] == "dpo" and axes_of(fig, margin) == cell_axes(fig, *F.PANEL_CELLS["reward_margin"])
    diff = F.find_trace(fig, "loss_diff", "loss_diff", run="grpo")
    assert diff.yaxis == cell_axes(fig, F.diff_row(True, True), 1)[1]


# -- the comparison figure --------------------------------------------------------------------------------------------
def test_compare_figure_adds_a_row_per_grpo_panel_with_one_trace_per_variant():
    names = ("fp32", "bf16", "fp16")
    hist = {n: frame(grpo_records(8, seed=k, variant=n), STEP_FIELDS) for k, n in enumerate(names)}
    fig = F.compare_figure(hist, reference="fp32", infos={n: grpo_info(n, n) for n in names})
    grid = F.compare_grid(rewards=False, grpo=True)
    assert [grid[p] for p in GRPO] == [(6, 1), (7, 1), (8, 1), (9, 1)]
    for panel, field in MAIN.items():
        assert len(F.find_traces(fig, panel=panel, kind=field)) == 3
        for n in names:
            tr = F.find_trace(fig, panel, field, run=n)
            np.testing.assert_array_equal(ys(tr), hist[n][field].to_numpy(dtype=float))
            assert tr.yaxis == cell_axes(fig, *grid[panel])[1]
        assert F.GRPO_TITLES[panel] in titles_of(fig)
        assert fig.get_subplot(*grid[panel]).yaxis.title.text == F.GRPO_AXIS_TITLES[panel]
    assert fig.layout.height == F.COMPARE_HEIGHT + 4 * F.COMPARE_REWARD_HEIGHT
    assert not panels_of(fig) & set(F.REWARD_PANELS)
    # the fp32 gaps of each variant, on its sampled steps
    assert sorted(int(v) for v in F.find_trace(fig, "mismatch", "sampler_fp32_gap", run="bf16").x) == [1, 2, 3]
    # the last row names the step axis
    assert fig.get_subplot(9, 1).xaxis.title.text == "optimizer step"


def test_compare_figure_of_lm_or_preference_runs_has_no_grpo_row():
    lm = F.compare_figure({n: frame(make_records(8, seed=k), STEP_FIELDS) for k, n in enumerate(("a", "b"))})
    assert lm.layout.height == F.COMPARE_HEIGHT and not panels_of(lm) & set(GRPO)
    assert len([k for k in lm.layout if k.startswith("yaxis")]) == 7
    pref = F.compare_figure({n: frame(pref_records(8, seed=k), STEP_FIELDS) for k, n in enumerate(("a", "b"))})
    assert pref.layout.height == F.COMPARE_HEIGHT + 2 * F.COMPARE_REWARD_HEIGHT and not panels_of(pref) & set(GRPO)
    assert F.compare_grid(rewards=True) == F._COMPARE_GRID


# -- the live dashboard -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["widget", "html"])
def test_live_dashboard_draws_the_grpo_panels_per_variant_in_place(mode):
    dash = LiveDashboard(mode=mode, display=False)
    fig0 = dash.figure
    runs = {"fp32": grpo_records(9, seed=0, variant="fp32"),
            "bf16": grpo_records(9, seed=1, variant="bf16", nan_reward={4})}
    dash.on_run_start(grpo_info("fp32"))
    assert set(GRPO) <= panels_of(dash.figure)   # from the config, before the first step
    for r in runs["fp32"]:
        dash.on_step_end(r)
    dash.on_run_end(None)
    dash.on_run_start(grpo_info("bf16", "bf16"))
    for r in runs["bf16"]:
        dash.on_step_end(r)
    dash.refresh()
    if mode == "widget":
        assert dash.figure is fig0 and isinstance(dash.figure, go.FigureWidget)
    for name, recs in runs.items():
        for panel, field in MAIN.items():
            np.testing.assert_array_equal(ys(F.find_trace(dash.figure, panel, field, run=name)), values(recs, field))
    assert list(F.find_trace(dash.figure, "reward", "nonfinite", run="bf16").x) == [4]
    last = runs["bf16"][-1]
    status = dash.tracker.status()
    assert f"reward {last.reward_mean:.3g}" in status and f"mismatch {last.mismatch_mean:.2g} nats/token" in status
    dash.on_run_end(None)
    summaries = [s for s, _ in dash.tracker.summaries()]
    assert all("final reward" in s and "mismatch" in s for s in summaries)


def test_live_updates_between_rebuilds_replace_the_grpo_values_and_hovers():
    # a redraw that is not a rebuild copies the data into the existing traces: the hover's values too
    dash = LiveDashboard(mode="widget", display=False)
    recs = grpo_records(8)
    dash.on_run_start(grpo_info())
    for r in recs[:3]:
        dash.on_step_end(r)
    dash.refresh()
    n = len(dash.figure.data)
    for r in recs[3:]:
        dash.on_step_end(r)
    dash.refresh()
    assert len(dash.figure.data) == n
    main = F.find_trace(dash.figure, "reward", "reward_mean")
    np.testing.assert_array_equal(ys(main), values(recs, "reward_mean"))
    assert np.asarray(main.customdata).shape == (8, 2)
    np.testing.assert_allclose(ys(F.find_trace(dash.figure, "reward", "reward_band_low")),
                               values(recs, "reward_mean") - values(recs, "reward_std"))
    mism = F.find_trace(dash.figure, "mismatch", "mismatch_mean")
    np.testing.assert_allclose(np.asarray(mism.customdata, dtype=float)[:, 0], values(recs, "mismatch_max"))
    assert sorted(int(v) for v in F.find_trace(dash.figure, "mismatch", "trainer_fp32_gap").x) == [1, 2, 3]


def test_an_lm_dashboard_is_unchanged_by_grpo():
    dash = LiveDashboard(mode="html", display=False)
    dash.on_run_start(make_info())
    for r in make_records(6):
        dash.on_step_end(r)
    dash.on_run_end(None)
    assert not panels_of(dash.figure) & set(GRPO)
    assert "mismatch" not in dash.tracker.status() and "reward" not in dash.tracker.summaries()[0][0]


# -- words ------------------------------------------------------------------------------------------------------------
def test_status_and_summary_say_the_reward_and_the_mismatch_briefly():
    recs = grpo_records(5)
    recs[-1].reward_mean, recs[-1].reward_std, recs[-1].mismatch_mean = 0.4123, 0.1311, 0.00214
    info = grpo_info()
    assert T.grpo_text(recs[-1]) == "reward 0.412 ± 0.13 · mismatch 0.0021 nats/token"
    assert "reward 0.412 ± 0.13 · mismatch 0.0021 nats/token" in T.status_line(recs, info)
    assert "final reward 0.412 ± 0.13 · mismatch 0.0021 nats/token" in T.summary_text(recs, [], info)
    recs[-1].reward_mean = math.nan
    assert "reward nan" in T.status_line(recs, info)
    # a record with a mismatch but no reward (or the other way round) says what it has
    recs[-1].reward_mean = recs[-1].reward_std = None
    assert T.grpo_text(recs[-1]) == "mismatch 0.0021 nats/token"
    lm = make_records(5)
    assert T.grpo_text(lm[-1]) is None
    assert "mismatch" not in T.status_line(lm, make_info()) and "mismatch" not in T.summary_text(lm, [], make_info())
    # a preference run says its margin, not GRPO's words
    pref = pref_records(3)
    assert "mismatch" not in T.status_line(pref, pref_info()) and "reward margin" in T.status_line(pref, pref_info())


def test_the_command_lines_bar_shows_the_reward_of_a_grpo_step():
    class Bar:
        postfix = ""

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def update(self, n):
            pass

    bar = ProgressBar()
    bar.bar = Bar()
    rec = grpo_records(2)[-1]
    bar.on_step_end(rec)
    assert f"reward={rec.reward_mean:.3g}" in bar.bar.postfix and bar.bar.postfix.startswith("loss=")
    bar.on_step_end(make_records(2)[-1])
    assert "reward" not in bar.bar.postfix
