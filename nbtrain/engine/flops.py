"""FLOPs of one training token, from the model's own modules, and MFU (model FLOPs utilisation).

Counted per token of a sequence of ``seq_len`` tokens, as matmuls (2 FLOPs per multiply-add):

* forward: every Linear-like module the token passes through, 2 x in x out (LoRA's adapters and a quantised base
  layer included: what runs is counted), plus attention's two matmuls per layer, QK^T and AV over the whole
  sequence, 2 x 2 x seq_len x head_dim x heads (the full matrix, as ``torch.utils.flop_counter`` counts SDPA);
* backward: each matmul's input gradient (the same FLOPs as its forward) and, only where the weight trains, its
  weight gradient (the same again): 2x the forward for full fine-tuning, about 1x for LoRA and QLoRA, whose frozen
  weights get no gradient; attention's backward is 2x its forward;
* gradient checkpointing runs the decoder layers' forward again in backward: those are hardware FLOPs, not model
  FLOPs (MFU counts the model's, as PaLM's definition does), reported apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs of one training token: ``model`` (forward + backward) and ``hardware`` (with checkpointing's recompute)."""

    forward: float
    backward: float
    recompute: float = 0.0

    @property
    def model(self) -> float:
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        return self.model + self.recompute


def _linears(model: torch.nn.Module):
    from transformers.pytorch_utils import Conv1D

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            yield name, mod, int(mod.in_features), int(mod.out_features), mod.weight
        elif isinstance(mod, Conv1D):   # GPT-2 style: weight is (in, out)
            w = mod.weight
            yield name, mod, int(w.shape[0]), int(mod.nf), w


def _attention_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, heads, head_dim) from the model's config; (0, 0, 0) when it has none (no attention counted)."""
    config = getattr(model, "config", None)
    base = getattr(model, "get_base_model", None)
    if config is None and base is not None:
        config = getattr(base(), "config", None)
    if config is None:
        return 0, 0, 0
    text = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(text, "num_hidden_layers", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    hidden = getattr(text, "hidden_size", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    return int(layers), int(heads), int(head_dim)


def token_flops(model: torch.nn.Module, seq_len: int, gradient_checkpointing: bool = False) -> TokenFlops:
    """FLOPs of one training token of ``model`` on sequences of ``seq_len`` tokens (see the module docstring)."""
    fwd = bwd = 0.0
    in_layers = 0.0   # the forward FLOPs inside the repeated blocks: what checkpointing recomputes
    for name, _mod, n_in, n_out, weight in _linears(model):
        f = 2.0 * n_in * n_out
        fwd += f
        bwd += f                                   # the input's gradient
        if weight is not None and weight.requires_grad:
            bwd += f                               # the weight's gradient
        if ".layers." in f".{name}." or ".layer." in f".{name}." or ".h." in f".{name}.":
            in_layers += f
    layers, heads, head_dim = _attention_shape(model)
    attn = 2.0 * 2.0 * seq_len * head_dim * heads * layers
    fwd += attn
    bwd += 2.0 * attn
    in_layers += attn
    return TokenFlops(forward=fwd, backward=bwd, recompute=in_layers if gradient_checkpointing else 0.0)


def compute_dtype(precision: str) -> str:
    """The dtype a precision's matmuls run in, the key of ``capabilities().peak_tflops``."""
    return {"fp32": "fp32", "tf32": "tf32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16",
            "fp8": "fp8"}.get(precision, "fp32")


def mfu(flops_per_token: float, tokens_per_s: float, peak_tflops: dict[str, float], precision: str,
        world_size: int = 1) -> float | None:
    """Model FLOPs per second over the device's peak for the run's compute dtype (all processes' devices); None
    when the peak is unknown."""
    key = compute_dtype(precision)
    peak = peak_tflops.get(key) or (peak_tflops.get("bf16") if key == "fp8" else None) \
        or (peak_tflops.get("fp32") if key == "tf32" else None)
    if not peak or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * 1e12 * max(1, world_size))
