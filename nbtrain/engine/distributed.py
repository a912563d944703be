"""Several processes, the same loop: DDP under torchrun or accelerate launch (DESIGN rule 6).

The launcher sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; nothing here launches processes.
Mixed precision stays nbtrain's own torch.amp, identical to a single process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from ..data import collate


class SingleProcess:
    """One process: the no-op case of distributed, as a disabled GradScaler is of loss scaling.

    Every method the loop calls exists here and does nothing, so the loop has no "is this distributed?" branch.
    """

    rank, world = 0, 1

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def shard(self, micro: list, data) -> list:
        return micro

    def no_sync(self, model: torch.nn.Module, last: bool):
        return contextlib.nullcontext()

    def global_sum(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def agree(self, flag: bool) -> bool:
        return flag

    def close(self) -> None:
        pass


class DistContext(SingleProcess):
    """This process's place in the group a launcher started (DDP)."""

    def __init__(self, rank: int, world: int, local_rank: int, created_group: bool):
        self.rank, self.world, self.local_rank, self.created_group = rank, world, local_rank, created_group

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DistributedDataParallel around the model (gradients averaged over ranks on the synced backward)."""
        dev = next(model.parameters()).device
        ids = [self.local_rank] if dev.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def shard(self, micro: list, data) -> list:
        return [shard(mb, data, self.rank, self.world) for mb in micro]

    def no_sync(self, model: torch.nn.Module, last: bool):
        """All-reduce gradients only on the step's last micro-batch."""
        return contextlib.nullcontext() if last else model.no_sync()

    def global_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """DDP averages gradients over ranks; x world makes that the global sum."""
        return loss * self.world

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks, in place."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def agree(self, flag: bool) -> bool:
        """True on every rank when it is True on any rank (a stop asked for on rank 0 stops them all)."""
        dev = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([1.0 if flag else 0.0], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def close(self) -> None:
        """Leave the process group if this run created it."""
        if self.created_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def init_distributed(device: str) -> SingleProcess:
    """Join the process group the launcher describes; a SingleProcess when running as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SingleProcess()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
        created = True
    return DistContext(rank, world, local_rank, created)


def shard(mb, data, rank: int, world: int):
    """This rank's rows of a global micro-batch (strided, so short batches spread evenly over ranks).

    A rank left with no rows gets one real row marked ``n_targets=0`` so it still joins the all-reduce;
    the loop multiplies its loss by zero.
    """
    idx = mb.indices[rank::world]
    if idx:
        return collate([data.train[i] for i in idx], data.pad_token_id, data.task, indices=idx)
    filler = collate([data.train[mb.indices[0]]], data.pad_token_id, data.task, indices=())
    return dataclasses.replace(filler, n_targets=0, n_tokens=0)
