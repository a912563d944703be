"""TRL's ``SFTConfig`` for a TrainConfig: ``sft_config_kwargs(cfg)``, the keywords ``trl.SFTConfig(**kw)`` takes
(the TrainingArguments ones plus TRL's own), and ``sft_config(cfg)``, the same with notes.

trl is not a dependency: nothing here imports it. The field names are TRL's (``trl/trainer/sft_config.py``):
``max_length``, ``packing`` (and ``packing_strategy``), ``completion_only_loss`` (prompt-completion rows),
``assistant_only_loss`` (conversational rows), ``dataset_text_field`` (plain text). SFTConfig's defaults differ
from TrainingArguments' (bf16 on unless fp16, gradient checkpointing on, 10 logging steps, lr 2e-5), so every
one of those is written explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

from ...config import ConfigError, TrainConfig
from ...hardware import resolve_precision
from .mapping import NBTRAIN_ONLY, chat_format, non_default_notes, sample_notes
from .training_args import training_arguments_kwargs, training_arguments_notes

# SFTConfig's own fields this export writes (besides TrainingArguments'): the names TRL's source declares
TRL_SFT_FIELDS = ("max_length", "packing", "packing_strategy", "completion_only_loss", "assistant_only_loss",
                  "dataset_text_field")
_RENAMES = {"sharegpt": "from/value -> role/content, human/gpt -> user/assistant, in a 'messages' column",
            "alpaca": "instruction (+ input) -> a user turn, output -> the assistant turn, in a 'messages' column"}


def sft_config_kwargs(cfg: TrainConfig, output_dir: Optional[str] = None, **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of ``trl.SFTConfig`` for ``cfg`` (plain values, JSON-friendly)."""
    return sft_config(cfg, output_dir, **overrides)[0]


def sft_config(cfg: TrainConfig, output_dir: Optional[str] = None,
               **overrides: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``(SFTConfig keywords, notes)``; notes name what SFTConfig cannot say (or says differently). A preference
    objective is a ConfigError pointing at ``trl_dpo`` (SFTConfig trains on one answer)."""
    if cfg.objective != "lm":
        raise ConfigError(f"objective: {cfg.objective!r} is preference tuning, which TRL's SFTConfig does not run; "
                          "export it with --to trl-dpo (DPOConfig, or ORPOConfig / CPOConfig)", field="objective")
    kw = training_arguments_kwargs(cfg, output_dir)
    precision = resolve_precision(cfg.precision)
    # TRL turns bf16 on unless fp16 is set: an fp32 run must say bf16=False (and so must bf16-pure and fp8: see
    # the notes, which are TrainingArguments' own: precision, optimizer)
    kw.update(bf16=precision == "bf16", fp16=precision == "fp16", max_length=cfg.max_seq_len, packing=cfg.packing)
    notes: dict[str, str] = training_arguments_notes(cfg)
    fmt = chat_format(cfg)
    if fmt is None:
        kw["dataset_text_field"] = cfg.text_column
        if cfg.packing:
            kw["packing_strategy"] = "wrapped"   # nbtrain concatenates texts and cuts blocks, as "wrapped" does
        notes.update(non_default_notes(cfg, ("chat_template", "train_on", "columns"),
                                       f"only applies to chat data; data_format={cfg.data_format!r} exports as "
                                       "plain text (dataset_text_field)"))
    else:
        if fmt == "prompt-completion":
            kw["completion_only_loss"] = cfg.train_on != "all"
            kw["assistant_only_loss"] = False
        else:
            kw["assistant_only_loss"] = cfg.train_on != "all"
            if cfg.train_on != "all":
                notes["assistant_only_loss"] = ("assistant_only_loss=True needs a chat template that marks the "
                                                "answers with {% generation %}")
        if cfg.train_on == "last" and fmt != "prompt-completion":
            notes["train_on"] = ("train_on='last': TRL has no last-turn-only loss; assistant_only_loss trains "
                                 "every assistant turn (train_on='completion')")
        if fmt in _RENAMES:
            notes["data_format"] = (f"data_format={fmt!r}: TRL reads messages or prompt/completion rows; convert "
                                    f"them ({_RENAMES[fmt]})")
        if cfg.columns:
            notes["columns"] = (f"columns={cfg.columns!r}: TRL reads fixed names (messages, prompt, completion); "
                                "rename the dataset's columns (datasets' rename_columns)")
        if cfg.chat_template != "auto":
            name = repr(cfg.chat_template) if cfg.chat_template in ("chatml", "llama3", "alpaca") else "a Jinja string"
            notes["chat_template"] = (f"chat_template {name}: write the template to a .jinja file and pass "
                                      "chat_template_path=<file> (TRL uses the tokenizer's own otherwise)")
        if cfg.packing:
            notes["packing"] = ("packing=True: TRL's default bfd strategy keeps examples whole (padding-free; no "
                                "cross-attention with flash-attention), dropping what overflows a block")
    notes.update(sample_notes(cfg, "TRL SFTConfig"))
    notes.update(non_default_notes(cfg, tuple(f for f in NBTRAIN_ONLY if f not in ("chunked_loss", "loss_chunk_tokens")),
                                   "is an nbtrain speed/memory option with no SFTConfig key (the same training "
                                   "without it)"))
    if cfg.chunked_loss:   # TRL's default loss_type is chunked_nll: the head only at target positions
        notes["chunked_loss"] = "chunked_loss=True: TRL's default loss_type 'chunked_nll' does the same"
    kw.update(overrides)
    return kw, notes
