"""The step of an image classifier: a vision encoder's activations are its patches x hidden.

A ViT-style encoder (a config with ``image_size``, ``patch_size``, ``hidden_size`` and layers) is a stack of
transformer layers over ``T = (image_size / patch_size)^2 + 1`` tokens (the patches and the CLS token). Its step
is the text timeline's (``timeline.step_peak``) at sequence length ``T``: B x T tokens of ``hidden`` through
layers of the same sizes (approximated as Llama-style layers, as for any non-Llama architecture), with the
pixel values (fp32, B x C x H x W) instead of token ids as input.

Any other image classifier (a CNN such as ConvNeXt, whose activations are per pixel and stage, not per token)
is traced: its forward runs once on the ``meta`` device (no memory, no weights) with the method's trainable
parameters, and every tensor autograd saves for backward is counted (``torch.autograd.graph.saved_tensors_hooks``);
under 16-bit autocast the model runs in that dtype there (meta tensors have no autocast), which misses the few
fp32 copies autocast keeps. The peak is then taken as all those activations beside all the gradients, an upper
bound (the real backward frees activations as gradients appear).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import TrainConfig
from .facts import Architecture, architecture, parameter_bytes
from .timeline import StepPeak, step_peak

IMG_CLS = "image-classification"


def _size(v) -> Optional[int]:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return int(v) if v else None


def image_geometry(model: str, arch: Architecture, num_labels: int) -> tuple[int, int, Optional[int]]:
    """(channels, image size, tokens per image) of the model's config: 3 channels and 224 pixels when it does not
    say; tokens (patches + CLS) only for a ViT-style encoder, else None."""
    from ..models.loading import meta_model

    c = meta_model(model, IMG_CLS, num_labels, local_only=False).config
    channels = int(getattr(c, "num_channels", 3) or 3)
    image, patch = _size(getattr(c, "image_size", None)), _size(getattr(c, "patch_size", None))
    tokens = None
    if image and patch and arch.hidden and arch.layers and getattr(c, "hidden_size", None):
        tokens = (image // patch) ** 2 + 1
    return channels, image or 224, tokens


def image_step_peak(cfg: TrainConfig, precision: str, device: str, num_labels: int) -> StepPeak:
    """The parts of one training step of image classifier ``cfg`` and its peak (see the module docstring)."""
    arch = architecture(cfg.model, IMG_CLS, num_labels)
    channels, size, tokens = image_geometry(cfg.model, arch, num_labels)
    B = cfg.micro_batch_size
    pixels = 4 * B * channels * size * size + 8 * B          # fp32 pixel values and int64 labels
    if tokens is not None:
        # the text timeline at T = patches + CLS; max_seq_len's bound (>= 8) is for text, not for this copy
        as_text = cfg.model_copy(update={"max_seq_len": tokens})
        p = step_peak(as_text, precision, device, num_labels)
        delta = pixels - 3 * 8 * B * tokens                   # the timeline counted ids, mask and labels
        p.activations += delta
        p.peak += delta
        p.notes = [n for n in p.notes if "Llama-style layer" not in n]
        p.notes.insert(0, f"{arch.model_type}: {B} images x {tokens} tokens ({tokens - 1} patches + CLS) x "
                          f"{arch.hidden} hidden through {arch.layers} layers, approximated as Llama-style layers "
                          "of the same sizes")
        return p
    return _traced_step_peak(cfg, precision, arch, num_labels, channels, size, pixels)


def _traced_step_peak(cfg: TrainConfig, precision: str, arch: Architecture, num_labels: int, channels: int,
                      size: int, pixels: int) -> StepPeak:
    from ..models.loading import meta_model

    params = parameter_bytes(cfg, arch, num_labels, precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": torch.bfloat16,
             "fp8": torch.bfloat16}.get(precision, torch.float32)
    model = meta_model(cfg.model, IMG_CLS, num_labels, local_only=False)
    if cfg.method == "full":
        model.requires_grad_(True)
    else:
        from peft import get_peft_model

        from ..models.methods import lora_config, quiet_peft

        model.requires_grad_(False)
        with quiet_peft():
            model = get_peft_model(model, lora_config(cfg, model, IMG_CLS))
    model.to(dtype).train()
    param_ids = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in param_ids and id(base) not in param_ids:
            saved[id(base)] = max(saved.get(id(base), 0), base.numel() * base.element_size())
        return t

    x = torch.empty(cfg.micro_batch_size, channels, size, size, device="meta", dtype=dtype)
    y = torch.zeros(cfg.micro_batch_size, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(pixel_values=x).logits
        torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum")
    acts = sum(saved.values()) + pixels
    logits_bytes = 12 * cfg.micro_batch_size * num_labels
    earlier = params.gradients if cfg.grad_accum_steps > 1 else 0
    top = max(earlier + acts + logits_bytes, acts + params.gradients)
    notes = [f"{arch.model_type}: activations traced from one forward on the meta device "
             f"({cfg.micro_batch_size} images of {channels} x {size} x {size}); the peak assumes all of them beside "
             "all gradients (an upper bound)"]
    if dtype != torch.float32:
        notes.append(f"{precision}: traced with the model in {precision} (autocast's fp32 copies not counted)")
    return StepPeak(weights=params.weights, gradients=params.gradients, optimizer=params.optimizer,
                    activations=acts, logits=logits_bytes, peak=params.weights + params.optimizer + top,
                    phase="the backward", trainable=params.trainable, total=params.total, notes=notes,
                    master_weights=params.master_weights, param_bytes=params.param_bytes,
                    run_tensors=params.weights + params.optimizer + max(earlier + acts + 4 * cfg.micro_batch_size
                                                                        * num_labels, params.gradients))
