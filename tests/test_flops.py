"""Issue 37.2: the FLOPs of a training token from the architecture, against torch's own FLOP counter, and MFU in
every run's summary, compare's table and the dashboard's header."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import nbtrain as nbt
from nbtrain.engine.flops import mfu, token_flops
from nbtrain.hardware import cpu_peak_tflops, gpu_peak_tflops
from nbtrain.models import build_model, load_tokenizer

B, T = 2, 64


def _counted(method: str, ckpt: bool) -> tuple[float, object]:
    """FlopCounterMode's FLOPs per token of one forward + backward, and the model (eager attention: the counter
    sees its two matmuls as bmm; it does not count the CPU's fused SDPA kernel)."""
    cfg = nbt.TrainConfig(model="tiny", method=method, gradient_checkpointing=ckpt, lora_dropout=0.0)
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "fp32", "cpu")
    (model.get_base_model() if hasattr(model, "get_base_model") else model).set_attn_implementation("eager")
    x = torch.randint(0, 2000, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x).logits.float().sum().backward()
    return counter.get_total_flops() / (B * T), model


@pytest.mark.parametrize("method,ckpt", [("full", False), ("lora", False), ("full", True), ("lora", True)])
def test_token_flops_match_torchs_flop_counter_within_10_percent(method, ckpt):
    counted, model = _counted(method, ckpt)
    flops = token_flops(model, T, gradient_checkpointing=ckpt)
    assert flops.hardware == pytest.approx(counted, rel=0.10), (flops, counted)
    if ckpt:   # checkpointing's recompute is hardware FLOPs only: the model's are those of the plain step
        assert flops.model == token_flops(model, T).model < flops.hardware
    if method == "full":   # the 6N rule: backward is twice the forward when every weight trains
        assert flops.backward == pytest.approx(2 * flops.forward)
    else:                  # frozen weights get no weight gradient: backward is the forward plus the adapters'
        assert flops.backward < 1.25 * flops.forward


def test_peaks_a_gpu_table_and_a_measured_cpu():
    assert gpu_peak_tflops("NVIDIA H200")["bf16"] == 989.4 and gpu_peak_tflops("NVIDIA H100 PCIe")["bf16"] == 756.0
    assert gpu_peak_tflops("NVIDIA H100 NVL")["bf16"] == 835.5 and gpu_peak_tflops("NVIDIA H100 80GB HBM3")["fp32"] == 66.9
    assert gpu_peak_tflops("Some Unknown GPU") == {}
    cpu = cpu_peak_tflops(1)
    assert set(cpu) == {"fp32", "tf32", "bf16", "fp16"} and all(v > 0 for v in cpu.values())
    assert cpu_peak_tflops(1) is cpu                      # probed once per process
    if not nbt.capabilities("cpu").fp16_fast:   # fp16's linears are emulated with fp32 GEMMs: fp32's peak is theirs
        assert cpu["fp16"] == cpu["fp32"]
    if nbt.capabilities().device == "cpu":
        assert nbt.capabilities().peak_tflops == cpu_peak_tflops(torch.get_num_threads())


def test_every_run_reports_its_mfu_and_compare_and_the_header_show_it(collect, monkeypatch):
    import dataclasses

    import nbtrain.engine.flops as flops_mod
    from nbtrain.viz.text import status_line, summary_text

    calls = []

    def spy(*args, **kwargs):   # the summary's MFU goes through flops.mfu with the run's FLOPs, peaks and dtype
        calls.append(args)
        return mfu(*args, **kwargs)

    monkeypatch.setattr(flops_mod, "mfu", spy)
    cfg = nbt.TrainConfig(model="tiny", subset=16, max_seq_len=32, micro_batch_size=4, max_steps=2,
                          eval_fraction=0.0, precision="bf16", method="lora")
    r = nbt.train(cfg, callbacks=[collect])
    s = r.summary
    flops = token_flops(r.model, cfg.max_seq_len)
    assert s["model_flops_per_token"] == flops.model and s["hardware_flops_per_token"] == flops.hardware
    peak = nbt.capabilities().peak_tflops["bf16"]
    (args,) = calls
    assert args[0] == flops.model and args[2] == nbt.capabilities().peak_tflops and args[3] == "bf16"
    assert s["mfu"] is not None and s["mfu"] > 0
    # the arithmetic on fixed numbers: 1e9 FLOPs per token at 1,000 tokens/s on a 1 TFLOP/s peak is 100%
    assert mfu(1e9, 1000.0, {"bf16": 1.0}, "bf16") == pytest.approx(1.0)
    assert mfu(1e9, 1000.0, {"bf16": 1.0}, "bf16", world_size=4) == pytest.approx(0.25)
    shown = re.search(r"MFU ([\d.]+)%", summary_text(collect.records, [], result=r))
    assert shown and float(shown.group(1)) == pytest.approx(100 * s["mfu"], abs=0.05)
    # live, in the dashboard's status line, from the run's info and the recent steps: their timings injected (the
    # rate at which this model would use 40% of the peak), so the expected figure is fixed, not this machine's speed
    info = collect.info
    assert info.model_flops_per_token == flops.model and info.peak_tflops == peak
    rate = 0.4 * peak * 1e12 / flops.model
    steady = [dataclasses.replace(rec, tokens_per_s=rate, step_time_s=0.5) for rec in collect.records]
    live = re.search(r"MFU ([\d.]+)%", status_line(steady, info))
    assert live and float(live.group(1)) == pytest.approx(40.0, abs=0.06)
    cmp = nbt.compare(cfg, precisions=("fp32", "bf16"), warmup=False)
    t = cmp.table.set_index("variant")
    assert all(t.loc[v, "mfu"] == cmp.results[v].summary["mfu"] for v in ("fp32", "bf16"))
    assert "mfu" in cmp.format_table()
    assert math.isnan(mfu(1.0, 1.0, {}, "bf16") or math.nan)   # an unknown peak: no MFU
