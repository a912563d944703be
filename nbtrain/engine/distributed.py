"""Several processes, the same loop: DDP under torchrun or accelerate launch (DESIGN rule 6).

The launcher sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; nothing here launches processes.
Mixed precision stays nbtrain's own torch.amp, identical to a single process.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    created_group: bool


def init_distributed(device: str) -> DistContext | None:
    """Join the process group the launcher describes; None when running as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
        created = True
    return DistContext(rank, world, local_rank, created)


def close_distributed(ctx: DistContext) -> None:
    """Leave the process group if this run created it."""
    if ctx.created_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def wrap_ddp(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """DistributedDataParallel around the model (gradients averaged over ranks on the synced backward)."""
    dev = next(model.parameters()).device
    ids = [ctx.local_rank] if dev.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def shard(mb, data, rank: int, world: int):
    """This rank's rows of a global micro-batch (strided, so short batches spread evenly over ranks).

    A rank left with no rows gets one real row marked ``n_targets=0`` so it still joins the all-reduce;
    the loop multiplies its loss by zero.
    """
    from ..data import collate

    idx = mb.indices[rank::world]
    if idx:
        return collate([data.train[i] for i in idx], data.pad_token_id, data.task, indices=idx)
    filler = collate([data.train[mb.indices[0]]], data.pad_token_id, data.task, indices=())
    return dataclasses.replace(filler, n_targets=0, n_tokens=0)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks, in place."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def agree(flag: bool, ctx: DistContext) -> bool:
    """True on every rank when it is True on any rank (a stop asked for on rank 0 stops them all)."""
    dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
