"""Seeds that vary one thing, a band for each question named in the verdict, and the loss rule's bookkeeping.

``data_seed`` orders the data and draws the eval split; ``seed`` draws the initial weights. compare()'s reruns vary
the initial weights only (band="init", the default), the data order only (band="data"), or perturb the initial
weights by a relative ±rounding (band="rounding"). The rule's false-call rate and power are measured in
benchmarks/loss_rule.py; here, what it computes from fixed or tiny runs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import nbtrain as nbt
from nbtrain import verdicts as V
from nbtrain.compare import compare
from nbtrain.data import load_data
from nbtrain.engine.prepare import perturb_weights
from nbtrain.models import build_model, load_tokenizer


def tiny_cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=16, micro_batch_size=4,
                max_steps=4, eval_fraction=0.25, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


# -- data_seed ----------------------------------------------------------------------------------------------------
def test_data_seed_defaults_to_the_seed_and_old_configs_load_unchanged(tmp_path):
    cfg = tiny_cfg(seed=7)
    assert cfg.data_seed is None and cfg.data_order_seed == 7
    assert cfg.replace(data_seed=3).data_order_seed == 3
    old = {k: v for k, v in cfg.to_dict().items() if k != "data_seed"}   # a config saved before the field
    (tmp_path / "old.yaml").write_text(nbt.TrainConfig(**old).to_yaml().replace("data_seed: null\n", ""))
    assert nbt.TrainConfig.from_yaml(tmp_path / "old.yaml") == cfg
    with pytest.raises(nbt.ConfigError, match="data_seed"):
        tiny_cfg(data_seed=-1)


def test_the_eval_split_and_the_order_follow_data_seed_the_weights_follow_seed():
    tok = load_tokenizer(tiny_cfg())
    evals = {}
    for seed, data_seed in ((0, None), (5, 0), (0, 5)):
        cfg = tiny_cfg(seed=seed, data_seed=data_seed)
        evals[(seed, data_seed)] = [e["input_ids"] for e in load_data(cfg, tok).eval]
    assert evals[(0, None)] == evals[(5, 0)] != evals[(0, 5)]
    runs = {k: nbt.train(tiny_cfg(seed=k[0], data_seed=k[1], max_steps=2)) for k in ((0, None), (5, 0), (0, 5))}
    data = {k: r.summary["data_hash"] for k, r in runs.items()}
    assert data[(0, None)] == data[(5, 0)] != data[(0, 5)]
    first = {k: r.history.loss.iloc[0] for k, r in runs.items()}
    assert first[(0, None)] != first[(5, 0)]     # other initial weights, the same first batch


def test_a_checkpoint_resumes_only_the_same_data_seed(tmp_path):
    out = tmp_path / "run"
    nbt.train(tiny_cfg(output_dir=str(out), save_every=2, data_seed=3))
    with pytest.raises(nbt.CheckpointError, match="data_seed"):
        nbt.train(tiny_cfg(output_dir=str(tmp_path / "again"), resume_from=str(out), data_seed=4))


def test_a_seed_variant_on_the_same_data_is_fair_with_its_init_differing_on_purpose():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmp = compare(tiny_cfg(), variants={"ref": {}, "other init": {"seed": 9, "data_seed": 0},
                                            "other order": {"data_seed": 9}}, warmup=False)
    t = cmp.table.set_index("variant")
    assert t.loc["other init", "data_hash"] == t.loc["ref", "data_hash"] != t.loc["other order", "data_hash"]
    assert t.loc["other init", "fair"] and not t.loc["other order", "fair"] and not cmp.fair
    notes = {k: " ".join(v) for k, v in cmp.notes.items()}
    assert "initial weights differ by design (seed differs)" in notes["other init"]
    assert "NOT FAIR" in notes["other order"] and "data_seed differs" in notes["other order"]
    assert any("other order" in str(w.message) for w in caught)


# -- the bands ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bands():
    """One comparison per band: fp32 against itself under another name, and lr x 10."""
    out = {}
    for band in V.NULLS:
        out[band] = compare(tiny_cfg(), variants={"fp32": {}, "lr10": {"lr": 1e-2}}, seeds=(0, 1, 2), band=band,
                            warmup=False)
    return out


def test_each_band_reruns_vary_what_it_says(bands):
    ref = {b: c.results["fp32"].summary for b, c in bands.items()}
    for band, cmp in bands.items():
        assert cmp.null == band and cmp.band.null == band and set(cmp.seed_results) == {1, 2}
        for s, r in cmp.seed_results.items():
            c, summ = r.config, r.summary
            if band == "init":
                assert (c.seed, c.data_order_seed) == (s, 0)
                assert summ["data_hash"] == ref[band]["data_hash"] and summ["init_hash"] != ref[band]["init_hash"]
            elif band == "data":
                assert (c.seed, c.data_order_seed) == (0, s)
                assert summ["data_hash"] != ref[band]["data_hash"] and summ["init_hash"] == ref[band]["init_hash"]
            else:
                assert (c.seed, c.data_order_seed) == (0, 0)
                assert summ["data_hash"] == ref[band]["data_hash"] and summ["init_hash"] != ref[band]["init_hash"]
                assert any("initial weights perturbed" in n and f"±{V.ROUNDING_SCALE:.3g}" in n
                           for n in r.summary["notes"]), r.summary["notes"]


def test_every_verdict_names_its_null(bands):
    for band, cmp in bands.items():
        name = V.NULL_NAMES[band]
        ref_text = cmp.verdicts["fp32"].text
        assert f"the reference ({name} from {V.null_words(band, cmp.rounding)}: seeds 1, 2" in ref_text
        v = cmp.verdicts["lr10"]
        assert v.test is not None and v.test.null == band and v.test.runs == 3
        assert (f"within {name} (" in v.text) == v.within_noise and (f"beyond {name} (" in v.text) != v.within_noise
        assert f"{name} allows" in v.text
        # the rule, recomputed here from the band's runs
        d = cmp.differences["lr10"].reindex(cmp.band.runs.index)
        null = [0.0, *(cmp.band.runs[c].mean() for c in cmp.band.runs.columns)]
        assert v.test.null_means == pytest.approx(tuple(null))
        assert v.test.mean_diff == pytest.approx(d.mean())


def test_an_eval_verdict_is_judged_only_on_one_eval_set(bands):
    for band, cmp in bands.items():
        text = cmp.verdicts["lr10"].text
        assert "eval loss" in text
        if band == "data":
            assert "not judged against the data-order reruns, which held out other examples" in text
        else:
            assert f"{V.NULL_NAMES[band]} " in text.split("eval loss", 1)[1]


def test_the_rounding_perturbation_moves_each_weight_by_at_most_its_scale():
    cfg = tiny_cfg()
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    a = build_model(cfg, tok, None, "fp32", "cpu")
    before = {k: v.clone() for k, v in a.state_dict().items()}
    note = perturb_weights(a, 2.0 ** -8, seed=4)
    moved = 0
    for k, v in a.state_dict().items():
        rel = (v - before[k]).abs() / before[k].abs().clamp_min(1e-30)
        assert float(rel.max()) <= 2.0 ** -8 * (1 + 1e-5), k
        moved += int((v != before[k]).sum())
    assert moved > 0.9 * sum(int((v != 0).sum()) for v in before.values()) and "±0.00391" in note
    b = build_model(cfg, tok, None, "fp32", "cpu")
    b.load_state_dict(before)
    perturb_weights(b, 2.0 ** -8, seed=4)   # the same draw: the same weights
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_bad_band_and_rounding_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match=r"band: one of \['init', 'data', 'rounding'\]"):
        compare(tiny_cfg(), precisions=("fp32",), band="seed")
    for bad in (0, 1.5, "x", True):
        with pytest.raises(ValueError, match="rounding"):
            compare(tiny_cfg(), precisions=("fp32",), band="rounding", rounding=bad)
