"""Memory readings with explicit names; host-side queries only (no device sync)."""

from __future__ import annotations

import os

import psutil
import torch

_GIB = 2**30
_PROC = psutil.Process(os.getpid())


def host_rss_gib() -> float:
    """Resident memory of this process."""
    return _PROC.memory_info().rss / _GIB


def device_memory_gib(device: str) -> tuple[float | None, float | None, float | None]:
    """(allocated, reserved, peak since the last reset) on the accelerator; Nones on CPU."""
    if device != "cuda":
        return None, None, None
    # one stats snapshot (each of memory_allocated / memory_reserved / max_memory_allocated builds a new one)
    st = torch.cuda.memory_stats()
    return (st.get("allocated_bytes.all.current", 0) / _GIB, st.get("reserved_bytes.all.current", 0) / _GIB,
            st.get("allocated_bytes.all.peak", 0) / _GIB)


def reset_peak(device: str) -> None:
    """Start a new peak window (called once per record)."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
