"""LLaMA-Factory: ``to_llamafactory_yaml`` (``llamafactory-cli train FILE``), ``read_llamafactory_yaml`` and
``from_llamafactory_yaml``. A key missing from a file takes LLaMA-Factory's default (what it would have run)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Optional

from ...config import ConfigError, TrainConfig, load_yaml_mapping
from ...hardware import resolve_precision
from .mapping import (
    NBTRAIN_ONLY,
    Reader,
    hf_scheduler,
    intlike,
    non_default_notes,
    optimizer_in,
    scheduler_in,
    targets_in,
    targets_out,
    write_text,
    yaml_text,
)

# The TrainConfig fields the format carries. A round trip keeps all of them except those named in the
# export's notes.
LLAMAFACTORY_FIELDS = (
    "model", "task", "data", "max_seq_len", "subset", "precision", "micro_batch_size", "grad_accum_steps",
    "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits", "gradient_checkpointing",
    "lr", "weight_decay", "scheduler", "warmup_steps", "max_steps", "epochs", "max_grad_norm", "packing",
    "eval_fraction", "eval_every", "log_every", "seed", "output_dir", "save_every",
)
# LLaMA-Factory's and transformers' defaults for the keys nbtrain reads (what the tool runs when a key is absent)
_LF_DEFAULTS = dict(
    stage="sft", finetuning_type="lora", lora_rank=8, lora_alpha=None, lora_dropout=0.0, lora_target="all",
    quantization_method="bitsandbytes", quantization_type="nf4", double_quantization=True,
    cutoff_len=2048, per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-5,
    lr_scheduler_type="linear", warmup_steps=0, num_train_epochs=3.0, max_steps=-1, max_grad_norm=1.0,
    weight_decay=0.0, seed=42, logging_steps=500, val_size=0.0, eval_strategy="no", save_strategy="steps",
    save_steps=500, output_dir="trainer_output", disable_gradient_checkpointing=False,
)


def llamafactory_config(cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """``(the LLaMA-Factory YAML as a flat dict, notes)``; notes name the fields it cannot carry."""
    sections, notes = _llamafactory_sections(cfg)
    return {k: v for body in sections.values() for k, v in body.items()}, notes


def _llamafactory_sections(cfg: TrainConfig) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    if cfg.task != "causal-lm":
        raise ConfigError(f"task: LLaMA-Factory has no {cfg.task!r} stage (its stages are pt, sft, rm, ppo, "
                          "dpo, kto); only task='causal-lm' exports", field="task")
    notes: dict[str, str] = {}
    precision = resolve_precision(cfg.precision)
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if cfg.method != "qlora" and cfg.quant_bits != 4:
        notes["quant_bits"] = f"quant_bits={cfg.quant_bits} is only written for method='qlora'"
    if cfg.data.startswith("builtin:"):
        notes["data"] = (f"{cfg.data!r} is an nbtrain builtin: write its texts to a file and register that "
                         "file under this dataset name")
    if cfg.output_dir is None:
        notes["output_dir"] = "output_dir=None: written as 'runs/llamafactory' (LLaMA-Factory needs one)"
    notes.update(non_default_notes(cfg, ("nonfinite", "auto_batch_size", "resume_from"),
                                    "has no LLaMA-Factory key"))
    notes.update(non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no LLaMA-Factory "
                                                       "key (the same training without it)"))
    model = {"model_name_or_path": cfg.model}
    if cfg.method == "qlora":
        model.update(quantization_bit=cfg.quant_bits, quantization_method="bitsandbytes")
        if cfg.quant_bits == 4:
            model.update(quantization_type="nf4", double_quantization=True)   # nbtrain's nf4 + double quant
    # LLaMA-Factory checkpoints by default; nbtrain only when asked
    model["disable_gradient_checkpointing"] = not cfg.gradient_checkpointing
    method = dict(stage="pt",   # nbtrain's causal-lm is plain language modelling on every token
                  do_train=True, finetuning_type="full" if cfg.method == "full" else "lora",
                  lora_rank=cfg.lora_r, lora_alpha=intlike(cfg.lora_alpha), lora_dropout=cfg.lora_dropout,
                  lora_target=targets_out(cfg.lora_targets, "all"))
    dataset: dict[str, Any] = dict(dataset=cfg.data, cutoff_len=cfg.max_seq_len)
    if cfg.subset is not None:
        dataset["max_samples"] = cfg.subset
    dataset["packing"] = cfg.packing   # explicit: stage pt packs by default
    dataset["val_size"] = cfg.eval_fraction
    output: dict[str, Any] = dict(output_dir=cfg.output_dir or "runs/llamafactory", logging_steps=cfg.log_every)
    if cfg.save_every:
        output.update(save_strategy="steps", save_steps=cfg.save_every)
    else:
        output["save_strategy"] = "no"
    output["report_to"] = "none"
    train: dict[str, Any] = dict(
        per_device_train_batch_size=cfg.micro_batch_size, gradient_accumulation_steps=cfg.grad_accum_steps,
        learning_rate=cfg.lr, lr_scheduler_type=hf_scheduler(cfg), warmup_steps=cfg.warmup_steps)
    if cfg.max_steps is not None:
        train["max_steps"] = cfg.max_steps
    if cfg.epochs is not None:
        train["num_train_epochs"] = cfg.epochs
    train.update(max_grad_norm=cfg.max_grad_norm or 0.0, weight_decay=cfg.weight_decay, seed=cfg.seed,
                 optim="adamw_torch", bf16=precision == "bf16", fp16=precision == "fp16")
    if precision == "tf32":
        train["tf32"] = True
    evals: dict[str, Any] = {"eval_strategy": "steps" if cfg.eval_every else "no"}
    if cfg.eval_every:
        evals.update(eval_steps=cfg.eval_every, per_device_eval_batch_size=cfg.micro_batch_size)
    sections = {"model": model, "method": method, "dataset": dataset, "output": output, "train": train,
                "eval": evals}
    return sections, notes


def to_llamafactory_yaml(cfg: TrainConfig, path=None) -> str:
    """A LLaMA-Factory training YAML (``llamafactory-cli train FILE``); written to ``path`` when given."""
    sections, notes = _llamafactory_sections(cfg)
    info = ('"%s": {"file_name": "<your file>", "columns": {"prompt": "%s"}}' % (cfg.data, cfg.text_column))
    header = ["LLaMA-Factory config exported by nbtrain; run: llamafactory-cli train <this file>",
              f"the dataset must be registered in data/dataset_info.json, e.g. {info}"]
    return write_text(yaml_text(list(sections.items()), header, notes), path)


def read_llamafactory_yaml(path, **overrides: Any) -> tuple[TrainConfig, dict[str, Any]]:
    """``(TrainConfig, unmapped)`` from a LLaMA-Factory YAML; ``unmapped`` holds the keys (and values)
    with no nbtrain equivalent. No warning here: ``from_llamafactory_yaml`` warns."""
    cfg, unmapped, _ = _read_llamafactory(path, overrides)
    return cfg, unmapped


def from_llamafactory_yaml(path, **overrides: Any) -> TrainConfig:
    """The TrainConfig of a LLaMA-Factory YAML; keys that do not map are named in a ``UserWarning``."""
    cfg, _, message = _read_llamafactory(path, overrides)
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    return cfg


def _read_llamafactory(path, overrides):
    r = Reader(load_yaml_mapping(path), _LF_DEFAULTS, str(path))
    kw = r.kw
    if r.has("model_name_or_path"):
        kw["model"] = str(r.take("model_name_or_path"))
    elif "model" not in overrides:
        r.hard["model"] = "model_name_or_path: missing"

    stage = r.take("stage")
    kw["task"] = "causal-lm"
    if stage == "sft":   # sft with a template masks the prompt; nbtrain learns every token of plain text
        r.unmapped["stage"], r.why["stage"] = stage, "imported as plain causal-lm: nbtrain does not mask prompts"
    elif stage != "pt":
        r.hard["task"] = f"stage: {stage!r} has no nbtrain equivalent (nbtrain runs pt, plain causal-lm)"
    if r.has("do_train"):
        if r.doc["do_train"] is True:
            r.drop("do_train")
        else:
            r.reject("do_train", r.doc["do_train"], "nbtrain always trains")

    ftype = r.take("finetuning_type")
    bits = r.take("quantization_bit", int)
    if ftype == "full":
        kw["method"] = "full"
        if bits:
            r.hard["method"] = "quantization_bit: needs finetuning_type lora"
    elif ftype == "lora":
        kw["method"] = "qlora" if bits else "lora"
        if bits:
            kw["quant_bits"] = bits
            qm = r.take("quantization_method")
            if qm != "bitsandbytes":
                r.hard["method"] = f"quantization_method: {qm!r}; nbtrain's qlora uses bitsandbytes"
            if bits == 4:
                for key, want in (("quantization_type", "nf4"), ("double_quantization", True)):
                    v = r.take(key)
                    if v != want:
                        r.reject(key, v, f"nbtrain's 4-bit qlora is nf4 with double quantisation ({key}={want!r})")
    else:
        r.hard["method"] = f"finetuning_type: {ftype!r} has no nbtrain equivalent (full or lora)"
    for key in ("quantization_method", "quantization_type", "double_quantization"):
        if not bits and r.has(key):   # without quantization_bit these are inert in LLaMA-Factory too
            r.drop(key)
    rank = r.take("lora_rank", int)
    kw["lora_r"] = rank
    alpha = r.take("lora_alpha", float)
    kw["lora_alpha"] = alpha if alpha is not None else 2 * rank   # LLaMA-Factory: alpha defaults to 2 x rank
    kw["lora_dropout"] = r.take("lora_dropout", float)
    kw["lora_targets"] = targets_in(r.take("lora_target"), ("all",))

    dataset = r.take("dataset")
    if dataset is None:
        if "data" not in overrides:
            r.hard["data"] = "dataset: missing"
    elif "," in str(dataset):
        r.hard["data"] = f"dataset: {dataset!r} names several datasets; nbtrain trains on one"
    else:
        kw["data"] = _lf_dataset(r, str(dataset))
    kw["max_seq_len"] = r.take("cutoff_len", int)
    kw["subset"] = r.take("max_samples", int)
    packing = r.take("packing")
    kw["packing"] = bool(packing) if packing is not None else stage == "pt"   # LLaMA-Factory packs pt by default
    if r.has("neat_packing") and not r.doc["neat_packing"]:
        r.drop("neat_packing")
    val = r.take("val_size", float)
    if val >= 1:
        r.reject("val_size", val, "a count of examples; nbtrain's eval_fraction is a share below 1")
    else:
        kw["eval_fraction"] = val

    kw["micro_batch_size"] = r.take("per_device_train_batch_size", int)
    kw["grad_accum_steps"] = r.take("gradient_accumulation_steps", int)
    kw["lr"] = r.take("learning_rate", float)
    kw["weight_decay"] = r.take("weight_decay", float)
    max_steps = r.take("max_steps", int)
    kw["max_steps"] = max_steps if max_steps > 0 else None
    if r.has("num_train_epochs"):
        kw["epochs"] = r.take("num_train_epochs", float)
    else:   # the tool's 3 epochs only matter when max_steps does not decide
        kw["epochs"] = None if kw["max_steps"] else r.take("num_train_epochs", float)
    warmup = _warmup_steps(r, kw["max_steps"])
    scheduler_in(r, "lr_scheduler_type", warmup)
    norm = r.take("max_grad_norm", float)
    kw["max_grad_norm"] = norm if norm and norm > 0 else None   # 0 disables clipping in both
    kw["seed"] = r.take("seed", int)
    kw["output_dir"] = str(r.take("output_dir"))
    log = r.take("logging_steps", float)
    if log >= 1 and float(log).is_integer():
        kw["log_every"] = int(log)
    else:
        r.reject("logging_steps", log, "a ratio of the run; nbtrain's log_every counts steps")
    optimizer_in(r, "optim")
    if r.has("report_to") and str(r.doc["report_to"]).lower() == "none":
        r.drop("report_to")

    bf16, fp16 = bool(r.take("bf16")), bool(r.take("fp16"))
    tf32 = r.take("tf32")
    if bf16 and fp16:
        r.hard["precision"] = "bf16 and fp16 are both true"
    kw["precision"] = "bf16" if bf16 else "fp16" if fp16 else "tf32" if tf32 else "fp32"
    if tf32 and (bf16 or fp16):
        r.unmapped["tf32"], r.why["tf32"] = tf32, f"nbtrain's {kw['precision']} does not also enable tf32"

    gc = not bool(r.take("disable_gradient_checkpointing"))
    for key in ("gradient_checkpointing", "activation_checkpointing"):   # transformers' flags turn it on too
        if r.has(key):
            gc = gc or bool(r.take(key))
    kw["gradient_checkpointing"] = gc

    strategy = str(r.take("eval_strategy"))
    eval_steps = r.take("eval_steps", int)
    if strategy == "steps":
        kw["eval_every"] = eval_steps or kw.get("log_every")   # transformers: eval_steps defaults to logging_steps
        if r.has("per_device_eval_batch_size") and r.doc["per_device_eval_batch_size"] == kw["micro_batch_size"]:
            r.drop("per_device_eval_batch_size")
    elif strategy != "no":
        r.unmapped["eval_strategy"], r.why["eval_strategy"] = strategy, "nbtrain evaluates every N steps"
    save = str(r.take("save_strategy"))
    save_steps = r.take("save_steps", int)
    if save == "steps":
        kw["save_every"] = save_steps
    elif save != "no":
        r.unmapped["save_strategy"], r.why["save_strategy"] = save, "nbtrain saves every N steps"
    return r.finish(overrides)


def _lf_dataset(r: Reader, name: str) -> str:
    """A name in ``dataset_dir/dataset_info.json`` becomes its file or Hub id (and text column), else as-is."""
    ddir = r.take("dataset_dir")
    if ddir is None:
        return name
    info_file = Path(str(ddir)) / "dataset_info.json"
    try:
        entry = json.loads(info_file.read_text()).get(name)
    except (OSError, ValueError):
        entry = None
    if not isinstance(entry, dict):
        r.unmapped["dataset_dir"], r.why["dataset_dir"] = ddir, f"{name!r} is not in {info_file}"
        return name
    prompt = (entry.get("columns") or {}).get("prompt")
    if prompt:
        r.kw["text_column"] = prompt
    if entry.get("file_name"):
        return str(Path(str(ddir)) / entry["file_name"])
    return str(entry.get("hf_hub_url") or name)


def _warmup_steps(r: Reader, max_steps: Optional[int]) -> int:
    """transformers 5: warmup_steps >= 1 counts steps, below 1 is a ratio (warmup_ratio in older versions)."""
    steps = r.take("warmup_steps", float) or 0
    ratio = r.take("warmup_ratio", float) if r.has("warmup_ratio") else 0
    key = "warmup_ratio"
    if 0 < steps < 1:
        ratio, steps, key = steps, 0, "warmup_steps"
    if ratio:
        if max_steps:   # what transformers computes: ceil(ratio x total steps)
            return math.ceil(ratio * max_steps)
        r.unmapped[key], r.why[key] = ratio, "a share of a step count known only from the data; set warmup_steps"
        return 0
    return int(steps)


