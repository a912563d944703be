"""accelerate: a config file for ``accelerate launch --config_file FILE`` running nbtrain on several processes (or a
Trainer script of the training-args export)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...config import TrainConfig
from ...hardware import resolve_precision
from .mapping import FSDP_STATE_DICT, FSDP_WRAP, fsdp_layer_class, reshard_note, write_text, yaml_text

# what ``accelerate launch`` (1.15) sets in each process's environment from this file's fsdp_config, beside
# torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT: nbtrain's worker
# adopts sharding="fsdp" from ACCELERATE_USE_FSDP and reshard_after_forward from FSDP_RESHARD_AFTER_FORWARD
ACCELERATE_FSDP_ENV = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_AUTO_WRAP_POLICY",
                       "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_STATE_DICT_TYPE", "FSDP_OFFLOAD_PARAMS",
                       "FSDP_CPU_RAM_EFFICIENT_LOADING", "FSDP_SYNC_MODULE_STATES", "FSDP_ACTIVATION_CHECKPOINTING",
                       "FSDP_SHARDING_STRATEGY", "FSDP_MIN_NUM_PARAMS", "FSDP_FORWARD_PREFETCH",
                       "FSDP_USE_ORIG_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")


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

    How ``accelerate launch`` starts the processes follows ``distributed_type`` (accelerate 1.15): FSDP and MULTI_GPU
    go through torchrun (N processes with RANK / WORLD_SIZE / MASTER_ADDR), MULTI_CPU through mpirun and only with
    an mpirun hostfile, else as one plain process. So several processes on a machine without CUDA are MULTI_GPU
    with ``use_cpu: true`` (the processes join over gloo; "GPU" names only the launcher), and sharding="fsdp" is
    FSDP on CPU and GPU alike (checked on CPU: both start N ranks). Writing this file and passing
    ``--config_file`` is all a launch needs.

    sharding="fsdp": ``distributed_type: FSDP`` with ``fsdp_config`` (FSDP2, each decoder layer wrapped, its class
    named when the architecture can be read here, ``fsdp_reshard_after_forward``, sharded checkpoints, every process
    loading the weights as nbtrain's do). ``accelerate launch`` hands these to each process as environment variables
    (``ACCELERATE_FSDP_ENV``); nbtrain's worker adopts sharding="fsdp" and reshard_after_forward from them when its
    config says sharding="none". Activation checkpointing stays the script's (cfg.gradient_checkpointing; the
    training-args export puts it in its own fsdp_config), so it is never applied twice.
    """
    cuda = torch.cuda.is_available()
    n = int(num_processes) if num_processes else max(1, torch.cuda.device_count() if cuda else 1)
    fp8 = resolve_precision(cfg.precision) == "fp8"
    fsdp = cfg.sharding == "fsdp"
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        # MULTI_GPU also on CPU: MULTI_CPU would start a single process (see above)
        "distributed_type": "FSDP" if fsdp else "MULTI_GPU" if n > 1 else "NO",
        "mixed_precision": "fp8" if fp8 else "no",
    }
    if fp8:
        out["fp8_config"] = {"backend": "AO"}
    if fsdp:
        conf: dict[str, Any] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": FSDP_WRAP}
        layer = fsdp_layer_class(cfg)
        if layer:   # else accelerate wraps the model's _no_split_modules
            conf["fsdp_transformer_layer_cls_to_wrap"] = layer
        conf.update(fsdp_reshard_after_forward=cfg.reshard_after_forward, fsdp_state_dict_type=FSDP_STATE_DICT,
                    fsdp_offload_params=False,
                    # every process loads the weights, as nbtrain's do (True would need sync_module_states)
                    fsdp_cpu_ram_efficient_loading=False, fsdp_activation_checkpointing=False)
        out["fsdp_config"] = conf
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
    if cfg.sharding == "fsdp":
        why = ["sharding='fsdp': nbtrain's loop shards with FSDP2 itself (reading the launcher's FSDP settings); a "
               "Trainer script launched with this file gets accelerate's FSDP2"]
        if precision in ("bf16", "fp16", "fp8"):
            why.append("there the gradients are reduced in the parameters' dtype, nbtrain reduces them in float32")
        if not fsdp_layer_class(cfg):
            why.append("the decoder layer class could not be read here (the model is not cached), so "
                       "fsdp_transformer_layer_cls_to_wrap is left out and accelerate wraps the model's "
                       "_no_split_modules")
        notes["sharding"] = "; ".join(why)
    notes.update(reshard_note(cfg))
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
