"""From tokenized examples to optimizer steps: ordering, micro-batches and padding.

In epoch ``e`` the examples are visited in ``epoch_order(n, seed, e)`` order, a function of the
seed and the epoch only. That order is cut into optimizer steps of ``micro_batch_size *
grad_accum_steps`` examples (the epoch's last step may be short), and each step into micro-batches
of ``micro_batch_size`` (its last may be short). So ``8 x 1``, ``2 x 4`` and ``1 x 8`` put the same
examples in every optimizer step, and comparisons of accumulation settings see the same data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .bundle import DataError

CAUSAL_LM = "causal-lm"
CLASSIFICATION = "sequence-classification"
IMAGE_CLASSIFICATION = "image-classification"
TASKS = (CAUSAL_LM, CLASSIFICATION, IMAGE_CLASSIFICATION)
IGNORE_INDEX = -100   # the Hugging Face / torch cross-entropy "no target here" label
# a tokenized preference example: "input_ids"/"labels" hold prompt + chosen answer (-100 on the prompt), and
# "rejected_input_ids"/"rejected_labels" prompt + rejected answer
PREF_KEY = "rejected_input_ids"


@dataclass
class MicroBatch:
    """One forward/backward's worth of examples, right-padded to its longest row."""

    input_ids: torch.Tensor        # (B, T) long
    attention_mask: torch.Tensor   # (B, T) long, 1 for real tokens
    labels: torch.Tensor           # causal LM: (B, T), -100 at padding (the model shifts them); else (B,)
    n_targets: int                 # causal LM: positions the shifted loss counts; classification: B
    n_tokens: int                  # non-padding input tokens
    indices: tuple[int, ...] = ()  # positions of its examples in the list given to iter_steps
    # packed chat data: (B, T) long, restarting at 0 for each packed example (padding continues as one more run)
    position_ids: torch.Tensor | None = None
    # preference data: rows 0..P-1 are the P pairs' chosen sequences and rows P..2P-1 their rejected ones (the
    # same order); 0 for every other batch
    n_pairs: int = 0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_units(self) -> int:
        """What a step's loss is a mean over: its pairs (preference data), else its target tokens (rule 4)."""
        return self.n_pairs or self.n_targets

    def to(self, device, non_blocking: bool = False) -> MicroBatch:
        """A copy with the tensors on ``device``."""
        return MicroBatch(
            input_ids=self.input_ids.to(device, non_blocking=non_blocking),
            attention_mask=self.attention_mask.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            n_targets=self.n_targets, n_tokens=self.n_tokens, indices=self.indices,
            position_ids=None if self.position_ids is None else self.position_ids.to(device, non_blocking=non_blocking),
            n_pairs=self.n_pairs)

    def pin_memory(self) -> MicroBatch:
        """A copy in pinned (page-locked) host memory, so a ``to(cuda, non_blocking=True)`` does not wait."""
        return MicroBatch(input_ids=self.input_ids.pin_memory(), attention_mask=self.attention_mask.pin_memory(),
                          labels=self.labels.pin_memory(), n_targets=self.n_targets, n_tokens=self.n_tokens,
                          indices=self.indices,
                          position_ids=None if self.position_ids is None else self.position_ids.pin_memory(),
                          n_pairs=self.n_pairs)

    def model_inputs(self) -> dict[str, Any]:
        """``forward_inputs()`` and ``labels`` as keyword arguments for a HF model."""
        return {**self.forward_inputs(), "labels": self.labels}

    def forward_inputs(self) -> dict[str, Any]:
        """What the forward takes (no labels: the loop computes the loss itself). Packed examples pass their
        ``position_ids`` and no padding mask: transformers then masks attention between the examples (each run of
        positions is its own block), and padding, its own run at the end, is seen by no real token."""
        if self.position_ids is not None:
            # use_cache=False: transformers reads packing from position_ids only when no KV cache is being built
            return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if self.labels.dim() == 2:
            # a causal LM (labels per position): a training or eval forward builds no KV cache (memory). A
            # classifier's forward may not take the argument (BERT's does not), so it is not passed there
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "use_cache": False}
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


@dataclass
class ImageBatch:
    """One forward/backward's worth of images: the same protocol as ``MicroBatch`` (``labels``, ``n_targets``,
    ``n_tokens``, ``indices``, ``to``, ``pin_memory``, ``forward_inputs``). An example is what counts: one target
    per image, and ``n_tokens`` (the loop's throughput unit) is the number of images."""

    pixel_values: torch.Tensor     # (B, C, H, W) float32, preprocessed (resized, normalised)
    labels: torch.Tensor           # (B,) long
    n_targets: int                 # B
    n_tokens: int                  # B: images are the unit of throughput, as examples are for classification
    indices: tuple[int, ...] = ()

    def __len__(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def loss_units(self) -> int:
        """What a step's loss is a mean over: its images."""
        return self.n_targets

    def to(self, device, non_blocking: bool = False) -> ImageBatch:
        """A copy with the tensors on ``device``."""
        return ImageBatch(pixel_values=self.pixel_values.to(device, non_blocking=non_blocking),
                          labels=self.labels.to(device, non_blocking=non_blocking), n_targets=self.n_targets,
                          n_tokens=self.n_tokens, indices=self.indices)

    def pin_memory(self) -> ImageBatch:
        """A copy in pinned host memory (see ``MicroBatch.pin_memory``)."""
        return ImageBatch(pixel_values=self.pixel_values.pin_memory(), labels=self.labels.pin_memory(),
                          n_targets=self.n_targets, n_tokens=self.n_tokens, indices=self.indices)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``labels`` as keyword arguments for a HF image classifier."""
        return {"pixel_values": self.pixel_values, "labels": self.labels}

    def forward_inputs(self) -> dict[str, torch.Tensor]:
        """What the forward takes (no labels: the loop computes the loss itself)."""
        return {"pixel_values": self.pixel_values}


def collate_images(examples: list[dict], indices: tuple[int, ...] = ()) -> ImageBatch:
    """Stack preprocessed images (``{"pixel_values": (C, H, W), "label": int}``) into one batch."""
    if not examples:
        raise DataError("collate: got no examples")
    try:
        pixels = torch.stack([ex["pixel_values"] for ex in examples])
        labels = torch.tensor([ex["label"] for ex in examples], dtype=torch.long)
    except KeyError as e:
        raise DataError(f"collate: task='image-classification' needs 'pixel_values' and 'label' in every "
                        f"example (missing {e})") from None
    except RuntimeError as e:   # images of different sizes cannot be stacked
        raise DataError(f"collate: the images of a batch have different shapes ({e}); preprocess them to one "
                        "size") from None
    n = len(examples)
    return ImageBatch(pixel_values=pixels, labels=labels, n_targets=n, n_tokens=n, indices=tuple(indices))


def collate(examples: list[dict], pad_token_id: int, task: str,
            indices: tuple[int, ...] = ()) -> MicroBatch | ImageBatch:
    """Pad ``examples`` to their longest row (right padding) and build the labels for ``task``; images are
    stacked (``collate_images``; ``pad_token_id`` is not used)."""
    if not examples:
        raise DataError("collate: got no examples")
    if task not in TASKS:
        raise DataError(f"task: {task!r} is not supported; allowed: {', '.join(TASKS)}")
    if task == IMAGE_CLASSIFICATION:
        return collate_images(examples, indices)
    n_pairs = 0
    if any(PREF_KEY in ex for ex in examples):
        if task != CAUSAL_LM or not all(PREF_KEY in ex and "labels" in ex for ex in examples):
            raise DataError("collate: preference examples need 'input_ids'/'labels' (prompt + chosen) and "
                            f"'{PREF_KEY}'/'rejected_labels' (prompt + rejected) in every example of a batch")
        # one forward for both answers: the chosen rows, then the rejected rows in the same order
        n_pairs = len(examples)
        examples = list(examples) + [{"input_ids": ex[PREF_KEY], "labels": ex["rejected_labels"]}
                                     for ex in examples]
    seqs = [ex["input_ids"] for ex in examples]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    width = int(lengths.max())
    mask = torch.arange(width) < lengths[:, None]
    input_ids = torch.full((len(seqs), width), int(pad_token_id), dtype=torch.long)
    # a boolean-mask assignment fills row by row, which is exactly the concatenated sequences
    input_ids[mask] = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    position_ids = None
    if task == CAUSAL_LM and any("labels" in ex for ex in examples):
        # chat data: the example's own labels (-100 off the answers), padded with -100; targets are counted after
        # the shift the loss makes, so a step's normalisation is its answer tokens
        labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
        try:
            labels[mask] = torch.tensor(list(itertools.chain.from_iterable(ex["labels"] for ex in examples)),
                                        dtype=torch.long)
        except (KeyError, RuntimeError):
            raise DataError("collate: chat examples need 'labels' as long as their 'input_ids' in every example "
                            "of a batch") from None
        n_targets = int((labels[:, 1:] != IGNORE_INDEX).sum())
        if any("position_ids" in ex for ex in examples):
            # padding gets positions 0.. too: a run of its own, so no real token attends to it
            position_ids = torch.arange(width).repeat(len(seqs), 1) - lengths[:, None]
            position_ids[mask] = torch.tensor(list(itertools.chain.from_iterable(
                ex.get("position_ids", range(len(ex["input_ids"]))) for ex in examples)), dtype=torch.long)
    elif task == CAUSAL_LM:
        # mask by position, not by id: when pad == eos the real eos tokens must stay targets
        labels = input_ids.masked_fill(~mask, IGNORE_INDEX)
        n_targets = int((lengths - 1).clamp(min=0).sum())
    else:
        try:
            labels = torch.tensor([ex["label"] for ex in examples], dtype=torch.long)
        except KeyError:
            raise DataError("collate: task='sequence-classification' needs a 'label' in every "
                            "example") from None
        n_targets = len(examples)
    return MicroBatch(input_ids=input_ids, attention_mask=mask.long(), labels=labels,
                      n_targets=n_targets, n_tokens=int(lengths.sum()), indices=tuple(indices),
                      position_ids=position_ids, n_pairs=n_pairs)


def steps_per_epoch(n_examples: int, micro_batch_size: int, grad_accum_steps: int) -> int:
    """Optimizer steps in one pass over ``n_examples`` (the last step may be short)."""
    _check_sizes(micro_batch_size, grad_accum_steps)
    return math.ceil(n_examples / (micro_batch_size * grad_accum_steps))


def epoch_order(n_examples: int, seed: int, epoch: int) -> list[int]:
    """The order examples are visited in ``epoch``: depends on ``seed`` and ``epoch`` only."""
    return torch.randperm(n_examples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def iter_steps(examples: list[dict], micro_batch_size: int, grad_accum_steps: int, seed: int,
               pad_token_id: int, task: str,
               start_step: int = 0) -> Iterator[tuple[float, list[MicroBatch | ImageBatch]]]:
    """Endless ``(epoch after this step, its micro-batches)`` per optimizer step.

    ``start_step`` skips that many steps first (without building them), so a resumed run gets the
    same batches it would have had.
    """
    _check_sizes(micro_batch_size, grad_accum_steps)
    if not examples:
        raise DataError("iter_steps: no examples to train on")
    if task not in TASKS:
        raise DataError(f"task: {task!r} is not supported; allowed: {', '.join(TASKS)}")
    if start_step < 0:
        raise DataError(f"start_step: must be >= 0, got {start_step}")
    return _steps(examples, micro_batch_size, grad_accum_steps, seed, pad_token_id, task, start_step)


def _steps(examples, micro, accum, seed, pad_token_id, task, start_step):
    n = len(examples)
    per_step = micro * accum
    spe = math.ceil(n / per_step)
    epoch, first = divmod(start_step, spe)
    while True:
        order = epoch_order(n, seed, epoch)
        for s in range(first, spe):
            chunk = order[s * per_step: (s + 1) * per_step]
            batches = [collate([examples[i] for i in chunk[j: j + micro]], pad_token_id, task,
                               indices=tuple(chunk[j: j + micro]))
                       for j in range(0, len(chunk), micro)]
            yield epoch + min((s + 1) * per_step, n) / n, batches
        first = 0
        epoch += 1


def _check_sizes(micro_batch_size: int, grad_accum_steps: int) -> None:
    if int(micro_batch_size) < 1:
        raise DataError(f"micro_batch_size: must be >= 1, got {micro_batch_size}")
    if int(grad_accum_steps) < 1:
        raise DataError(f"grad_accum_steps: must be >= 1, got {grad_accum_steps}")
