"""accelerate: a config file for ``accelerate launch --config_file FILE`` running nbtrain on several processes (or a
Trainer script of the training-args export)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...config import TrainConfig
from ...hardware import resolve_precision
from .mapping import write_text, yaml_text


def accelerate_config(cfg: TrainConfig, num_processes: Optional[int] = None) -> dict[str, Any]:
    """An ``accelerate launch --config_file`` dict: one machine, ``num_processes`` processes (default: the
    visible GPUs, else 1), DDP when there are several.

    ``mixed_precision`` is ``"no"`` on purpose, except for precision="fp8": nbtrain's loop applies ``cfg.precision``
    itself with ``torch.autocast`` and a GradScaler (DESIGN rule 6), and the Trainer of the training-args export
    sets fp16 / bf16 from its own flags. accelerate's own mixed precision would add a second autocast and scaler
    around nbtrain's, and it is process-wide, so it could not follow the config. fp8 is the precision only this
    file can say for a Trainer (TrainingArguments has no fp8 flag): ``mixed_precision: fp8`` with
    ``fp8_config: {backend: AO}`` (accelerate's FP8BackendType.AO, torchao: float8 linears, bf16 autocast
    elsewhere, as nbtrain's fp8). nbtrain's own loop makes no Accelerator and reads neither; it converts its
    linear layers itself.
    """
    cuda = torch.cuda.is_available()
    n = int(num_processes) if num_processes else max(1, torch.cuda.device_count() if cuda else 1)
    fp8 = resolve_precision(cfg.precision) == "fp8"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("MULTI_GPU" if cuda else "MULTI_CPU") if n > 1 else "NO",
        "mixed_precision": "fp8" if fp8 else "no",
    }
    if fp8:
        out["fp8_config"] = {"backend": "AO"}
    out.update({
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": n,
        "gpu_ids": "all" if cuda else None,
        "use_cpu": not cuda,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "debug": False,
        "downcast_bf16": "no",
    })
    return out


def accelerate_config_notes(cfg: TrainConfig) -> dict[str, str]:
    """What the accelerate config says differently from nbtrain's run: {field: note}."""
    precision = resolve_precision(cfg.precision)
    notes: dict[str, str] = {}
    if precision == "fp8":
        notes["precision"] = ("precision='fp8': mixed_precision fp8 with fp8_config backend AO is for a Trainer / "
                              "accelerate script launched with this file (TrainingArguments bf16=False, or it "
                              "overrides fp8); accelerate's AO recipe keeps the first and the last linear layer "
                              "in bf16 and pads inner dimensions, nbtrain keeps the output layer (and any layer "
                              "whose sizes are not multiples of 16) out; nbtrain's own loop reads none of it")
    elif precision == "bf16-pure":
        notes["precision"] = ("precision='bf16-pure': mixed_precision stays 'no' (accelerate's bf16 is autocast over "
                              "fp32 weights, nbtrain's 'bf16'); a Trainer / accelerate script loads the model in "
                              "bf16 (dtype=torch.bfloat16) instead, with no autocast")
    if cfg.stochastic_rounding:
        notes["stochastic_rounding"] = ("stochastic_rounding=True: an optimizer setting, not accelerate's; nbtrain's "
                                        "own loop applies it")
    return notes


def to_accelerate_config_yaml(cfg: TrainConfig, path=None, num_processes: Optional[int] = None) -> str:
    """The accelerate config as YAML; written to ``path`` when given."""
    doc = accelerate_config(cfg, num_processes)
    header = ["accelerate config exported by nbtrain; run: accelerate launch --config_file <this file> ..."]
    if doc["mixed_precision"] == "no":
        header.append(f"mixed_precision is 'no' on purpose: nbtrain applies precision={cfg.precision!r} itself "
                      "(torch.autocast + GradScaler)")
    else:
        header.append("mixed_precision fp8 (torchao) is for a Trainer script; nbtrain's own loop converts its "
                      "linear layers to float8 itself")
    return write_text(yaml_text([(None, doc)], header, accelerate_config_notes(cfg)), path)
