"""compare() on GRPO: each variant's sampler/trainer mismatch with its batch-to-batch band, held against fp16's,
in the verdict; sampler_precision as a variant; the judgement's arithmetic on hand-made histories."""

from __future__ import annotations

import math

import pandas as pd
import pytest

import nbtrain as nbt
from nbtrain.verdicts import mismatch_judgements


def _h(values, steps=None):
    steps = steps or list(range(1, len(values) + 1))
    return pd.DataFrame({"step": steps, "mismatch_mean": values})


def test_the_mismatch_judgement_says_the_ratio_and_whether_the_bands_part():
    js = mismatch_judgements({"fp32": _h([1e-6, 2e-6]), "bf16": _h([0.03, 0.032, 0.028]),
                              "fp16": _h([0.003, 0.004, 0.0035])}, "fp32",
                             means={"bf16": 0.030, "fp16": 0.0035})
    b = js["bf16"]
    assert b.partner == "fp16" and b.ratio == pytest.approx(0.030 / 0.0035) and b.beyond_noise
    assert b.text == ("sampler/trainer mismatch 0.03 nats per token (0.028-0.032 over 3 rollout batches), 8.6x "
                      "fp16's, beyond their batch-to-batch spread")
    assert js["fp16"].partner == "fp32" and js["fp16"].beyond_noise
    assert js["fp32"].partner == "fp16" and js["fp32"].ratio < 0.01
    # overlapping bands: within
    js = mismatch_judgements({"a": _h([0.01, 0.03]), "fp16": _h([0.02, 0.04])}, "a")
    assert js["a"].beyond_noise is False and "within their batch-to-batch spread" in js["a"].text
    # a rollout batch trained on for 2 steps is counted once
    js = mismatch_judgements({"a": _h([0.1, 0.1, 0.2, 0.2])}, "a", iterations={"a": 2})
    assert js["a"].batches == 2 and js["a"].partner is None
    # no GRPO column: no judgement
    assert mismatch_judgements({"a": pd.DataFrame({"step": [1], "loss": [1.0]})}, "a") == {}


@pytest.fixture(scope="module")
def grpo_comparison():
    cfg = nbt.TrainConfig(objective="grpo", reward="length:5", data="builtin:prompts", model="tiny", precision="fp32",
                          micro_batch_size=8, num_generations=4, max_new_tokens=6, eval_fraction=0.0, max_steps=2,
                          lr=1e-3)
    return nbt.compare(cfg, variants={"fp32": {}, "fp16": dict(precision="fp16"),
                                      "bf16 sampling": dict(sampler_precision="bf16")}, seeds=(0, 1))


def test_a_grpo_comparison_says_each_variants_mismatch_against_fp16s(grpo_comparison):
    c = grpo_comparison
    assert set(c.mismatch) == {"fp32", "fp16", "bf16 sampling"}
    for name, v in c.verdicts.items():
        j = c.mismatch[name]
        assert j.text in v.text and v.parts.index(j.text) <= 1, v.text
        assert math.isfinite(j.mean)
    s = c.mismatch["bf16 sampling"]
    assert s.partner == "fp16" and c.results["bf16 sampling"].summary.sampler_precision == "bf16"
    assert c.results["bf16 sampling"].summary.precision_used == "fp32"
    # fp32 sampling and training: the decoding arithmetic only; bf16 sampling for fp32 training: bf16's rounding
    assert c.mismatch["fp32"].high < 1e-4 < s.low
    # the reference's band takes in its seed run's rollout batches
    assert c.mismatch["fp32"].batches == 4
    # the total reward is judged against the seed band as the loss is
    assert "reward mean" in c.verdicts["fp16"].text


def test_the_table_and_its_compact_view_show_the_sampler_trainer_mismatch(grpo_comparison):
    c = grpo_comparison
    t = c.table.set_index("variant")
    for name in ("fp32", "fp16", "bf16 sampling"):
        assert t.loc[name, "sampler_mismatch"] == pytest.approx(c.results[name].summary.mismatch_mean)
    compact = c.compact_table().set_index("Variant")
    col = [k for k in compact.columns if "Sampler/trainer" in k]
    assert len(col) == 1 and compact.loc["fp32", col[0]] != "—"


def test_variants_that_sample_differently_are_still_fair(grpo_comparison):
    # the data hash covers the prompts, not the completions each precision draws for itself
    c = grpo_comparison
    assert c.fair and len(set(c.table.data_hash)) == 1
    assert "NOT FAIR" not in " ".join(v.text for v in c.verdicts.values())
