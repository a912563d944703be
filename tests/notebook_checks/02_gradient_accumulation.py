"""Library checks of notebooks/02_gradient_accumulation.ipynb, run in its kernel after the named cells."""
# %% after: 02-04
assert ref["tokens"].nunique() > 1                       # the steps really have different lengths...
for _name, _h in hist.items():
    assert _h["tokens"].tolist() == ref["tokens"].tolist()               # ...and every split sees the same ones
by_variant = cmp.table.set_index("variant")
assert by_variant["init_hash"].nunique() == 1 and by_variant["data_hash"].nunique() == 1   # what the markdown says the hashes show
# %% after: 02-12
assert measured["8 x 1"] > 4 * measured["1 x 8"]
assert estimated["8 x 1"] > estimated["2 x 4"] > estimated["1 x 8"]  # and the estimate agrees
# %% after: 02-14
assert total["8 x 1"] > total["2 x 4"] > total["1 x 8"]
assert total["8 x 1"] / total["1 x 8"] < estimated["8 x 1"] / estimated["1 x 8"]
est = nbt.estimate_memory(cfg)
assert est.weights_gib == nbt.estimate_memory(cfg.replace(micro_batch_size=1, grad_accum_steps=8)).weights_gib
# %% after: 02-19
assert abs(diff["naive 1 x 8"].iloc[0]) < 1e-5     # step 1 starts from the same weights: same loss
