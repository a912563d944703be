"""Library checks of notebooks/11_troubleshooting.ipynb, run in its kernel after the named cells."""
# %% after: 10-05
import numpy as np

from nbtrain.viz import find_trace

skipped = h.index[h["skipped"]].tolist()
assert hot.summary["skipped_steps"] == len(skipped) > 0
assert hot.summary["stopped_reason"] == "max_steps"                 # with a GradScaler the run goes on
assert hot.summary["first_nonfinite_step"] == int(h.index[h["nonfinite"]][0])
assert h.loc[h["nonfinite"], "skipped"].all()                       # every non-finite step was skipped
assert list(find_trace(dash.figure, "scale", "skipped").x) == skipped   # the dashboard marks them
np.testing.assert_array_equal(find_trace(dash.figure, "loss", "loss").y, h["loss"].to_numpy())
if hot.summary["device"] == "cpu":   # measured on a CPU: steps 2 and 3 overflowed in the backward, every step from 5 in the forward
    assert skipped == [2, 3] + list(range(5, 21))
    assert all(math.isfinite(h.loc[s, "loss"]) and not math.isfinite(h.loc[s, "grad_norm"]) for s in (2, 3))
    assert h.loc[5:, "loss"].isna().all()
# %% after: 10-08
assert answer_where in ("activations", "gradients")
if hot.summary["device"] == "cpu":
    assert answer_where == "gradients"
# %% after: 10-11
findings = {f.kind: f for f in hot.diagnose()}
f = findings["fp16_overflow"]
assert f.severity == "error" and f.evidence["skipped_steps"] == skipped and f.step == skipped[0]
assert f.evidence["min_scale"] == h["scale"].min() and f.evidence["last_scale"] == h["scale"].iloc[-1]
assert f.advice[0].startswith("keep the GradScaler")
assert any(a.startswith("lower the learning rate") for a in f.advice)
assert not any("clip" in a for a in f.advice)       # clipping is on already (max_grad_norm=1.0): not advised
assert "nonfinite" not in findings                    # skipped by the scaler: an overflow, not a divergence
over = nbt.scan_fp16_overflow(hot.model, ids)
assert over and all(d["max_abs"] > 65504 for d in over)   # the grown weights' activations leave fp16's range
# %% after: 10-13
assert fixed.summary["skipped_steps"] == 0 and fixed.history["loss"].notna().all()
assert fixed.history["loss"].iloc[-1] < fixed.history["loss"].iloc[0] - 0.5          # it learns
assert abs(fixed.history["loss"].iloc[0] - hot.history["loss"].iloc[0]) < 1e-3        # same start, same batch
assert hot.config.max_grad_norm == 1.0                                                # clipping was on
# %% after: 10-15
assert (steps.loc[~steps["skipped"], "scale after"] == steps.loc[~steps["skipped"], "ran with scale"]).all()
assert overflow.evidence["min_scale"] == 2.0**16 / 2**hot.summary["skipped_steps"]   # halved once per skip
if hot.summary["device"] == "cpu":
    assert overflow.evidence["min_scale"] == 0.25 and below_one == [20]
# %% after: 10-17
assert fixed.history["scale"].eq(2.0**16).all()
# %% after: 10-19
bh = blocked.history
assert bh["skipped"].all() and bh["nonfinite"].all() and bh["loss"].isna().all()
assert blocked.summary["first_nonfinite_step"] == 1
assert bh["scale"].tolist() == [2.0**16 / 2**k for k in range(1, len(bh) + 1)]   # halved at every step
fig_blocked = blocked.figure()
assert list(find_trace(fig_blocked, "scale", "skipped").x) == bh["step"].tolist()
assert len(find_trace(fig_blocked, "loss", "nonfinite").x) == len(bh)
assert {f.kind: f for f in blocked.diagnose()}["fp16_overflow"].severity == "error"
# %% after: 10-22
assert answer_scale == 2.0**16 / 2**blocked.summary["steps"] == 16.0
# %% after: 10-25
modules = set(found["module"])
assert (found["max_abs"] > 65504).all()
assert max(modules, key=lambda m: m.count(".")) == "model.layers.0.mlp"   # the innermost: where it starts
assert "model.layers.0.mlp.down_proj" not in modules                      # the MLP's own layers are fine
assert not any(m.startswith("model.layers.0.self_attn") or m == "model.embed_tokens" for m in modules)
# %% after: 10-27
assert cured.summary["precision_used"] == wide and cured.history["loss"].notna().all()
assert cured.history["loss"].iloc[-1] < cured.history["loss"].iloc[0] - 0.5
assert cured.summary["nonfinite_steps"] == 0 and cured.history["scale"].isna().all()   # no GradScaler
# %% after: 10-29
assert not est.fits and est.advice and big.micro_batch_size >= 32
assert est.total_params == est.trainable_params > 100_000_000     # a full fine-tune of SmolLM2-135M
assert est.logits_gib > est.weights_gib + est.gradients_gib + est.optimizer_gib   # the logits are a large share
# %% after: 10-32
assert abs(answer_factor - big.micro_batch_size) < 0.01 * big.micro_batch_size    # logits scale with the micro-batch
assert one.weights_gib == est.weights_gib and one.optimizer_gib == est.optimizer_gib   # batch-independent parts
assert one.gradients_gib == est.gradients_gib
# %% after: 10-35
totals = [est.total_gib] + [a.total_gib for a in est.advice]
assert all(b < a for a, b in zip(totals, totals[1:]))                 # every item of the advice helps
assert last.fits and abs(after.total_gib - last.total_gib) < 1e-6     # the advice's own estimate, recomputed
assert small.effective_batch_size == big.effective_batch_size         # the optimizer sees the same batch
assert "max_seq_len" not in est.advice[0].change                      # shorter sequences come last, if at all
# %% after: 10-37
try:
    cfg.replace(lr=0)
    raise AssertionError("lr=0 was accepted")
except nbt.ConfigError as e:
    assert e.field == "lr"
# %% after: 10-41
assert (low.history["lr"] == 1e-6).all()
assert low.summary["trainable_params"] == low.summary["total_params"]      # everything trains
assert low.summary["lost_updates"] < 0.01                                   # the updates land: small, not lost
assert low.history["grad_norm"].gt(0.5).all()                               # the gradients are there
assert low.summary["skipped_steps"] == low.summary["nonfinite_steps"] == 0
assert not [f for f in low.diagnose() if f.kind != "fp16_underflow"]        # no precision trouble
assert low.config.lr * low.config.max_steps < 0.01 * low.model.config.initializer_range
# %% after: 10-47
assert answer_changes is False
assert spacing == 2.0**-13
assert torch.tensor(0.02) + 3e-5 != torch.tensor(0.02)       # fp32 keeps it (the solution's last sentence)
# %% after: 10-50
if "bf16-pure" in caps.allowed_precisions:
    kinds = {f.kind: f for f in pure.diagnose()}
    assert "lost_updates" in kinds and any("precision='bf16'" in a for a in kinds["lost_updates"].advice)
    assert any("stochastic_rounding" in a for a in kinds["lost_updates"].advice)
    assert "lost_updates" not in {f.kind for f in master.diagnose()}
    assert pure.summary["weights_dtype"] == "bf16" and master.summary["weights_dtype"] == "fp32"
    assert master.summary["lost_updates"] < 0.01
    assert progress(master) > progress(pure)                  # with fp32 master weights the loss moves further
