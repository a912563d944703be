"""accelerate: a config file for ``accelerate launch --config_file FILE`` running nbtrain on several processes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ...config import TrainConfig
from .mapping import write_text, yaml_text


def accelerate_config(cfg: TrainConfig, num_processes: Optional[int] = None) -> dict[str, Any]:
    """An ``accelerate launch --config_file`` dict: one machine, ``num_processes`` processes (default: the
    visible GPUs, else 1), DDP when there are several.

    ``mixed_precision`` is ``"no"`` on purpose: nbtrain's loop applies ``cfg.precision`` itself with
    ``torch.autocast`` and a GradScaler (DESIGN rule 6). accelerate's own mixed precision would add a
    second autocast and scaler around it, and it is process-wide, so it could not follow the config.
    """
    cuda = torch.cuda.is_available()
    n = int(num_processes) if num_processes else max(1, torch.cuda.device_count() if cuda else 1)
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("MULTI_GPU" if cuda else "MULTI_CPU") if n > 1 else "NO",
        "mixed_precision": "no",
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
    }


def to_accelerate_config_yaml(cfg: TrainConfig, path=None, num_processes: Optional[int] = None) -> str:
    """The accelerate config as YAML; written to ``path`` when given."""
    header = ["accelerate config exported by nbtrain; run: accelerate launch --config_file <this file> ...",
              f"mixed_precision is 'no' on purpose: nbtrain applies precision={cfg.precision!r} itself "
              "(torch.autocast + GradScaler)"]
    return write_text(yaml_text([(None, accelerate_config(cfg, num_processes))], header, {}), path)


