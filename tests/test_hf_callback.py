"""The Hugging Face Trainer callback drives the same dashboard; its traces equal the Trainer's own logs."""

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from nbtrain.integrations.hf import LiveDashboardCallback  # noqa: E402
from nbtrain.viz import figures as F  # noqa: E402
from nbtrain.viz.dashboard import LiveDashboard  # noqa: E402

SEQ = 16


class _Tokens(torch.utils.data.Dataset):
    """Random token rows; labels = inputs (causal LM), a few padded positions masked out."""

    def __init__(self, n, vocab, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (n, SEQ), generator=g)
        self.mask = torch.ones(n, SEQ, dtype=torch.long)
        self.mask[::3, -4:] = 0

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.mask[i] == 0] = -100
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels}


def _model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _trainer(tmp_path, callback, *, max_steps=8, logging_steps=1, eval_steps=None, use_cpu=True, **args):
    from transformers import Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=use_cpu, max_steps=max_steps, logging_steps=logging_steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=3e-3,
        max_grad_norm=1.0, report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
        logging_nan_inf_filter=False, include_num_input_tokens_seen="non_padding",
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
        per_device_eval_batch_size=4, **args)
    return Trainer(model=_model(), args=targs, train_dataset=_Tokens(48, 64),
                   eval_dataset=_Tokens(8, 64, seed=1) if eval_steps else None, callbacks=[callback])


def _logged(trainer, key):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h and "loss" in h]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dashboard_traces_equal_the_trainer_logs(tmp_path, precision):
    cb = LiveDashboardCallback(mode="widget", display=False)
    trainer = _trainer(tmp_path, cb, bf16=precision == "bf16", eval_steps=4)
    trainer.train()
    dash = cb.dashboard
    info = dash.runs["run"]
    assert info.precision_used == precision and not info.scaler_enabled
    assert info.total_steps == 8 and info.max_grad_norm == 1.0 and info.config.micro_batch_size == 4

    fig = dash.figure
    steps, norms = zip(*_logged(trainer, "grad_norm"))
    assert list(steps) == list(range(1, 9))
    gn = F.find_trace(fig, "grad_norm", "grad_norm")
    np.testing.assert_array_equal(gn.x, steps)
    np.testing.assert_array_equal(gn.y, np.array(norms, dtype=float))
    np.testing.assert_array_equal(F.find_trace(fig, "loss", "loss").y,
                                  np.array([v for _, v in _logged(trainer, "loss")], dtype=float))
    clipped = [s for s, v in zip(steps, norms) if v > 1.0]
    np.testing.assert_array_equal(F.find_trace(fig, "grad_norm", "clipped").x, clipped)
    # No scaler on CPU: the scale panel is empty and says so; memory is host memory.
    assert np.isnan(np.asarray(F.find_trace(fig, "scale", "scale").y, dtype=float)).all()
    assert any(a.name == "no_scaler" for a in fig.layout.annotations)
    assert all(r.host_rss_gib > 0 and r.vram_peak_gib is None for r in dash.records)
    assert not any(r.skipped or r.nonfinite for r in dash.records)
    assert all(r.tokens > 0 and r.tokens_per_s > 0 for r in dash.records)  # non-padding input tokens
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    ev = F.find_trace(fig, "loss", "eval_loss")
    np.testing.assert_array_equal(ev.x, [s for s, _ in evals])
    np.testing.assert_array_equal(ev.y, [v for _, v in evals])


def test_logging_every_n_steps_makes_one_record_per_log(tmp_path):
    cb = LiveDashboardCallback(mode="text", display=False)
    trainer = _trainer(tmp_path, cb, max_steps=6, logging_steps=3)
    trainer.train()
    recs = cb.dashboard.records
    assert [r.step for r in recs] == [3, 6]
    assert [r.grad_norm for r in recs] == [v for _, v in _logged(trainer, "grad_norm")]
    assert [r.loss for r in recs] == [v for _, v in _logged(trainer, "loss")]


def test_fp16_on_cpu_is_labelled_fp32(tmp_path):
    """accelerate makes no scaler and no autocast for fp16 on a CPU; the dashboard must not claim fp16."""
    cb = LiveDashboardCallback(mode="html", display=False)
    try:
        trainer = _trainer(tmp_path, cb, max_steps=2, fp16=True)
    except ValueError as e:  # a transformers version that refuses fp16 on CPU outright
        pytest.skip(f"fp16 on CPU refused: {e}")
    trainer.train()
    info = cb.dashboard.runs["run"]
    assert info.precision_used == "fp32" and not info.scaler_enabled
    assert all(r.scale is None for r in cb.dashboard.records)


def test_shared_dashboard_overlays_two_trainer_runs(tmp_path):
    dash = LiveDashboard(mode="widget", display=False)
    for name in ("a", "b"):
        trainer = _trainer(tmp_path / name, LiveDashboardCallback(dash, variant=name), max_steps=3)
        trainer.train()
    assert list(dash.runs) == ["a", "b"]
    for name in ("a", "b"):
        assert len(F.find_trace(dash.figure, "grad_norm", "grad_norm", run=name).y) == 3
    with pytest.raises(TypeError):
        LiveDashboardCallback(dash, mode="text")


@pytest.mark.gpu
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_fp16_on_gpu_reads_the_scaler_and_marks_the_skipped_step(tmp_path, optim):
    # The fused optimizer (the Trainer's CUDA default) skips inside its kernel, unseen by accelerate.
    cb = LiveDashboardCallback(mode="widget", display=False)
    trainer = _trainer(tmp_path, cb, max_steps=6, use_cpu=False, fp16=True, optim=optim)
    calls = {"n": 0}

    def hook(module, inputs, output):
        # On lm_head, not the model: the Trainer's loss is computed inside the model's forward.
        if module.training:
            calls["n"] += 1
            if calls["n"] == 3:  # micro 4 x accum 1: forward 3 is step 3
                return output * math.inf
        return output

    trainer.model.lm_head.register_forward_hook(hook)
    trainer.train()
    dash = cb.dashboard
    info = dash.runs["run"]
    assert info.precision_used == "fp16" and info.scaler_enabled and info.device == "cuda"
    recs = dash.records
    assert [r.step for r in recs if r.skipped] == [3]
    assert recs[2].scale == recs[1].scale / 2
    assert all(r.scale is not None for r in recs)
    assert all(r.vram_peak_gib is not None and r.vram_peak_gib > 0 for r in recs)
    fig = dash.figure
    steps, norms = zip(*_logged(trainer, "grad_norm"))
    np.testing.assert_array_equal(F.find_trace(fig, "grad_norm", "grad_norm").y, np.array(norms, dtype=float))
    assert not math.isfinite(norms[2])
    for panel in ("loss", "grad_norm", "scale", "memory"):
        np.testing.assert_array_equal(F.find_trace(fig, panel, "skipped").x, [3])
    np.testing.assert_array_equal(F.find_trace(fig, "scale", "scale").y, [r.scale for r in recs])
    np.testing.assert_array_equal(F.find_trace(fig, "loss", "loss").y,
                                  np.array([v for _, v in _logged(trainer, "loss")], dtype=float))
