"""Library checks of notebooks/A1_hf_trainer_dashboard.ipynb, run in its kernel after the named cells."""
# %% after: A1-07
assert all(r.tokens > 0 and r.tokens_per_s > 0 for r in records)          # tokens from include_num_input_tokens_seen
# %% after: A1-09
assert info.config.micro_batch_size == 8 and info.total_steps == args.max_steps
