"""Atomic checkpoints: trainable weights, optimizer, scheduler, GradScaler, RNG, data position, history.

A checkpoint is a directory ``step-000123`` holding ``state.pt`` and ``meta.json`` (with the SHA-256 of
``state.pt``). It is written under a temporary name and renamed into place, so a crash mid-write never
leaves a directory that looks complete; a truncated or altered ``state.pt`` fails its checksum with a clear
message, and ``latest_checkpoint`` falls back to the newest one that verifies.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only the parameters that train (the adapter and head for LoRA): small, and all a resume needs."""
    return {n: p.detach().to("cpu").clone() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(directory: str | os.PathLike, step: int, state: dict[str, Any], config_yaml: str) -> Path:
    """Write ``state`` as checkpoint ``step`` under ``directory`` atomically; returns its path."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    (tmp / "config.yaml").write_text(config_yaml)
    meta = {"step": step, "sha256": _sha256(tmp / "state.pt"), "format": 1}
    (tmp / "meta.json").write_text(json.dumps(meta))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)   # the rename is the commit point
    return final


def verify(path: str | os.PathLike) -> dict:
    """Check a checkpoint directory; returns its meta or raises CheckpointError saying what is wrong."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    meta_file, state_file = p / "meta.json", p / "state.pt"
    if not meta_file.is_file() or not state_file.is_file():
        raise CheckpointError(f"checkpoint {str(p)!r} is incomplete (needs meta.json and state.pt)")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"checkpoint {str(p)!r}: meta.json is corrupt ({e})") from None
    if _sha256(state_file) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {str(p)!r}: state.pt is truncated or corrupt (checksum mismatch); "
                              "resume from an earlier checkpoint")
    return meta


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``directory`` that verifies, or None."""
    root = Path(directory)
    for cand in sorted(root.glob("step-*"), reverse=True):
        try:
            verify(cand)
            return cand
        except CheckpointError:
            continue
    return None


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a folder of them (its newest valid one). Raises CheckpointError."""
    p = Path(path)
    if (p / "meta.json").exists() or (p / "state.pt").exists():
        verify(p)
        return p
    for root in (p, p / "checkpoints"):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CheckpointError(f"resume_from={str(p)!r}: no valid checkpoint there (expected a step-NNNNNN "
                          "directory written by save_every, or a folder holding them)")


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Verify and load a checkpoint's state (on the CPU)."""
    p = resolve(path)
    try:
        state = torch.load(p / "state.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint {str(p)!r} could not be read: {type(e).__name__}: {e}") from None
    state["path"] = str(p)
    return state
