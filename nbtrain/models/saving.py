"""Saving a trained model so that plain transformers / peft can load it again.

What ``save_model(model, tokenizer, cfg, path)`` writes:

* method ``full``: the whole model (``AutoModelFor....from_pretrained(path)``);
* ``lora`` / ``qlora``: the peft adapter (with the classification head, for classifiers), loadable
  with ``AutoPeftModelFor....from_pretrained(path)`` or ``PeftModel.from_pretrained(base, path)``.
  For the ``tiny`` preset, whose random base exists nowhere else, the base is written to
  ``path/base_model`` and the adapter points at it. For QLoRA that base is the *dequantised*
  4/8-bit weights the adapter was trained against, in fp32. For any other model the adapter points
  at ``cfg.model`` (the local directory, or the Hub id); a QLoRA adapter then reproduces the
  trained model exactly when that base is loaded with the same ``BitsAndBytesConfig``;
* ``merged=True``: the adapter merged into the base weights, as a plain transformers model in
  fp32; for QLoRA the base is dequantised first, so the merged model computes what was trained.

Each also holds the tokenizer and ``nbtrain.yaml`` (the TrainConfig of the run).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from .._logs import defers_bitsandbytes
from .loading import CAUSAL_LM, ModelError, local_source, resolve_source

BASE_DIR = "base_model"
CONFIG_FILE = "nbtrain.yaml"


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The original module under peft's wrappers (a LoRA layer's base, a saved head's original)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    while True:
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        elif isinstance(module, AuxiliaryTrainingWrapper):
            module = module.original_module
        else:
            return module


def _live_submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    module = _unwrap(root)
    for part in path.split(".") if path else ():
        module = _unwrap(getattr(module, part))
    return module


def _weight_fp32(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    kind = type(tensor).__name__
    if name == "weight" and kind in ("Params4bit", "Int8Params"):
        # dequantised by hand: peft's helper re-creates an 8-bit weight on the CPU and so breaks the
        # live layer; this reads the packed weight and its scales and changes nothing
        import bitsandbytes.functional as bnbf

        if kind == "Params4bit":
            data, state = tensor.data, tensor.quant_state
            if getattr(state, "packing_format_for_cpu", False):
                # bitsandbytes repacked it for its CPU inference kernel; undo that on a copy
                data, state = bnbf._convert_weight_packed_for_cpu_inverse(data.clone(), copy.deepcopy(state))
            tensor = bnbf.dequantize_4bit(data, state)
        else:
            scb = getattr(tensor, "SCB", None)
            if scb is None:
                scb = getattr(getattr(module, "state", None), "SCB", None)
            if scb is None:
                raise ModelError(f"cannot dequantise the 8-bit weight of {type(module).__name__}: it "
                                 "has no scales (SCB)")
            tensor = bnbf.int8_vectorwise_dequant(tensor.data, scb.to(tensor.device))
    return tensor.detach().to("cpu", torch.float32)


def plain_base_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain fp32 transformers model on the CPU with the base weights of ``model``: no adapters,
    original heads, and 4/8-bit weights dequantised. ``model`` itself is left untouched."""
    base = model.get_base_model() if _is_peft(model) else model
    config = copy.deepcopy(base.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = torch.float32
    with torch.device("meta"):
        fresh = type(base)(config)
    fresh.to_empty(device="cpu")
    filled: set[int] = set()
    with torch.no_grad():
        for path, fmod in fresh.named_modules():
            if not fmod._parameters and not fmod._buffers:
                continue
            try:
                live = _live_submodule(base, path)
            except AttributeError:
                raise ModelError(f"cannot copy {type(base).__name__}: module {path!r} has no "
                                 "counterpart in the trained model") from None
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(fmod, kind).items():
                    src = getattr(live, kind).get(name)
                    if t is None or src is None:
                        continue
                    t.copy_(_weight_fp32(live, name, src).to(t.dtype))
                    filled.add(id(t))
    missing = [n for n, p in fresh.named_parameters() if id(p) not in filled]
    if missing:
        raise ModelError(f"cannot copy {type(base).__name__}: no trained values for {missing[:5]}")
    fresh.tie_weights()
    if getattr(config, "use_cache", None) is False and _task_of(fresh) == CAUSAL_LM:
        fresh.config.use_cache = True  # training switched it off; generation wants it back
    return fresh.eval()


def _task_of(model) -> str:
    return CAUSAL_LM if model.get_output_embeddings() is not None else "sequence-classification"


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain fp32 CPU copy of a peft ``model`` with its LoRA weights merged into the base."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from .methods import quiet_peft

    if not _is_peft(model):
        return plain_base_copy(model)
    name = model.active_adapter
    fresh = plain_base_copy(model)
    pcfg = copy.deepcopy(model.peft_config[name])
    pcfg.inference_mode = True
    pcfg.base_model_name_or_path = fresh.__dict__.get("name_or_path") or None  # as peft sets it
    with quiet_peft():
        pm = get_peft_model(fresh, pcfg, adapter_name=name)
    state = {k: v.detach().to("cpu", torch.float32)
             for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    result = set_peft_model_state_dict(pm, state, adapter_name=name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k or "modules_to_save" in k]
    if unexpected:
        raise ModelError(f"merging the adapter: weights {unexpected[:5]} did not find their layers")
    return pm.merge_and_unload().eval()


def _base_reference(cfg, path: Path) -> str:
    src = resolve_source(cfg.model)
    if src.is_preset:
        return str((path / BASE_DIR).resolve())
    return local_source(src).name   # a GGUF model's converted folder: what from_pretrained can load


# save_pretrained imports peft's and transformers' quantizer modules, which import bitsandbytes: quietly, lazily
@defers_bitsandbytes
def save_model(model, tokenizer, cfg, path, merged: bool = False) -> Path:
    """Write ``model`` (full weights, or the peft adapter; ``merged=True``: LoRA merged into the base),
    its tokenizer and ``nbtrain.yaml`` to ``path``; returns the directory. See the module docstring
    for what reloads it."""
    out = Path(path).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if _is_peft(model) and merged:
        merged_copy(model).save_pretrained(out)
    elif _is_peft(model):
        # never resized: no tokens are added, so peft need not look the base up (on the Hub) to check
        model.save_pretrained(out, save_embedding_layers=False)
        ref = _base_reference(cfg, out)
        if resolve_source(cfg.model).is_preset:
            base = plain_base_copy(model)
            base.save_pretrained(out / BASE_DIR)
            tokenizer.save_pretrained(out / BASE_DIR)
        adapter_cfg = out / "adapter_config.json"
        data = json.loads(adapter_cfg.read_text())
        data["base_model_name_or_path"] = ref
        adapter_cfg.write_text(json.dumps(data, indent=2, sort_keys=True))
    else:
        restore = getattr(model.config, "use_cache", None)
        if restore is False and _task_of(model) == CAUSAL_LM:
            model.config.use_cache = True  # the saved model is for generation, not for this loop
        try:
            model.save_pretrained(out)
        finally:
            if restore is not None:
                model.config.use_cache = restore
    tokenizer.save_pretrained(out)
    cfg.to_yaml(out / CONFIG_FILE)
    return out
