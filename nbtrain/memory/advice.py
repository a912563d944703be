"""Advice: the concrete changes that make a step fit, following the out-of-memory flow.

(0) DPO on a full fine-tune: precompute_ref instead of a frozen reference copy, (1) lower micro_batch_size and
raise grad_accum_steps to keep the effective batch, (2) enable lean_layers
(Llama-style layers) and gradient checkpointing, (3) shard with FSDP over the fewest processes that make it fit
(the run's numbers unchanged; it needs that many GPUs), (4) the chunked loss (causal LM; not under fsdp), (5) switch
full -> LoRA -> QLoRA, (6) shorten max_seq_len. A step is taken only when it lowers the estimate. Each item is cumulative: its ``change``
holds all overrides so far, so ``cfg.replace(**advice[k].change)`` is the config whose estimate
``advice[k].total_gib`` is; the list stops at the first that fits.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import ConfigError, TrainConfig
from .estimate import Advice, MemoryEstimate, Target, check_estimable, estimate_once, target
from .sharding import WORLD_SIZES
from .timeline import reference_copy

# what the out-of-memory advice says when there is no estimate to base it on
FALLBACK_ADVICE = ("lower micro_batch_size and raise grad_accum_steps, enable gradient_checkpointing, or switch "
                   "to method='lora'/'qlora'")


def _estimate_changed(cfg: TrainConfig, change: dict[str, Any], where: Target,
                      world_size: int = 1) -> Optional[MemoryEstimate]:
    """The estimate of ``cfg`` with ``change`` for one of ``world_size`` processes, or None when that change is
    not allowed."""
    try:
        new = cfg.replace(**change)
    except (ConfigError, ValueError):   # an invalid combination of fields
        return None
    if where.caps is not None and new.method not in where.caps.allowed_methods:
        return None                     # this machine's device cannot run it (QLoRA without bitsandbytes)
    return estimate_once(new, where.device, where.total_gib, where.name, where.target_fraction, world_size,
                         where.prompt_tokens)


# the processes of a CPU run split one machine's memory: more of them make nothing fit
CPU_SHARED = "a CPU run's processes share one machine's memory"


def fsdp_refusal(cfg: TrainConfig) -> str:
    """Why ``cfg`` cannot run under sharding="fsdp" ("" when it can)."""
    if cfg.task == "image-classification":
        return "the image-classification estimate is for one process"
    try:
        cfg.replace(sharding="fsdp")
    except (ConfigError, ValueError) as e:
        return str(e).splitlines()[0]
    return ""


def min_world_size(cfg: TrainConfig, where: Target) -> tuple[Optional[int], str]:
    """(the smallest world size in 1, 2, 4, ... 512 at which ``cfg`` under sharding="fsdp" fits ``where`` per
    rank, or None; why fsdp cannot run ``cfg``, or "")."""
    why = fsdp_refusal(cfg) if where.device == "cuda" else CPU_SHARED
    if why:
        return None, why
    sharded = cfg.replace(sharding="fsdp")
    for n in WORLD_SIZES:
        if estimate_once(sharded, where.device, where.total_gib, where.name, where.target_fraction, n).fits:
            return n, ""
    return None, ""


def fsdp_description(n: int) -> str:
    return (f"sharding='fsdp' over {n} processes (weights, gradients and optimizer state split {n} ways; "
            f"needs {n} GPUs)")


def advise(cfg: TrainConfig, where: Target, world_size: int = 1) -> list[Advice]:
    """The cumulative changes that make ``cfg`` fit ``where`` (as one of ``world_size`` processes), stopping at
    the first that fits (else the closest reachable)."""
    advice: list[Advice] = []
    change: dict[str, Any] = {}
    world = world_size
    current = estimate_once(cfg, where.device, where.total_gib, where.name, where.target_fraction,
                            world, where.prompt_tokens).total_gib

    def first_fit(steps: list[tuple[dict[str, Any], str]], worlds: Optional[list[int]] = None) -> bool:
        """Take the first candidate that fits, else the smallest one if it helps; True once it fits. ``worlds``:
        each candidate's world size (default: the current one)."""
        nonlocal current, world
        tried = []
        for k, (step, desc) in enumerate(steps):
            n = worlds[k] if worlds else world
            est = _estimate_changed(cfg, {**change, **step}, where, n)
            if est is not None:
                tried.append((step, desc, est, n))
                if est.fits:
                    break
        if not tried:
            return False
        step, desc, est, n = next((t for t in tried if t[2].fits), min(tried, key=lambda t: t[2].total_gib))
        if est.total_gib >= current:
            return False
        change.update(step)
        current, world = est.total_gib, n
        advice.append(Advice(dict(change), desc, est.total_gib, est.fits, world))
        return est.fits

    # 0. DPO on a full fine-tune: the reference log-probs computed once before training instead of a frozen copy
    # of the model held all run (the same reference, one extra forward pass over the data, no copy)
    if reference_copy(cfg) and first_fit(
            [({"precompute_ref": True}, "precompute_ref on (DPO's reference log-probs computed once before "
                                        "training: no frozen copy of the model)")]):
        return advice
    # 1. a smaller micro-batch and more accumulation, so the effective batch stays the same
    mb, accum = cfg.micro_batch_size, cfg.grad_accum_steps
    smaller = [d for d in range(mb - 1, 0, -1) if mb % d == 0]
    if first_fit([({"micro_batch_size": d, "grad_accum_steps": accum * (mb // d)},
                   f"micro_batch_size {mb} -> {d}, grad_accum_steps {accum} -> {accum * (mb // d)} "
                   f"(same effective batch {cfg.effective_batch_size})")
                  for d in smaller]):
        return advice
    # 2. lean layers: the MLP and the norms recompute their cheap intermediates (a few % of the time, where
    # checkpointing costs ~30%); no change for other architectures or under compile, so first_fit skips it there
    if not cfg.lean_layers and first_fit(
            [({"lean_layers": True}, "lean_layers on (MLP and norms recompute SiLU, product, normalised input; "
                                     "same results)")]):
        return advice
    # 2b. gradient checkpointing: keep each layer's input only, recompute the rest in backward
    if not cfg.gradient_checkpointing and first_fit(
            [({"gradient_checkpointing": True}, "gradient_checkpointing on (~30% more compute)")]):
        return advice
    # 3. FSDP over the fewest processes (more than the run has) that make it fit: the run's numbers stay the
    # same. Offered only when it makes it fit: a partial sharding would rule out the chunked loss and QLoRA.
    if cfg.task != "image-classification" and where.device == "cuda":
        more = [n for n in WORLD_SIZES if n > world or (n == world and cfg.sharding != "fsdp" and n > 1)]
        for n in more:
            est = _estimate_changed(cfg, {**change, "sharding": "fsdp"}, where, n)
            if est is None:
                break
            if est.fits:
                first_fit([({"sharding": "fsdp"}, fsdp_description(n))], [n])
                return advice
    # 4. the loss chunk by chunk (nbtrain's chunked_loss): the vocabulary-sized logits never exist whole
    if cfg.task == "causal-lm" and not cfg.chunked_loss and first_fit(
            [({"chunked_loss": True}, f"chunked_loss on (the output layer and loss {cfg.loss_chunk_tokens} "
                                      "tokens at a time; same loss)")]):
        return advice
    # 5. full -> LoRA -> QLoRA
    order = ["full", "lora", "qlora"]
    for method in order[order.index(cfg.method) + 1:]:
        desc = {"lora": f"method {cfg.method} -> lora (rank-{cfg.lora_r} adapters, frozen base)",
                "qlora": f"method -> qlora (frozen {cfg.quant_bits}-bit base, rank-{cfg.lora_r} adapters)"}[method]
        if first_fit([({"method": method}, desc)]):
            return advice
    # 6. shorter sequences
    seqs, t = [], cfg.max_seq_len
    while t > 8:
        t = max(8, t // 2)
        seqs.append(t)
    first_fit([({"max_seq_len": t}, f"max_seq_len {cfg.max_seq_len} -> {t} (longer texts are truncated)")
               for t in seqs])
    return advice


def oom_advice(cfg: TrainConfig, world_size: int = 1) -> list[str]:
    """What to change after ``cfg`` ran out of memory on this machine (as one of ``world_size`` processes): the
    advice for a 25% smaller peak than estimated (or than the device has, when the estimate is above it). Never
    raises: advice is a courtesy that must not mask the real stop reason, so without an estimate it is the
    general advice."""
    try:
        check_estimable(cfg)
        where = target(None, None)
        est = estimate_once(cfg, where.device, where.total_gib, where.name, None, world_size)
        smaller = Target(where.device, min(est.total_gib, where.total_gib) * 0.75, where.name, where.caps)
        return [a.description for a in advise(cfg, smaller, world_size)]
    except Exception as e:
        return [f"(no estimate available: {type(e).__name__}: {e}) {FALLBACK_ADVICE}"]
