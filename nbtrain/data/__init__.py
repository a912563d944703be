"""Data: builtin corpora, local files and dataset ids -> tokenized examples (or preprocessed images) -> steps.

``load_data(cfg, tokenizer)`` gives a ``DataBundle``; ``iter_steps(bundle.train, ...)`` turns its
examples into the micro-batches of each optimizer step. Nothing here imports widgets or plots.
"""

from .batching import ImageBatch, MicroBatch, collate, epoch_order, iter_steps, steps_per_epoch
from .builtin import BUILTINS, builtin_label_names, builtin_names, builtin_rows, builtin_texts
from .bundle import IMAGE_EXTS, DataBundle, DataError
from .chat import ensure_chat_tokens, prompt_ids
from .images import TorchImageProcessor, digits_images, load_image_data
from .loading import FILE_FORMATS, pack, split_indices
from .loading import load_data as load_text_data
from .preference import PREF_FORMATS


def load_data(cfg, tokenizer) -> DataBundle:
    """The ``DataBundle`` of ``cfg.data`` for ``cfg.task``: texts tokenized with ``tokenizer``
    (``loading.load_data``), or, for ``task="image-classification"``, images preprocessed with the image processor
    passed as ``tokenizer`` (``images.load_image_data``). Bad data raises ``DataError`` before any training."""
    if cfg.task == "image-classification":
        return load_image_data(cfg, tokenizer)
    return load_text_data(cfg, tokenizer)


__all__ = [
    "BUILTINS", "FILE_FORMATS", "IMAGE_EXTS", "PREF_FORMATS", "DataBundle", "DataError", "ImageBatch", "MicroBatch",
    "TorchImageProcessor", "builtin_label_names", "builtin_names", "builtin_rows", "builtin_texts", "collate",
    "digits_images", "ensure_chat_tokens", "epoch_order", "iter_steps", "load_data", "load_image_data", "load_text_data", "pack", "prompt_ids",
    "split_indices", "steps_per_epoch",
]
