"""The data package's result type and its error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# image files (what datasets' imagefolder reads; Pillow opens them all): images.py reads them, loading.py names them
IMAGE_EXTS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"})


class DataError(ValueError):
    """Bad or unusable data: the message names the file, column or field and what is allowed."""


@dataclass
class DataBundle:
    """Tokenized train and eval examples, ready for ``iter_steps``.

    Each example is ``{"input_ids": list[int]}``, plus ``"label": int`` for sequence classification; for image
    classification it is ``{"pixel_values": (C, H, W) float32 tensor, "label": int}``. Chat data adds ``"labels":
    list[int]`` (unshifted, as Hugging Face's: the token id where it is a target, -100 elsewhere) and, packed,
    ``"position_ids"`` restarting at 0 for each example; its ``stats`` say ``data_format``, ``chat_template``,
    ``train_on``, ``target_tokens``, ``truncated_examples`` and ``dropped_no_answer``.

    Preference data (``preference.py``) adds ``"rejected_input_ids"`` / ``"rejected_labels"`` (the same prompt with
    the rejected answer) to each example; its ``stats`` say ``pairs``, ``prompts_cut_left``, ``answers_cut`` and
    ``pairs_identical_after_cut``. ``notes`` are lines for the run's notes: what loading changed that a person
    should know (prompts cut, answers cut).
    """

    train: list[dict]
    eval: list[dict]
    task: str                         # "causal-lm" | "sequence-classification" | "image-classification"
    pad_token_id: int
    num_labels: int | None            # classification only
    label_names: list[str] | None
    source: str                       # where the data came from, for people
    stats: dict[str, Any] = field(default_factory=dict)   # documents, dropped rows, truncated rows, ...
    notes: list[str] = field(default_factory=list)         # for the run's notes, in words

    @property
    def train_tokens(self) -> int:
        """Input tokens over all training examples (a preference pair: both its sequences; images: the number of
        images, the unit of throughput)."""
        # a preference pair is two sequences through the model: prompt + chosen and prompt + rejected
        return sum(len(ex["input_ids"]) + len(ex.get("rejected_input_ids", ())) if "input_ids" in ex else 1
                   for ex in self.train)

    def __repr__(self) -> str:
        labels = f", num_labels={self.num_labels}" if self.num_labels is not None else ""
        return (f"DataBundle(task={self.task!r}, train={len(self.train)}, eval={len(self.eval)}"
                f"{labels}, source={self.source!r})")
