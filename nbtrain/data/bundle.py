"""The data package's result type and its error type."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Bad or unusable data: the message names the file, column or field and what is allowed."""


@dataclass
class DataBundle:
    """Tokenized train and eval examples, ready for ``iter_steps``.

    Each example is ``{"input_ids": list[int]}``, plus ``"label": int`` for sequence classification.
    """

    train: list[dict]
    eval: list[dict]
    task: str                         # "causal-lm" | "sequence-classification"
    pad_token_id: int
    num_labels: int | None            # classification only
    label_names: list[str] | None
    source: str                       # where the data came from, for people
    stats: dict[str, Any] = field(default_factory=dict)   # documents, dropped rows, truncated rows, ...

    @property
    def train_tokens(self) -> int:
        """Input tokens over all training examples."""
        return sum(len(ex["input_ids"]) for ex in self.train)

    def __repr__(self) -> str:
        labels = f", num_labels={self.num_labels}" if self.num_labels is not None else ""
        return (f"DataBundle(task={self.task!r}, train={len(self.train)}, eval={len(self.eval)}"
                f"{labels}, source={self.source!r})")
