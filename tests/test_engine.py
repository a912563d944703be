"""The loop's contract: token-correct accumulation, honest telemetry, skip detection, clean stops."""

import math
import threading

import pytest
import torch

import nbtrain as nbt
from nbtrain.engine import STEP_FIELDS

from .helpers import Collect, after_build, inject_inf


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulation_variants_are_equal(tiny_cfg):
    # Adam turns last-bit differences in near-zero gradients into updates of size ~lr (m / sqrt(v) is
    # scale-free), so weight differences scale with lr; 1e-4 keeps that rounding noise well under 1e-5.
    cfg = tiny_cfg.replace(lr=1e-4)
    runs = {}
    for micro, accum in [(8, 1), (2, 4), (1, 8)]:
        runs[(micro, accum)] = nbt.train(cfg.replace(micro_batch_size=micro, grad_accum_steps=accum))
    ref = runs[(8, 1)]
    assert len(ref.history) == tiny_cfg.max_steps
    # The rows really are of different lengths, so naive averaging would weigh them differently.
    assert ref.history["tokens"].nunique() > 1
    ref_w = _weights(ref.model)
    for key, r in runs.items():
        assert list(r.history["micro_steps"]) == [key[1]] * tiny_cfg.max_steps
        assert list(r.history["tokens"]) == list(ref.history["tokens"])
        for a, b in zip(r.history["loss"], ref.history["loss"]):
            assert abs(a - b) <= 1e-5 * abs(b), (key, a, b)
        w = _weights(r.model)
        for k in ref_w:
            torch.testing.assert_close(w[k], ref_w[k], rtol=1e-5, atol=1e-5)


def test_naive_micro_batch_averaging_differs(tiny_cfg):
    """Control: averaging per-micro-batch means (the 2024 bug) gives a different loss on the same data."""
    from nbtrain.data import iter_steps, load_data
    from nbtrain.engine import loss_sum
    from nbtrain.models import build_model, load_tokenizer

    tok = load_tokenizer(tiny_cfg)
    data = load_data(tiny_cfg, tok)
    torch.manual_seed(0)
    model = build_model(tiny_cfg, tok, None, "fp32", "cpu")
    _, micro = next(iter_steps(data.train, 2, 4, tiny_cfg.seed, data.pad_token_id, data.task))
    with torch.no_grad():
        sums = [loss_sum(model(input_ids=m.input_ids, attention_mask=m.attention_mask).logits, m.labels,
                         data.task) for m in micro]
    correct = sum(sums) / sum(m.n_targets for m in micro)
    naive = sum(s / m.n_targets for s, m in zip(sums, micro)) / len(micro)
    assert abs(naive - correct) / correct > 1e-4
    # ...while the engine's 2x4 step-1 loss is the token-correct one.
    r = nbt.train(tiny_cfg.replace(micro_batch_size=2, grad_accum_steps=4, max_steps=1))
    assert r.history["loss"][0] == pytest.approx(correct.item(), rel=1e-5)


class _NormAtStep:
    """Wraps AdamW.step to measure the gradients the optimizer really receives."""

    def __init__(self, monkeypatch):
        self.norms = []
        original = torch.optim.AdamW.step

        def step(opt, *a, **k):
            grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
            self.norms.append(math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)))
            return original(opt, *a, **k)

        monkeypatch.setattr(torch.optim.AdamW, "step", step)


def test_grad_norm_matches_independent_computation(tiny_cfg, monkeypatch):
    probe = _NormAtStep(monkeypatch)
    r = nbt.train(tiny_cfg.replace(max_grad_norm=None))
    assert len(probe.norms) == len(r.history)
    for measured, recorded in zip(probe.norms, r.history["grad_norm"]):
        assert recorded == pytest.approx(measured, rel=1e-4)
    assert not r.history["clipped"].any()


def test_clipping_is_recorded_and_applied(tiny_cfg, monkeypatch):
    probe = _NormAtStep(monkeypatch)
    r = nbt.train(tiny_cfg.replace(max_grad_norm=0.05))
    for after_clip, rec in zip(probe.norms, r.history.itertuples()):
        assert rec.clipped == (rec.grad_norm > 0.05)
        assert after_clip == pytest.approx(min(rec.grad_norm, 0.05), rel=1e-3)
    assert r.history["clipped"].any()


def test_fp16_forced_inf_is_skipped_and_recovers(tiny_cfg, monkeypatch, collect):
    cfg = tiny_cfg.replace(precision="fp16", max_steps=5, subset=40, max_seq_len=24)
    inject_inf(monkeypatch, on_forward_calls={3})  # micro 8 x accum 1: forward 3 is step 3

    snapshots = []

    class Snap(Collect):
        def on_step_end(self, rec):
            super().on_step_end(rec)
            snapshots.append(_weights(self.info.model))

    snap = Snap()
    r = nbt.train(cfg, callbacks=[snap])
    h = r.history
    bad = h[h.step == 3].iloc[0]
    assert bad.skipped and bad.nonfinite and not bad.clipped
    assert not math.isfinite(bad.loss)  # the nan/inf loss is recorded, not hidden
    assert h.scale[2] == h.scale[1] / 2
    for k in snapshots[1]:
        assert torch.equal(snapshots[1][k], snapshots[2][k]), k  # weights did not move
    assert h.lr[3] == h.lr[2]   # the scheduler did not advance on the skipped step
    later = h[h.step > 3]
    assert not later.skipped.any() and not later.nonfinite.any()
    assert r.summary["skipped_steps"] == 1 and r.summary["nonfinite_steps"] == 1
    assert r.summary["stopped_reason"] == "max_steps"


def test_fp32_nonfinite_stops_by_default(tiny_cfg, monkeypatch):
    inject_inf(monkeypatch, on_forward_calls={2})
    r = nbt.train(tiny_cfg)
    assert r.summary["stopped_reason"] == "nonfinite"
    assert r.summary["first_nonfinite_step"] == 2
    assert len(r.history) == 2 and r.history.nonfinite.iloc[-1] and r.history.skipped.iloc[-1]
    for p in r.model.parameters():
        assert torch.isfinite(p).all()


def test_bf16_autocast_dtype_inside_model(tiny_cfg, monkeypatch):
    seen = []

    def watch_first_linear(m):
        lin = next(mod for mod in m.modules() if isinstance(mod, torch.nn.Linear))
        lin.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))

    after_build(monkeypatch, watch_first_linear)
    r = nbt.train(tiny_cfg.replace(precision="bf16", max_steps=2))
    assert seen and set(seen) == {torch.bfloat16}
    assert r.history["scale"].isna().all()
    assert r.summary["precision_used"] == "bf16"
    assert all(p.dtype == torch.float32 for p in r.model.parameters() if p.requires_grad)


def test_healthy_50_step_run():
    cfg = nbt.TrainConfig(model="tiny", max_steps=50, precision="fp32", max_seq_len=64, subset=800,
                          eval_fraction=0.05)
    seen = Collect()
    r = nbt.train(cfg, callbacks=[seen])
    h = r.history
    assert list(h.columns) == list(STEP_FIELDS)
    assert list(h.step) == list(range(1, 51)) and len(seen.records) == 50
    # no scaler and no accelerator on the CPU; no preference or RL objective (objective="lm")
    from nbtrain.engine.records import StepRecord

    grpo = {f for f in STEP_FIELDS if f not in StepRecord.__dataclass_fields__ or f.startswith(("mismatch_", "is_ratio_"))}
    grpo |= {"sampler_fp32_gap", "trainer_fp32_gap", "reward_mean", "reward_std", "completion_len_mean", "clip_ratio",
             "frac_zero_std"}
    cpu_none = {"scale", "vram_allocated_gib", "vram_reserved_gib", "vram_peak_gib", "reward_chosen",
                "reward_rejected", "reward_margin", "reward_accuracy"} | grpo
    for rec in seen.records:
        for f in STEP_FIELDS:
            v = getattr(rec, f)
            if f in cpu_none:
                assert v is None
            elif f == "host_tensors_gib":   # the run-tensor tracer measures steps 1-3, every 10th and the last
                measured = rec.step <= 3 or rec.step % 10 == 0 or rec.step == 50
                assert (v is not None and math.isfinite(v) and v > 0) if measured else v is None, (rec.step, v)
            else:
                assert v is not None and (not isinstance(v, float) or math.isfinite(v)), (f, v)
    first, last = h.loss[:5].mean(), h.loss[-5:].mean()
    assert last < first - 0.4, (first, last)
    assert (h.tokens_per_s > 0).all() and (h.elapsed_s.diff().dropna() > 0).all()
    s = r.summary
    for k in ["steps", "tokens", "tokens_per_s", "peak_vram_gib", "final_loss", "eval_loss", "skipped_steps",
              "nonfinite_steps", "wall_s", "stopped_reason", "precision_used", "device"]:
        assert k in s
    assert s["steps"] == 50 and s["stopped_reason"] == "max_steps" and s["eval_loss"] < h.loss[0]
    assert seen.evals and seen.result is r


def test_epochs_and_max_steps(tiny_cfg):
    r = nbt.train(tiny_cfg.replace(max_steps=None, epochs=1))
    assert len(r.history) == 8  # 64 examples / 8 per step
    assert r.history.epoch.iloc[-1] == pytest.approx(1.0)
    r = nbt.train(tiny_cfg.replace(max_steps=3, epochs=5))  # max_steps wins
    assert len(r.history) == 3


def test_interrupt_keeps_history_and_model(tiny_cfg):
    class Interrupt:
        def on_step_end(self, rec):
            if rec.step == 2:
                raise KeyboardInterrupt

    r = nbt.train(tiny_cfg.replace(max_steps=10), callbacks=[Interrupt()])
    assert r.summary["stopped_reason"] == "interrupted" and len(r.history) == 2
    assert all(p.grad is None for p in r.model.parameters())
    r.model(input_ids=torch.tensor([[1, 2, 3]]))  # still usable


def test_stop_training_from_callback(tiny_cfg):
    class Stop:
        def on_step_end(self, rec):
            if rec.step == 2:
                raise nbt.StopTraining

    r = nbt.train(tiny_cfg.replace(max_steps=10), callbacks=[Stop()])
    assert r.summary["stopped_reason"] == "stopped" and len(r.history) == 2


def test_callback_error_names_callback_and_event(tiny_cfg):
    class Broken:
        def on_step_end(self, rec):
            raise ZeroDivisionError("boom")

    with pytest.raises(nbt.CallbackError, match=r"Broken\.on_step_end.*ZeroDivisionError"):
        nbt.train(tiny_cfg, callbacks=[Broken()])


def test_start_runs_in_background_and_stops(tiny_cfg):
    gate = threading.Event()

    class Slow:
        def on_step_end(self, rec):
            if rec.step == 2:
                gate.set()

    run = nbt.start(tiny_cfg.replace(max_steps=500), callbacks=[Slow()])
    assert gate.wait(60)
    run.stop()
    result = run.wait(60)
    assert run.done and result.summary["stopped_reason"] == "stopped"
    assert 2 <= len(result.history) < 500


def test_global_torch_state_restored(tiny_cfg):
    from nbtrain.precision import tf32_state

    before = (torch.get_default_dtype(), torch.is_grad_enabled(), tf32_state())
    nbt.train(tiny_cfg.replace(precision="bf16", max_steps=1))
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), tf32_state()) == before


def test_output_dir_written(tiny_cfg, tmp_path):
    r = nbt.train(tiny_cfg.replace(output_dir=str(tmp_path / "out"), max_steps=2))
    assert (tmp_path / "out" / "history.csv").exists() and (tmp_path / "out" / "summary.json").exists()
    assert nbt.TrainConfig.from_yaml(tmp_path / "out" / "config.yaml") == r.config


def test_runs_after_the_new_tf32_api_was_used(tiny_cfg):
    """A transformers.Trainer with tf32=True switches torch to the new fp32_precision API; nbtrain must cope."""
    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip("torch without the fp32_precision API")
    before = torch.backends.fp32_precision
    torch.backends.fp32_precision = "tf32"
    try:
        r = nbt.train(tiny_cfg.replace(max_steps=1))
        assert len(r.history) == 1 and torch.backends.fp32_precision == "tf32"
    finally:
        torch.backends.fp32_precision = before


def test_loss_sum_matches_plain_mean():
    from nbtrain.engine import loss_sum

    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1),
                                            ignore_index=-100, reduction="sum")
    assert torch.allclose(loss_sum(logits, labels, "causal-lm"), ref)


def test_cuda_memory_readings_come_from_one_stats_snapshot(monkeypatch):
    """allocated / reserved / peak on CUDA are read from one torch.cuda.memory_stats() call, under their keys."""
    from nbtrain.engine import telemetry

    calls = []
    stats = {"allocated_bytes.all.current": 3 * 2**30, "reserved_bytes.all.current": 5 * 2**30,
             "allocated_bytes.all.peak": 4 * 2**30}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda *a, **k: calls.append(1) or stats)
    assert telemetry.device_memory_gib("cuda") == (3.0, 5.0, 4.0)
    assert len(calls) == 1
    assert telemetry.device_memory_gib("cpu") == (None, None, None)
