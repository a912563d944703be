"""Causal-LM loss without the full logits: the output head applied chunk by chunk, so at most one chunk of
``tokens x vocab`` logits lives at a time.

For a 0.5B model with a 152k vocabulary at 8 x 1024 tokens the plain path holds the bf16 logits, their fp32 copy
and its gradient (~14 GiB); this path holds one chunk. The maths is the same sum of per-token cross-entropies,
accumulated in fp32. It applies to models whose logits are ``output_embeddings(final hidden state)`` — true of
Llama, Qwen, Mistral, GPT-2 and most decoders; models that post-process logits (e.g. soft-capping) are refused.

Two ways to do the chunks:

- **fused** (a plain ``nn.Linear`` head, the usual case): each chunk's gradients (of the hidden states, the
  weight and the bias) are computed in the forward, right after its loss, while its logits are still there; the
  backward only multiplies them by the incoming scalar. The head's matmuls run once each, as in the plain path.
- **recompute** (any other head, e.g. one with a LoRA adapter or quantized): each chunk under activation
  checkpointing, so its logits are recomputed in backward: one more head forward per step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..precision import active_autocast_dtype, autocast


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


def fusable(head) -> bool:
    """Whether the fused path applies: a plain floating-point ``nn.Linear`` (no adapter, not quantized)."""
    return (type(head) is torch.nn.Linear and head.weight.dtype.is_floating_point
            and type(head.weight) in (torch.nn.Parameter, torch.Tensor))


def _ce_and_grad(logits: torch.Tensor, ys: torch.Tensor):
    """(sum of CE, softmax - onehot) of one chunk's 16-bit logits: fp32 inside, the gradient in the logits' dtype.

    Written without in-place ops so torch.compile can fuse it: the chunk's logits are read twice (the
    log-sum-exp, then the gradient) and its gradient written once, all in 16 bits, instead of the eager path's
    fp32 copy and its several full passes."""
    lf = logits.float()
    lse = torch.logsumexp(lf, dim=-1)
    loss = (lse - lf.gather(1, ys[:, None]).squeeze(1)).sum()
    onehot = torch.arange(lf.shape[1], device=lf.device)[None, :] == ys[:, None]
    g = torch.exp(lf - lse[:, None]) - onehot.to(lf.dtype)
    return loss, g.to(logits.dtype)


_COMPILED_CE = None


def _compiled_ce():
    global _COMPILED_CE
    if _COMPILED_CE is None:   # compiled on first use only: importing nbtrain must not start a compiler
        _COMPILED_CE = torch.compile(_ce_and_grad)
    return _COMPILED_CE


def _fused_chunks(h, weight, bias, y, chunk_tokens: int, cdtype: torch.dtype, need_h: bool, need_w: bool,
                  need_b: bool, compiled: bool = False):
    """(loss sum, d/dh, d/dW, d/db) of sum_i CE(h_i @ W.T + b, y_i), one chunk of rows at a time.

    ``compiled``: the chunk's softmax gradient through torch.compile (16-bit compute dtypes, no bias gradient)."""
    # The matmuls in the compute dtype (autocast's, when it is on), the softmax and the loss in fp32: the
    # plain path's rounding points (bf16 logits, then .float()).
    with torch.autocast(h.device.type, enabled=False):
        w = weight.to(cdtype)
        b = bias.to(cdtype) if bias is not None else None
        hc = h.to(cdtype)
        total = torch.zeros((), device=h.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(h) if need_h else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        fast = compiled and cdtype in (torch.bfloat16, torch.float16) and not need_b and (need_h or need_w)
        for s in range(0, y.numel(), chunk_tokens):
            hs, ys = hc[s:s + chunk_tokens], y[s:s + chunk_tokens]
            if fast:
                loss, g = _compiled_ce()(F.linear(hs, w, b), ys)
            else:
                loss, g = _eager_ce_and_grad(F.linear(hs, w, b).float(), ys, cdtype, need_h or need_w or need_b,
                                             grad_bias)
            total += loss
            if g is None:
                continue
            if need_h:
                grad_hidden[s:s + chunk_tokens] = g @ w
            if need_w:
                if grad_weight.dtype == g.dtype:
                    grad_weight.addmm_(g.t(), hs)
                else:   # the chunk's bf16 weight gradient, summed in fp32
                    grad_weight += g.t() @ hs
            del g
    return total, grad_hidden, grad_weight, grad_bias


def _eager_ce_and_grad(logits, ys, cdtype, need_grad: bool, grad_bias):
    """The eager chunk: the loss of its fp32 ``logits`` and (when wanted) their gradient in ``cdtype``, built in
    place in the logits' storage; the bias gradient, from the fp32 gradient, is added to ``grad_bias``."""
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, ys[:, None]).squeeze(1)).sum()
    if not need_grad:
        return loss, None
    # d(sum CE)/d logits = softmax - onehot, built in place in the fp32 logits' storage
    g = logits.sub_(lse[:, None]).exp_()
    g[torch.arange(ys.numel(), device=g.device), ys] -= 1.0
    if grad_bias is not None:
        grad_bias += g.sum(0)
    return loss, g.to(cdtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """The fused path as an autograd node: gradients made in the forward, scaled in the backward."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunk_tokens: int, cdtype: torch.dtype, compiled: bool):
        total, grad_hidden, grad_weight, grad_bias = _fused_chunks(h, weight, bias, y, chunk_tokens, cdtype, *ctx.needs_input_grad[:3],
                                          compiled=compiled)
        ctx.dtypes = (h.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        # The loss is a scalar, so the chain rule is one multiplication (by 1/n_targets, times any loss scale).
        go = grad_out.float()
        return (*(None if g is None else (g * go).to(dt) for g, dt in zip(ctx.saved_tensors, ctx.dtypes)),
                None, None, None, None)


def _chunk_ce(head: torch.nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(h)   # in the autocast dtype when autocast is on
    return F.cross_entropy(logits.float(), y, reduction="sum")


def head_loss_sum(head, h: torch.Tensor, y: torch.Tensor, chunk_tokens: int = 1024,
                  fused: Optional[bool] = None, compiled: bool = False) -> torch.Tensor:
    """Sum of cross-entropies of ``head(h)`` against ``y`` (no -100 in ``y``), ``chunk_tokens`` rows at a time.

    ``fused``: None picks the fused path when the head allows it (see the module docstring), True requires it.
    ``compiled``: the fused path's per-chunk softmax gradient through torch.compile (16-bit autocast only).
    """
    can_fuse = fusable(head)
    if fused and not can_fuse:
        raise ChunkedLossError(f"chunked_loss: the fused path needs a plain nn.Linear head, got "
                               f"{type(head).__name__}")
    if fused is None:
        fused = can_fuse
    if fused:
        cdtype = active_autocast_dtype(h.device.type) or head.weight.dtype
        if not torch.is_grad_enabled():   # evaluation: no gradients to make
            return _fused_chunks(h, head.weight, head.bias, y, chunk_tokens, cdtype, False, False, False)[0]
        return _LinearCrossEntropy.apply(h, head.weight, head.bias, y, chunk_tokens, cdtype, compiled)
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    for s in range(0, y.numel(), chunk_tokens):
        # Recomputed in backward: the chunk's logits are freed as soon as its loss is known.
        total = total + checkpoint(_chunk_ce, head, h[s:s + chunk_tokens], y[s:s + chunk_tokens],
                                   use_reentrant=False)
    return total


def target_positions(labels: torch.Tensor, n_targets: Optional[int] = None):
    """(flat positions into ``labels.reshape(-1)`` whose next label counts, those labels).

    ``n_targets`` (known on the host: ``MicroBatch.n_targets``) sizes the selection, so nothing is read back
    from the device; without it the count is read (a host sync)."""
    keep = F.pad(labels[:, 1:] != -100, (0, 1), value=False).reshape(-1)
    if n_targets is None:
        idx = keep.nonzero().squeeze(1)
    else:
        idx = torch.nonzero_static(keep, size=int(n_targets)).squeeze(1)
    return idx, labels.reshape(-1).index_select(0, idx + 1)


def decoder_inputs(input_ids, attention_mask, position_ids=None) -> dict:
    """The decoder's keyword arguments in training: packed examples pass their ``position_ids`` and no padding
    mask (transformers then keeps them apart, only when no KV cache is built), and no forward builds a cache."""
    if position_ids is not None:
        return {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}


def chunked_loss_sum(model, input_ids, attention_mask, labels, chunk_tokens: int = 1024, *,
                     parts=None, fused: Optional[bool] = None, n_targets: Optional[int] = None,
                     compiled: bool = False, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of next-token cross-entropies (labels in HF convention, -100 ignored), computed chunk by chunk.

    ``parts``: the (decoder, head) pair ``split_for_chunked_loss(model)`` gives, when the caller has it already.
    ``n_targets``: the number of labels that count, when the caller knows it on the host; when it is every
    position, no selection is needed, and otherwise it sizes the selection without a host sync. The head runs
    on the target positions only (a chat prompt's logits are never made). ``position_ids``: packed examples
    (see ``decoder_inputs``). ``compiled``: see ``head_loss_sum``.
    """
    decoder, head = parts if parts is not None else split_for_chunked_loss(model)
    hidden = decoder(**decoder_inputs(input_ids, attention_mask, position_ids)).last_hidden_state
    y = labels[:, 1:]
    if n_targets is not None and n_targets == y.numel():
        return head_loss_sum(head, hidden[:, :-1].reshape(-1, hidden.shape[-1]), y.reshape(-1), chunk_tokens,
                             fused, compiled)
    idx, ys = target_positions(labels, n_targets)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)   # padding and prompts cost no head FLOPs
    return head_loss_sum(head, h, ys, chunk_tokens, fused, compiled)


def selected_logits(parts, mb) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain path on a causal-LM batch with fewer targets than positions: (the head's logits at the target
    positions only, their labels). The decoder's hidden states are selected before the head, so the logits of
    prompt tokens and padding are never made; the loss over them is the full-logits loss, to rounding."""
    decoder, head = parts
    hidden = decoder(**decoder_inputs(mb.input_ids, mb.attention_mask, mb.position_ids)).last_hidden_state
    idx, ys = target_positions(mb.labels, mb.n_targets)
    return head(hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)), ys


def selects_targets(mb, task: str, parts) -> bool:
    """Whether the plain path runs the head on the target positions only: a causal-LM batch, a (decoder, head)
    split, and real tokens that are not targets (chat prompts under completion-only loss: fewer targets than
    the ``n_tokens - rows`` plain text has). Plain text, padded or not, keeps the model's own forward (and its
    pinned losses); its padding alone is not worth a second code path."""
    labels = getattr(mb, "labels", None)
    return (task == "causal-lm" and parts is not None and labels is not None and labels.dim() == 2
            and mb.n_targets < mb.n_tokens - labels.shape[0])


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Sum (not mean) of the per-target losses in fp32, so a step can divide by its own token count (a classifier,
    text or image: one target per example, so a step divides by its examples)."""
    if task == "causal-lm":
        # Shift the labels, not the logits: slicing the logits would copy all of them (GBs for big vocabularies).
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100, reduction="sum")
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def micro_loss_sum(model, mb, task: str, spec, device: str, chunk_tokens: Optional[int] = None,
                   parts=None, compiled: bool = False) -> torch.Tensor:
    """Sum of one micro-batch's per-target losses in fp32, the forward under autocast.

    Nothing here reads a device value back (the model's own mask logic may: transformers checks the mask on
    the host in eager mode). ``chunk_tokens`` (causal LM): the chunked loss, with ``parts`` its (decoder, head)
    and ``compiled`` its per-chunk softmax gradient compiled. Without it, ``parts`` lets the plain path run the
    head on the target positions only when the batch has fewer targets than positions (``selects_targets``). The logits are not kept past the loss: backward
    needs only what the autograd graph holds.
    """
    with autocast(spec, device):
        if chunk_tokens and task == "causal-lm":
            return chunked_loss_sum(model, mb.input_ids, mb.attention_mask, mb.labels, chunk_tokens, parts=parts,
                                    n_targets=mb.n_targets, compiled=compiled, position_ids=mb.position_ids)
        if selects_targets(mb, task, parts):
            logits, ys = selected_logits(parts, mb)
        else:
            # input_ids + attention_mask, or an image's pixel_values: in the weights' dtype when no autocast casts
            # them (bf16-pure)
            inputs = {k: v.to(spec.param_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                      and spec.autocast_dtype is None else v
                      for k, v in mb.forward_inputs().items()}
            logits = model(**inputs).logits
    if selects_targets(mb, task, parts):
        return F.cross_entropy(logits.float(), ys, reduction="sum")
    return loss_sum(logits, mb.labels, task)
