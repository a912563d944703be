"""Library checks of notebooks/09_preference_tuning.ipynb, run in its kernel after the named cells."""
# %% after: 3acf1a58
assert {"prompt", "chosen", "rejected"} <= set(rows[0])             # TRL's preference format, conversational
assert all(r["chosen"] != r["rejected"] for r in rows)              # every pair is a real choice
assert rows[0]["prompt"][-1]["role"] == "user" and rows[0]["chosen"][0]["role"] == "assistant"

# %% after: 8361dad6
assert h.loc[1, "reward_margin"] == 0 and h.loc[1, "reward_accuracy"] == 0   # ties are not "chosen ranked higher"
# Then it learns the preference: by the last steps every pair ranks the chosen answer higher, by a wide margin.
assert (h.loc[4:, "reward_accuracy"] == 1).all() and (h.loc[4:, "reward_margin"] > 1).all()
assert h.loc[5, "loss"] < 0.1 * math.log(2)
assert result.summary["reference"] == "adapters off" and result.summary["objective"] == "dpo"

# %% after: e3ce3137
assert (margins["before"] < 0).sum() > (margins["after"] < 0).sum()

# %% after: c149f211
assert all(answers[q, "before"] != answers[q, "after"] for q, _ in answers)

# %% after: fd5dfbbc
assert cmp.fair                                              # same weights, same pairs
assert mm["fp32"] == 0                                       # fp32 against fp32: 0 by definition, not re-run
assert t.loc["fp16", "skipped_steps"] == len(skipped)
if cmp.results["fp16"].summary["device"] == "cpu":   # exact on a CPU: the GradScaler's first scale, 65,536, overflowed, and the step was skipped
    assert t.loc["fp16", "skipped_steps"] == 1 and cmp.results["fp16"].history["scale"].iloc[-1] == 2.0**15
    assert skipped == [1] and finite
assert t.loc["bf16", "skipped_steps"] == 0 and "reward margin within init noise" in cmp.verdicts["bf16"].text
