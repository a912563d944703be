"""Data: builtin corpora, local files and dataset ids -> tokenized examples -> optimizer steps.

``load_data(cfg, tokenizer)`` gives a ``DataBundle``; ``iter_steps(bundle.train, ...)`` turns its
examples into the micro-batches of each optimizer step. Nothing here imports widgets or plots.
"""

from .batching import MicroBatch, collate, epoch_order, iter_steps, steps_per_epoch
from .builtin import BUILTINS, builtin_label_names, builtin_names, builtin_rows, builtin_texts
from .bundle import DataBundle, DataError
from .loading import FILE_FORMATS, load_data, pack, split_indices

__all__ = [
    "BUILTINS", "FILE_FORMATS", "DataBundle", "DataError", "MicroBatch", "builtin_label_names",
    "builtin_names", "builtin_rows", "builtin_texts", "collate", "epoch_order", "iter_steps",
    "load_data", "pack", "split_indices", "steps_per_epoch",
]
