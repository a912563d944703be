"""Library checks of notebooks/08_instruction_tuning.ipynb, run in its kernel after the named cells."""
# %% after: 23b73677
assert data.stats["data_format"] == "messages" and data.stats["train_on"] == "completion"
assert data.stats["chat_template"] == "tokenizer" and data.stats["chat_tokens_added"] == []   # its own ChatML
# The targets are the answer's tokens and its end marker (with ChatML's newline after it), nothing of the
# system prompt or the question.
assert "<|im_end|>" in targets[-2:] and SYSTEM not in "".join(targets)

# %% after: ea455f9f
assert SYSTEM in ours and "SmolLM" not in ours
assert "SmolLM" not in tok.decode(ex["input_ids"])   # a training example keeps its own system prompt

# %% after: a2640e66
# The step's tokens are its answer tokens only: about half of the tokens it reads.
assert h.tokens.sum() < 0.7 * sum(int(b.attention_mask.sum()) for b in batches)
assert result.summary["trainable_params"] < 0.02 * result.summary["total_params"]
# Before: the pretrained model's own chat style, which runs past 32 tokens on every question. After 16 steps it
# answers briefly, as the system prompt asks and the data does, and stops by itself: on the data's questions
# and on the one that is not in the data.
for p, a in answers.items():
    assert a["before"][1] == cfg.max_new_tokens, p                              # cut at the limit
    assert a["after"][1] < cfg.max_new_tokens and a["after"][1] < 0.8 * a["before"][1], p   # ended at <|im_end|>
# It took the reference's phrasing ('The "with" statement is used to ...') ...
assert shared_opening(after, reference) >= 6 > 1 >= shared_opening(before, reference)
# ... but not its content: what follows is its own, not the reference's words.
assert words(after)[:10] != words(reference)[:10]

# %% after: 974afc8b
# "all": every token is a target, the prompt's too (the labels are the input ids; the loss shifts them by one).
assert all(sum(lab == -100 for lab in e["labels"]) <= 1 for e in by["all"].train)
assert n_targets["all"] > 1.5 * n_targets["completion"] and prompt_share > 0.4
# One answer per conversation here, so "last" is "completion".
assert [e["labels"] for e in by["last"].train] == [e["labels"] for e in by["completion"].train]
