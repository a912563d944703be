"""Library checks of notebooks/03_mixed_precision.ipynb, run in its kernel after the named cells."""
# %% after: 03-04
assert table["bf16"]["largest"] / table["fp32"]["largest"] > 0.99  # bf16 reaches ~3.4e38, like fp32
assert [table[n]["exponent bits"] for n in formats] == [8, 5, 8]
assert [table[n]["mantissa bits"] for n in formats] == [23, 10, 7]
# %% after: 03-06
assert math.isinf(examples.loc["70000 (a large activation)", "fp16"])          # overflow
assert math.isfinite(examples.loc["70000 (a large activation)", "bf16"])
assert examples.loc["1e-8 (a small gradient)", "fp16"] == 0.0                  # underflow: the gradient is gone
assert abs(examples.loc["1e-8 (a small gradient)", "bf16"] / 1e-8 - 1) < 0.01   # bf16 keeps it (to 1%)
assert examples.loc["1 + 1/256 (a small update)", "bf16"] == 1.0               # bf16 rounds the update away
assert examples.loc["1 + 1/256 (a small update)", "fp16"] == 1 + 2**-8         # fp16 keeps it
# %% after: 03-32
assert answer_update == 1.0                                    # exercise 1: the quarter-step update is lost
# %% after: 03-10
assert scaling.loc["S = 1 (no scaling)", "subnormal (imprecise)"] > 0.05        # many gradients are tiny
assert scaling.loc["S = 1 (no scaling)", "become 0"] > 0                        # some vanish entirely
assert scaling.loc["S = 2**16 (the GradScaler's start)", "subnormal (imprecise)"] < 1e-3
assert scaling.loc["S = 2**16 (the GradScaler's start)", "overflow to inf"] == 0
assert scaling.loc["S = 2**24 (too large)", "overflow to inf"] > 0             # too large: inf
# %% after: 03-36
assert 16 <= answer_k < 24           # exercise 2 agrees with the table: 2**16 fits, 2**24 overflows
# %% after: 03-14
from nbtrain.viz import find_trace

assert not fp16.loc[7:, "skipped"].any() and np.isfinite(fp16.loc[7:, "loss"]).all()   # it recovered
assert fp16.loc[cfg.max_steps, "loss"] < fp16.loc[3, "loss"]          # and keeps learning
# The dashboard's loss-scale plot marks the skipped steps.
assert list(find_trace(dash.figure, "scale", "skipped", run="fp16").x) == skipped
# where the fp16 run trained, not what capabilities() says (under tests/test_notebooks_devices.py's fake GPU the run
# still trains on the CPU): measured on a CPU, no overflow but the outlier's, so the scale is exactly known
if cmp.results["fp16"].summary["device"] == "cpu":
    assert skipped == outlier_steps and fp16["nonfinite"].sum() == 3     # exactly the outlier steps
    assert fp16.loc[1:3, "scale"].eq(2.0**16).all()                       # the start, 65536
    assert fp16.loc[4:6, "scale"].tolist() == [2.0**15, 2.0**14, 2.0**13]   # halved at each skipped step
    assert fp16.loc[7:, "scale"].eq(2.0**13).all()                        # no growth for 2000 clean steps
# %% after: 03-40
assert (start, interval) == (2.0**16, 2000)                    # PyTorch's GradScaler defaults, as the text says
if device == "cpu":
    assert answer_steps == 6000                                # exercise 3: three halvings, 3 x 2000 steps
# %% after: 03-16
assert overflow.evidence["skipped_steps"] == skipped and overflow.evidence["min_scale"] == fp16["scale"].min()
if device == "cpu":
    assert overflow.evidence["skipped_steps"] == outlier_steps and overflow.evidence["min_scale"] == 2.0**13
# %% after: 03-19
assert not bf16["skipped"].any() and not bf16["nonfinite"].any()          # no step lost in bf16
assert bf16["scale"].isna().all()                                         # no GradScaler
assert (bf16.loc[outlier_steps, "grad_norm"] > 1e5).all() and bf16.loc[outlier_steps, "clipped"].all()
# %% after: 03-21
assert abs(fp16.loc[1, "grad_norm"] / bf16.loc[1, "grad_norm"] - 1) < 0.05
# %% after: 03-25
assert caps.auto_precision in caps.allowed_precisions
if "bf16" in caps.allowed_precisions:   # the doctor's advice for the fp16 run includes switching to bf16 here
    assert any("bf16" in a for a in overflow.advice)
