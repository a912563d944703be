"""GRPO's arithmetic: group-relative advantages, the clipped per-token objective under each normalization, and the
sampler/trainer mismatch statistics. Pure functions of tensors; ``grpo_run`` feeds them from the loop.

Normalizations, as TRL's GRPOConfig defines ``loss_type``:

- ``"grpo"``: each completion's token losses averaged over its own tokens, then averaged over the completions;
- ``"dr_grpo"``: every token loss summed, divided by completions x ``max_completion_len`` (no length bias);
- ``"dapo"``: every token loss summed, divided by the tokens of all completions of the optimizer step.

Every one is written as a sum over a micro-batch divided by a count over the whole step (``units``), so that an
optimizer step cut into micro-batches gives the loss, and the gradient, of the same step taken at once: the loop
divides each micro-batch's sum by the step's units, as it does for next-token losses (DESIGN rule 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> tuple[torch.Tensor, float]:
    """Each reward minus its group's mean, divided by the group's standard deviation when ``scale`` (``rewards``:
    one per completion, the ``group_size`` completions of a prompt next to each other). A group whose rewards are
    all equal carries no signal: its advantages are 0. Returns ``(advantages, frac_zero_std)``, the share of
    groups with a zero std."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"num_generations: {rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size).to(torch.float64)
    centred = r - r.mean(dim=1, keepdim=True)
    # the unbiased std, as TRL's (torch.std's default); one completion per group has none: no signal either
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
    flat = std.squeeze(1) == 0
    scaled = centred / std.clamp_min(torch.finfo(torch.float64).tiny) if scale else centred
    adv = torch.where(std > 0, scaled, torch.zeros_like(r))
    out = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.reshape(-1).to(out), float(flat.float().mean())


def loss_units(kind: str, mask: torch.Tensor, max_completion_len: int) -> float:
    """What a micro-batch adds to its step's divisor under ``kind``: completions ("grpo"), completions x
    ``max_completion_len`` ("dr_grpo") or completion tokens ("dapo"). ``mask``: (completions, tokens), 1 where a
    token is a completion token."""
    _check_kind(kind)
    n = mask.shape[0]
    if kind == "grpo":
        return float(n)
    if kind == "dr_grpo":
        return float(n * max_completion_len)
    return float(mask.sum())


@dataclass
class GrpoTerms:
    """One micro-batch's objective: ``loss_sum`` (divide by the step's units), and what the records report."""

    loss_sum: torch.Tensor
    clipped_tokens: torch.Tensor   # tokens whose ratio the clip held (the min took the clipped side)
    kl_sum: torch.Tensor           # the k3 KL to the reference over the completion tokens (0 without one)
    tokens: torch.Tensor


def grpo_terms(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               kind: str = "grpo", epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
               ref_logp: torch.Tensor | None = None, token_weights: torch.Tensor | None = None) -> GrpoTerms:
    """The clipped surrogate of a micro-batch: per token ``-min(ratio x A, clip(ratio, 1 - eps, 1 + eps_high) x A)``
    with ``ratio = exp(logp - old_logp)`` (1 on the first update of a batch whose old log-probs are the trainer's
    own), plus ``beta`` x the k3 KL to the reference. ``logp``/``old_logp``/``ref_logp``/``mask``: (completions,
    tokens); ``advantages``: one per completion; ``token_weights`` (detached, (completions, tokens)): each token's
    surrogate times its weight (truncated importance sampling). Under "grpo" each completion's sum is divided by its
    own token count here (the step divides by completions); under the others the token sum is returned as it is."""
    _check_kind(kind)
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.to(per_token.dtype)
    kl = torch.zeros_like(per_token)
    if beta and ref_logp is not None:
        kl = k3(ref_logp, logp)   # KL(policy || reference), estimated on the policy's own samples
        per_token = per_token + beta * kl
    if kind == "grpo":
        loss_sum = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1)).sum()
    else:
        loss_sum = (per_token * mask).sum()
    held = ((clipped < unclipped) & (mask > 0)).sum()
    return GrpoTerms(loss_sum, held.detach(), (kl * mask).sum().detach(), mask.sum().detach())


def k3(logp_q: torch.Tensor, logp_p: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(p || q) per sample drawn from p: ``r - 1 - log r`` with ``r = q / p``; never
    negative, unbiased."""
    log_r = logp_q - logp_p
    return torch.exp(log_r) - 1 - log_r


@dataclass
class Mismatch:
    """The sampler's log-probs of its own tokens against the trainer's for the same tokens (StepRecord's fields)."""

    mismatch_mean: float   # mean |log p_sampler - log p_trainer| per completion token, nats
    mismatch_max: float
    mismatch_kl: float     # the k3 estimate of KL(sampler || trainer) per token
    is_ratio_min: float    # p_trainer / p_sampler over the tokens
    is_ratio_mean: float
    is_ratio_max: float


def mismatch(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> Mismatch:
    """How far the trainer's teacher-forced log-probs lie from the sampler's, over the completion tokens of
    ``mask`` (the tokens were drawn from the sampler, so KL(sampler || trainer) is what k3 estimates)."""
    keep = mask.bool()
    s, t = sampler_logp.detach().double()[keep], trainer_logp.detach().double()[keep]
    if s.numel() == 0:
        nan = float("nan")
        return Mismatch(nan, nan, nan, nan, nan, nan)
    diff, ratio = (s - t).abs(), torch.exp(t - s)
    return Mismatch(float(diff.mean()), float(diff.max()), float(k3(t, s).mean()), float(ratio.min()),
                    float(ratio.mean()), float(ratio.max()))


def _check_kind(kind: str) -> None:
    if kind not in GRPO_LOSSES:
        raise ValueError(f"grpo_loss: must be one of {GRPO_LOSSES}, got {kind!r}")
