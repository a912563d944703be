"""The precision of the weights themselves, applied after the model is built and its initial weights hashed
(so every precision of a comparison starts from the same init): bf16 weights for precision="bf16-pure", float8
linear layers for precision="fp8". The other precisions keep fp32 weights and reach low precision through
autocast alone. Both are table lookups (``PrecisionSpec.param_dtype``, ``PrecisionSpec.fp8``)."""

from __future__ import annotations

import torch

from ..precision import PrecisionSpec
from .loading import ModelError

# torch._scaled_mm (float8 matmuls) needs both dimensions of each weight divisible by 16
FP8_ALIGN = 16


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Every floating-point parameter that is not ``dtype`` (trainable or frozen; a quantized one is not
    floating point and stays) cast to ``dtype``, in place. Buffers (RoPE's frequencies) keep their dtype: the
    model computes them in fp32. Returns the count of parameters cast."""
    n = 0
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += 1
    return n


def _output_layers(model: torch.nn.Module) -> set[str]:
    """Qualified names of the output layer (a causal LM's lm_head) and a classifier's head modules."""
    from .loading import head_module_names

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names: set[str] = set()
    out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    for name, mod in model.named_modules():
        if out is not None and mod is out:
            names.add(name)
    heads = head_module_names(base)
    for name, _ in model.named_modules():
        if any(name == h or name.endswith("." + h) or name.startswith(h + ".") or f".{h}." in name
               for h in heads):
            names.add(name)
    return names


def convert_fp8(model: torch.nn.Module, emulate: bool) -> list[str]:
    """torchao's float8 training on the model's linear layers: e4m3 inputs and weights in the forward, e5m2
    gradients in the backward, each with a dynamic per-tensor scale (torchao's default "tensorwise" recipe).
    Kept out: the output layer and a classifier's head (their logits feed the loss; torchao's own advice), LoRA's
    adapter matrices (rank-sized, too small to gain) and any layer whose sizes are not multiples of 16 (float8
    matmuls need them). ``emulate``: compute the float8 matmuls in higher precision (a CPU or a GPU without
    float8 tensor cores: the numbers of fp8, not its speed). Returns the run notes."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ModelError(f"precision: 'fp8' needs torchao (pip install 'nbtrain[fp8]'); importing it failed: "
                         f"{type(e).__name__}: {e}") from None
    keep_out = _output_layers(model)
    converted: list[str] = []
    skipped: dict[str, str] = {}

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return False
        if fqn in keep_out:
            skipped[fqn] = "output layer"
            return False
        if "lora_" in fqn:
            return False
        if module.in_features % FP8_ALIGN or module.out_features % FP8_ALIGN:
            skipped[fqn] = f"{module.in_features}x{module.out_features} not multiples of {FP8_ALIGN}"
            return False
        converted.append(fqn)
        return True

    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate), module_filter_fn=keep)
    if not converted:
        raise ModelError("precision: 'fp8' found no linear layer to convert (each needs sizes that are multiples "
                         f"of {FP8_ALIGN}, and the output layer stays bf16); use precision='bf16' for this model")
    shown = ", ".join(converted[:6]) + (f", ... ({len(converted)} in all)" if len(converted) > 6 else "")
    notes = [f"fp8: {len(converted)} linear layers run their matmuls in float8 (e4m3 forward, e5m2 gradients, "
             f"dynamic per-tensor scales{', emulated: numerics only' if emulate else ''}): {shown}"]
    if skipped:
        notes.append("fp8: kept in bf16 (autocast): " + ", ".join(f"{n} ({why})" for n, why in skipped.items()))
    return notes


def apply_tensor_precision(model: torch.nn.Module, spec: PrecisionSpec, fp8_native: bool) -> list[str]:
    """The weights' precision of ``spec`` applied to ``model`` in place; returns the run notes that say what
    changed (none for the fp32-weight precisions)."""
    notes: list[str] = []
    if spec.param_dtype != torch.float32:
        n = cast_weights(model, spec.param_dtype)
        notes.append(f"{spec.name}: {n} weight tensors in {str(spec.param_dtype).removeprefix('torch.')}, no fp32 "
                     "master copy: gradients in it too, and the optimizer's state for adamw and sgd (which keep it in the weights' "
                     "dtype)")
    if spec.fp8:
        notes.extend(convert_fp8(model, emulate=not fp8_native))
    return notes
