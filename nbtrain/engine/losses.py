"""Causal-LM loss without the full logits: the output head applied chunk by chunk, each chunk recomputed in
backward (activation checkpointing), so at most one chunk of ``tokens x vocab`` logits lives at a time.

For a 0.5B model with a 152k vocabulary at 8 x 1024 tokens the plain path holds the bf16 logits, their fp32 copy
and its gradient (~14 GiB); this path holds one chunk. The maths is the same sum of per-token cross-entropies,
accumulated in fp32. It applies to models whose logits are ``output_embeddings(final hidden state)`` — true of
Llama, Qwen, Mistral, GPT-2 and most decoders; models that post-process logits (e.g. soft-capping) are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class ChunkedLossError(ValueError):
    """The model cannot use the chunked loss; the message says why and what to do."""


def _unwrap(model):
    if hasattr(model, "get_base_model"):   # peft
        model = model.get_base_model()
    return model


def split_for_chunked_loss(model):
    """(decoder, head): the module that gives final hidden states and the output projection."""
    base = _unwrap(model)
    cfg = getattr(base, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if cfg is not None and getattr(cfg, attr, None) not in (None, 0, 1, 1.0):
            raise ChunkedLossError(f"chunked_loss: {type(base).__name__} post-processes its logits ({attr}); "
                                   "set chunked_loss=False for this model")
    get_decoder = getattr(base, "get_decoder", None)
    decoder = get_decoder() if get_decoder else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is base:
        raise ChunkedLossError(f"chunked_loss: cannot find the decoder and output head of {type(base).__name__}; "
                               "set chunked_loss=False")
    return decoder, head


def _chunk_ce(head: torch.nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(h)   # in the autocast dtype when autocast is on
    return F.cross_entropy(logits.float(), y, reduction="sum")


def chunked_loss_sum(model, input_ids, attention_mask, labels, chunk_tokens: int = 4096) -> torch.Tensor:
    """Sum of next-token cross-entropies (labels in HF convention, -100 ignored), computed chunk by chunk."""
    decoder, head = split_for_chunked_loss(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    y = labels[:, 1:]
    keep = y != -100
    h = hidden[:, :-1][keep]   # only positions that count: padding costs no head FLOPs either
    y = y[keep]
    total = torch.zeros((), device=hidden.device, dtype=torch.float32)
    for s in range(0, y.numel(), chunk_tokens):
        # Recomputed in backward: the chunk's logits are freed as soon as its loss is known.
        total = total + checkpoint(_chunk_ce, head, h[s:s + chunk_tokens], y[s:s + chunk_tokens],
                                   use_reentrant=False)
    return total
