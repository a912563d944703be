"""Estimate the memory a TrainConfig needs, from the model's config alone: ``estimate_memory(cfg)``.

Nothing is loaded or run. The package reads top down:

* ``facts``: the architecture's shapes and parameters (built on the ``meta`` device), and the exact parts:
  weights, gradients, optimizer state.
* ``trace``: what autograd saves in a decoder layer, traced op by op.
* ``timeline``: the phases of one training step and its peak (the total is that peak, not the sum of the parts).
* ``estimate``: the peak plus what lies outside the tensors, as a ``MemoryEstimate``.
* ``advice``: the concrete changes that make it fit (``estimate_memory``'s advice, ``oom_advice`` after a run ran
  out of memory).
* ``report``: the text and the HTML of an estimate, from one row model.

docs/memory-model.md derives the terms.
"""

from __future__ import annotations

from .._logs import defers_bitsandbytes
from ..config import TrainConfig
from .advice import advise, min_world_size, oom_advice
from .estimate import Advice, MemoryEstimate, check_estimable, estimate_once, target
from .estimate import target_fraction as estimate_target_fraction
from .rollouts import longest_prompt
from .report import EstimateReport, estimate_html, estimate_report, estimate_text, fmt_gib

__all__ = ["Advice", "EstimateReport", "MemoryEstimate", "estimate_html", "estimate_memory", "estimate_report",
           "estimate_target_fraction", "estimate_text", "fmt_gib", "format_estimate", "oom_advice"]

# the name ``nbtrain estimate`` and the tests know the text report by
format_estimate = estimate_text


@defers_bitsandbytes
def estimate_memory(cfg: TrainConfig, device_total_gib: float | None = None, *, device: str | None = None,
                    target_fraction: float | None = None, data=None, world_size: int = 1) -> MemoryEstimate:
    """Estimate the memory one training step of ``cfg`` needs, from the model config alone.

    ``device_total_gib`` defaults to this device's memory (host RAM on CPU); ``device`` ("cuda" or
    "cpu", default: the one nbtrain would use) selects the device-specific terms. When it does not
    fit, ``advice`` lists cumulative changes, each with its new estimate, stopping at the first that fits.
    A precision or method this machine cannot run is estimated all the same; explicit LoRA targets the model
    does not have raise ConfigError.

    The logits and the loss are made only at positions that carry a target (nbtrain.engine.losses). The
    estimate cannot read the data, so it counts every position unless told: ``target_fraction`` (the share of
    the B x (T - 1) positions with a target; chat data with completion-only loss: the answer tokens), or
    ``data`` (a DataBundle, e.g. ``nbtrain.data.load_data(cfg, tokenizer)``), whose examples give it.

    ``objective="grpo"``: the rollouts (G completions of a prompt sampled with the KV cache, no_grad) and the
    update (B completions of prompt + max_new_tokens tokens, the head on the completion positions) are phases of
    their own; the prompt length is ``data``'s longest prompt when it is given, else max_seq_len.

    ``world_size``: the processes the run has (micro_batch_size is per process); every number is then one
    process's: under ``sharding="fsdp"`` weights, gradients and optimizer state split world_size ways plus the
    gathered layers, else (DDP) a whole copy with its gradient buckets. ``min_world_size`` says from how many
    processes the config under fsdp fits ``device_total_gib`` each.
    """
    check_estimable(cfg)
    if int(world_size) < 1:
        raise ValueError(f"world_size: at least 1 process, got {world_size}")
    world_size = int(world_size)
    prompt_tokens = None
    if getattr(cfg, "objective", "lm") == "grpo":
        # prompts without answers: no target share to read, but their length sets the rows'
        prompt_tokens = longest_prompt(data) if data is not None else None
    elif target_fraction is None and data is not None:
        target_fraction = estimate_target_fraction(data, cfg.max_seq_len)
    where = target(device, device_total_gib, target_fraction, prompt_tokens)
    est = estimate_once(cfg, where.device, where.total_gib, where.name, target_fraction, world_size, prompt_tokens)
    est.min_world_size, est.fsdp_refused = min_world_size(cfg, where)
    if not est.fits:
        est.advice = advise(cfg, where, world_size)
    return est
