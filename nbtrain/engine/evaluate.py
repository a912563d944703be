"""Evaluation on the held-out examples, with the training step's own loss."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..data import iter_steps
from ..precision import autocast
from .losses import loss_sum, micro_loss_sum


@torch.no_grad()
def evaluate(model, examples: list[dict], task: str, pad_token_id: int, batch_size: int,
             spec, device: str, chunk_tokens: Optional[int] = None) -> dict[str, float]:
    """Mean loss per target token (and accuracy for classification, text or image) on ``examples``.

    ``chunk_tokens`` (causal LM): the loss chunk by chunk, as in training with ``chunked_loss``, so that an
    evaluation never needs the full logits a chunked training run was set up to avoid.
    """
    if not examples:
        return {}
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=device, dtype=torch.float64)
    total_targets = 0
    correct = torch.zeros((), device=device, dtype=torch.long)
    n_batches = math.ceil(len(examples) / batch_size)
    # iter_steps with accum 1 gives micro-batches; order is irrelevant for a mean.
    it = iter_steps(examples, batch_size, 1, 0, pad_token_id, task)
    try:
        for _ in range(n_batches):
            _, (mb,) = next(it)
            mb = mb.to(device)
            if task == "causal-lm":   # the training step's loss, chunked when it is
                total_loss += micro_loss_sum(model, mb, task, spec, device, chunk_tokens).double()
            else:                     # the logits are needed for the accuracy
                with autocast(spec, device):
                    logits = model(**mb.forward_inputs()).logits
                total_loss += loss_sum(logits, mb.labels, task).double()
                correct += (logits.argmax(-1) == mb.labels).sum()
            total_targets += mb.n_targets
    finally:
        model.train(was_training)
    out = {"eval_loss": total_loss.item() / max(1, total_targets), "eval_tokens": total_targets}
    if task == "causal-lm":
        out["eval_perplexity"] = math.exp(min(out["eval_loss"], 50.0))
    else:
        out["eval_accuracy"] = correct.item() / max(1, total_targets)
    return out
