"""AutoTrain Advanced: ``to_autotrain_yaml`` (``autotrain --config FILE``), ``read_autotrain_yaml`` and
``from_autotrain_yaml``. A key missing from a file takes AutoTrain's default (what it would have run).

Chat data (``mapping.chat_format``) exports as ``task: llm-sft``: AutoTrain renders one column of role/content
messages (``column_mapping.text_column``) with ``data.chat_template`` (its names: ``chatml``, ``zephyr``,
``tokenizer`` = the model's own, nbtrain's ``"auto"``) and trains every token of the result (TRL's SFTTrainer
on the text): train_on="all". Other layouts and losses are named in the notes.

Preference tuning: objective="dpo" is ``task: llm-dpo`` with ``params.dpo_beta``, "orpo" ``llm-orpo`` (AutoTrain
passes no beta to TRL's ORPOConfig, so ORPO's lambda is TRL's default 0.1: another pref_beta is named in the notes);
the column mapping is ``prompt_text_column``, ``text_column`` (the chosen answer) and ``rejected_text_column``;
``params.max_prompt_length`` is half of block_size. AutoTrain has no SimPO: objective="simpo" is refused (a
ConfigError naming the formats that have it), as exporting ORPO or DPO instead would train another loss. Nor has
it GRPO: objective="grpo" is refused likewise, pointing at ``--to trl-grpo``.

Several GPUs: AutoTrain's LLM tasks launch ``accelerate launch --multi_gpu`` (``params.distributed_backend: ddp``,
also its default) or DeepSpeed ZeRO-3 (``deepspeed``); it has no FSDP. sharding="none" exports as ddp;
sharding="fsdp" exports as ddp too (every GPU holds the whole model), with a note. ``deepspeed`` reads back as an
error naming it unless ``sharding=`` is passed (ZeRO-3's nearest in nbtrain is sharding="fsdp").
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Optional

from ...config import ConfigError, TrainConfig, load_yaml_mapping
from ...hardware import resolve_precision
from .mapping import (
    DATA_EXTS,
    NBTRAIN_ONLY,
    OPTIM_NAMES,
    Reader,
    chat_format,
    column,
    export_model,
    flatten,
    hf_scheduler,
    non_default_notes,
    number,
    optimizer_in,
    plain_text_chat_notes,
    pref_column,
    pref_format,
    pref_notes,
    sample_notes,
    scheduler_in,
    stochastic_rounding_notes,
    targets_in,
    targets_out,
    write_text,
    yaml_text,
)

# The TrainConfig fields the format carries. A round trip keeps all of them except those named in the
# export's notes (for instance max_steps, which AutoTrain cannot express).
AUTOTRAIN_FIELDS = (
    "model", "task", "data", "text_column", "label_column", "image_column", "max_seq_len", "precision", "micro_batch_size",
    "grad_accum_steps", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits",
    "gradient_checkpointing", "lr", "weight_decay", "scheduler", "warmup_steps", "epochs", "max_grad_norm",
    "log_every", "seed", "output_dir", "data_format", "columns", "chat_template", "train_on", "optimizer",
    "sharding", "objective", "pref_beta",
)
# nbtrain's preference objectives as AutoTrain's tasks (its trainers dpo and orpo: TRL's DPOTrainer and ORPOTrainer);
# AutoTrain has no SimPO
AT_PREF_TASKS = {"dpo": "llm-dpo", "orpo": "llm-orpo"}
# TRL's ORPOConfig beta (ORPO's lambda), which AutoTrain's llm-orpo leaves at TRL's default (it passes dpo_beta to
# DPO only; trl 0.13, AutoTrain's pin)
AT_ORPO_BETA = 0.1
# AutoTrain's data.chat_template values (None: plain text) and nbtrain's names for them
AT_CHAT_TEMPLATES = {"chatml": "chatml", "tokenizer": "auto"}
AT_ALL_TEMPLATES = ("chatml", "zephyr", "tokenizer")
# AutoTrain's LLMTrainingParams / TextClassificationParams defaults (what it runs when a key is absent)
_AT_LLM_DEFAULTS = {
    "params.lr": 3e-5, "params.epochs": 1, "params.batch_size": 2, "params.warmup_ratio": 0.1,
    "params.gradient_accumulation": 4, "params.scheduler": "linear", "params.weight_decay": 0.0,
    "params.max_grad_norm": 1.0, "params.seed": 42, "params.quantization": "int4",
    "params.target_modules": "all-linear", "params.peft": False, "params.lora_r": 16, "params.lora_alpha": 32,
    "params.lora_dropout": 0.05, "params.model_max_length": 2048, "params.block_size": -1,
    "params.disable_gradient_checkpointing": False, "params.logging_steps": -1, "project_name": "project-name",
    "data.column_mapping.text_column": "text", "data.train_split": "train", "params.max_prompt_length": 128,
    "params.dpo_beta": 0.1,
}
_AT_CLF_DEFAULTS = {
    "params.lr": 5e-5, "params.epochs": 3, "params.batch_size": 8, "params.warmup_ratio": 0.1,
    "params.gradient_accumulation": 1, "params.scheduler": "linear", "params.weight_decay": 0.0,
    "params.max_grad_norm": 1.0, "params.seed": 42, "params.max_seq_length": 128, "params.logging_steps": -1,
    "project_name": "project-name", "data.column_mapping.text_column": "text",
    "data.column_mapping.target_column": "target", "data.train_split": "train",
}
# AutoTrain's ImageClassificationParams defaults
_AT_IMG_DEFAULTS = {
    "params.lr": 5e-5, "params.epochs": 3, "params.batch_size": 8, "params.warmup_ratio": 0.1,
    "params.gradient_accumulation": 1, "params.scheduler": "linear", "params.weight_decay": 0.0,
    "params.max_grad_norm": 1.0, "params.seed": 42, "params.logging_steps": -1, "project_name": "project-name",
    "data.column_mapping.image_column": "image", "data.column_mapping.target_column": "target",
    "data.train_split": "train",
}
_AT_LLM_TASKS = ("llm", "llm-sft", "llm-generic", "lm_training", "llm_training", "llm_finetuning", "llm-dpo",
                 "llm-orpo")
# AutoTrain's parser aliases image_classification and image_binary_classification to its multi-class task
_AT_IMG_TASKS = ("image_classification", "image_multi_class_classification", "image_binary_classification",
                 "image-classification")
_AT_CLF_TASKS = ("text_multi_class_classification", "text_binary_classification", "text_classification",
                 "text-classification", "text-binary-classification")


def _project_name(output_dir: Optional[str]) -> str:
    # AutoTrain: letters, digits and hyphens only, at most 50 characters; it is also the output directory
    if not output_dir:
        return "nbtrain-run"
    return re.sub(r"[^A-Za-z0-9-]+", "-", output_dir).strip("-")[:50] or "nbtrain-run"


def _split_local_file(data: str) -> tuple[str, str]:
    p = Path(data).expanduser()
    if p.is_file() and p.suffix.lower() in DATA_EXTS:   # AutoTrain reads <path>/<train_split>.<ext>
        return str(p.parent), p.stem
    return data, "train"


def _split_local_folder(data: str) -> tuple[str, str]:
    p = Path(data).expanduser()
    if p.is_dir():   # AutoTrain reads <path>/<train_split>/<class>/<image>
        return str(p.parent), p.name
    return data, "train"


def autotrain_config(cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """``(the AutoTrain Advanced YAML as a dict, notes)``; notes name the fields it cannot carry.

    ``task="image-classification"`` exports as AutoTrain's ``image_classification`` (column mapping
    ``image_column`` / ``target_column``); an image folder ``DIR`` as ``path: DIR/..`` with ``train_split:
    <DIR's name>``, the folder of class subfolders AutoTrain reads."""
    llm = cfg.task == "causal-lm"
    image = cfg.task == "image-classification"
    if cfg.objective == "grpo":
        raise ConfigError("objective: 'grpo' does not export to AutoTrain, which has no GRPO (its LLM tasks are "
                          "llm, llm-sft, llm-reward, llm-dpo and llm-orpo; none samples completions and scores them "
                          "with reward functions); export it with --to trl-grpo (TRL's GRPOConfig)", field="objective")
    if cfg.objective == "simpo":
        raise ConfigError("objective: AutoTrain has no SimPO (its preference tasks are llm-dpo and llm-orpo, a "
                          "different loss); export it with --to llamafactory (stage dpo, pref_loss simpo) or --to "
                          "trl-dpo (TRL's CPOConfig, loss_type simpo), or choose objective='dpo' or 'orpo'",
                          field="objective")
    if not llm and cfg.method != "full":
        kind = "image" if image else "text"
        raise ConfigError(f"method: AutoTrain's {kind} classification fine-tunes the whole model; method="
                          f"{cfg.method!r} does not export (use method='full')", field="method")
    notes: dict[str, str] = {}
    precision = resolve_precision(cfg.precision)
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if precision == "tf32":
        notes["precision"] = "tf32 has no AutoTrain setting; exported as mixed_precision none (fp32)"
    elif precision == "bf16-pure":
        notes["precision"] = ("bf16-pure has no AutoTrain setting (no key loads the weights in bf16 for training "
                              "without autocast); exported as mixed_precision bf16, autocast over fp32 weights "
                              "(nbtrain's 'bf16'), and reads back as bf16")
    elif precision == "fp8":
        notes["precision"] = ("fp8 has no AutoTrain setting (mixed_precision is fp16, bf16 or none); exported as "
                              "mixed_precision bf16, with the linear layers in bf16 instead of float8, and reads "
                              "back as bf16")
    if cfg.optimizer == "sgd":
        notes["optimizer"] = ("optimizer='sgd': AutoTrain has no optim_args, so its sgd is the Trainer's SGD without "
                              "momentum (nbtrain's has momentum 0.9); exported as sgd, which reads back as adamw with "
                              "params.optimizer named")
    notes.update(stochastic_rounding_notes(cfg, "AutoTrain"))
    if cfg.max_steps is not None:
        notes["max_steps"] = f"max_steps={cfg.max_steps}: AutoTrain trains whole epochs and has no step limit"
        notes["epochs"] = "epochs: a guess standing in for max_steps (1 unless epochs is set), check it"
    elif not float(cfg.epochs).is_integer():
        notes["epochs"] = f"epochs={cfg.epochs}: AutoTrain takes whole epochs (rounded up)"
    if cfg.warmup_steps:
        notes["warmup_steps"] = ("warmup_steps=%d: AutoTrain takes warmup_ratio, a share of all steps%s"
                                 % (cfg.warmup_steps, f" (of max_steps={cfg.max_steps})" if cfg.max_steps else
                                    "; exported as 0"))
    if not float(cfg.lora_alpha).is_integer():
        notes["lora_alpha"] = f"lora_alpha={cfg.lora_alpha}: AutoTrain takes an integer (rounded)"
    if cfg.method != "qlora" and cfg.quant_bits != 4:
        notes["quant_bits"] = f"quant_bits={cfg.quant_bits} is only written for method='qlora'"
    if not llm:
        kind = "image" if image else "text"
        notes.update(non_default_notes(cfg, ("gradient_checkpointing", "lora_r", "lora_alpha", "lora_dropout",
                                              "lora_targets", "quant_bits")
                                       + (("text_column", "max_seq_len") if image else ()),
                                        f"has no key in AutoTrain's {kind} classification"))
    name = _project_name(cfg.output_dir)
    if name != cfg.output_dir:
        notes["output_dir"] = f"output_dir={cfg.output_dir!r} becomes project_name {name!r} (letters, digits, -)"
    if cfg.data.startswith("builtin:"):
        notes["data"] = (f"{cfg.data!r} is an nbtrain builtin: write its images to a folder of class subfolders "
                         "for AutoTrain" if image else
                         f"{cfg.data!r} is an nbtrain builtin: write its texts to a csv/jsonl file for AutoTrain")
    pref = pref_format(cfg) if llm else None
    if llm and not cfg.packing and not pref:
        notes["packing"] = "AutoTrain packs causal-LM text into block_size blocks (packing=False has no setting)"
    if cfg.eval_fraction:
        notes["eval_fraction"] = (f"eval_fraction={cfg.eval_fraction}: AutoTrain evaluates only on a named "
                                  "valid_split; none is set")
    notes.update(non_default_notes(
        cfg, ("subset", "eval_every", "save_every", "nonfinite", "auto_batch_size", "resume_from", "data_seed"),
        "has no AutoTrain key"))
    notes.update(non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no AutoTrain key "
                                                       "(the same training without it)"))
    notes.update(sample_notes(cfg, "AutoTrain"))
    if cfg.sharding == "fsdp":
        notes["sharding"] = ("sharding='fsdp': AutoTrain has no FSDP (its distributed_backend is ddp or deepspeed, "
                             "ZeRO-3)" + (": exported as ddp, every GPU holds the whole model, weights, gradients "
                                          "and optimizer state; reads back as sharding='none'" if llm else
                                          ": its classification tasks launch DDP on several GPUs"))
    notes.update(non_default_notes(cfg, ("reshard_after_forward",), "has no AutoTrain key (no FSDP there)"))
    fmt = chat_format(cfg) if llm and not pref else None
    if pref:
        notes.update(_pref_notes(cfg, pref))
    elif fmt:
        notes.update(_sft_notes(cfg, fmt))
    elif llm:
        notes.update(plain_text_chat_notes(cfg, "task llm"))
    if cfg.dataset_entry:
        notes["dataset_entry"] = (f"dataset_entry={cfg.dataset_entry!r}: AutoTrain reads one data file, not "
                                  "LLaMA-Factory's dataset_info.json entries; point data.path at the entry's file")

    if image:
        path, split = _split_local_folder(cfg.data)
        local = Path(cfg.data).expanduser().is_dir()
        # an image folder's columns are imagefolder's (image, label), whatever image_column/label_column say
        columns = ({"image_column": "image", "target_column": "label"} if local else
                   {"image_column": cfg.image_column, "target_column": cfg.label_column})
    else:
        path, split = _split_local_file(cfg.data)
        if pref:   # AutoTrain's names: text_column is the chosen answer
            columns = {"prompt_text_column": pref_column(cfg, pref, "prompt"),
                       "text_column": pref_column(cfg, pref, "chosen"),
                       "rejected_text_column": pref_column(cfg, pref, "rejected")}
        else:   # llm-sft: the column of messages the chat template renders
            columns = {"text_column": _messages_column(cfg, fmt) if fmt else cfg.text_column}
    if not llm and not image:
        columns["target_column"] = cfg.label_column
    data: dict[str, Any] = {"path": path, "train_split": split, "valid_split": None}
    if llm:   # None: plain text, as nbtrain reads it
        data["chat_template"] = ("chatml" if cfg.chat_template == "chatml" else "tokenizer") if fmt or pref else None
    data["column_mapping"] = columns
    if cfg.max_steps is not None:
        epochs = math.ceil(cfg.epochs) if cfg.epochs else 1
    else:
        epochs = math.ceil(cfg.epochs)
    warmup_ratio = round(cfg.warmup_steps / cfg.max_steps, 6) if cfg.warmup_steps and cfg.max_steps else 0.0
    params: dict[str, Any] = {}
    if llm:
        params.update(block_size=cfg.max_seq_len, model_max_length=cfg.max_seq_len, padding="right")
    elif not image:
        params["max_seq_length"] = cfg.max_seq_len
    if pref:
        # TRL (0.13) cuts the prompt to max_prompt_length, then the answers to the rest of block_size (see the notes)
        params["max_prompt_length"] = _max_prompt_length(cfg.max_seq_len)
        if cfg.objective == "dpo":
            params["dpo_beta"] = cfg.pref_beta
    params.update(epochs=epochs, batch_size=cfg.micro_batch_size, gradient_accumulation=cfg.grad_accum_steps,
                  lr=cfg.lr, optimizer=OPTIM_NAMES[cfg.optimizer], scheduler=hf_scheduler(cfg),
                  warmup_ratio=warmup_ratio, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm or 0.0,
                  seed=cfg.seed,
                  # bf16-pure and fp8 have no AutoTrain value: bf16 is the nearest (the notes say so)
                  mixed_precision="fp16" if precision == "fp16" else
                  "bf16" if precision in ("bf16", "bf16-pure", "fp8") else "none",
                  logging_steps=cfg.log_every)
    if llm:
        params.update(
            peft=cfg.method != "full",
            quantization={4: "int4", 8: "int8"}[cfg.quant_bits] if cfg.method == "qlora" else "none",
            target_modules=targets_out(cfg.lora_targets, "all-linear"), merge_adapter=False,
            lora_r=cfg.lora_r, lora_alpha=int(round(cfg.lora_alpha)), lora_dropout=cfg.lora_dropout,
            disable_gradient_checkpointing=not cfg.gradient_checkpointing,
            # AutoTrain's default; written so the file says how several GPUs run (FSDP: see the notes)
            distributed_backend="ddp")
    at_task = (AT_PREF_TASKS[cfg.objective] if pref else "llm-sft" if fmt else "llm") if llm else \
        "image_classification" if image else "text_multi_class_classification"
    base_model, model_notes = export_model(cfg, "AutoTrain")
    notes.update(model_notes)
    doc = {"task": at_task, "base_model": base_model,
           "project_name": name, "log": "none", "backend": "local", "data": data, "params": params}
    return doc, notes


def _max_prompt_length(max_seq_len: int) -> int:
    return max(1, max_seq_len // 2)


def _pref_notes(cfg: TrainConfig, pref: str) -> dict[str, str]:
    """What AutoTrain's llm-dpo / llm-orpo cannot say of a preference config."""
    notes = pref_notes(cfg, "AutoTrain")
    if cfg.objective == "orpo" and cfg.pref_beta != AT_ORPO_BETA:
        notes["pref_beta"] = (f"pref_beta={cfg.pref_beta} (ORPO's lambda): AutoTrain's llm-orpo runs TRL's ORPOConfig "
                              f"with its default beta {AT_ORPO_BETA} (dpo_beta is passed to DPO only); not exported")
    if cfg.precompute_ref:
        notes["precompute_ref"] = ("precompute_ref=True has no AutoTrain key: TRL's DPOTrainer computes the "
                                   "reference log-probs at every step, from a frozen copy of the model for a full "
                                   "fine-tune (more memory than this config's run); not exported")
    if pref != "preference":
        notes["data_format"] = (f"data_format={cfg.data_format!r}: AutoTrain reads prompt, chosen and rejected "
                                f"columns; convert the {pref} ranking rows (prompt_text_column names "
                                f"{pref_column(cfg, pref, 'prompt')!r} meanwhile)")
    extra = sorted(set(cfg.columns) - {"prompt", "chosen", "rejected"}) if pref == "preference" else []
    if extra:
        notes["columns"] = f"columns {extra}: AutoTrain maps only the prompt, chosen and rejected columns"
    # keyed without a field: these say how AutoTrain reads the rows, data_format and columns still read back
    notes["conversational"] = (
        "AutoTrain's llm-dpo/llm-orpo with a chat template (data.chat_template) read chosen and rejected as whole "
        "conversations, lists of role/content messages with the prompt's turns first; it takes the prompt from "
        "chosen's turns before the last (the prompt column must exist but is not used): convert prompt/chosen/"
        "rejected rows (chosen = the prompt's messages + the chosen answer, rejected likewise)")
    notes["truncation"] = (
        f"nbtrain cuts a prompt too long for max_seq_len from its left and keeps both answers whole; AutoTrain (TRL "
        f"0.13) cuts the prompt to max_prompt_length={_max_prompt_length(cfg.max_seq_len)} (half of block_size, as "
        "written) and then the answers to the rest; rows that fit are the same")
    if cfg.chat_template not in ("auto", "chatml"):
        name = "a Jinja string" if cfg.chat_template not in ("llama3", "alpaca") else repr(cfg.chat_template)
        notes["chat_template"] = (f"chat_template {name} has no AutoTrain name (None, chatml, zephyr, tokenizer): "
                                  "exported as tokenizer, the model's own template; set the tokenizer's "
                                  "chat_template to it where the model's differs")
    return notes


def _messages_column(cfg: TrainConfig, fmt: str) -> str:
    main = {"messages": "messages", "sharegpt": "conversations", "alpaca": "instruction", "prompt-completion": "prompt"}
    return column(cfg, main[fmt])


def _sft_notes(cfg: TrainConfig, fmt: str) -> dict[str, str]:
    notes: dict[str, str] = {}
    if fmt != "messages":
        notes["data_format"] = (f"data_format={cfg.data_format!r}: AutoTrain's llm-sft reads one column of role/content "
                                f"messages; convert the {fmt} rows to a 'messages' column (text_column names "
                                f"{_messages_column(cfg, fmt)!r} meanwhile)")
    extra = sorted(set(cfg.columns) - {"messages"}) if fmt == "messages" else []
    if extra:
        notes["columns"] = f"columns {extra}: AutoTrain maps only the messages column (text_column)"
    if cfg.chat_template not in ("auto", "chatml"):
        name = "a Jinja string" if cfg.chat_template not in ("llama3", "alpaca") else repr(cfg.chat_template)
        notes["chat_template"] = (f"chat_template {name} has no AutoTrain name (None, chatml, zephyr, tokenizer): "
                                  "exported as tokenizer, the model's own template; set the tokenizer's "
                                  "chat_template to it where the model's differs")
    if cfg.train_on != "all":
        notes["train_on"] = (f"train_on={cfg.train_on!r}: AutoTrain's llm-sft trains every token of the rendered "
                             "chat, prompts too (train_on='all')")
    return notes


def to_autotrain_yaml(cfg: TrainConfig, path=None) -> str:
    """An AutoTrain Advanced YAML (``autotrain --config FILE``); written to ``path`` when given."""
    doc, notes = autotrain_config(cfg)
    header = ["AutoTrain Advanced config exported by nbtrain; run: autotrain --config <this file>"]
    top = {k: doc[k] for k in ("task", "base_model", "project_name", "log", "backend")}
    return write_text(yaml_text([(None, top), (None, {"data": doc["data"]}), (None, {"params": doc["params"]})],
                             header, notes), path)


def read_autotrain_yaml(path, **overrides: Any) -> tuple[TrainConfig, dict[str, Any]]:
    """``(TrainConfig, unmapped)`` from an AutoTrain YAML; ``unmapped`` uses dotted keys (``params.unsloth``).
    No warning here: ``from_autotrain_yaml`` warns."""
    cfg, unmapped, _ = _read_autotrain(path, overrides)
    return cfg, unmapped


def from_autotrain_yaml(path, **overrides: Any) -> TrainConfig:
    """The TrainConfig of an AutoTrain YAML; keys that do not map are named in a ``UserWarning``."""
    cfg, _, message = _read_autotrain(path, overrides)
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    return cfg


def _none(v) -> bool:
    return v is None or str(v).strip().lower() in ("none", "no", "null", "")


def _read_autotrain(path, overrides):
    flat = flatten(load_yaml_mapping(path))
    task = str(flat.get("task"))
    if task in _AT_CLF_TASKS:
        defaults, nb_task = _AT_CLF_DEFAULTS, "sequence-classification"
    elif task in _AT_IMG_TASKS:
        defaults, nb_task = _AT_IMG_DEFAULTS, "image-classification"
    else:
        defaults, nb_task = _AT_LLM_DEFAULTS, "causal-lm"
    r = Reader(flat, defaults, str(path))
    kw = r.kw
    r.drop("task")
    kw["task"] = nb_task
    llm = nb_task == "causal-lm"
    image = nb_task == "image-classification"
    if task not in _AT_LLM_TASKS + _AT_CLF_TASKS + _AT_IMG_TASKS:
        r.hard["task"] = (f"task: {task!r} has no nbtrain equivalent (llm, llm-sft, text or image "
                          "classification)")
    # AutoTrain's parser takes the trainer from the task's suffix (llm-dpo: dpo) over params.trainer
    trainer = task.split("-", 1)[1] if task.startswith("llm-") else None
    if r.has("params.trainer"):
        given = r.doc["params.trainer"]
        if llm and given in ("default", "sft", "generic", "dpo", "orpo"):
            r.drop("params.trainer")
            trainer = trainer or given
        else:
            r.hard["task"] = f"params.trainer: {given!r} has no nbtrain equivalent (default, sft, dpo or orpo)"
    objective = {"dpo": "dpo", "orpo": "orpo"}.get(trainer) if llm else None
    if r.has("base_model"):
        kw["model"] = str(r.take("base_model"))
    elif "model" not in overrides:
        r.hard["model"] = "base_model: missing"
    kw["output_dir"] = str(r.take("project_name"))
    for key, ok in (("log", "none"), ("backend", "local")):
        if r.has(key) and str(r.doc[key]).lower().startswith(ok):
            r.drop(key)

    data_path = r.take("data.path")
    split = str(r.take("data.train_split"))
    if data_path is None:
        if "data" not in overrides:
            r.hard["data"] = "data.path: missing"
    elif image:
        folder = Path(str(data_path)).expanduser() / split
        kw["data"] = str(folder) if folder.is_dir() else str(data_path)
        if not folder.is_dir() and split != "train":
            r.unmapped["data.train_split"] = split
            r.why["data.train_split"] = "nbtrain reads a dataset's 'train' split (or a local image folder)"
    else:
        kw["data"] = _at_data(r, str(data_path), split)
    if r.has("data.valid_split") and _none(r.doc["data.valid_split"]):
        r.drop("data.valid_split")
    template = r.doc.pop("data.chat_template", None)
    chat = llm and not _none(template)
    if chat:
        _at_template_in(r, str(template))
    if objective:
        _pref_in(r, objective, template)
    elif image:
        kw["image_column"] = str(r.take("data.column_mapping.image_column"))
    elif chat:   # the column holds the messages the template renders
        kw["data_format"] = "messages"
        col = str(r.take("data.column_mapping.text_column"))
        if col != "messages":
            kw["columns"] = {"messages": col}
        kw["train_on"] = "all"   # AutoTrain trains every token of the rendered chat
    else:
        kw["text_column"] = str(r.take("data.column_mapping.text_column"))
    if not llm:
        kw["label_column"] = str(r.take("data.column_mapping.target_column"))

    if llm:
        block = r.take("params.block_size")
        mml = r.take("params.model_max_length", int)
        if isinstance(block, list):
            r.reject("params.block_size", block, "a list of block sizes; nbtrain has one max_seq_len")
            block = None
        kw["max_seq_len"] = number(block, int) if block is not None and number(block) > 0 else mml
        if r.has("params.padding") and r.doc["params.padding"] == "right":
            r.drop("params.padding")
        if objective:
            _pref_lengths_in(r, kw["max_seq_len"], "params.max_prompt_length" in flat)
    elif not image:
        kw["max_seq_len"] = r.take("params.max_seq_length", int)
    kw["micro_batch_size"] = r.take("params.batch_size", int)
    kw["grad_accum_steps"] = r.take("params.gradient_accumulation", int)
    kw["lr"] = r.take("params.lr", float)
    kw["weight_decay"] = r.take("params.weight_decay", float)
    kw["epochs"] = r.take("params.epochs", float)
    kw["max_steps"] = None   # AutoTrain trains whole epochs
    kw["seed"] = r.take("params.seed", int)
    norm = r.take("params.max_grad_norm", float)
    kw["max_grad_norm"] = norm if norm and norm > 0 else None
    log = r.take("params.logging_steps", int)
    if log > 0:   # -1: AutoTrain picks; nbtrain keeps its default
        kw["log_every"] = log
    ratio = r.take("params.warmup_ratio", float)
    if ratio:   # a share of a step count AutoTrain derives from the data
        r.unmapped["params.warmup_ratio"] = ratio
        r.why["params.warmup_ratio"] = ("a share of all steps, known only from the data" +
                                        ("" if "params.warmup_ratio" in flat else " (AutoTrain's default)") +
                                        "; set warmup_steps")
    scheduler_in(r, "params.scheduler", 0)
    optimizer_in(r, "params.optimizer")
    mp = r.take("params.mixed_precision")
    if _none(mp):
        kw["precision"] = "fp32"
    elif str(mp) in ("fp16", "bf16"):
        kw["precision"] = str(mp)
    else:
        r.hard["precision"] = f"params.mixed_precision: {mp!r} (fp16, bf16 or none)"

    if llm:
        peft = bool(r.take("params.peft"))
        quant = r.take("params.quantization")
        if peft:
            bits = {"int4": 4, "int8": 8}.get(str(quant).lower())
            kw["method"] = "qlora" if bits else "lora"
            if bits:
                kw["quant_bits"] = bits
        else:
            kw["method"] = "full"   # AutoTrain quantises only with peft
        kw["lora_r"] = r.take("params.lora_r", int)
        kw["lora_alpha"] = r.take("params.lora_alpha", float)
        kw["lora_dropout"] = r.take("params.lora_dropout", float)
        targets = r.take("params.target_modules")
        if _none(targets):
            r.unmapped["params.target_modules"] = targets
            r.why["params.target_modules"] = "AutoTrain then picks per model; nbtrain used 'all-linear'"
        kw["lora_targets"] = targets_in(targets, ("all-linear", "none", "null", ""))
        kw["gradient_checkpointing"] = not bool(r.take("params.disable_gradient_checkpointing"))
        if r.has("params.merge_adapter") and not r.doc["params.merge_adapter"]:
            r.drop("params.merge_adapter")
        _backend_in(r, overrides)
    else:
        kw["method"] = "full"
    return r.finish(overrides)


def _pref_in(r: Reader, objective: str, template) -> None:
    """llm-dpo / llm-orpo: objective, pref_beta (dpo_beta for DPO; llm-orpo leaves ORPO's lambda at TRL's default)
    and the column mapping (prompt_text_column, text_column = chosen, rejected_text_column) as data_format
    "preference" and columns."""
    kw = r.kw
    kw["objective"] = objective
    kw["data_format"] = "preference"
    if objective == "dpo":
        kw["pref_beta"] = r.take("params.dpo_beta", float)
    else:
        kw["pref_beta"] = AT_ORPO_BETA
        if r.has("params.dpo_beta"):
            r.reject("params.dpo_beta", r.doc["params.dpo_beta"], "llm-orpo does not pass dpo_beta on: TRL's "
                     f"ORPOConfig keeps its beta (ORPO's lambda) at {AT_ORPO_BETA}, which nbtrain's pref_beta took")
    if _none(template):
        r.unmapped["data.chat_template"] = template
        r.why["data.chat_template"] = ("AutoTrain then passes prompt, chosen and rejected as raw text, without a "
                                       "chat template; nbtrain renders them with the model's (chat_template='auto')")
    columns = {}
    for role, key in (("prompt", "prompt_text_column"), ("chosen", "text_column"),
                      ("rejected", "rejected_text_column")):
        full = f"data.column_mapping.{key}"
        if not r.has(full) and role != "chosen":   # AutoTrain renames a missing column and fails
            r.hard["columns"] = f"{full}: missing (llm-{objective} reads prompt, chosen and rejected columns)"
            continue
        name = str(r.take(full))
        if name != role:
            columns[role] = name
    if columns:
        kw["columns"] = columns


def _pref_lengths_in(r: Reader, max_seq_len: int, given: bool) -> None:
    """max_prompt_length / max_completion_length / model_ref of llm-dpo and llm-orpo: what nbtrain's export writes
    (half of block_size, none, none) maps; another prompt or answer limit, or a separate reference model, is
    unmapped."""
    limit = r.take("params.max_prompt_length", int)
    if limit != _max_prompt_length(max_seq_len):
        r.unmapped["params.max_prompt_length"] = limit
        r.why["params.max_prompt_length"] = (("" if given else "AutoTrain's default; ") + "TRL cuts prompts to it; "
                                             "nbtrain cuts a prompt only when prompt and answer exceed max_seq_len, "
                                             "from its left, keeping both answers")
    if r.has("params.max_completion_length"):
        v = r.doc["params.max_completion_length"]
        if _none(v):
            r.drop("params.max_completion_length")
        else:
            r.reject("params.max_completion_length", v, "a limit on each answer; nbtrain keeps answers whole "
                     "within max_seq_len")
    if r.has("params.model_ref"):
        v = r.doc["params.model_ref"]
        if _none(v) or r.doc.get("params.peft") is True:   # with peft AutoTrain drops model_ref itself
            r.drop("params.model_ref")
        else:
            r.reject("params.model_ref", v, "a separate reference model; nbtrain's reference is the model itself "
                     "(adapters off, or a frozen copy of the starting weights)")


def _backend_in(r: Reader, overrides: dict) -> None:
    """params.distributed_backend: ddp (or unset, AutoTrain's ddp) is sharding="none"; deepspeed (ZeRO-3) has no
    nbtrain equivalent: an error naming it, unless ``sharding`` is passed."""
    key = "params.distributed_backend"
    value = r.doc.pop(key, None)
    if _none(value) or str(value).lower() == "ddp":
        r.kw["sharding"] = "none"
        return
    if str(value).lower() == "deepspeed":
        why = ("AutoTrain's DeepSpeed ZeRO-3 (parameters, gradients and optimizer state sharded, no offload); nbtrain "
               "has no DeepSpeed: its nearest is sharding='fsdp' (FSDP2 full sharding), or 'none' for DDP")
    else:
        why = "AutoTrain takes ddp or deepspeed (it refuses other backends)"
    r.unmapped[key], r.why[key] = value, why + ("; sharding=%r was passed" % overrides["sharding"]
                                                if "sharding" in overrides else "")
    r.hard["sharding"] = f"{key}: {value!r}: {why}"


def _at_template_in(r: Reader, name: str) -> None:
    if name in AT_CHAT_TEMPLATES:
        r.kw["chat_template"] = AT_CHAT_TEMPLATES[name]
    else:   # zephyr, or a name AutoTrain itself would not apply: never replaced silently
        r.hard["chat_template"] = (f"data.chat_template: {name!r} is not a template nbtrain has (AutoTrain's chatml "
                                   "and tokenizer map to chatml and auto; or give a Jinja string)")


def _at_data(r: Reader, path: str, split: str) -> str:
    p = Path(path).expanduser()
    if p.is_dir():
        for ext in DATA_EXTS:
            if (p / f"{split}{ext}").is_file():
                return str(p / f"{split}{ext}")
    if split != "train":
        r.unmapped["data.train_split"] = split
        r.why["data.train_split"] = "nbtrain reads a dataset's 'train' split (or a local file)"
    return path


