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


@pytest.fixture(scope="module")
def big_vocab_model(tmp_path_factory):
    """A small Qwen2 whose output layer dominates (vocab 32,000 x hidden 64, tied): the chunked loss's terms
    are most of the step's memory, so the estimate of them (and, on chat data, of the answer rows only) is what this
    model tests (test_memory.py, test_chat_memory.py)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from nbtrain.models.presets import preset_tokenizer

    tok = preset_tokenizer("tiny")
    path = tmp_path_factory.mktemp("bigvocab")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32000, tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
