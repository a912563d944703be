"""Library checks of notebooks/07_real_model_precisions.ipynb, run in its kernel after the named cells."""
# %% after: 2b7887ce
assert cmp.fair and t["init_hash"].nunique() == 1 and t["data_hash"].nunique() == 1   # same weights, same batches
assert (t["status"] == "max_steps").all() and t["precision_used"].tolist() == names
assert t["weights_dtype"].tolist() == ["fp32", "fp32", "fp32", "bf16"]   # only bf16-pure stores bf16 weights
assert summary["trainable_params"] < 0.02 * summary["total_params"]   # LoRA: under 2% of the weights train
# Every precision is within init noise (the reference and its two reruns): the rule's words and numbers
assert sorted(cmp.seed_results) == [1, 2] and cmp.null == "init"
for name in names[1:]:
    v = cmp.verdicts[name]
    assert v.test.runs == 3 and v.test.null == "init"
    null = [0.0, *(cmp.band.runs[c].mean() for c in cmp.band.runs.columns)]
    half = 4.303 * np.std(null, ddof=1) * np.sqrt(1 + 1 / 3)          # t(0.975, 2 df)
    d = cmp.differences[name].reindex(cmp.band.runs.index)
    assert v.within_noise == (abs(d.mean() - np.mean(null)) <= half * (1 + 1e-6))
    assert (f"loss within init noise (mean" in v.text) == v.within_noise
assert first["fp16"] < first["bf16"]
assert t.loc["bf16-pure", "lost_updates"] > 100 * t.loc["bf16", "lost_updates"]
assert max(lost, key=lost.get) == cfg.max_steps                 # the most at the last step, the smallest lr

# %% after: 36576dbe
assert t.loc["fp16", "skipped_steps"] == len(skipped)
if skipped:
    assert any(f.kind == "fp16_overflow" and f.evidence["skipped_steps"] == skipped
               for f in cmp.results["fp16"].diagnose())
if cmp.results["fp16"].summary["device"] == "cpu":   # exact on a CPU: one step skipped, the third
    assert skipped == [3] and t.loc["fp16", "skipped_steps"] == 1            # one step, the third
    assert fp16.loc[1:2, "scale"].eq(2.0**16).all() and fp16.loc[3:, "scale"].eq(2.0**15).all()   # halved once
    assert np.isfinite(fp16.loc[4:, "loss"]).all()
    # The skipped step leaves fp16 one update behind the others: its difference grows after step 3.
    assert abs(cmp.differences["fp16"].loc[4]) > 10 * first["fp16"]
    assert any(f.kind == "fp16_overflow" and f.evidence["skipped_steps"] == [3] for f in cmp.results["fp16"].diagnose())

# %% after: 09cb77a8
from nbtrain.engine.fingerprint import weights_hash

if cmp.results["fp32"].summary["device"] == "cpu":   # the runs built their model here, from the same generator: the same LoRA A matrices
    assert weights_hash(model) == t.loc["fp32", "init_hash"]        # the runs' starting point, exactly
assert len(layers) == 30
assert rounding["fp16"] < rounding["bf16"] / 4     # fp16's 10-bit mantissa rounds 8x finer than bf16's 7 bits

# %% after: f1cf27e4
with torch.no_grad():
    assert nbt.scan_fp16_overflow(model, batches[0]) == []     # nbtrain's own scan of every module agrees
if next(model.parameters()).device.type == "cpu":   # measured by the notebook's own forward, on the CPU
    # One value, 38% of the range, written by layer 11's MLP into one hidden dimension of the first token, and
    # carried by the residual stream through layer 27.
    assert top == 11 and 0.35 < peak / FP16_MAX < 0.45
    assert (acts.loc[:10, "residual stream"] < 1_000).all() and (acts.loc[11:27, "residual stream"] > 20_000).all()
    assert acts.loc[11, "in"] == "mlp.down_proj" and acts.loc[11, "largest matmul output"] > 20_000
    assert set(acts.loc[11:29, "token"]) == {"<|im_start|>"} and set(acts.loc[11:29, "position"]) == {0}
    assert acts.loc[11:29, "dim"].nunique() == 1
    assert acts.loc[12:29, "largest matmul output"].max() < FP16_MAX / 4   # later matmuls read it, none writes it again
    assert list(carried) == list(range(11, 28))

# %% after: 07-24
assert 2 < headroom < 3

# %% after: 4730252e
assert math.isclose(h.abs().max().item(), peak, rel_tol=1e-3)    # the massive activation itself

# %% after: 51270abc
assert scaling == 2 and set(per_step) == {1, 2, 3, 4}
if cmp.results["fp16"].summary["device"] == "cpu":   # fp16's skipped step: where its run trained
    # The batch with the largest scaled gradient is the one fp16 skipped; step 4's batch would have overflowed
    # too at 65,536, but the scaler had halved its scale by then.
    assert step == 3 and skipped == [step]
    assert [k for k, v in per_step.items() if v > FP16_MAX] == [3, 4]

# %% after: aff44226
# Only one number crosses fp16's top: the gradient entering layer 0's attention-output adapter, twice the
# gradient at that projection's output, which itself fits.
assert list(grads.index[grads["entering a LoRA adapter"] > FP16_MAX]) == [0] and grads.loc[0, "which"] == "self_attn.o_proj"
assert grads["residual stream and matmuls"].max() < FP16_MAX < g_peak < 2 * FP16_MAX
# Halved, as the GradScaler did after the skip, it fits: 32,768 is a scale this batch survives.
assert g_peak / 2 < FP16_MAX
assert math.isclose(g_peak / scaling, grads.loc[g_top, "residual stream and matmuls"], rel_tol=1e-6)

# %% after: 07-28
assert overflows is False

# %% after: 9e9d1896
assert bad_65536 and all(name.startswith("layers.0.") for name in bad_65536)
assert "layers.0.self_attn.o_proj" in bad_65536 and bad_32768 == []
