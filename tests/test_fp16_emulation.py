"""fp16 on a CPU without fp16 hardware: the linear layers are emulated (fp16 roundings, fp32 arithmetic). The
numbers must be autocast's own fp16 numbers, what backward keeps must be fp16, an overflow must still be inf, and a
CPU with fp16 hardware (or a GPU) keeps torch's kernels."""

import torch
import torch.nn.functional as F

from nbtrain import hardware, precision
from nbtrain.precision import PRECISION_TABLE, _Fp16Linear, emulated_fp16_linears

FP16 = PRECISION_TABLE["fp16"]


def linear_step(emulate: bool, x, lin):
    lin.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.float16):
        if emulate:
            with emulated_fp16_linears():
                y = F.linear(x, lin.weight, lin.bias)
        else:
            y = F.linear(x, lin.weight, lin.bias)
    (y.float() ** 2).mean().backward()
    return y.detach(), x.grad, lin.weight.grad, lin.bias.grad, saved


def test_the_emulated_linear_gives_autocasts_fp16_numbers_and_keeps_fp16_for_backward():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(4, 8, 64) * 3
    native, emulated = linear_step(False, x, lin), linear_step(True, x, lin)
    for a, b in zip(native[:4], emulated[:4]):
        assert a.dtype == b.dtype
        # the same roundings: at most one fp16 step apart (the fp32 sums differ only in their order)
        ulp = torch.finfo(torch.float16).eps * a.float().abs().clamp_min(2 ** -14)
        assert ((a.float() - b.float()).abs() <= ulp + 1e-12).all()
    assert native[0].dtype == torch.float16 and native[1].dtype == torch.float32   # fp16 out, fp32 master grads
    assert set(emulated[4]) == {torch.float16}, emulated[4]    # what backward keeps is fp16, as autocast's own


def test_an_fp16_overflow_is_still_inf():
    lin = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(300.0)
    x = torch.full((1, 4), 100.0)   # 4 x 300 x 100 = 120,000 > fp16's 65,504
    with torch.autocast("cpu", dtype=torch.float16), emulated_fp16_linears():
        y = F.linear(x, lin.weight)
    assert y.dtype == torch.float16 and torch.isinf(y).all()


def test_autocast_emulates_on_a_cpu_without_fp16_hardware_only(monkeypatch):
    calls = []
    original = _Fp16Linear.apply
    monkeypatch.setattr(_Fp16Linear, "apply", lambda *a: calls.append(1) or original(*a))
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    for fast, expected in ((False, 1), (True, 0)):
        calls.clear()
        caps = hardware.capabilities("cpu")
        monkeypatch.setattr(hardware, "capabilities", lambda device=None, c=caps, f=fast: c.__class__(
            **{**c.__dict__, "fp16_fast": f}))
        with precision.autocast(FP16, "cpu"):
            y = lin(x)
        assert y.dtype == torch.float16 and len(calls) == expected
    calls.clear()
    with precision.autocast(PRECISION_TABLE["bf16"], "cpu"):
        assert lin(x).dtype == torch.bfloat16 and not calls   # bf16 keeps torch's own kernels
    with emulated_fp16_linears():
        assert lin(x).dtype == torch.float32 and not calls   # no autocast: nothing to emulate


def test_a_large_weight_is_converted_a_slice_at_a_time_with_the_same_numbers(monkeypatch):
    torch.manual_seed(1)
    lin = torch.nn.Linear(32, 40)
    x = torch.randn(3, 5, 32)
    whole = linear_step(True, x, lin)
    monkeypatch.setattr(precision, "_SLICE_ELEMENTS", 32 * 7)   # 7 rows at a time: 6 slices, the last one short
    assert precision._row_slices(40, 32)[-1] == (35, 40)
    sliced = linear_step(True, x, lin)
    for a, b in zip(whole[:4], sliced[:4]):
        ulp = torch.finfo(torch.float16).eps * a.float().abs().clamp_min(2 ** -14)
        assert a.dtype == b.dtype and ((a.float() - b.float()).abs() <= ulp + 1e-12).all()
