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
    """The forward's autocast context for this precision (a no-op context for fp32/tf32)."""
    if spec.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=spec.autocast_dtype)


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
