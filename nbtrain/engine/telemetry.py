"""Memory readings with explicit names; host-side queries only (no device sync)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Optional

import psutil
import torch

from .distributed import local

_GIB = 2**30
_PROC = psutil.Process(os.getpid())


def sampled_step(step: int, total: int) -> bool:
    """The steps an extra measurement (an fp32 pass, a tensor count) runs on: the first three, every 10th, the last."""
    return step <= 3 or step % 10 == 0 or step == total


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


class RunTensorBytes:
    """One run's own tensors on the CPU at the peak of each step, in bytes: what RSS cannot say.

    RSS is the whole process (other runs' models, the notebook's variables, freed memory the allocator keeps).
    This counts the run's weights, buffers, gradients and optimizer state (unique storages, each once) plus the
    tensors autograd saves for backward, packed by ``saved_tensors_hooks`` around each micro-batch. Those hooks
    are thread-local in torch, and the counts live on this object, so concurrent runs never see each other's
    tensors (a process-wide allocator counter would). Not counted: an op's short-lived temporaries, and what a
    checkpointed layer recomputes in backward (torch's checkpoint packs it with its own hooks).
    Disabled (``micro()`` a no-op, ``step_peak()`` None) off the CPU, where the allocator answers.

    Under FSDP2 (fully_shard) the weights, gradients and optimizer state are this rank's shards (``_storage``
    reads a DTensor's local tensor), and the groups FSDP has gathered are counted at their size when each tensor
    is saved: FSDP frees a layer's gathered storage after its forward (``resize_(0)``) while autograd still refers
    to it, so a saved gathered weight is counted with its group while gathered, not as saved at its packed size.

    Sampled: packing every saved tensor in Python costs the loop several percent, so only the steps that
    ``measures(step)`` picks are measured (the first MEASURE_FIRST, every MEASURE_EVERY-th, and the last); the
    others record None. A step's tensors are the same shapes every step (up to the batch's padded length), so
    the measured steps show the run's peak."""

    #: steps 1..MEASURE_FIRST are measured (step 2 is the first with optimizer state and all gradients)
    MEASURE_FIRST = 3
    #: then every MEASURE_EVERY-th step, and the run's last
    MEASURE_EVERY = 10

    def __init__(self, device: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 total_steps: Optional[int] = None):
        self.enabled = device == "cpu"
        self.total_steps = total_steps
        self._on = self.enabled   # whether the current step is measured (every step until begin_step says)
        # listed once: walking the module tree costs more than reading every storage it yields
        self._params, self._buffers = list(model.parameters()), list(model.buffers())
        self._fsdp = _fsdp_params(model) if self.enabled else []
        self._optimizer = optimizer
        self._live: dict[int, list[int]] = {}   # storage address -> [saved references, bytes]
        self._skip: frozenset[int] = frozenset()
        self._now = self._saved_peak = self._step_peak = 0

    def also_holds(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count more tensors the run holds all along (a DPO reference copy's weights, precomputed log-probs)."""
        self._buffers.extend(tensors)

    def _tensors(self) -> Iterable[torch.Tensor]:
        yield from self._params
        yield from self._buffers
        yield from (p.grad for p in self._params if p.grad is not None)
        for state in self._optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def _gathered(self) -> dict[int, int]:
        """FSDP: storage address -> bytes of each parameter's gathered (all-gather output) storage allocated now;
        empty without FSDP."""
        out = {}
        for fp in self._fsdp:
            for t in getattr(fp, "all_gather_outputs", ()):
                st = t.untyped_storage()
                n = st.nbytes()
                if n:
                    out[st.data_ptr()] = n
        return out

    def _persistent(self) -> tuple[int, frozenset[int]]:
        """Bytes and addresses of the distinct storages the run holds between steps (a tied weight counts once)."""
        sizes = dict(filter(None, map(_storage, self._tensors())))
        return sum(sizes.values()), frozenset(sizes)

    def _pack(self, t: torch.Tensor):
        where = _storage(t)
        if where is None or where[0] in self._skip:   # a weight (fp32 linear layers save theirs): counted already
            return t
        gathered = 0
        if self._fsdp:
            now = self._gathered()
            gathered = sum(now.values())
            self._saved_peak = max(self._saved_peak, self._now + gathered)
            if where[0] in now:   # a gathered weight: counted with its group while FSDP keeps it gathered
                return t
        key, nbytes = where
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, nbytes]
            self._now += nbytes
            self._saved_peak = max(self._saved_peak, self._now + gathered)
        else:
            entry[0] += 1
        # detached: the packed object must not hold the tensor's grad_fn, which holds the packed object (a
        # cycle through C++ that the garbage collector cannot see)
        return _Saved(self, key, t.detach())

    @staticmethod
    def _unpack(packed):
        return packed.tensor if type(packed) is _Saved else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if not entry[0]:
            del self._live[key]
            self._now -= entry[1]

    def measures(self, step: int) -> bool:
        """Whether ``step`` is one of the measured steps."""
        return self.enabled and (step <= self.MEASURE_FIRST or step % self.MEASURE_EVERY == 0
                                 or step == self.total_steps)

    def begin_step(self, step: int) -> None:
        """Called before a step's first micro-batch: decides whether this step is measured."""
        self._on = self.measures(step)

    @contextlib.contextmanager
    def micro(self):
        """Around one micro-batch's forward and backward: its saved tensors on top of what the run holds."""
        if not self._on:
            yield
            return
        # earlier micro-batches' gradients are here all through this one's forward
        base, self._skip = self._persistent()
        self._saved_peak = self._now
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._step_peak = max(self._step_peak, base + self._saved_peak)

    def step_peak(self) -> Optional[float]:
        """The step's peak in GiB, read once per step after the optimizer step and before the gradients go
        (weights, all gradients and the optimizer state together); starts the next step's window. None on
        a step that was not measured."""
        if not self._on:
            return None
        peak = max(self._step_peak, self._persistent()[0])
        self._step_peak = 0
        return peak / _GIB


def _fsdp_params(model: torch.nn.Module) -> list:
    """The FSDPParam objects of every fully_shard group in ``model`` (empty when it is not sharded): what holds
    each group's gathered storage. Private to torch's FSDP2; a torch that lays it out otherwise gives none."""
    out = []
    for mod in model.modules():
        get = getattr(mod, "_get_fsdp_state", None)
        if get is None:
            continue
        try:
            group = get()._fsdp_param_group
        except Exception:
            continue
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def _storage(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(address, bytes) of the storage behind ``t``; None for one without a plain storage (sparse, nested): a
    training step must not fail for want of a count."""
    try:
        st = local(t).untyped_storage()   # a sharded (FSDP) tensor: this rank's shard
    except (RuntimeError, NotImplementedError):
        return None
    return st.data_ptr(), st.nbytes()


class _Saved:
    """A tensor saved for backward, counted until autograd drops it."""

    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: RunTensorBytes, key: int, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner._release(self.key)


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
