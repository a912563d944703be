"""Library checks of notebooks/10_rl_and_precision.ipynb, run in its kernel after the named cells."""
# %% after: 6b1f0a03
assert {"prompt", "answer"} <= set(rows[0])                           # TRL's prompt format, with an answer column
assert rows[0]["prompt"][-1]["role"] == "user" and len(rows) == 400

# %% after: 6b1f0a05
assert list(h.index) == list(range(1, 16)) and len(ro) == 15 * 4
assert result.summary["objective"] == "grpo"
assert {"rollout_s", "rollout_tokens_per_s", "update_tokens_per_s"} <= set(result.summary)
assert list(h.index[h.sampler_fp32_gap.notna()]) == [1, 2, 3, 10, 15]   # sampled: 1-3, every 10th, the last
for step, rows_ in ro.groupby("step"):                                 # the records' reward is the table's
    assert abs(rows_.reward.mean() - h.loc[step, "reward_mean"]) < 1e-9

# %% after: 6b1f0a22
assert set(cmp.mismatch) == {"fp32", "bf16", "fp16"} and cmp.mismatch["bf16"].partner == "fp16"
assert cmp.mismatch["fp32"].high < 1e-4
assert all(cmp.mismatch[n].text in cmp.verdicts[n].text for n in cmp.mismatch)
