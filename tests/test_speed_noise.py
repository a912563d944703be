"""The loss verdict says which way the loss went, on real runs against the reference's seed band.

Speed is not asserted here: no test asserts on a wall-clock time or a throughput. The speed rule is tested on
injected timings (tests/test_speed_rule.py, tests/test_verdicts.py); real A/A timings on this machine are a
benchmark (benchmarks/aa_speed.py, benchmarks/results/aa_speed_cpu.md)."""

from __future__ import annotations

import warnings

import pytest

import nbtrain as nbt
from nbtrain.compare import compare


def tiny_cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=256, max_seq_len=64, micro_batch_size=8,
                max_steps=6, eval_fraction=0.0, precision="fp32")
    return nbt.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def directions():
    """The reference, lr x10 (learns faster: its loss ends lower) and lr 3.0 (diverges: higher), against the
    reference's seed band."""
    cfg = tiny_cfg(subset=64, max_seq_len=32, micro_batch_size=4, max_steps=8, lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compare(cfg, variants={"ref": {}, "lr10": {"lr": 1e-2}, "hot": {"lr": 3.0}}, seeds=(0, 1, 2),
                       warmup=False)


@pytest.mark.parametrize("name,way", [("lr10", "lower"), ("hot", "higher")])
def test_the_loss_verdict_says_which_way_the_variant_left_the_band(directions, name, way):
    cmp = directions
    diff, width = cmp.differences[name], cmp.band.width
    outside = [s for s in width.index if abs(diff[s]) > width[s]]   # computed here from the two series
    assert outside, f"premise: {name} leaves the seed band"
    mine = [s for s in outside if (diff[s] < 0) == (way == "lower")]
    assert len(mine) > len(outside) - len(mine), "premise: most steps outside lie on that side"
    v = cmp.verdicts[name]
    assert v.direction == way and v.leaves_band_at == outside[0] and v.outside[way] == mine
    assert f"loss {way} than ref beyond init noise (mean" in v.text
    assert (f"outside the reruns' range on {len(mine)} of {len(width)} steps "
            f"({'step' if len(mine) == 1 else 'from step'} {mine[0]}") in v.text
