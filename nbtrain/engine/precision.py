"""Precision is a table, not branches (DESIGN rule 2)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    autocast_dtype: Optional[torch.dtype]   # None: no autocast, plain fp32 kernels
    scaler: bool                            # a GradScaler is needed (fp16 underflows without one)
    tf32: bool                              # allow TF32 tensor-core matmuls for fp32 tensors


PRECISION_TABLE: dict[str, PrecisionSpec] = {
    "fp32": PrecisionSpec("fp32", None, False, False),
    "tf32": PrecisionSpec("tf32", None, False, True),
    "fp16": PrecisionSpec("fp16", torch.float16, True, False),
    "bf16": PrecisionSpec("bf16", torch.bfloat16, False, False),
}


def autocast(spec: PrecisionSpec, device_type: str):
    """The forward's autocast context for this precision (a no-op context for fp32/tf32)."""
    if spec.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=spec.autocast_dtype)


def make_scaler(spec: PrecisionSpec, device_type: str) -> torch.amp.GradScaler:
    """A GradScaler that is a no-op unless the precision needs loss scaling."""
    return torch.amp.GradScaler(device_type, enabled=spec.scaler)


@contextlib.contextmanager
def global_torch_state(spec: PrecisionSpec):
    """Set the process-wide flags a precision needs, and restore every one of them afterwards."""
    saved = (
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.get_float32_matmul_precision(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
    )
    try:
        torch.backends.cuda.matmul.allow_tf32 = spec.tf32
        torch.backends.cudnn.allow_tf32 = spec.tf32
        torch.set_float32_matmul_precision("high" if spec.tf32 else "highest")
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.backends.cudnn.allow_tf32 = saved[1]
        torch.set_float32_matmul_precision(saved[2])
        torch.set_default_dtype(saved[3])
        torch.set_grad_enabled(saved[4])
