"""The learning-rate schedules, as the Hugging Face Trainer computes them (``transformers.get_scheduler``'s
``constant``, ``constant_with_warmup``, ``linear`` and ``cosine``), step for step.

Kept here rather than imported: ``transformers.optimization`` imports peft, and peft imports bitsandbytes, so
every run, LoRA or not, paid both imports (and bitsandbytes' Hub kernel lookup on some CPUs) for four formulas.
``tests/test_schedules.py`` holds them equal to transformers' own at every step.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "linear", "cosine")


def _warmup(step: int, warmup: int) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int, *, warmup: int, total: int) -> float:
    return _warmup(step, warmup) if step < warmup else 1.0


def _linear(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, *, warmup: int, total: int) -> float:
    if step < warmup:
        return _warmup(step, warmup)
    progress = float(step - warmup) / float(max(1, total - warmup))
    # half a cosine wave (the Trainer's num_cycles=0.5): from the peak to zero at the last step
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def make_scheduler(name: str, optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` for ``name`` ("constant", "linear" or "cosine"), with ``warmup_steps``
    of linear warm-up from 0 (the Trainer's "constant" ignores warm-up; nbtrain's is its constant_with_warmup)."""
    fns = {"constant": _constant, "linear": _linear, "cosine": _cosine}
    if name not in fns:
        raise ValueError(f"scheduler: must be one of {', '.join(SCHEDULES)}, got {name!r}")
    # a partial, as the Trainer's: LambdaLR's state_dict then has the same shape, and old checkpoints load
    return LambdaLR(optimizer, partial(fns[name], warmup=warmup_steps, total=total_steps))
