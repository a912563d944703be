"""Library checks of notebooks/A2_image_classification.ipynb, run in its kernel after the named cells."""
# %% after: 237a38bc
assert len(data.train) + len(data.eval) == 1797 and data.num_labels == 10
assert data.label_names == [str(d) for d in range(10)]
assert len(data.eval) == round(1797 * cfg.eval_fraction)             # 5% held out (90 images)
# %% after: dc8dc09c
assert (h["tokens"] == cfg.micro_batch_size).all()                   # a classifier's "tokens" are its examples
assert s["tokens"] == cfg.max_steps * cfg.micro_batch_size
assert h["loss"].iloc[-20:].mean() < 0.5 * h["loss"].iloc[:5].mean()   # it learned
assert s["stopped_reason"] == "max_steps" and s["skipped_steps"] == 0
# %% after: A2-33
assert tokens_per_step == cfg.micro_batch_size * cfg.grad_accum_steps == 8
# %% after: A2-37
assert tokens_per_image == 5 and tokens_per_micro_batch == 40        # 4 patches + CLS, 8 images
assert any("4 patches + CLS" in n for n in nbt.estimate_memory(cfg).notes)
# %% after: 673e33c6
assert acc.fair and acc.table["data_hash"].nunique() == 1
assert b["micro_steps"].tolist() == [4] * 5 and (a["tokens"] == b["tokens"]).all()
# %% after: A2-41
assert answer_2x4 == [4, 8]
# %% after: 2afdc92d
assert cmp.fair and t["init_hash"].nunique() == 1 and t["data_hash"].nunique() == 1   # fair by hash
assert t["precision_used"].tolist() == ["fp32", "bf16"] and (t["steps"] == 30).all()
# %% after: 102c23dc
assert est.fits and est.trainable_params == est.total_params
assert any("4 patches + CLS" in n for n in est.notes)
assert "task: image_classification" in text and "image_column: image" in text and "target_column: label" in text
