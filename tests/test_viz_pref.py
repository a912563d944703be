"""Issue 38: the dashboard and the comparison figure plot a preference objective's reward margin and accuracy per
variant (exact values, one colour per run, non-finite and skipped steps marked as on the loss panel), and an
objective="lm" run gets no reward panel at all. Synthetic records only: no training."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from nbtrain.engine.finish import frame
from nbtrain.engine.records import STEP_FIELDS, RunInfo
from nbtrain.viz import figures as F
from nbtrain.viz import text as T
from nbtrain.viz.dashboard import LiveDashboard

from .test_viz import make_info, make_records

REWARDS = ("reward_margin", "reward_accuracy")


class _PrefCfg:
    micro_batch_size = 4
    grad_accum_steps = 2
    method = "lora"
    objective = "dpo"


class _LmCfg(_PrefCfg):
    objective = "lm"


def pref_records(n=12, *, seed=0, variant=None, nan_reward=(), skip=(), scaler=True):
    """A DPO-like run: the margin grows, accuracy climbs from 0.5; ``nan_reward`` steps have NaN rewards and loss
    and are flagged non-finite (the engine's policy)."""
    recs = make_records(n, skip=set(skip), variant=variant, seed=seed, scaler=scaler,
                        nan_loss=set(nan_reward))
    rng = np.random.default_rng(100 + seed)
    for r in recs:
        chosen = 0.05 * r.step + 0.01 * rng.random()
        rejected = -0.03 * r.step - 0.01 * rng.random()
        r.reward_chosen, r.reward_rejected = chosen, rejected
        r.reward_margin = chosen - rejected
        r.reward_accuracy = float(min(1.0, 0.5 + 0.25 * int(rng.integers(0, 3))))
        if r.step in nan_reward:
            r.reward_chosen = r.reward_rejected = r.reward_margin = math.nan
            r.reward_accuracy = 0.0
            r.nonfinite = True
    return recs


def pref_info(objective="dpo", **kw):
    info = make_info(**kw)
    info.config = _PrefCfg() if objective != "lm" else _LmCfg()
    return info


def values(recs, field):
    return np.array([math.nan if getattr(r, field) is None else getattr(r, field) for r in recs], dtype=float)


def panels_of(fig):
    return {tr.meta["panel"] for tr in fig.data if isinstance(tr.meta, dict)}


def titles_of(fig):
    return [a.text for a in fig.layout.annotations]


# -- one run --------------------------------------------------------------------------------------------------
def test_a_preference_run_has_reward_panels_holding_exactly_the_recorded_values():
    recs = pref_records(12)
    fig = F.run_figure(recs, None, pref_info())
    assert set(REWARDS) <= panels_of(fig)
    for field in REWARDS:
        tr = F.find_trace(fig, field, field)
        np.testing.assert_array_equal(np.asarray(tr.x, dtype=float), np.arange(1, 13))
        np.testing.assert_array_equal(np.asarray(tr.y, dtype=float), values(recs, field))
        ema = F.find_trace(fig, field, field + "_ema")
        np.testing.assert_allclose(np.asarray(ema.y, dtype=float), F.smooth(values(recs, field), 0.9))
    # one run: the chosen and rejected rewards the margin is the difference of, in the margin's panel
    for field in ("reward_chosen", "reward_rejected"):
        np.testing.assert_array_equal(np.asarray(F.find_trace(fig, "reward_margin", field).y, dtype=float),
                                      values(recs, field))
    # the panels sit in the third row, titled, the accuracy axis a share from 0 to 1
    assert F.REWARD_TITLES["reward_margin"] in titles_of(fig)
    acc_axis = fig.get_subplot(*F.PANEL_CELLS["reward_accuracy"]).yaxis
    assert acc_axis.tickformat == ".0%" and tuple(acc_axis.range) == (-0.05, 1.05)
    assert fig.layout.height == F.RUN_HEIGHT + F.REWARD_HEIGHT
    # the margin trace is drawn in the cell PANEL_CELLS names (its axes are that subplot's)
    sp = fig.get_subplot(*F.PANEL_CELLS["reward_margin"])
    margin = F.find_trace(fig, "reward_margin", "reward_margin")
    assert (margin.xaxis, margin.yaxis) == (sp.xaxis.plotly_name.replace("axis", ""),
                                            sp.yaxis.plotly_name.replace("axis", ""))


@pytest.mark.parametrize("as_frame", [False, True])
def test_an_lm_run_gets_no_reward_panel(as_frame):
    recs = make_records(12, skip={3}, nan_loss={5})
    assert all(r.reward_margin is None for r in recs)
    history = frame(recs, STEP_FIELDS) if as_frame else recs
    for info in (make_info(), pref_info("lm"), None):
        fig = F.run_figure(history, None, info)
        assert not panels_of(fig) & set(REWARDS)
        assert not any("reward" in (t or "") for t in titles_of(fig))
        assert fig.layout.height == F.RUN_HEIGHT
    # a table read back from a file has NaN, not None, in an lm run's reward columns: still no panel
    read_back = frame(recs, STEP_FIELDS).astype({c: float for c in F._REWARD_COLS})
    assert read_back["reward_margin"].isna().all()
    assert not panels_of(F.run_figure(read_back)) & set(REWARDS)


def test_history_frame_of_a_preference_run_draws_the_same_panels():
    recs = pref_records(8)
    fig = F.run_figure(frame(recs, STEP_FIELDS))   # no run info: the records' rewards decide
    np.testing.assert_array_equal(np.asarray(F.find_trace(fig, "reward_margin", "reward_margin").y, dtype=float),
                                  values(recs, "reward_margin"))


def test_non_finite_and_skipped_steps_are_marked_on_the_reward_panels_as_on_the_loss_panel():
    recs = pref_records(12, nan_reward={5}, skip={3, 5})
    fig = F.run_figure(recs, None, pref_info())
    for panel in ("loss",) + REWARDS:
        nf = F.find_trace(fig, panel, "nonfinite")
        assert list(nf.x) == [5]
        assert all(math.isfinite(y) for y in nf.y)   # placed at a visible height, never at NaN
        assert "reward_margin=nan" in nf.hovertext[0] and "step 5" in nf.hovertext[0]
        assert list(F.find_trace(fig, panel, "skipped").x) == [3, 5]
    # the NaN margin itself is written where it would be, as the loss's is; the data trace keeps the NaN
    assert list(F.find_trace(fig, "reward_margin", "nonfinite").text) == ["nan"]
    assert math.isnan(F.find_trace(fig, "reward_margin", "reward_margin").y[4])
    # at the last finite margin before it (step 4)
    assert F.find_trace(fig, "reward_margin", "nonfinite").y[0] == pytest.approx(recs[3].reward_margin)


def test_a_preference_run_whose_rewards_are_all_nan_keeps_its_panels():
    recs = pref_records(6, nan_reward=set(range(1, 7)))
    fig = F.run_figure(recs, None, pref_info())
    assert set(REWARDS) <= panels_of(fig)
    assert list(F.find_trace(fig, "reward_margin", "nonfinite").x) == list(range(1, 7))
    # the same records without run info are still a preference run's (flagged NaN rewards count as recorded)
    assert set(REWARDS) <= panels_of(F.run_figure(recs))


# -- overlaid runs --------------------------------------------------------------------------------------------
def test_overlaid_variants_get_one_reward_trace_each_in_their_own_colour():
    runs = {"fp32": pref_records(10, seed=0), "bf16": pref_records(10, seed=1), "fp16": pref_records(10, seed=2)}
    fig = F.runs_figure({n: (r, None, pref_info(variant=n)) for n, r in runs.items()})
    for field in REWARDS:
        assert len(F.find_traces(fig, panel=field, kind=field)) == 3
        for name, recs in runs.items():
            tr = F.find_trace(fig, field, field, run=name)
            np.testing.assert_array_equal(np.asarray(tr.y, dtype=float), values(recs, field))
            # the run's colour, the one its loss is drawn in
            assert tr.line.color == F.find_trace(fig, "loss", "loss_ema", run=name).line.color
    colours = {F.find_trace(fig, "reward_margin", "reward_margin", run=n).line.color for n in runs}
    assert len(colours) == 3
    # overlaid: no per-quantity chosen/rejected lines (one colour per run says which run a line is)
    assert not F.find_traces(fig, kind="reward_chosen")
    # the difference panel moves under the reward row
    diff = F.find_trace(fig, "loss_diff", "loss_diff", run="bf16")
    sp = fig.get_subplot(F.diff_row(True), 1)
    assert diff.yaxis == sp.yaxis.plotly_name.replace("axis", "")


def test_an_lm_run_overlaid_with_a_preference_run_draws_no_reward_line_of_its_own():
    fig = F.runs_figure({"dpo": (pref_records(6), None, pref_info()), "lm": (make_records(6), None, make_info())})
    assert len(F.find_traces(fig, panel="reward_margin", kind="reward_margin")) == 1
    assert not F.find_traces(fig, run="lm", panel="reward_margin")


# -- the comparison figure ------------------------------------------------------------------------------------
def test_compare_figure_adds_two_reward_rows_for_a_preference_comparison_only():
    pref = {n: frame(pref_records(8, seed=k), STEP_FIELDS) for k, n in enumerate(("fp32", "bf16", "fp16"))}
    fig = F.compare_figure(pref, reference="fp32")
    for field in REWARDS:
        assert len(F.find_traces(fig, panel=field, kind=field)) == 3
        tr = F.find_trace(fig, field, field, run="fp16")
        np.testing.assert_array_equal(np.asarray(tr.y, dtype=float), pref["fp16"][field].to_numpy(dtype=float))
        row, col = F._COMPARE_GRID[field]
        sp = fig.get_subplot(row, col)
        assert tr.yaxis == sp.yaxis.plotly_name.replace("axis", "")
    assert fig.layout.height == F.COMPARE_HEIGHT + 2 * F.COMPARE_REWARD_HEIGHT
    assert F.REWARD_TITLES["reward_accuracy"] in titles_of(fig)

    lm = {n: frame(make_records(8, seed=k), STEP_FIELDS) for k, n in enumerate(("fp32", "bf16"))}
    plain = F.compare_figure(lm, reference="fp32")
    assert not panels_of(plain) & set(REWARDS) and plain.layout.height == F.COMPARE_HEIGHT
    assert not any("reward" in (t or "") for t in titles_of(plain))


# -- the live dashboard ---------------------------------------------------------------------------------------
def _feed(dash, info, recs):
    dash.on_run_start(info)
    for r in recs:
        dash.on_step_end(r)
    dash.refresh()


@pytest.mark.parametrize("mode", ["widget", "html"])
def test_live_dashboard_draws_rewards_per_variant_in_place(mode):
    dash = LiveDashboard(mode=mode, display=False)
    fig0 = dash.figure
    runs = {"fp32": pref_records(9, seed=0, variant="fp32"), "fp16": pref_records(9, seed=1, variant="fp16",
                                                                                  nan_reward={4})}
    # the panels are there from the run's start: the config says it is a preference objective
    dash.on_run_start(pref_info(variant="fp32"))
    assert set(REWARDS) <= panels_of(dash.figure)
    for r in runs["fp32"]:
        dash.on_step_end(r)
    dash.on_run_end(None)
    _feed(dash, pref_info(variant="fp16"), runs["fp16"])
    if mode == "widget":
        assert dash.figure is fig0 and isinstance(dash.figure, go.FigureWidget)   # updated in place, not remade
    for name, recs in runs.items():
        for field in REWARDS:
            tr = F.find_trace(dash.figure, field, field, run=name)
            np.testing.assert_array_equal(np.asarray(tr.y, dtype=float), values(recs, field))
    assert list(F.find_trace(dash.figure, "reward_margin", "nonfinite", run="fp16").x) == [4]
    assert not list(F.find_trace(dash.figure, "reward_margin", "nonfinite", run="fp32").x)
    # the status line says the latest margin and accuracy
    last = runs["fp16"][-1]
    status = dash.tracker.status()
    assert f"reward margin {last.reward_margin:.3g}" in status and f"accuracy {last.reward_accuracy:.0%}" in status


def test_live_dashboard_of_an_lm_run_has_no_reward_panel_and_says_no_reward():
    dash = LiveDashboard(mode="html", display=False)
    recs = make_records(8)
    _feed(dash, make_info(), recs)
    assert not panels_of(dash.figure) & set(REWARDS)
    assert "reward" not in dash.tracker.status()
    dash.on_run_end(None)
    assert "reward" not in dash.tracker.summaries()[0][0]


def test_live_updates_between_rebuilds_replace_the_reward_values():
    # a redraw that is not a rebuild copies x/y into the existing traces: the rewards must follow
    dash = LiveDashboard(mode="widget", display=False)
    recs = pref_records(6)
    info = pref_info()
    dash.on_run_start(info)
    for r in recs[:3]:
        dash.on_step_end(r)
    dash.refresh()
    n_traces = len(dash.figure.data)
    for r in recs[3:]:
        dash.on_step_end(r)
    dash.refresh()
    assert len(dash.figure.data) == n_traces   # the same traces, their data replaced
    np.testing.assert_array_equal(np.asarray(F.find_trace(dash.figure, "reward_accuracy", "reward_accuracy").y,
                                             dtype=float), values(recs, "reward_accuracy"))


# -- words ----------------------------------------------------------------------------------------------------
def test_status_and_summary_say_the_latest_margin_and_accuracy_and_name_a_nan():
    recs = pref_records(5)
    recs[-1].reward_margin, recs[-1].reward_accuracy = 0.4123, 0.75
    info = pref_info()
    assert "reward margin 0.412 · accuracy 75%" in T.status_line(recs, info)
    assert "final reward margin 0.412 · accuracy 75%" in T.summary_text(recs, [], info)
    recs[-1].reward_margin = math.nan
    assert "reward margin nan" in T.status_line(recs, info)
    lm = make_records(5)
    assert "reward" not in T.status_line(lm, make_info()) and "reward" not in T.summary_text(lm, [], make_info())


def test_has_rewards_follows_the_objective_then_the_records():
    recs = pref_records(4)
    c = F.columns(recs)
    assert F.has_rewards(c) and F.has_rewards(c, pref_info())
    assert not F.has_rewards(c, pref_info("lm"))          # the config is what the run trained
    assert not F.has_rewards(F.columns(make_records(4)))
    assert F.has_rewards(F.columns(make_records(4)), pref_info("dpo"))
    assert isinstance(pref_info(), RunInfo) and isinstance(frame(recs, STEP_FIELDS), pd.DataFrame)
