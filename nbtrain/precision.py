"""Precision is a table, not branches (DESIGN rule 2). It sits below models/ and engine/, which both use it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    autocast_dtype: Optional[torch.dtype]   # None: no autocast (the weights' own dtype computes)
    scaler: bool                            # a GradScaler is needed (fp16 underflows without one)
    tf32: bool                              # allow TF32 tensor-core matmuls for fp32 tensors
    # The trainable weights' dtype, hence their gradients' and (for AdamW, SGD) the optimizer state's: fp32 is a
    # master copy the low-precision compute reads through autocast; bf16 has none (LLaMA-Factory's pure_bf16).
    param_dtype: torch.dtype = torch.float32
    fp8: bool = False                       # nn.Linear matmuls in float8 (torchao Float8Linear), the rest autocast


PRECISION_TABLE: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec("fp32", None, False, False),
    "tf32": PrecisionSpec("tf32", None, False, True),
    "fp16": PrecisionSpec("fp16", torch.float16, True, False),
    "bf16": PrecisionSpec("bf16", torch.bfloat16, False, False),
    "bf16-pure": PrecisionSpec("bf16-pure", None, False, False, param_dtype=torch.bfloat16),
    "fp8": PrecisionSpec("fp8", torch.bfloat16, False, False, fp8=True),
}

# Which tensor is in which dtype under each precision (the README's "every tensor" table, notebook 09).
# "compute": the matmuls' inputs; "activations": what the forward saves for backward.
TENSOR_DTYPES: dict[str, dict[str, str]] = {
    "fp32": {"weights": "fp32", "master weights": "-", "compute": "fp32", "activations": "fp32",
             "gradients": "fp32", "optimizer state": "fp32"},
    "tf32": {"weights": "fp32", "master weights": "-", "compute": "tf32 (fp32 in, 10-bit mantissa products)",
             "activations": "fp32", "gradients": "fp32", "optimizer state": "fp32"},
    "fp16": {"weights": "fp32", "master weights": "the fp32 weights", "compute": "fp16 (autocast)",
             "activations": "fp16", "gradients": "fp32 (scaled in backward)", "optimizer state": "fp32"},
    "bf16": {"weights": "fp32", "master weights": "the fp32 weights", "compute": "bf16 (autocast)",
             "activations": "bf16", "gradients": "fp32", "optimizer state": "fp32"},
    "bf16-pure": {"weights": "bf16", "master weights": "none", "compute": "bf16", "activations": "bf16",
                  "gradients": "bf16", "optimizer state": "bf16 (adamw, sgd)"},
    "fp8": {"weights": "fp32", "master weights": "the fp32 weights",
            "compute": "fp8 linears (e4m3 forward, e5m2 gradients), bf16 autocast elsewhere",
            "activations": "bf16 (+ fp8 copies of the linears' inputs)", "gradients": "fp32",
            "optimizer state": "fp32"},
}


def autocast(spec: PrecisionSpec, device_type: str):
    """The forward's autocast context for this precision (a no-op context for fp32/tf32). On a CPU without fp16
    hardware, fp16's linear layers are emulated (``emulated_fp16_linears``): the same roundings, fp32 speed."""
    if spec.autocast_dtype is None:
        return contextlib.nullcontext()
    ctx = torch.autocast(device_type=device_type, dtype=spec.autocast_dtype)
    if device_type == "cpu" and spec.autocast_dtype == torch.float16 and _emulate_fp16_on_cpu():
        stack = contextlib.ExitStack()
        stack.enter_context(ctx)
        stack.enter_context(emulated_fp16_linears())
        return stack
    return ctx


def _emulate_fp16_on_cpu() -> bool:
    from .hardware import capabilities   # below hardware in the layers: asked when a run needs the answer

    return not capabilities("cpu").fp16_fast


# fp32 copies of a weight are made a slice of rows at a time (at most this many elements, 16 MiB): a whole fp32 copy of
# a large head (SmolLM2's 28M-weight tied head: 113 MB) would cost more memory than autocast's own fp16 kernels
_SLICE_ELEMENTS = 1 << 22


def _row_slices(rows: int, row_len: int):
    step = max(1, _SLICE_ELEMENTS // max(1, row_len))
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


class _Fp16Linear(torch.autograd.Function):
    """``F.linear`` as an fp16 GEMM with fp32 accumulation computes it (a GPU's tensor cores, or a CPU with fp16
    hardware): inputs, weight and bias rounded to fp16, the products summed in fp32, the output rounded to fp16;
    in backward the same for each gradient. What backward keeps are the fp16 copies, as autocast's own linear
    keeps. The arithmetic runs as fp32 GEMMs on the rounded values, a slice of the weight's rows at a time: on a
    CPU without fp16 hardware torch's fp16 GEMM is a scalar loop, ~20x slower than fp32 on SmolLM2's layers."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        half = torch.float16
        x16, w16 = x.to(half), weight.to(half)
        b16 = bias.to(half) if bias is not None else None
        ctx.save_for_backward(x16, w16)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=half, device=x.device)
        with torch.autocast("cpu", enabled=False):
            x32 = x16.float()
            for a, b in _row_slices(*weight.shape):
                # the copy into the fp16 output rounds to nearest, as .to(torch.float16) does
                out[..., a:b] = torch.nn.functional.linear(x32, w16[a:b].float(),
                                                           b16[a:b].float() if b16 is not None else None)
        return out

    @staticmethod
    def backward(ctx, grad):
        x16, w16 = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        n_out, n_in = w16.shape
        g = grad.to(torch.float16).reshape(-1, n_out)   # the gradient arrives in fp16, as autocast's linear gets it
        gx = gw = gb = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                acc = torch.zeros(g.shape[0], n_in, dtype=torch.float32, device=g.device)
                for a, b in _row_slices(n_out, n_in):   # the sum over the output features, in fp32
                    acc.addmm_(g[:, a:b].float(), w16[a:b].float())
                gx = acc.to(torch.float16).to(x_dtype).reshape(*x16.shape)
            if ctx.needs_input_grad[1]:
                x32 = x16.reshape(-1, n_in).float()
                gw = torch.empty(n_out, n_in, dtype=w_dtype, device=g.device)
                for a, b in _row_slices(n_out, n_in):
                    gw[a:b] = (g[:, a:b].float().t() @ x32).to(torch.float16)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                gb = g.sum(0, dtype=torch.float32).to(torch.float16).to(b_dtype)
        return gx, gw, gb


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class emulated_fp16_linears(torch.overrides.TorchFunctionMode):
    """While fp16 autocast is on for the CPU, every ``F.linear`` on plain CPU float tensors runs as
    ``_Fp16Linear``: autocast's fp16 numerics (the roundings, the fp16 copies kept for backward, an fp16 overflow
    to inf that the GradScaler sees) at the speed of fp32. Other ops keep autocast's own fp16 kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and self._emulates(*args, **kwargs):
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            return _Fp16Linear.apply(x, weight, bias)
        return func(*args, **kwargs)

    @staticmethod
    def _emulates(x=None, weight=None, bias=None) -> bool:
        if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16):
            return False
        if torch.compiler.is_compiling():
            return False
        tensors = [t for t in (x, weight, bias) if t is not None]
        # plain tensors only: a quantized weight or a tensor subclass (float8, 4-bit) has its own matmul
        return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype in _FLOATS
                   for t in tensors) and x is not None and weight is not None


def active_autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to right now on this device type; None when autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def make_scaler(spec: PrecisionSpec, device_type: str) -> torch.amp.GradScaler:
    """A GradScaler that is a no-op unless the precision needs loss scaling."""
    return torch.amp.GradScaler(device_type, enabled=spec.scaler)


def tf32_state():
    """("legacy", flags) or ("new", precisions): whichever TF32 API the process already uses.

    torch >= 2.9 refuses to read the legacy flags once the new ``fp32_precision`` API was used (a
    transformers.Trainer with tf32=True does that), and refuses mixing them, so we keep to the one in use.
    """
    try:
        return "legacy", (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                          torch.get_float32_matmul_precision())
    except RuntimeError:
        return "new", (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
                       torch.backends.cudnn.conv.fp32_precision)


def _write_tf32(api: str, values) -> None:
    if api == "legacy":
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = values[0], values[1]
        torch.set_float32_matmul_precision(values[2])
    else:
        torch.backends.fp32_precision = values[0]
        torch.backends.cuda.matmul.fp32_precision = values[1]
        torch.backends.cudnn.conv.fp32_precision = values[2]


@contextlib.contextmanager
def global_torch_state(spec: PrecisionSpec):
    """Set the process-wide flags a precision needs, and restore every one of them afterwards."""
    api, saved_tf32 = tf32_state()
    saved = (torch.get_default_dtype(), torch.is_grad_enabled())
    try:
        if api == "legacy":
            _write_tf32(api, (spec.tf32, spec.tf32, "high" if spec.tf32 else "highest"))
        else:
            mode = "tf32" if spec.tf32 else "ieee"
            _write_tf32(api, (saved_tf32[0], mode, mode))
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        yield
    finally:
        _write_tf32(api, saved_tf32)
        torch.set_default_dtype(saved[0])
        torch.set_grad_enabled(saved[1])
