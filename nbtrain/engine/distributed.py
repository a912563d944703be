"""Several processes, the same loop: DDP or FSDP2 under torchrun or accelerate launch (DESIGN rule 6).

The launcher sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; nothing here launches processes.
Mixed precision stays nbtrain's own torch.amp, identical to a single process; under FSDP the precision table's
compute dtype also becomes FSDP's MixedPrecisionPolicy (parameters gathered in it, gradients reduced in fp32).
What differs between one process, DDP and FSDP lives here (wrap, no_sync, the gradient norm, local views of
sharded tensors, the scaler), so the loop has no "distributed?" branch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..data import collate
from ..models.loading import layer_stack
from ..precision import make_scaler


def grad_norm(params: list[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
    """Total L2 norm of the (already unscaled) gradients; clips in place when max_norm is set."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(torch.nn.utils, "get_total_norm"):   # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads)
    return torch.nn.utils.clip_grad_norm_(params, float("inf"))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of an FSDP parameter or gradient (a DTensor), else ``t``.

    What samples a tensor element-wise (the doctor, the tensor counter) reads this, so no slice of a sharded
    tensor turns into a collective."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class SingleProcess:
    """One process: the no-op case of distributed, as a disabled GradScaler is of loss scaling.

    Every method the loop calls exists here and does nothing, so the loop has no "is this distributed?" branch.
    """

    rank, world = 0, 1
    sharded = False   # whether each rank holds only a shard of the weights (FSDP)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def make_scaler(self, spec, device: str) -> torch.amp.GradScaler:
        return make_scaler(spec, device)

    def grad_norm(self, params: list[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
        return grad_norm(params, max_norm)

    def broadcast(self, obj):
        return obj

    def barrier(self) -> None:
        pass

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

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (a plain Python object)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

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


class FSDPContext(DistContext):
    """This process's place in an FSDP2 group: every rank holds 1/world of the weights, gradients and optimizer
    state; a layer's weights are gathered for its forward and backward only."""

    sharded = True

    def __init__(self, rank: int, world: int, local_rank: int, created_group: bool, device: str,
                 param_dtype: Optional[torch.dtype], reshard_after_forward: bool):
        super().__init__(rank, world, local_rank, created_group)
        self.device, self.param_dtype, self.reshard = device, param_dtype, reshard_after_forward

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` each layer of the model's largest stack, then the root (embeddings, norm, head), in
        place: frozen weights are sharded too. Weights on the CPU move to this rank's device as they are sharded,
        so no GPU ever holds the whole model."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device, (self.world,))
        # Parameters are gathered in the compute dtype (half the traffic under bf16/fp16) and gradients reduced in
        # fp32, so the sharded fp32 master weights see what the unsharded run's would.
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for block in layer_stack(model):
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=self.reshard)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=self.reshard)
        return model

    def make_scaler(self, spec, device: str) -> torch.amp.GradScaler:
        """fp16: a GradScaler whose inf check is all-reduced, so a step skipped on one rank is skipped on all (each
        rank sees only its shard of the gradients)."""
        if not spec.scaler:
            return make_scaler(spec, device)
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device, enabled=True)

    def no_sync(self, model: torch.nn.Module, last: bool):
        # Gradients are reduce-scattered after every micro-batch and accumulate sharded: holding them unsharded
        # across micro-batches (DDP's no_sync) would keep a whole model's gradients on every rank.
        return contextlib.nullcontext()

    def grad_norm(self, params: list[torch.Tensor], max_norm: Optional[float]) -> torch.Tensor:
        """The global pre-clip L2 norm over every rank's shards (equal to the unsharded run's); clips in place."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        sq = torch.zeros((), device=grads[0].device if grads else self.device, dtype=torch.float32)
        if grads:
            sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)   # each element lives on exactly one rank
        norm = sq.sqrt()
        if max_norm and grads:
            # as clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm


def init_distributed(device: str, sharding: str = "none", spec=None,
                     reshard_after_forward: bool = True) -> SingleProcess:
    """Join the process group the launcher describes; a SingleProcess when running as one process.

    ``sharding="fsdp"`` gives an FSDPContext, also for a single process a launcher started (torchrun
    --nproc_per_node 1: what FSDP itself costs); a plain single process has nothing to shard."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "RANK" in os.environ and "MASTER_ADDR" in os.environ
    if world <= 1 and not (sharding == "fsdp" and launched):
        return SingleProcess()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    created = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")
        created = True
    if sharding == "fsdp":
        return FSDPContext(rank, world, local_rank, created, device,
                           spec.autocast_dtype if spec is not None else None, reshard_after_forward)
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
