"""Issue 27 item 5: compare() over the precision of every tensor.

One real comparison on ``tiny``: bf16 autocast (the reference), bf16-pure, bf16-pure with stochastic rounding,
8-bit AdamW and fp8 (emulated off a GPU with fp8 tensor cores). It must be fair by hash (one init, one data
order), carry each variant's optimizer, weights' dtype, lost-update share and memory estimate by tensor class,
and say in the verdict when a variant's weights lost their updates.
"""

import math
import types
import warnings

import pytest

import nbtrain as nbt
from nbtrain.compare.result import ESTIMATE_COLUMNS, _Outcome
from nbtrain.compare.run import ComparisonWarning, _check_fairness
from nbtrain.engine.doctor import LOST_UPDATES_REPORTED, lost_updates_line

VARIANTS = {"bf16": {}, "pure": {"precision": "bf16-pure"},
            "pure+sr": {"precision": "bf16-pure", "stochastic_rounding": True},
            "adamw8": {"optimizer": "adamw_8bit"}, "fp8": {"precision": "fp8"}}
BASE = dict(model="tiny", data="builtin:python-docs", precision="bf16", max_seq_len=48, micro_batch_size=4,
            eval_fraction=0.0, lr=1e-5)
TENSOR_COLUMNS = ("optimizer", "weights_dtype", "lost_updates", *ESTIMATE_COLUMNS.values())


def _can_run(caps, overrides) -> bool:
    return all(v not in caps.reasons for k, v in overrides.items() if k in ("precision", "optimizer"))


@pytest.fixture(scope="module")
def cmp():
    caps = nbt.capabilities()
    missing = [n for n, ov in VARIANTS.items() if not _can_run(caps, {"precision": "bf16", **ov})]
    if missing:
        pytest.skip(f"this device cannot run {missing}: {caps.reasons}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ComparisonWarning)   # a fair comparison must not warn
        return nbt.compare(nbt.TrainConfig(**BASE), variants=VARIANTS, subset=32, max_steps=4, seeds=(0, 1))


def row(cmp, name):
    return cmp.table.set_index("variant").loc[name]


def test_the_five_variants_are_fair_by_hash(cmp):
    t = cmp.table
    assert list(t.variant) == list(VARIANTS)
    assert (t.status == "max_steps").all() and cmp.finished == list(VARIANTS)
    # the init hash is taken before bf16-pure casts the weights and fp8 converts the linears: one for all
    assert t.init_hash.nunique() == 1 and t.data_hash.nunique() == 1
    assert {r.summary["init_hash"] for r in cmp.results.values()} == {t.init_hash.iloc[0]}
    assert cmp.fair and t.fair.all() and cmp.warnings == []
    # nothing is excused "by design": the variants share the init, they do not explain a different one
    assert not any("by design" in n for notes in cmp.notes.values() for n in notes)
    assert cmp._fairness_line().startswith("fair: every variant started from the same weights")


def test_each_variant_says_its_optimizer_and_the_dtype_of_its_weights(cmp):
    assert set(TENSOR_COLUMNS) <= set(cmp.table.columns)
    expected = {"bf16": ("adamw", "fp32"), "pure": ("adamw", "bf16"), "pure+sr": ("adamw", "bf16"),
                "adamw8": ("adamw_8bit", "fp32"), "fp8": ("adamw", "fp32")}
    for name, (optimizer, dtype) in expected.items():
        r = row(cmp, name)
        assert (r.optimizer, r.weights_dtype) == (optimizer, dtype), name
        s = cmp.results[name].summary
        assert (s["optimizer"], s["weights_dtype"]) == (optimizer, dtype), name
        assert cmp.configs[name].optimizer == optimizer
    assert row(cmp, "pure").precision_used == "bf16-pure" and row(cmp, "fp8").precision_used == "fp8"


def test_memory_by_tensor_class_is_each_variants_own_estimate(cmp):
    for name in VARIANTS:
        est = nbt.estimate_memory(cmp.configs[name])   # computed again here, independently of the table
        r = row(cmp, name)
        for attr, col in ESTIMATE_COLUMNS.items():
            want = getattr(est, attr, None)
            if want is None:   # an estimate without that class (before issue 27.4 landed): no value, not a 0
                assert math.isnan(r[col]), (name, col)
            else:
                assert r[col] == pytest.approx(float(want), rel=1e-12, abs=0), (name, col)
    ref, pure, adamw8 = row(cmp, "bf16"), row(cmp, "pure"), row(cmp, "adamw8")
    # bf16-pure stores the weights and their gradients in 2 bytes instead of 4, and has no fp32 master copy
    assert pure.est_weights_gib == pytest.approx(ref.est_weights_gib / 2, rel=1e-6)
    assert pure.est_gradients_gib == pytest.approx(ref.est_gradients_gib / 2, rel=1e-6)
    if not math.isnan(ref.est_master_weights_gib):
        assert pure.est_master_weights_gib == 0
        assert ref.est_master_weights_gib == pytest.approx(ref.est_weights_gib)   # full training: all of them
    # 8-bit AdamW keeps less optimizer state than AdamW's two fp32 moments; the weights are the same
    assert adamw8.est_optimizer_gib < ref.est_optimizer_gib
    assert adamw8.est_weights_gib == ref.est_weights_gib


def test_lost_updates_are_in_the_table_and_the_verdict_of_pure_only(cmp):
    for name in VARIANTS:
        s = cmp.results[name].summary
        lost = row(cmp, name).lost_updates
        if s.get("lost_updates") is None:
            assert math.isnan(lost)
        else:
            assert lost == pytest.approx(s["lost_updates"])
    pure, ref = cmp.results["pure"].summary, cmp.results["bf16"].summary
    # at lr 1e-5 most bf16 weights cannot move by lr x update; fp32 master weights can
    assert pure["lost_updates"] > LOST_UPDATES_REPORTED > ref["lost_updates"]
    h = cmp.results["pure"].history
    line = lost_updates_line("bf16-pure", pure["lost_updates_by_step"], False, dict(zip(h.step, h.lr)))
    assert line and "stochastic_rounding=True" in line
    at = max(pure["lost_updates_by_step"], key=lambda k: (pure["lost_updates_by_step"][k], -k))
    share = pure["lost_updates_by_step"][at]
    # the largest share leads, with where it fell and its lr
    assert line.startswith(f"{share:.0%} of updates lost at step {at} (where lr is {h.set_index('step').lr[at]:.2g})")
    assert line in cmp.notes["pure"]      # the note under the table says it as the verdict does
    v = cmp.verdicts["pure"]
    assert v.lost_updates_text == line and line in v.text and v.lost_updates == pytest.approx(pure["lost_updates"])
    assert cmp.verdicts["bf16"].lost_updates_text is None and "updates lost" not in cmp.verdicts["bf16"].text
    # stochastic rounding: the sentence says they are kept on average, and suggests nothing
    sr = cmp.verdicts["pure+sr"]
    if sr.lost_updates_text is not None:
        assert "stochastic rounding keeps them" in sr.lost_updates_text and "try" not in sr.lost_updates_text
    for name in ("adamw8", "fp8"):   # fp32 master weights keep the updates
        assert cmp.verdicts[name].lost_updates_text is None, cmp.verdicts[name].text
    assert line in cmp.summary_html() and line in cmp.format_table()


def test_the_loss_is_judged_against_the_seed_band(cmp):
    assert cmp.band is not None and cmp.seed_results and set(cmp.seed_results) == {1}
    for name in VARIANTS:
        v = cmp.verdicts[name]
        if name == "bf16":
            assert v.is_reference and "init noise from reruns with other initial weights" in v.text
            continue
        assert v.within_noise is not None, v.text   # judged against the reference and its rerun
        assert ("within init noise" in v.text) == v.within_noise
        if not v.within_noise:
            assert f"loss {v.direction} than bf16 beyond init noise (mean {v.test.mean_diff:+.2g}" in v.text
            mine = v.outside.get(v.direction, [])
            if mine:
                assert f"outside the reruns' range on {len(mine)} of {v.judged_steps} steps" in v.text


def test_compact_views_show_optimizer_and_weights_where_they_differ(cmp):
    compact = cmp.compact_table().set_index("Variant")
    assert {"Optimizer", "Weights"} <= set(compact.columns)
    assert list(compact.columns[:4]) == ["Precision", "Optimizer", "Weights", "Tokens/s (speed-up)"]
    assert compact.loc["adamw8", "Optimizer"] == "adamw_8bit" and compact.loc["pure", "Weights"] == "bf16"
    assert compact.loc["bf16", "Weights"] == "fp32"
    html = cmp.summary_html()
    assert "Optimizer" in html and "Weights" in html and "adamw_8bit" in html
    text = cmp.format_table()
    header = text.splitlines()[len(VARIANTS) + 1]
    assert "optimizer" in header and "weights_dtype" in header and "lost_updates" in header
    assert "est_weights_gib" in header and "est_optimizer_gib" in header
    # the emulated fp8 says so in its notes, as the capabilities do
    caps = nbt.capabilities()
    if caps.notes.get("fp8"):
        assert any(caps.notes["fp8"] in n for n in cmp.notes["fp8"])


def test_a_comparison_that_does_not_differ_in_them_leaves_the_columns_out(cmp):
    # the same outcome, seen with only the variants that share optimizer and weights' dtype
    from nbtrain.compare.render import ComparisonViews

    same = types.SimpleNamespace(table=cmp.table[cmp.table.variant.isin(["bf16", "fp8"])].reset_index(drop=True))
    heads = ComparisonViews._compact_headers.__get__(types.SimpleNamespace(
        table=same.table, _eval_column=lambda: "eval_loss"))()
    assert "optimizer" not in heads and "weights_dtype" not in heads


def _outcome(name, init, **cfg):
    config = nbt.TrainConfig(**{**BASE, **cfg})
    summary = {"init_hash": init, "data_hash": "d", "steps": 4}
    return _Outcome(name, dict(cfg), config.to_dict(), config=config,
                    result=types.SimpleNamespace(summary=summary), status="max_steps")


@pytest.mark.parametrize("changes", [{"optimizer": "adamw_8bit"}, {"precision": "bf16-pure"},
                                     {"precision": "bf16-pure", "stochastic_rounding": True},
                                     {"precision": "fp8"}])
def test_optimizer_and_precision_never_explain_another_init(changes):
    # Those variants share the reference's init by construction: a different hash is a real problem.
    ref, other = _outcome("ref", "aaaa"), _outcome("other", "bbbb", **changes)
    warns = _check_fairness([ref, other], "ref")
    assert other.fair is False and warns and "no config difference explains it" in warns[0]
    assert not any("by design" in n for n in other.notes)
    same = _outcome("same", "aaaa", **changes)
    assert _check_fairness([ref, same], "ref") == [] and same.fair is True


def test_a_variant_this_device_cannot_run_still_shows_its_estimate():
    caps = nbt.capabilities()
    if "paged_adamw_8bit" not in caps.reasons:
        pytest.skip("this device runs paged_adamw_8bit")
    cfg = nbt.TrainConfig(**BASE)
    c = nbt.compare(cfg, variants={"bf16": {}, "paged": {"optimizer": "paged_adamw_8bit"}}, subset=16,
                    max_steps=1, warmup=False)
    r = row(c, "paged")
    assert r.status == "unsupported" and "optimizer" in r.notes and caps.reasons["paged_adamw_8bit"] in r.notes
    assert (r.optimizer, r.weights_dtype) == ("paged_adamw_8bit", "fp32")
    est = nbt.estimate_memory(cfg.replace(optimizer="paged_adamw_8bit"))
    assert r.est_optimizer_gib == pytest.approx(est.optimizer_gib) and r.est_total_gib == pytest.approx(est.total_gib)
    assert math.isnan(r.lost_updates) and "not run (unsupported here" in c.verdicts["paged"].text
    compact = c.compact_table()
    paged = compact[compact.Variant.str.startswith("paged")].iloc[0]   # "paged (unsupported)"
    assert paged.Optimizer == "paged_adamw_8bit"
    assert "Weights" not in compact.columns   # both keep fp32 weights: nothing to tell apart
