"""A run's own random stream, so two runs in one process never draw from each other's.

torch has one global generator per device, and model initialisation and dropout draw from it. A run keeps
its own generator states and swaps them in (under one process-wide lock) only around the work that draws:
building the model and each step's forward/backward. The caller's global state is put back every time, so
``train()`` leaves the caller's random state as it found it, and two concurrent runs each equal a solo run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

# Re-entrant: a callback may start a nested run on the same thread.
_LOCK = threading.RLock()


class RunRng:
    """The torch generator states of one run (CPU, and CUDA when the run is on CUDA), seeded from ``seed``."""

    def __init__(self, seed: int, device: str):
        self.cuda = device == "cuda" and torch.cuda.is_available()
        with _LOCK:
            saved = self._read()
            torch.manual_seed(seed)   # seeds every device's default generator
            self._state = self._read()
            self._write(saved)

    def _read(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state()}
        if self.cuda:
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def _write(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if self.cuda and "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])

    @contextlib.contextmanager
    def active(self):
        """Make this run's state torch's global one for the block; the caller's comes back after it."""
        with _LOCK:
            saved = self._read()
            self._write(self._state)
            try:
                yield
            finally:
                self._state = self._read()
                self._write(saved)

    def state_dict(self) -> dict[str, Any]:
        """Tensors only, so a checkpoint holding it loads with ``weights_only=True``."""
        return {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v])
                for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        new = {"torch": state["torch"]}
        if self.cuda and "cuda" in state:
            new["cuda"] = state["cuda"]
        elif self.cuda:
            new["cuda"] = self._state["cuda"]
        self._state = new
