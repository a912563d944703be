"""Advice: the concrete changes that make a step fit, following the out-of-memory flow.

(1) lower micro_batch_size and raise grad_accum_steps to keep the effective batch, (2) enable lean_layers
(Llama-style layers), gradient checkpointing, then the chunked loss (causal LM), (3) switch full -> LoRA -> QLoRA,
(4) shorten max_seq_len. A step is taken only when it lowers the estimate. Each item is cumulative: its ``change``
holds all overrides so far, so ``cfg.replace(**advice[k].change)`` is the config whose estimate
``advice[k].total_gib`` is; the list stops at the first that fits.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import ConfigError, TrainConfig
from .estimate import Advice, MemoryEstimate, Target, check_estimable, estimate_once, target

# what the out-of-memory advice says when there is no estimate to base it on
FALLBACK_ADVICE = ("lower micro_batch_size and raise grad_accum_steps, enable gradient_checkpointing, or switch "
                   "to method='lora'/'qlora'")


def _estimate_changed(cfg: TrainConfig, change: dict[str, Any], where: Target) -> Optional[MemoryEstimate]:
    """The estimate of ``cfg`` with ``change``, or None when that change is not allowed."""
    try:
        new = cfg.replace(**change)
    except (ConfigError, ValueError):   # an invalid combination of fields
        return None
    if where.caps is not None and new.method not in where.caps.allowed_methods:
        return None                     # this machine's device cannot run it (QLoRA without bitsandbytes)
    return estimate_once(new, where.device, where.total_gib, where.name, where.target_fraction)


def advise(cfg: TrainConfig, where: Target) -> list[Advice]:
    """The cumulative changes that make ``cfg`` fit ``where``, stopping at the first that fits (else the
    closest reachable)."""
    advice: list[Advice] = []
    change: dict[str, Any] = {}
    current = estimate_once(cfg, where.device, where.total_gib, where.name, where.target_fraction).total_gib

    def first_fit(steps: list[tuple[dict[str, Any], str]]) -> bool:
        """Take the first candidate that fits, else the smallest one if it helps; True once it fits."""
        nonlocal current
        tried = []
        for step, desc in steps:
            est = _estimate_changed(cfg, {**change, **step}, where)
            if est is not None:
                tried.append((step, desc, est))
                if est.fits:
                    break
        if not tried:
            return False
        step, desc, est = next((t for t in tried if t[2].fits), min(tried, key=lambda t: t[2].total_gib))
        if est.total_gib >= current:
            return False
        change.update(step)
        current = est.total_gib
        advice.append(Advice(dict(change), desc, est.total_gib, est.fits))
        return est.fits

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
    # 2c. the loss chunk by chunk (nbtrain's chunked_loss): the vocabulary-sized logits never exist whole
    if cfg.task == "causal-lm" and not cfg.chunked_loss and first_fit(
            [({"chunked_loss": True}, f"chunked_loss on (the output layer and loss {cfg.loss_chunk_tokens} "
                                      "tokens at a time; same loss)")]):
        return advice
    # 3. full -> LoRA -> QLoRA
    order = ["full", "lora", "qlora"]
    for method in order[order.index(cfg.method) + 1:]:
        desc = {"lora": f"method {cfg.method} -> lora (rank-{cfg.lora_r} adapters, frozen base)",
                "qlora": f"method -> qlora (frozen {cfg.quant_bits}-bit base, rank-{cfg.lora_r} adapters)"}[method]
        if first_fit([({"method": method}, desc)]):
            return advice
    # 4. shorter sequences
    seqs, t = [], cfg.max_seq_len
    while t > 8:
        t = max(8, t // 2)
        seqs.append(t)
    first_fit([({"max_seq_len": t}, f"max_seq_len {cfg.max_seq_len} -> {t} (longer texts are truncated)")
               for t in seqs])
    return advice


def oom_advice(cfg: TrainConfig) -> list[str]:
    """What to change after ``cfg`` ran out of memory on this machine: the advice for a 25% smaller peak than
    estimated (or than the device has, when the estimate is above it). Never raises: advice is a courtesy that
    must not mask the real stop reason, so without an estimate it is the general advice."""
    try:
        check_estimable(cfg)
        where = target(None, None)
        est = estimate_once(cfg, where.device, where.total_gib, where.name)
        smaller = Target(where.device, min(est.total_gib, where.total_gib) * 0.75, where.name, where.caps)
        return [a.description for a in advise(cfg, smaller)]
    except Exception as e:
        return [f"(no estimate available: {type(e).__name__}: {e}) {FALLBACK_ADVICE}"]
