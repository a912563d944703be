"""GRPO's rollouts: a prompt's group of sampled completions, with the sampler's own log-probs of the tokens it drew,
and the trainer's teacher-forced log-probs of the same tokens. Their difference is the sampler/trainer mismatch.

The sampler decodes incrementally with the KV cache, under the sampling precision's autocast, and records the
log-prob of each drawn token under the distribution it was drawn from (logits / temperature, then top-p). The
trainer scores the whole sequence in one forward under the training precision with the same temperature (and no
top-p, as TRL's trainer scores it: the truncation is part of what the trainer does not see).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..precision import autocast
from .sampling import _device_of, _forward_kwargs


@dataclass
class Rollout:
    """``G`` completions of one prompt. ``completion_ids``, ``mask`` and ``sampler_logp`` are (G, T): a token
    after a completion's stop token is padding (mask 0, log-prob 0); the stop token itself counts."""

    prompt_ids: list[int]
    completion_ids: torch.Tensor
    mask: torch.Tensor
    sampler_logp: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.mask.sum(dim=1).tolist()]


def _filtered(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a token is drawn from: ``logits / temperature``, the tokens outside the top-p
    nucleus removed (the most likely token always stays), renormalized."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()   # the mass of the tokens ranked above
        drop = before >= top_p
        drop[..., 0] = False
        logp = logp.scatter(-1, order, sorted_logp.masked_fill(drop, float("-inf")))
        logp = torch.log_softmax(logp, dim=-1)
    return logp


@torch.no_grad()
def sample_group(model, prompt_ids: list[int], group: int, max_new_tokens: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, stops: frozenset[int] | set[int] = frozenset(), pad_id: int = 0, spec=None,
                 generator: Optional[torch.Generator] = None) -> Rollout:
    """``group`` completions of ``prompt_ids`` drawn from ``model`` with its KV cache (eval mode for the call,
    the previous mode after it), each up to ``max_new_tokens`` or a token of ``stops``; the forwards under
    ``spec``'s autocast (None: the model's dtype). ``generator`` makes the draws repeatable."""
    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0 to sample, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")
    device = _device_of(model)
    was_training = model.training
    model.eval()
    cache_kw, extra = _forward_kwargs(model)
    tokens, logps = [], []
    done = torch.zeros(group, dtype=torch.bool, device=device)
    alive = []
    try:
        with autocast(spec, device.type) if spec else contextlib.nullcontext():
            x = torch.tensor([prompt_ids] * group, dtype=torch.long, device=device)
            past = None
            for _ in range(max_new_tokens):
                res = model(input_ids=x, use_cache=True, **{cache_kw: past}, **extra)
                past = getattr(res, cache_kw, None)
                logp = _filtered(res.logits[:, -1], temperature, top_p)
                nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
                alive.append(~done)
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
                tokens.append(nxt)
                logps.append(logp.gather(1, nxt.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0))
                done = done | torch.tensor([int(t) in stops for t in nxt.tolist()], device=device)
                if bool(done.all()):
                    break
                if past is None:   # a model without a cache: the whole sequence again
                    x = torch.cat([torch.tensor([prompt_ids] * group, device=device), torch.stack(tokens, 1)], 1)
                else:
                    x = nxt.unsqueeze(1)
    finally:
        model.train(was_training)
    return Rollout(list(prompt_ids), torch.stack(tokens, 1), torch.stack(alive, 1).float(), torch.stack(logps, 1))


def teacher_forced_logp(model, rollout: Rollout, *, temperature: float = 1.0, spec=None) -> torch.Tensor:
    """The log-probs ``model`` gives each completion token of ``rollout`` in one forward over prompt + completion
    (its current mode: train for the trainer's pass), under ``spec``'s autocast; (G, T), 0 on padding. Keeps the
    graph: the GRPO loss backpropagates through it."""
    device = _device_of(model)
    g, t = rollout.completion_ids.shape
    prompt = torch.tensor([rollout.prompt_ids] * g, dtype=torch.long, device=device)
    ids = torch.cat([prompt, rollout.completion_ids.to(device)], dim=1)
    attention = torch.cat([torch.ones_like(prompt), rollout.mask.to(device).long()], dim=1)
    with autocast(spec, device.type) if spec else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=attention).logits
    # the logit at position i predicts token i + 1: the completion's tokens are predicted from P - 1 on
    p = prompt.shape[1]
    logp = torch.log_softmax(logits[:, p - 1:p - 1 + t].float() / temperature, dim=-1)
    picked = logp.gather(-1, rollout.completion_ids.to(device).unsqueeze(-1)).squeeze(-1)
    return picked * rollout.mask.to(device)
