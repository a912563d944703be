import os

import pytest
import torch

from .helpers import Collect

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tiny_cfg():
    """A fast causal-LM config on the builtin text: fp32, variable-length rows, no eval."""
    import nbtrain as nbt

    return nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=64, max_seq_len=48,
                           micro_batch_size=8, max_steps=4, eval_fraction=0.0, precision="fp32", lr=1e-3)


@pytest.fixture
def collect():
    return Collect()
