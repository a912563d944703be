"""Issue 18.3: a CPU run's memory is its own tensors (host_tensors_gib), not the whole process's RSS."""

from __future__ import annotations

import threading

import pytest
import torch

import nbtrain as nbt
from nbtrain.engine.telemetry import RunTensorBytes

GIB = 2**30
# Full-length rows (packing), so the estimator's activations (which assume max_seq_len) apply.
SMALL = dict(model="tiny", subset=64, eval_fraction=0.0, max_seq_len=64, micro_batch_size=4, packing=True,
             precision="fp32")


def _train_step(model, opt, tracker, x) -> float:
    """One forward/backward/AdamW step the way the loop measures it; returns the step's value in bytes."""
    with tracker.micro():
        model(x).square().sum().backward()
    opt.step()
    peak = tracker.step_peak()
    opt.zero_grad(set_to_none=True)
    return peak * GIB


def test_tracker_counts_weights_state_and_saved_activations_exactly():
    n, batch = 256, 2048   # activations (2 x batch x n fp32) dwarf the weights' gradients
    model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.Sigmoid(), torch.nn.Linear(n, n))
    opt = torch.optim.AdamW(model.parameters())
    tracker = RunTensorBytes("cpu", model, opt)
    x = torch.randn(batch, n)
    weights = 4 * sum(p.numel() for p in model.parameters())
    state = 2 * weights + 4 * len(list(model.parameters()))   # AdamW moments and each tensor's fp32 step
    # Saved for backward: the input (first Linear), the sigmoid output (kept by it and by the second Linear: one
    # storage, counted once), the second Linear's output (kept by square); the weights Linear saves are the
    # parameters, counted once with them.
    saved = 3 * 4 * batch * n
    first = _train_step(model, opt, tracker, x)
    assert first == max(weights + saved, 2 * weights + state)   # no optimizer state during step 1's forward
    # Later steps: the optimizer state is there during the forward; nothing is left over from earlier steps.
    assert [_train_step(model, opt, tracker, x) for _ in range(3)] == [weights + state + saved] * 3
    # A graph dropped without its backward (a step cut short) frees what it saved, and the count with it.
    with tracker.micro():
        loss = model(x).square().sum()
    del loss
    assert tracker.step_peak() * GIB == weights + state + saved
    assert _train_step(model, opt, tracker, x) == weights + state + saved


def test_tracker_sees_only_its_own_thread():
    """saved_tensors_hooks are thread-local: another thread's forward, during this tracker's micro-batch, is not
    counted (a process-wide counter would count it)."""
    mine = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(mine.parameters())
    tracker = RunTensorBytes("cpu", mine, opt)
    inside, other_done = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        big = torch.nn.Linear(512, 512)
        y = big(torch.randn(4096, 512)).relu().sum()
        y.backward()
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with tracker.micro():
        inside.set()
        assert other_done.wait(30)
    t.join()
    assert tracker.step_peak() * GIB == 4 * (8 * 8 + 8)   # this model's weights alone


def test_none_and_no_hooks_off_the_cpu():
    model = torch.nn.Linear(4, 4)
    tracker = RunTensorBytes("cuda", model, torch.optim.AdamW(model.parameters()))
    with tracker.micro():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None   # nothing installed
        model(torch.randn(2, 4)).sum().backward()
    assert tracker.step_peak() is None


def test_full_finetune_against_independent_parts():
    cfg = nbt.TrainConfig(**SMALL, max_steps=3)
    r = nbt.train(cfg)
    h, s = r.history, r.summary
    assert list(h.columns).index("host_tensors_gib") == list(h.columns).index("host_rss_gib") + 1
    assert h.host_tensors_gib.notna().all()
    assert s["peak_host_tensors_gib"] == pytest.approx(h.host_tensors_gib.max())
    p = s["total_params"]
    assert s["trainable_params"] == p
    est = nbt.estimate_memory(cfg, device="cpu", device_total_gib=64)
    acts = est.activations_gib * GIB
    values = h.host_tensors_gib * GIB
    # weights + gradients + AdamW's two moments, all fp32, together at each optimizer step
    assert (values >= 16 * p).all()
    # from step 2 the forward holds weights and optimizer state plus the step's activations; the estimator's
    # activations are what autograd saves, and its logits part bounds the loss's saved tensors
    assert (values[1:] >= 12 * p + 0.8 * acts).all(), (list(values), p, acts)
    assert (values <= 16 * p + acts + est.logits_gib * GIB).all(), (list(values), p, acts)
    # far below the process's resident memory, which holds torch, transformers and the tokenizer too
    assert s["peak_host_tensors_gib"] < 0.5 * s["peak_host_rss_gib"]


def test_a_later_run_does_not_count_what_an_earlier_one_left():
    cfg = nbt.TrainConfig(**SMALL, max_steps=2)
    first = nbt.train(cfg)
    leftover = torch.ones(64 * 2**20)   # 256 MiB the notebook keeps, beside the first run's model
    second = nbt.train(cfg)
    # The leftover (kept alive to the end) is over five times the run's own tensors: a count that saw the process (as RSS
    # does, where the machine lets it grow: a worker at its memory limit showed the same RSS in both runs) would
    # differ by far more than 2%.
    assert first.model is not None and leftover.sum() > 0
    assert leftover.numel() * 4 / GIB > 5 * first.summary["peak_host_tensors_gib"]
    assert second.summary["peak_host_tensors_gib"] == pytest.approx(first.summary["peak_host_tensors_gib"],
                                                                    rel=0.02)
    assert list(second.history.host_tensors_gib) == pytest.approx(list(first.history.host_tensors_gib), rel=0.02)


def test_concurrent_runs_each_see_their_own_tensors():
    full = nbt.TrainConfig(**SMALL, max_steps=2)
    lora = full.replace(method="lora", micro_batch_size=2)
    solo = {name: nbt.train(cfg).history.host_tensors_gib.tolist() for name, cfg in (("full", full),
                                                                                    ("lora", lora))}
    runs = {"full": nbt.start(full), "lora": nbt.start(lora)}
    together = {name: run.wait().history.host_tensors_gib.tolist() for name, run in runs.items()}
    for name in solo:
        assert together[name] == pytest.approx(solo[name], rel=0.02), name


def test_lora_holds_far_less_than_full_on_the_same_model():
    # short rows, so weights, gradients and optimizer state dominate the activations
    small = dict(SMALL, max_seq_len=16, micro_batch_size=1, max_steps=2)
    full = nbt.train(nbt.TrainConfig(**small))
    lora = nbt.train(nbt.TrainConfig(**small, method="lora"))
    f, lo = full.summary, lora.summary
    assert lo["trainable_params"] < 0.1 * f["trainable_params"]
    # the frozen weights are the run's too; gradients and optimizer state only for the adapters
    assert lo["peak_host_tensors_gib"] * GIB >= 4 * lo["total_params"] + 16 * lo["trainable_params"]
    assert lo["peak_host_tensors_gib"] < 0.5 * f["peak_host_tensors_gib"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_none_on_cuda():
    r = nbt.train(nbt.TrainConfig(**SMALL, max_steps=2))
    assert r.summary["device"] == "cuda"
    assert r.history.host_tensors_gib.isna().all() and r.summary["peak_host_tensors_gib"] is None
    assert r.history.vram_peak_gib.notna().all()


def test_run_tensors_are_measured_on_sampled_steps_and_the_record_says_which():
    """The tracer costs the loop several percent, so it runs on steps 1-3, every 10th and the last; the others
    record None (issue 25.4), and the peak is the measured steps' peak."""
    r = nbt.train(nbt.TrainConfig(**SMALL, max_steps=23))
    h = r.history
    measured = list(h.step[h.host_tensors_gib.notna()])
    assert measured == [1, 2, 3, 10, 20, 23]
    assert r.summary["peak_host_tensors_gib"] == pytest.approx(h.host_tensors_gib.max())
    # packed full-length rows: every measured step from 2 on holds the same tensors
    assert h.host_tensors_gib.dropna().iloc[1:].nunique() == 1
    tracker = RunTensorBytes("cpu", torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters()),
                             total_steps=45)
    assert [s for s in range(1, 46) if tracker.measures(s)] == [1, 2, 3, 10, 20, 30, 40, 45]
    # the figure draws the measured steps as markers joined across the unmeasured ones
    pytest.importorskip("plotly")
    from nbtrain.viz import figures as F

    tr = F.find_trace(F.run_figure(h), "memory", "host_tensors")
    assert tr.connectgaps and "markers" in tr.mode
