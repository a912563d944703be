"""Models: the ``tiny`` preset, loading from a directory or the Hub, full / LoRA / QLoRA, saving."""

from __future__ import annotations

import torch

from .loading import ModelError, known_module_names, load_tokenizer, resolve_source
from .methods import build_model
from .presets import PRESETS, ModelPreset
from .saving import save_model

__all__ = ["PRESETS", "ModelError", "ModelPreset", "build_model", "count_params", "known_module_names",
           "load_tokenizer", "resolve_source", "save_model"]


def _real_numel(p: torch.Tensor) -> int:
    if type(p).__name__ == "Params4bit":
        qs = getattr(p, "quant_state", None)
        if qs is not None and getattr(qs, "shape", None) is not None:
            return int(torch.Size(qs.shape).numel())
        # packed storage: two 4-bit values per byte of the storage dtype
        return p.numel() * p.element_size() * 2
    return p.numel()


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count their real elements, not packed bytes."""
    trainable = total = 0
    for p in model.parameters():  # shared (tied) parameters are yielded once
        n = _real_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total
