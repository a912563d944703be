"""Models: the ``tiny`` and ``tiny-vit`` presets, the pretrained ``smollm2-135m-instruct``, loading from a directory,
a GGUF file or the Hub, full / LoRA / QLoRA, saving."""

from __future__ import annotations

import torch

from ..config import ConfigError, TrainConfig
from .loading import (ModelError, known_module_names, load_image_processor, load_tokenizer, local_source,
                      minilm_model, resolve_source, source_notes, where_from)
from .methods import build_model
from .presets import PRESETS, ModelPreset
from .saving import save_model

__all__ = ["PRESETS", "ModelError", "ModelPreset", "build_model", "check_lora_targets", "count_params",
           "known_module_names", "load_image_processor", "load_tokenizer", "local_source", "minilm_model", "resolve_source",
           "save_model", "source_notes", "where_from"]


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


def check_lora_targets(cfg: TrainConfig) -> None:
    """Raise ConfigError (field ``lora_targets``) when ``cfg`` lists LoRA targets the model does not have.

    Checked for an explicit list under lora/qlora, against the model's Linear-like module names (read
    from its architecture, no weights; skipped when that needs a download). A TrainConfig does not ask
    at construction, so it loads without the model; a run or an estimate asks when it prepares."""
    if cfg.method not in ("lora", "qlora") or not isinstance(cfg.lora_targets, list):
        return
    names = known_module_names(cfg.model, cfg.task)
    if names is None:
        return
    unknown = [t for t in cfg.lora_targets if t not in names]
    if unknown:
        raise ConfigError(f"lora_targets: {unknown} not found in model {cfg.model!r}; it has {sorted(names)} "
                          "(or use 'all-linear')", field="lora_targets")
