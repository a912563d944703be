"""Fairness fingerprints: hashes that prove two runs started from the same weights and saw the same batches."""

from __future__ import annotations

import hashlib

import torch


def weights_hash(model: torch.nn.Module) -> str:
    """A short hash of every parameter and buffer, to prove two runs started from the same weights."""
    h = hashlib.blake2b(digest_size=8)
    for name, t in sorted(list(model.state_dict().items()), key=lambda kv: kv[0]):
        if not isinstance(t, torch.Tensor):
            continue
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def chain_step(previous: bytes, micro: list, task: str) -> bytes:
    """The data hash after one more step: chained over the step's real (unpadded) token ids, and its labels for a
    classifier, independent of how the step is cut into micro-batches. Plain bytes, so a checkpoint keeps it.

    Images: over the step's pixel values (the preprocessed fp32 inputs, row-major, so the micro-batches' bytes in
    order are the whole step's) and labels. Preprocessing does not depend on the precision, so fp32 and bf16 runs
    of one config hash alike.

    GRPO's micro-batches (``engine.grpo_run.GrpoBatch``) hash their prompts only (``data_mask``): the completions are
    the model's own, and differ by precision; the prompts are the data every variant must share."""
    if task == "image-classification":
        step_ids = b"".join(mb.pixel_values.contiguous().numpy().tobytes() for mb in micro)
    else:
        step_ids = b"".join(mb.input_ids[(mb.attention_mask if getattr(mb, "data_mask", None) is None
                                          else mb.data_mask).bool()].numpy().tobytes() for mb in micro)
    if task != "causal-lm":   # class labels are data too
        step_ids += b"".join(mb.labels.numpy().tobytes() for mb in micro)
    return hashlib.blake2b(previous + step_ids, digest_size=8).digest()
