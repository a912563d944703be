"""Per-rank parts under FSDP2 (``sharding="fsdp"`` over N processes), from the architecture alone.

``fully_shard`` wraps each layer of the model's largest stack, then the root (embeddings, final norm, head: every
parameter outside the layers). Each parameter, frozen or not, is split along dim 0 into N chunks of
ceil(dim0 / N) rows (torch.chunk; rank 0 always holds a full chunk, the padded size, so these are rank 0's bytes).
Gradients are reduce-scattered after every micro-batch into one flat buffer per group (the trainable shards), and
the optimizer steps the shards. A group's full parameters are gathered in the compute dtype (the precision
table's autocast dtype becomes FSDP's MixedPrecisionPolicy.param_dtype; fp32 and bf16-pure gather what they
store), into padded buffers (N chunks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .facts import Architecture, ParameterBytes, adapters, layer_index, optimizer_state_bytes

# powers of two tried for the smallest world size that fits (MemoryEstimate.min_world_size, the advice)
WORLD_SIZES = tuple(2**k for k in range(10))   # 1 .. 512


def shard_elems(shape: Sequence[int], world: int) -> int:
    """Elements of rank 0's shard of a parameter of ``shape`` (the padded chunk of dim 0)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def gathered_elems(shape: Sequence[int], world: int) -> int:
    """Elements of the all-gather buffer of a parameter of ``shape``: N padded chunks."""
    return shard_elems(shape, world) * world


@dataclass(frozen=True)
class ShardedParts:
    """Rank 0's bytes under FSDP over ``world`` ranks."""

    world: int
    weights: int            # the parameter shards in their stored dtype
    gradients: int          # the trainable shards' gradients (the reduce-scatter output, in the weights' dtype)
    optimizer: int          # the optimizer's state of the trainable shards
    master_weights: int     # of ``weights``: the fp32 trainable shards autocast precisions compute from
    root: int               # the root group's gathered parameters (compute dtype)
    layers: tuple[int, ...]         # each layer's gathered parameters (compute dtype)
    layer_trainable: tuple[int, ...]   # each layer's trainable elements (unsharded)
    root_trainable: int     # the root's trainable elements (unsharded)
    layer_grad_shards: tuple[int, ...]  # each layer's sharded gradient bytes
    compute_bytes: int      # element size of the gathered parameters and their unsharded gradients

    def grad_transient(self, elems: int) -> int:
        """A group's unsharded gradients (compute dtype) beside the fp32 reduce-scatter input they are copied
        into, for ``elems`` trainable elements."""
        return elems * (self.compute_bytes + 4)


def fsdp_parts(cfg, arch: Architecture, params: ParameterBytes, compute_bytes: int, world: int,
               num_labels: int) -> ShardedParts:
    """Rank 0's weights, gradients, optimizer state and gathered groups for ``cfg`` over ``world`` ranks."""
    pb = params.param_bytes
    L = arch.layers
    base_shapes = arch.shapes or tuple((n,) for _, n, _ in arch.params)
    layer_params = [0] * L
    root_params = 0
    for (name, _, _), shape in zip(arch.params, base_shapes):
        idx = layer_index(name, L)
        g = gathered_elems(shape, world)
        if idx is None:
            root_params += g
        else:
            layer_params[idx] += g
    if cfg.method == "full":
        trainable_shapes = base_shapes
        all_shapes = base_shapes
        layer_train = list(layer_params)
        root_train = root_params
    else:   # LoRA (QLoRA is refused under fsdp): the frozen base is sharded too, beside the adapters
        targets = cfg.lora_targets if isinstance(cfg.lora_targets, str) else tuple(cfg.lora_targets)
        lora = adapters(cfg.model, cfg.task, num_labels, cfg.lora_r, targets)
        trainable_shapes = lora.shapes
        all_shapes = tuple(base_shapes) + tuple(lora.shapes)
        layer_train = [0] * L
        root_train = sum(lora.others.values())   # heads under modules_to_save
        for name, n in lora.adapted.items():
            idx = layer_index(name, L)
            if idx is None:
                root_train += n
            else:
                layer_train[idx] += n
        for k in range(L):
            layer_params[k] += layer_train[k]
        root_params += root_train
    weights = pb * sum(shard_elems(s, world) for s in all_shapes)
    trainable_shard = sum(shard_elems(s, world) for s in trainable_shapes)
    gradients = pb * trainable_shard
    optimizer = optimizer_state_bytes(cfg.optimizer, [_shard_shape(s, world) for s in trainable_shapes], pb)
    master = 4 * trainable_shard if params.master_weights else 0
    # each layer's share of the sharded gradients, in proportion to its trainable elements
    total_train = sum(layer_train) + root_train
    layer_grad_shards = tuple(gradients * n // total_train if total_train else 0 for n in layer_train)
    return ShardedParts(world=world, weights=weights, gradients=gradients, optimizer=optimizer,
                        master_weights=master, root=compute_bytes * root_params,
                        layers=tuple(compute_bytes * n for n in layer_params), layer_trainable=tuple(layer_train),
                        root_trainable=root_train, layer_grad_shards=layer_grad_shards,
                        compute_bytes=compute_bytes)


def _shard_shape(shape: Sequence[int], world: int) -> tuple[int, ...]:
    if not shape:
        return ()
    return (math.ceil(shape[0] / world), *shape[1:])
