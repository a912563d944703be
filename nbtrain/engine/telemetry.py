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


class LiveTensorBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of the tensor storages created under it and still referenced, checked after every op.

    On any device, CPU included: what ``estimate_memory``'s tensor peak is checked against where there is no
    allocator to ask. Storages in ``ignore`` (their ``untyped_storage()._cdata``: weights, optimizer state,
    inputs) are not counted. Code compiled by torch.compile allocates out of its sight."""

    def __init__(self, ignore: set[int] = frozenset()):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self.ignore, self.live, self.now, self.peak = set(ignore), {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(k)[1]
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.ignore and st._cdata not in self.live:
                    self.live[st._cdata] = (self._ref(st), st.nbytes())
                    self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        return out
