"""Library checks of notebooks/01_quickstart.ipynb, run in its kernel after the named cells."""
# %% after: 01-05
assert in_background   # click() returned while the run goes on in its thread
assert stopped is panel.result and stopped.summary["stopped_reason"] == "stopped"
assert "stopped" in panel.status.value             # the status line says so
assert not panel.train_button.disabled and panel.stop_button.disabled   # ready for the next run
assert panel.refresh_memory().fits                 # the memory readout: these settings fit this machine
# %% after: 01-07
if stopped.summary["device"] == "cpu":
    assert (stopped.history["scale"] == 65536.0).all()   # the GradScaler's starting scale, 2**16; no overflow here
if stopped.summary["device"] == "cuda":
    assert np.isfinite(np.asarray(find_trace(fig, "memory", "vram_allocated").y, dtype=float)).sum() == len(steps)
else:
    tensors = np.asarray(find_trace(fig, "memory", "host_tensors").y, dtype=float)
    measured = [s for s, v in zip(steps, tensors) if np.isfinite(v)]
    carried = find_trace(fig, "memory", "host_tensors_carried")
    assert measured == [s for s in steps if s <= 3 or s % 10 == 0]          # the sampled steps
    assert measured[-1] == steps[-1] or list(carried.x) == [measured[-1], steps[-1]]   # it reaches the last step
    rss = np.asarray(find_trace(fig, "memory", "host_rss").y, dtype=float)
    assert np.isfinite(rss).sum() == len(steps)                             # the process's RSS: every step
# %% after: 01-12
assert result.summary["steps"] == cfg.max_steps and result.summary["stopped_reason"] == "max_steps"
assert h["lr"].iloc[0] == cfg.lr and h["lr"].is_monotonic_decreasing   # cosine schedule from lr down
assert len(dash.records) == len(h)                 # the dashboard drew exactly these records
# %% after: 01-15
assert summary["final_loss"] == h["loss"].iloc[-1]
assert summary["skipped_steps"] == 0 and summary["nonfinite_steps"] == 0
assert summary["trainable_params"] == sum(p.numel() for p in result.model.parameters())   # full fine-tuning
