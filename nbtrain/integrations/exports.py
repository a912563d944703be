"""Exports of a TrainConfig to the tools people run in production, and imports back.

- ``to_training_arguments(cfg)``: a ``transformers.TrainingArguments`` for the same run, with
  ``.peft_config`` (a ``peft.LoraConfig``) and ``.quantization_config`` (a ``BitsAndBytesConfig``)
  attached as attributes (None when the method does not use them); ``peft_and_quant_configs(cfg)``
  returns the same pair. The Trainer reads neither: pass them to ``from_pretrained`` /
  ``get_peft_model`` (or to TRL's ``SFTTrainer(peft_config=...)``).
- ``to_llamafactory_yaml`` / ``read_llamafactory_yaml`` / ``from_llamafactory_yaml``
- ``to_autotrain_yaml`` / ``read_autotrain_yaml`` / ``from_autotrain_yaml``
- ``to_accelerate_config_yaml``: an ``accelerate launch --config_file`` for several processes.

Each export also returns (``*_config``) or writes (as YAML comments) its *notes*: the fields the
other tool cannot express or runs differently. Imports map every key they know; a key (or a value)
with no nbtrain equivalent is never dropped silently: ``read_*`` returns it in ``unmapped`` and
``from_*`` names it in a ``UserWarning``. A key that is missing takes the *tool's* default (what
that tool would have run), not nbtrain's.

Where the maths differs from nbtrain's own loop (documented, kept small):

- Warm-up. nbtrain's factor during warm-up is ``(done + 1) / (warmup + 1)``: its first step already
  moves. Hugging Face's is ``done / warmup``: its first step has lr 0. After warm-up both decay the
  same way (constant, linear, or half a cosine to 0 at the last step). With ``warmup_steps=0`` the
  schedules are identical. ``constant`` with warm-up exports as ``constant_with_warmup``, because
  Hugging Face's ``constant`` ignores ``warmup_steps``.
- Weight decay. nbtrain decays every trainable parameter; the Trainer exempts biases and norm
  weights. Identical when ``weight_decay=0`` (the default).
- For the exact nbtrain optimizer and schedule in a Trainer, pass
  ``Trainer(optimizers=nbtrain_optimizer_and_scheduler(cfg, model, total_steps))``.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import yaml

from ..config import ConfigError, TrainConfig, load_yaml_mapping

# The TrainConfig fields each YAML format can carry. A round trip keeps all of them except those
# named in the export's notes (for instance max_steps, which AutoTrain cannot express).
LLAMAFACTORY_FIELDS = (
    "model", "task", "data", "max_seq_len", "subset", "precision", "micro_batch_size", "grad_accum_steps",
    "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits", "gradient_checkpointing",
    "lr", "weight_decay", "scheduler", "warmup_steps", "max_steps", "epochs", "max_grad_norm", "packing",
    "eval_fraction", "eval_every", "log_every", "seed", "output_dir", "save_every",
)
AUTOTRAIN_FIELDS = (
    "model", "task", "data", "text_column", "label_column", "max_seq_len", "precision", "micro_batch_size",
    "grad_accum_steps", "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits",
    "gradient_checkpointing", "lr", "weight_decay", "scheduler", "warmup_steps", "epochs", "max_grad_norm",
    "log_every", "seed", "output_dir",
)

_ADAMW = ("adamw_torch", "adamw_torch_fused")   # torch.optim.AdamW, what nbtrain runs
_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
_DATA_EXTS = (".csv", ".jsonl", ".json", ".parquet", ".txt")


# -----------------------------------------------------------------------------------------------------------
# transformers.TrainingArguments
# -----------------------------------------------------------------------------------------------------------
def _hf_scheduler(cfg: TrainConfig) -> str:
    # Hugging Face's "constant" has no warm-up at all; "constant_with_warmup" is nbtrain's constant
    return "constant_with_warmup" if cfg.scheduler == "constant" and cfg.warmup_steps else cfg.scheduler


def _checkpointing_arg(args_cls: Any = None) -> str:
    # transformers 5.2x renamed gradient_checkpointing to activation_checkpointing (5.24 takes both, the old one
    # deprecated; 5.17 only the old one): the new name where this install's TrainingArguments has it
    if args_cls is None:
        try:
            from transformers import TrainingArguments as args_cls
        except ImportError:
            return "activation_checkpointing"
    names = set(getattr(args_cls, "__dataclass_fields__", {}))
    return "gradient_checkpointing" if "activation_checkpointing" not in names and "gradient_checkpointing" in names \
        else "activation_checkpointing"


def training_arguments_kwargs(cfg: TrainConfig, output_dir: Optional[str] = None,
                              **overrides: Any) -> dict[str, Any]:
    """The keyword arguments of ``to_training_arguments`` (plain values, JSON-friendly)."""
    from ..hardware import default_device

    device = default_device()
    precision = cfg.resolved_precision()
    kw: dict[str, Any] = dict(
        output_dir=output_dir or cfg.output_dir or "runs/hf",
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.micro_batch_size,   # nbtrain evaluates in micro batches too
        gradient_accumulation_steps=cfg.grad_accum_steps,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",   # nbtrain: fused AdamW on CUDA
        lr_scheduler_type=_hf_scheduler(cfg),
        warmup_steps=cfg.warmup_steps,
        # 0 disables clipping; transformers 5 still measures and logs grad_norm, as nbtrain does
        max_grad_norm=cfg.max_grad_norm or 0.0,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1,
        seed=cfg.seed,
        logging_strategy="steps",
        logging_steps=cfg.log_every,
        # a nan/inf loss must show as such (DESIGN rule 5); the Trainer's default hides it behind an average
        logging_nan_inf_filter=False,
        eval_strategy="steps" if cfg.eval_every else "no",
        save_strategy="steps" if cfg.save_every else "no",
        report_to="none",
    )
    ckpt = _checkpointing_arg()
    kw[ckpt] = cfg.gradient_checkpointing
    if cfg.epochs is not None:
        kw["num_train_epochs"] = cfg.epochs   # the Trainer, like nbtrain, lets max_steps win when both are set
    if cfg.eval_every:
        kw["eval_steps"] = cfg.eval_every
    if cfg.save_every:
        kw["save_steps"] = cfg.save_every
    if cfg.gradient_checkpointing:
        kw[f"{ckpt}_kwargs"] = {"use_reentrant": False}   # nbtrain's checkpointing style
    if precision in ("fp16", "bf16", "tf32"):
        kw[precision] = True
    if device == "cpu":
        kw["use_cpu"] = True
    kw.update(overrides)
    return kw


def to_training_arguments(cfg: TrainConfig, output_dir: Optional[str] = None, **overrides: Any):
    """A ``transformers.TrainingArguments`` for ``cfg``; ``overrides`` are passed on as-is.

    Attributes ``peft_config`` and ``quantization_config`` carry the LoRA / bitsandbytes configs (None
    when unused). ``precision="auto"`` is resolved for this machine; the warm-up and weight-decay
    differences are in the module docstring. fp16 on a CPU: accelerate makes no GradScaler there,
    unlike nbtrain's loop, so only CUDA runs compare on fp16.
    """
    from transformers import TrainingArguments

    args = TrainingArguments(**training_arguments_kwargs(cfg, output_dir, **overrides))
    args.peft_config, args.quantization_config = peft_and_quant_configs(cfg)
    return args


def peft_and_quant_configs(cfg: TrainConfig):
    """``(peft.LoraConfig or None, transformers.BitsAndBytesConfig or None)`` exactly as nbtrain builds them."""
    if cfg.method == "full":
        return None, None
    from ..models.loading import ModelError, head_module_names, meta_model
    from ..models.methods import bnb_config, lora_config

    try:   # the architecture (no weights) lets nbtrain check target names and find a classifier's head
        arch = meta_model(cfg.model, cfg.task)
    except ModelError:
        arch = None
    if arch is not None:
        lcfg = lora_config(cfg, arch, cfg.task)
    else:   # a Hub model that is not cached: the same config, unchecked; peft finds the classifier head itself
        from peft import LoraConfig, TaskType

        lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, bias="none",
                          target_modules=cfg.lora_targets if isinstance(cfg.lora_targets, str)
                          else list(cfg.lora_targets),
                          task_type=TaskType.SEQ_CLS if cfg.task == "sequence-classification"
                          else TaskType.CAUSAL_LM)
    qcfg = None
    if cfg.method == "qlora":
        skip = head_module_names(arch) if arch is not None and cfg.task == "sequence-classification" else None
        qcfg = bnb_config(cfg, cfg.resolved_precision(), skip)
    return lcfg, qcfg


def nbtrain_optimizer_and_scheduler(cfg: TrainConfig, model, total_steps: int):
    """nbtrain's own AdamW (weight decay on every trainable parameter) and warm-up/decay schedule, for
    ``Trainer(optimizers=...)`` when the Trainer must follow nbtrain's lr curve exactly."""
    import torch

    from ..engine.loop import make_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and params[0].device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    return opt, make_scheduler(opt, cfg.scheduler, cfg.warmup_steps, total_steps)


# -----------------------------------------------------------------------------------------------------------
# shared helpers
# -----------------------------------------------------------------------------------------------------------
# speed/memory options of nbtrain's own loop: no other tool has their keys, and a run without them computes the same
NBTRAIN_ONLY = ("chunked_loss", "loss_chunk_tokens", "compile", "lean_layers")


def _non_default_notes(cfg: TrainConfig, fields: tuple[str, ...], why: str) -> dict[str, str]:
    """Notes for fields the format cannot carry, when they differ from nbtrain's default."""
    out = {}
    for f in fields:
        v = getattr(cfg, f)
        if v != TrainConfig.model_fields[f].default:
            out[f] = f"{f}={v!r} {why}"
    return out


def _yaml_text(sections: list[tuple[Optional[str], dict]], header: list[str], notes: dict[str, str]) -> str:
    lines = [f"# {h}" for h in header]
    if notes:
        lines.append("# notes (what this file cannot say, or says differently):")
        lines += [f"#   - {n}" for n in notes.values()]
    text = "\n".join(lines) + "\n"
    for title, body in sections:
        if not body:
            continue
        text += ("\n" if text.strip() else "") + (f"### {title}\n" if title else "")
        text += yaml.safe_dump(body, sort_keys=False, default_flow_style=False)
    return text


def _write(text: str, path) -> str:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


def _load_mapping(path) -> dict:
    return load_yaml_mapping(path)


def _flatten(doc: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _num(v, kind=float):
    # PyYAML (YAML 1.1) reads "3e-5" as a string; the tools' own parsers convert it
    if isinstance(v, str):
        v = float(v.strip())
    if kind is int:
        if float(v) != int(v):
            raise ValueError(f"expected an integer, got {v!r}")
        return int(v)
    return float(v)


def _intlike(x: float):
    return int(x) if float(x).is_integer() else x


class _Reader:
    """Takes keys out of a flat document; whatever is not taken (or is set aside) is unmapped."""

    def __init__(self, doc: dict, defaults: dict, where: str):
        self.doc = dict(doc)
        self.defaults = defaults
        self.where = where
        self.kw: dict[str, Any] = {}
        self.unmapped: dict[str, Any] = {}
        self.why: dict[str, str] = {}
        self.hard: dict[str, str] = {}    # field -> problem: an error unless an override sets that field

    def has(self, key: str) -> bool:
        return key in self.doc

    def take(self, key: str, kind=None):
        v = self.doc.pop(key) if key in self.doc else self.defaults.get(key)
        if kind is None or v is None:
            return v
        try:
            return _num(v, kind)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{self.where}: {key}: expected a number, got {v!r}", field=key) from None

    def drop(self, key: str) -> None:
        self.doc.pop(key, None)

    def reject(self, key: str, value, why: str) -> None:
        self.doc.pop(key, None)
        self.unmapped[key] = value
        self.why[key] = why

    def finish(self, overrides: dict) -> tuple[TrainConfig, dict[str, Any], str]:
        for k, v in self.doc.items():
            self.unmapped[k] = v
            self.why.setdefault(k, "no nbtrain equivalent")
        problems = {f: m for f, m in self.hard.items() if f not in overrides}
        if problems:
            raise ConfigError(f"{self.where}: " + "; ".join(problems.values()) +
                              " (pass the field as an override to choose a value)", field=next(iter(problems)))
        try:
            cfg = TrainConfig(**{**self.kw, **overrides})
        except ConfigError as e:
            raise ConfigError(f"{self.where}: {e}", field=e.field, errors=e.errors) from None
        message = ""
        if self.unmapped:
            # a Hub token in the file must not end up in logs
            items = [f"{k}={'<hidden>' if 'token' in k.lower() else repr(v)} ({self.why[k]})"
                     for k, v in self.unmapped.items()]
            message = (f"{self.where}: {len(items)} key(s) do not map to nbtrain and were not used: "
                       + "; ".join(items))
        return cfg, self.unmapped, message


def _scheduler_in(r: _Reader, key: str, warmup: int) -> None:
    name = str(r.take(key)).lower()
    if name not in _SCHEDULERS:
        r.hard["scheduler"] = f"{key}: {name!r} has no nbtrain equivalent (nbtrain has {_SCHEDULERS})"
        return
    if name == "constant" and warmup:
        # the tool's "constant" runs without any warm-up, so the faithful import drops it
        r.unmapped["warmup_steps"] = warmup
        r.why["warmup_steps"] = f"{key}={name!r} runs without warm-up in the tool, so it was not used"
        warmup = 0
    r.kw["scheduler"] = "constant" if name == "constant_with_warmup" else name
    r.kw["warmup_steps"] = warmup


def _optimizer_in(r: _Reader, key: str) -> None:
    if r.has(key):
        name = str(r.doc[key])
        if name in _ADAMW:
            r.drop(key)
        else:
            r.reject(key, name, "nbtrain always uses torch AdamW with default betas and eps")


def _targets_out(targets, all_name: str) -> str:
    return all_name if isinstance(targets, str) else ",".join(targets)


def _targets_in(value, all_names: tuple[str, ...]):
    if value is None or str(value).strip().lower() in all_names:
        return "all-linear"
    return [t.strip() for t in str(value).split(",") if t.strip()]


# -----------------------------------------------------------------------------------------------------------
# LLaMA-Factory
# -----------------------------------------------------------------------------------------------------------
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
    precision = cfg.resolved_precision()
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if cfg.method != "qlora" and cfg.quant_bits != 4:
        notes["quant_bits"] = f"quant_bits={cfg.quant_bits} is only written for method='qlora'"
    if cfg.data.startswith("builtin:"):
        notes["data"] = (f"{cfg.data!r} is an nbtrain builtin: write its texts to a file and register that "
                         "file under this dataset name")
    if cfg.output_dir is None:
        notes["output_dir"] = "output_dir=None: written as 'runs/llamafactory' (LLaMA-Factory needs one)"
    notes.update(_non_default_notes(cfg, ("nonfinite", "auto_batch_size", "resume_from"),
                                    "has no LLaMA-Factory key"))
    notes.update(_non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no LLaMA-Factory "
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
                  lora_rank=cfg.lora_r, lora_alpha=_intlike(cfg.lora_alpha), lora_dropout=cfg.lora_dropout,
                  lora_target=_targets_out(cfg.lora_targets, "all"))
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
        learning_rate=cfg.lr, lr_scheduler_type=_hf_scheduler(cfg), warmup_steps=cfg.warmup_steps)
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
    return _write(_yaml_text(list(sections.items()), header, notes), path)


def read_llamafactory_yaml(path, **overrides: Any) -> tuple[TrainConfig, dict[str, Any]]:
    """``(TrainConfig, unmapped)`` from a LLaMA-Factory YAML; ``unmapped`` holds the keys (and values)
    with no nbtrain equivalent. No warning here: ``from_llamafactory_yaml`` warns."""
    cfg, unmapped, _ = _read_llamafactory(path, overrides)
    return cfg, unmapped


def from_llamafactory_yaml(path, **overrides: Any) -> TrainConfig:
    """The TrainConfig of a LLaMA-Factory YAML; keys that do not map are named in a ``UserWarning``."""
    cfg, _, message = _read_llamafactory(path, overrides)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)
    return cfg


def _read_llamafactory(path, overrides):
    r = _Reader(_load_mapping(path), _LF_DEFAULTS, str(path))
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
    kw["lora_targets"] = _targets_in(r.take("lora_target"), ("all",))

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
    _scheduler_in(r, "lr_scheduler_type", warmup)
    norm = r.take("max_grad_norm", float)
    kw["max_grad_norm"] = norm if norm and norm > 0 else None   # 0 disables clipping in both
    kw["seed"] = r.take("seed", int)
    kw["output_dir"] = str(r.take("output_dir"))
    log = r.take("logging_steps", float)
    if log >= 1 and float(log).is_integer():
        kw["log_every"] = int(log)
    else:
        r.reject("logging_steps", log, "a ratio of the run; nbtrain's log_every counts steps")
    _optimizer_in(r, "optim")
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


def _lf_dataset(r: _Reader, name: str) -> str:
    """A name in ``dataset_dir/dataset_info.json`` becomes its file or Hub id (and text column), else as-is."""
    import json

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


def _warmup_steps(r: _Reader, max_steps: Optional[int]) -> int:
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


# -----------------------------------------------------------------------------------------------------------
# AutoTrain Advanced
# -----------------------------------------------------------------------------------------------------------
# AutoTrain's LLMTrainingParams / TextClassificationParams defaults (what it runs when a key is absent)
_AT_LLM_DEFAULTS = {
    "params.lr": 3e-5, "params.epochs": 1, "params.batch_size": 2, "params.warmup_ratio": 0.1,
    "params.gradient_accumulation": 4, "params.scheduler": "linear", "params.weight_decay": 0.0,
    "params.max_grad_norm": 1.0, "params.seed": 42, "params.quantization": "int4",
    "params.target_modules": "all-linear", "params.peft": False, "params.lora_r": 16, "params.lora_alpha": 32,
    "params.lora_dropout": 0.05, "params.model_max_length": 2048, "params.block_size": -1,
    "params.disable_gradient_checkpointing": False, "params.logging_steps": -1, "project_name": "project-name",
    "data.column_mapping.text_column": "text", "data.train_split": "train",
}
_AT_CLF_DEFAULTS = {
    "params.lr": 5e-5, "params.epochs": 3, "params.batch_size": 8, "params.warmup_ratio": 0.1,
    "params.gradient_accumulation": 1, "params.scheduler": "linear", "params.weight_decay": 0.0,
    "params.max_grad_norm": 1.0, "params.seed": 42, "params.max_seq_length": 128, "params.logging_steps": -1,
    "project_name": "project-name", "data.column_mapping.text_column": "text",
    "data.column_mapping.target_column": "target", "data.train_split": "train",
}
_AT_LLM_TASKS = ("llm", "llm-sft", "llm-generic", "lm_training", "llm_training", "llm_finetuning")
_AT_CLF_TASKS = ("text_multi_class_classification", "text_binary_classification", "text_classification",
                 "text-classification", "text-binary-classification")


def _project_name(output_dir: Optional[str]) -> str:
    # AutoTrain: letters, digits and hyphens only, at most 50 characters; it is also the output directory
    if not output_dir:
        return "nbtrain-run"
    return re.sub(r"[^A-Za-z0-9-]+", "-", output_dir).strip("-")[:50] or "nbtrain-run"


def _split_local_file(data: str) -> tuple[str, str]:
    p = Path(data).expanduser()
    if p.is_file() and p.suffix.lower() in _DATA_EXTS:   # AutoTrain reads <path>/<train_split>.<ext>
        return str(p.parent), p.stem
    return data, "train"


def autotrain_config(cfg: TrainConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """``(the AutoTrain Advanced YAML as a dict, notes)``; notes name the fields it cannot carry."""
    llm = cfg.task == "causal-lm"
    if not llm and cfg.method != "full":
        raise ConfigError(f"method: AutoTrain's text classification fine-tunes the whole model; method="
                          f"{cfg.method!r} does not export (use method='full')", field="method")
    notes: dict[str, str] = {}
    precision = cfg.resolved_precision()
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if precision == "tf32":
        notes["precision"] = "tf32 has no AutoTrain setting; exported as mixed_precision none (fp32)"
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
        notes.update(_non_default_notes(cfg, ("gradient_checkpointing", "lora_r", "lora_alpha", "lora_dropout",
                                              "lora_targets", "quant_bits"),
                                        "has no key in AutoTrain's text classification"))
    name = _project_name(cfg.output_dir)
    if name != cfg.output_dir:
        notes["output_dir"] = f"output_dir={cfg.output_dir!r} becomes project_name {name!r} (letters, digits, -)"
    if cfg.data.startswith("builtin:"):
        notes["data"] = f"{cfg.data!r} is an nbtrain builtin: write its texts to a csv/jsonl file for AutoTrain"
    if llm and not cfg.packing:
        notes["packing"] = "AutoTrain packs causal-LM text into block_size blocks (packing=False has no setting)"
    if cfg.eval_fraction:
        notes["eval_fraction"] = (f"eval_fraction={cfg.eval_fraction}: AutoTrain evaluates only on a named "
                                  "valid_split; none is set")
    notes.update(_non_default_notes(
        cfg, ("subset", "eval_every", "save_every", "nonfinite", "auto_batch_size", "resume_from"),
        "has no AutoTrain key"))
    notes.update(_non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no AutoTrain key "
                                                       "(the same training without it)"))

    path, split = _split_local_file(cfg.data)
    columns = {"text_column": cfg.text_column}
    if not llm:
        columns["target_column"] = cfg.label_column
    data: dict[str, Any] = {"path": path, "train_split": split, "valid_split": None}
    if llm:
        data["chat_template"] = None   # plain text, as nbtrain reads it
    data["column_mapping"] = columns
    if cfg.max_steps is not None:
        epochs = math.ceil(cfg.epochs) if cfg.epochs else 1
    else:
        epochs = math.ceil(cfg.epochs)
    warmup_ratio = round(cfg.warmup_steps / cfg.max_steps, 6) if cfg.warmup_steps and cfg.max_steps else 0.0
    params: dict[str, Any] = {}
    if llm:
        params.update(block_size=cfg.max_seq_len, model_max_length=cfg.max_seq_len, padding="right")
    else:
        params["max_seq_length"] = cfg.max_seq_len
    params.update(epochs=epochs, batch_size=cfg.micro_batch_size, gradient_accumulation=cfg.grad_accum_steps,
                  lr=cfg.lr, optimizer="adamw_torch", scheduler=_hf_scheduler(cfg), warmup_ratio=warmup_ratio,
                  weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm or 0.0, seed=cfg.seed,
                  mixed_precision=precision if precision in ("fp16", "bf16") else "none",
                  logging_steps=cfg.log_every)
    if llm:
        params.update(
            peft=cfg.method != "full",
            quantization={4: "int4", 8: "int8"}[cfg.quant_bits] if cfg.method == "qlora" else "none",
            target_modules=_targets_out(cfg.lora_targets, "all-linear"), merge_adapter=False,
            lora_r=cfg.lora_r, lora_alpha=int(round(cfg.lora_alpha)), lora_dropout=cfg.lora_dropout,
            disable_gradient_checkpointing=not cfg.gradient_checkpointing)
    doc = {"task": "llm" if llm else "text_multi_class_classification", "base_model": cfg.model,
           "project_name": name, "log": "none", "backend": "local", "data": data, "params": params}
    return doc, notes


def to_autotrain_yaml(cfg: TrainConfig, path=None) -> str:
    """An AutoTrain Advanced YAML (``autotrain --config FILE``); written to ``path`` when given."""
    doc, notes = autotrain_config(cfg)
    header = ["AutoTrain Advanced config exported by nbtrain; run: autotrain --config <this file>"]
    top = {k: doc[k] for k in ("task", "base_model", "project_name", "log", "backend")}
    return _write(_yaml_text([(None, top), (None, {"data": doc["data"]}), (None, {"params": doc["params"]})],
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
        warnings.warn(message, UserWarning, stacklevel=3)
    return cfg


def _none(v) -> bool:
    return v is None or str(v).strip().lower() in ("none", "no", "null", "")


def _read_autotrain(path, overrides):
    flat = _flatten(_load_mapping(path))
    task = str(flat.get("task"))
    if task in _AT_CLF_TASKS:
        defaults, nb_task = _AT_CLF_DEFAULTS, "sequence-classification"
    else:
        defaults, nb_task = _AT_LLM_DEFAULTS, "causal-lm"
    r = _Reader(flat, defaults, str(path))
    kw = r.kw
    r.drop("task")
    kw["task"] = nb_task
    llm = nb_task == "causal-lm"
    if task not in _AT_LLM_TASKS + _AT_CLF_TASKS:
        r.hard["task"] = f"task: {task!r} has no nbtrain equivalent (llm, llm-sft or text classification)"
    if r.has("params.trainer"):
        trainer = r.doc["params.trainer"]
        if llm and trainer in ("default", "sft", "generic"):
            r.drop("params.trainer")
        else:
            r.hard["task"] = f"params.trainer: {trainer!r} has no nbtrain equivalent (default or sft)"
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
    else:
        kw["data"] = _at_data(r, str(data_path), split)
    for key in ("data.valid_split", "data.chat_template"):
        if r.has(key) and _none(r.doc[key]):
            r.drop(key)
    kw["text_column"] = str(r.take("data.column_mapping.text_column"))
    if not llm:
        kw["label_column"] = str(r.take("data.column_mapping.target_column"))

    if llm:
        block = r.take("params.block_size")
        mml = r.take("params.model_max_length", int)
        if isinstance(block, list):
            r.reject("params.block_size", block, "a list of block sizes; nbtrain has one max_seq_len")
            block = None
        kw["max_seq_len"] = _num(block, int) if block is not None and _num(block) > 0 else mml
        if r.has("params.padding") and r.doc["params.padding"] == "right":
            r.drop("params.padding")
    else:
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
    _scheduler_in(r, "params.scheduler", 0)
    _optimizer_in(r, "params.optimizer")
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
        kw["lora_targets"] = _targets_in(targets, ("all-linear", "none", "null", ""))
        kw["gradient_checkpointing"] = not bool(r.take("params.disable_gradient_checkpointing"))
        if r.has("params.merge_adapter") and not r.doc["params.merge_adapter"]:
            r.drop("params.merge_adapter")
    else:
        kw["method"] = "full"
    return r.finish(overrides)


def _at_data(r: _Reader, path: str, split: str) -> str:
    p = Path(path).expanduser()
    if p.is_dir():
        for ext in _DATA_EXTS:
            if (p / f"{split}{ext}").is_file():
                return str(p / f"{split}{ext}")
    if split != "train":
        r.unmapped["data.train_split"] = split
        r.why["data.train_split"] = "nbtrain reads a dataset's 'train' split (or a local file)"
    return path


# -----------------------------------------------------------------------------------------------------------
# accelerate
# -----------------------------------------------------------------------------------------------------------
def accelerate_config(cfg: TrainConfig, num_processes: Optional[int] = None) -> dict[str, Any]:
    """An ``accelerate launch --config_file`` dict: one machine, ``num_processes`` processes (default: the
    visible GPUs, else 1), DDP when there are several.

    ``mixed_precision`` is ``"no"`` on purpose: nbtrain's loop applies ``cfg.precision`` itself with
    ``torch.autocast`` and a GradScaler (DESIGN rule 6). accelerate's own mixed precision would add a
    second autocast and scaler around it, and it is process-wide, so it could not follow the config.
    """
    import torch

    cuda = torch.cuda.is_available()
    n = int(num_processes) if num_processes else max(1, torch.cuda.device_count() if cuda else 1)
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": ("MULTI_GPU" if cuda else "MULTI_CPU") if n > 1 else "NO",
        "mixed_precision": "no",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": n,
        "gpu_ids": "all" if cuda else None,
        "use_cpu": not cuda,
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "debug": False,
        "downcast_bf16": "no",
    }


def to_accelerate_config_yaml(cfg: TrainConfig, path=None, num_processes: Optional[int] = None) -> str:
    """The accelerate config as YAML; written to ``path`` when given."""
    header = ["accelerate config exported by nbtrain; run: accelerate launch --config_file <this file> ...",
              f"mixed_precision is 'no' on purpose: nbtrain applies precision={cfg.precision!r} itself "
              "(torch.autocast + GradScaler)"]
    return _write(_yaml_text([(None, accelerate_config(cfg, num_processes))], header, {}), path)


def export_text(cfg: TrainConfig, to: str, path: Optional[str | os.PathLike] = None) -> str:
    """The text of one export by name (the ``nbtrain export`` command): training-args (JSON of the
    TrainingArguments keywords, plus peft_config / quantization_config), llamafactory, autotrain,
    accelerate-config. Written to ``path`` when given."""
    if to == "training-args":
        import json

        lcfg, qcfg = peft_and_quant_configs(cfg)
        out: dict[str, Any] = {"training_arguments": training_arguments_kwargs(cfg)}
        if lcfg is not None:
            d = lcfg.to_dict()
            out["peft_config"] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}
        if qcfg is not None:
            out["quantization_config"] = qcfg.to_dict()
        return _write(json.dumps(out, indent=2, default=str) + "\n", path)
    if to == "llamafactory":
        return to_llamafactory_yaml(cfg, path)
    if to == "autotrain":
        return to_autotrain_yaml(cfg, path)
    if to == "accelerate-config":
        return to_accelerate_config_yaml(cfg, path)
    raise ValueError(f"--to: {to!r}; choose training-args, llamafactory, autotrain or accelerate-config")
