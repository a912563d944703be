"""Library checks of notebooks/06_lora_qlora_memory.ipynb, run in its kernel after the named cells."""
# %% after: 06-03
assert cmp.fair                                                                 # same weights, same batches
assert (cmp.table["status"] == "max_steps").all()
# %% after: 06-05
assert params.loc["full", "trainable"] == params.loc["full", "total"]          # full: everything trains
assert params.loc["qlora", "trainable"] == by_hand                              # QLoRA: the same adapters
assert params.loc["lora", "trainable %"] < 10
# %% after: 06-41
assert adapted.scaling["default"] == lora_cfg.lora_alpha / lora_cfg.lora_r == 2.0   # peft's factor, the defaults 16 / 8
assert cmp.configs["full"].lora_alpha == 16                                        # lora_alpha's default
# %% after: 06-07
for m, (n, k) in sizes.items():
    grads = memory.loc[(m, "gradients"), "measured (MiB)"] * MiB
    state = memory.loc[(m, "optimizer"), "measured (MiB)"] * MiB
    assert grads == 4 * n, m                         # a 4-byte gradient per trainable parameter
    assert state == 8 * n + 4 * k, m                 # AdamW: 2 x 4 bytes each, plus a step counter per tensor
# %% after: 06-08
assert g["lora"] < g["full"] / 10 and o["lora"] < o["full"] / 10       # LoRA: a fraction of the gradients and state
assert w["lora"] > w["full"]                                           # ...its weights are the model plus adapters
assert w["qlora"] < w["full"] / 1.5                                    # QLoRA: the Linear weights in 4 bits
# %% after: 06-56
assert abs(share_of_state - params.loc["lora", "trainable"] / params.loc["full", "trainable"]) < 0.01
# %% after: 06-10
assert 0.3 < share < 0.35 and 0.4 < w["qlora"] / w["full"] < 0.55
# %% after: 06-31
assert ckpt_est[True].logits_gib == ckpt_est[False].logits_gib              # the logits are not checkpointed
assert ckpt_est[True].weights_gib == ckpt_est[False].weights_gib and ckpt_est[True].optimizer_gib == ckpt_est[False].optimizer_gib
assert ckpt_est[True].total_gib < ckpt_est[False].total_gib
# %% after: 06-33
assert cmp.results["full, checkpointed"].config.gradient_checkpointing and not plain.config.gradient_checkpointing
assert plain.summary["init_hash"] == ckpt.summary["init_hash"] and plain.summary["data_hash"] == ckpt.summary["data_hash"]
if plain.summary["device"] == "cpu":   # the loop counts its own tensors on a CPU: the checkpointed run kept fewer
    assert ckpt.summary["peak_host_tensors_gib"] < 0.8 * plain.summary["peak_host_tensors_gib"]
    assert (cmp.differences["full, checkpointed"] == 0).all()                # bit for bit on a CPU
# %% after: 06-60
assert plain.summary["hardware_flops_per_token"] == plain.summary["model_flops_per_token"]
assert plain.summary["model_flops_per_token"] == ckpt.summary["model_flops_per_token"]
assert 1.1 < ratio < 4 / 3
# %% after: 06-15
totals = [est.total_gib] + [a.total_gib for a in est.advice]
assert all(after < before for before, after in zip(totals, totals[1:]))   # every change helps
fixed = big.replace(**est.advice[-1].change)                              # cumulative: apply the last one
assert fixed.effective_batch_size == big.effective_batch_size            # the optimizer sees the same batch
assert nbt.estimate_memory(fixed, device_total_gib=0.05).fits
first = est.advice[0].change                                              # the first advice: accumulate
assert first["micro_batch_size"] < big.micro_batch_size and "method" not in first
assert not any("max_seq_len" in a.change for a in est.advice[:-1])        # shorter sequences come last
assert any(a.change.get("gradient_checkpointing") for a in est.advice)    # checkpointing is one of the steps
# %% after: 06-18
assert oom.summary["advice"] and all(isinstance(a, str) for a in oom.summary["advice"])
assert all(p.grad is None for p in oom.model.parameters())          # no half-accumulated gradients left behind
assert all(torch.isfinite(p).all() for p in oom.model.parameters())
# %% after: 06-20
assert trainable["lora"] < 0.02 * trainable["full"]     # on a real model LoRA trains under 2% of the weights
# %% after: 06-22
assert measured == run.summary["trainable_params"] == trainable["lora"] + 2 * (hidden + 1)
assert run.model.config.num_hidden_layers == 6
assert run.summary["stopped_reason"] == "max_steps" and run.history["loss"].notna().all()
