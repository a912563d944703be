"""Library checks of notebooks/05_precision_of_every_tensor.ipynb, run in its kernel after the named cells."""
# %% after: 05-33
assert after == 1.0 and spacing == 2**-7                    # the update of exercise 1 is lost
# %% after: 287b7acb
# bf16-pure: AdamW's two moments at 4 B per weight instead of 8
assert np.isclose(e["pure"].optimizer_gib, e["bf16"].optimizer_gib / 2, rtol=0.01)   # (+ a 4-byte step count each)
# 8-bit AdamW: two bytes per weight plus a small absmax per block, where bf16's AdamW holds eight
assert e["adamw8"].optimizer_gib < 0.35 * e["bf16"].optimizer_gib and e["adamw8"].weights_gib == e["bf16"].weights_gib
# %% after: 05-38
assert 0.25 < share_8bit < 0.3
# %% after: 05-42
assert pure_answer in ("higher", "within noise")   # never lower: bf16-pure loses updates, it gains none
# %% after: 29c5056c
assert (t["status"] == "max_steps").all()
assert t["precision_used"].tolist() == ["bf16", "bf16-pure", "bf16-pure", "bf16", "fp8"]
# %% after: 2ede1c58
assert lost["bf16"] < 0.01 and lost["adamw8"] < 0.01 and lost["fp8"] < 0.01
assert any("of updates lost at step" in n for n in cmp.results["pure"].summary["notes"])
v_pure = cmp.verdicts["pure"]
assert v_pure.test.null == "init" and ("loss within init noise" in v_pure.text) == v_pure.within_noise
# %% after: 05-48
assert 0.09 < moved < 0.11 and abs(rounded.float().mean().item() - exact.mean().item()) < spacing / 100
# %% after: 6a063a8f
assert cmp.verdicts["pure+sr"].within_noise
# %% after: 9c08c055
width = cmp.band.width
for n in ("fp8", "adamw8"):
    assert (cmp.differences[n].abs() <= width).all(), n
notes = " ".join(cmp.results["fp8"].summary["notes"])
assert "linear layers run their matmuls in float8" in notes and "lm_head (output layer)" in notes
