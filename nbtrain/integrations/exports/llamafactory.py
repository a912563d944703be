"""LLaMA-Factory: ``to_llamafactory_yaml`` (``llamafactory-cli train FILE``), ``read_llamafactory_yaml`` and
``from_llamafactory_yaml``. A key missing from a file takes LLaMA-Factory's default (what it would have run).

Plain text exports as ``stage: pt``; instruction / chat data (``mapping.chat_format``: a named data_format, or
what a run detects under ``"auto"``) as ``stage: sft`` with ``template`` (chatml, llama3 and alpaca are
LLaMA-Factory's names too; ``"auto"`` is the model's LLaMA-Factory template where it has one by name, smollm2 for
SmolLM2, else left unset, so LLaMA-Factory parses the tokenizer's own template, as nbtrain does), ``train_on_prompt`` (train_on="all"), ``mask_history`` (train_on="last") and ``neat_packing``
with packing (packed examples do not attend to each other). sharding="fsdp" is the TrainingArguments keys
LLaMA-Factory passes on (``fsdp: full_shard auto_wrap``, or ``shard_grad_op`` without resharding, and
``fsdp_config``: FSDP2, sharded checkpoints); run it with ``accelerate launch --config_file <nbtrain export --to
accelerate-config> src/train.py FILE`` in a LLaMA-Factory checkout (as its FSDP examples launch), or
``FORCE_TORCHRUN=1 llamafactory-cli train FILE``, which reads these keys alone.

The dataset is a name in ``dataset_dir``'s ``dataset_info.json``: ``llamafactory_dataset_info(cfg)`` is its entry (``formatting``, ``columns`` and, for
sharegpt / messages rows, ``tags``), and ``to_llamafactory_yaml(cfg, path)`` writes it into
``dataset_info.json`` beside the YAML (merged into one already there). The importer reads all of it back.
``dataset_entry`` (entries of a data folder's own ``dataset_info.json``) is ``dataset:`` with ``dataset_dir:`` that
folder; several datasets read back as ``dataset_entry``, one as its file with its format and columns.

Preference tuning (objective dpo / orpo / simpo) is ``stage: dpo`` with ``pref_loss`` sigmoid / orpo / simpo,
``pref_beta`` (beta; ORPO's lambda) and, for simpo, ``simpo_gamma``; the dataset's entry is a ranking one
(``"ranking": true``): TRL's prompt/chosen/rejected as alpaca with ``query: null``, alpaca and sharegpt with their
``chosen`` / ``rejected`` columns. The import reads stage dpo back (pref_loss gives the objective); its keys for what
nbtrain does not run (pref_ftx, dpo_label_smoothing, ld_alpha, a separate ref_model) are unmapped unless off, and a
ranking entry outside stage dpo (or a plain one inside) is an error, as LLaMA-Factory refuses both. LLaMA-Factory has
no precomputed reference (precompute_ref is named in the notes). It has no GRPO: objective="grpo" is refused (a
ConfigError pointing at ``--to trl-grpo``), as stage sft or dpo would train another loss.
"""

from __future__ import annotations

import json
import math
import os
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
    SGD_OPTIM_ARGS,
    Reader,
    chat_format,
    column,
    export_model,
    format_unreadable,
    fsdp_layer_class,
    fsdp_notes,
    hf_fsdp_config,
    hf_fsdp_option,
    hf_scheduler,
    intlike,
    lf_model_template,
    non_default_notes,
    optimizer_in,
    plain_text_chat_notes,
    pref_column,
    pref_format,
    pref_notes,
    pref_unknown_columns_note,
    reshard_note,
    sample_notes,
    scheduler_in,
    sharding_in,
    stochastic_rounding_notes,
    targets_in,
    targets_out,
    unknown_columns_note,
    write_text,
    yaml_text,
)

# The TrainConfig fields the format carries. A round trip keeps all of them except those named in the
# export's notes.
LLAMAFACTORY_FIELDS = (
    "model", "task", "data", "max_seq_len", "subset", "precision", "micro_batch_size", "grad_accum_steps",
    "method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits", "gradient_checkpointing",
    "lr", "weight_decay", "scheduler", "warmup_steps", "max_steps", "epochs", "max_grad_norm", "packing",
    "eval_fraction", "eval_every", "log_every", "seed", "data_seed", "output_dir",
    "save_every", "data_format", "columns", "chat_template", "train_on", "optimizer", "sharding", "reshard_after_forward",
    "dataset_entry", "objective", "pref_beta", "simpo_gamma",
)
# nbtrain's preference objectives as LLaMA-Factory's stage dpo pref_loss, and back
PREF_LOSS = {"dpo": "sigmoid", "orpo": "orpo", "simpo": "simpo"}
PREF_LOSS_IN = {v: k for k, v in PREF_LOSS.items()}
# nbtrain's template names that are LLaMA-Factory's too (the same prompt layout)
LF_TEMPLATES = ("chatml", "llama3", "alpaca")
DATASET_INFO = "dataset_info.json"
LF_DATASET_DIR = "data"   # LLaMA-Factory's default dataset_dir
# LLaMA-Factory's and transformers' defaults for the keys nbtrain reads (what the tool runs when a key is absent)
_LF_DEFAULTS = dict(
    stage="sft", finetuning_type="lora", lora_rank=8, lora_alpha=None, lora_dropout=0.0, lora_target="all",
    quantization_method="bitsandbytes", quantization_type="nf4", double_quantization=True,
    cutoff_len=2048, per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-5,
    lr_scheduler_type="linear", warmup_steps=0, num_train_epochs=3.0, max_steps=-1, max_grad_norm=1.0,
    weight_decay=0.0, seed=42, logging_steps=500, val_size=0.0, eval_strategy="no", save_strategy="steps",
    save_steps=500, output_dir="trainer_output", disable_gradient_checkpointing=False,
    train_on_prompt=False, mask_history=False, neat_packing=False, pure_bf16=False, fp8=False, fp8_backend="auto",
    pref_loss="sigmoid", pref_beta=0.1, simpo_gamma=0.5,
)
# stage dpo's keys for what nbtrain's objectives do not have, at the values that turn them off
_LF_PREF_OFF = {"pref_ftx": 0.0, "pref_bco_weight": 0.0, "dpo_label_smoothing": 0.0, "ld_alpha": None,
                "ref_model": None, "ref_model_adapters": None, "ref_model_quantization_bit": None}
_LF_PREF_WHY = {
    "pref_ftx": "adds pref_ftx x the SFT loss of the chosen answer to DPO's; nbtrain's dpo has no such term",
    "pref_bco_weight": "mixes in the BCO loss; nbtrain's dpo has no such term",
    "dpo_label_smoothing": "cDPO's label smoothing; nbtrain's dpo is the plain sigmoid loss",
    "ld_alpha": "LD-DPO's down-weighting of the longer answer's verbose tokens; nbtrain's dpo weights every token",
    "ref_model": "a separate reference model; nbtrain's reference is the model itself (adapters off, or a frozen "
                 "copy of the starting weights)",
    "ref_model_adapters": "adapters of a separate reference model; nbtrain's reference is the model itself",
    "ref_model_quantization_bit": "a quantized separate reference model; nbtrain's reference is the model itself",
}


def _refuse_grpo(cfg: TrainConfig) -> None:
    # stage ppo trains against a reward model; writing sft or dpo instead would train another loss
    if cfg.objective == "grpo":
        raise ConfigError("objective: 'grpo' does not export to LLaMA-Factory, which has no GRPO (its stages are "
                          "pt, sft, rm, ppo, dpo, kto; ppo scores with a reward model, not reward functions); export "
                          "it with --to trl-grpo (TRL's GRPOConfig)", field="objective")


def llamafactory_config(cfg: TrainConfig, dataset_dir: Optional[str] = None) -> tuple[dict[str, Any], dict[str, str]]:
    """``(the LLaMA-Factory YAML as a flat dict, notes)``; notes name the fields it cannot carry.

    For chat data, ``dataset_dir`` is the folder whose ``dataset_info.json`` holds the dataset's entry
    (default: a local file's own folder, else LLaMA-Factory's ``data``)."""
    sections, notes = _llamafactory_sections(cfg, dataset_dir)
    return {k: v for body in sections.values() for k, v in body.items()}, notes


def _local_data(data: str) -> bool:
    # a config is portable: a file is known by its extension (it need not exist on this machine)
    return not data.startswith("builtin:") and (Path(data).suffix.lower() in DATA_EXTS or Path(data).is_dir())


def _default_dataset_dir(cfg: TrainConfig) -> str:
    return str(Path(cfg.data).parent) if _local_data(cfg.data) else "data"


def _dataset_name(data: str) -> str:
    # LLaMA-Factory names datasets in dataset_info.json; a file's stem, or the Hub id, with safe characters
    base = Path(data).stem if _local_data(data) else data.replace("builtin:", "")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_") or "nbtrain_data"


def llamafactory_dataset_info(cfg: TrainConfig, dataset_dir: Optional[str] = None) -> dict[str, Any]:
    """``{dataset name: entry}`` for LLaMA-Factory's ``dataset_info.json`` (chat data only; plain text exports
    as stage pt and needs no formatting).

    The entry names the file (``file_name``, relative to ``dataset_dir`` unless cfg.data is absolute) or the
    Hub id (``hf_hub_url``); ``formatting`` is ``alpaca`` for alpaca and prompt-completion rows (``query: null``:
    no input column) and ``sharegpt`` for sharegpt and messages rows, whose ``tags`` say which keys and roles a
    message has (messages: role / content / user / assistant / system). ``columns`` follow cfg.columns;
    the optional alpaca ``system`` and ``history`` columns are written only when cfg.columns names them (a
    name LLaMA-Factory is given must exist in the file). With ``dataset_entry``: those entries of the data folder's
    own ``dataset_info.json``, as they are."""
    _refuse_grpo(cfg)
    pref = pref_format(cfg)
    fmt = pref or chat_format(cfg)
    if fmt is None:
        raise ConfigError(f"data_format: {cfg.data_format!r} on {cfg.data!r} exports as plain text (stage pt), which "
                          "needs no dataset_info formatting; name the format of instruction data", field="data_format")
    if cfg.dataset_entry:   # the data folder's own entries, as nbtrain reads them
        info = json.loads((Path(cfg.data) / DATASET_INFO).read_text(encoding="utf-8"))
        return {name: info[name] for name in cfg.dataset_entry.split(",")}
    ddir = dataset_dir if dataset_dir is not None else _default_dataset_dir(cfg)
    entry: dict[str, Any] = {}
    if _local_data(cfg.data):
        entry["file_name"] = cfg.data if os.path.isabs(cfg.data) else os.path.relpath(cfg.data, ddir)
    elif cfg.data.startswith("builtin:"):
        entry["file_name"] = f"{_dataset_name(cfg.data)}.jsonl"   # where the builtin's rows are to be written
    else:
        entry["hf_hub_url"] = cfg.data
    if pref:
        entry.update(_ranking_entry(cfg, pref))
    elif fmt in ("alpaca", "prompt-completion"):
        entry["formatting"] = "alpaca"
        if fmt == "alpaca":
            cols = {"prompt": column(cfg, "instruction"), "query": column(cfg, "input"),
                    "response": column(cfg, "output")}
            for opt in ("system", "history"):
                if opt in cfg.columns:
                    cols[opt] = cfg.columns[opt]
        else:
            cols = {"prompt": column(cfg, "prompt"), "query": None, "response": column(cfg, "completion")}
        entry["columns"] = cols
    else:
        entry["formatting"] = "sharegpt"
        if fmt == "sharegpt":
            cols = {"messages": column(cfg, "conversations")}
            if "system" in cfg.columns:
                cols["system"] = cfg.columns["system"]
            tags = dict(role_tag=column(cfg, "from"), content_tag=column(cfg, "value"), user_tag="human",
                        assistant_tag="gpt", system_tag="system")
        else:
            cols = {"messages": column(cfg, "messages")}
            tags = dict(role_tag=column(cfg, "role"), content_tag=column(cfg, "content"), user_tag="user",
                        assistant_tag="assistant", system_tag="system")
        entry["columns"], entry["tags"] = cols, tags
    return {_dataset_name(cfg.data): entry}


def _ranking_entry(cfg: TrainConfig, pref: str) -> dict[str, Any]:
    """``formatting`` / ``ranking`` / ``columns`` (/ ``tags``) of a preference dataset's entry: TRL's
    prompt/chosen/rejected strings are alpaca ranking rows with no input column (``query: null``)."""
    chosen, rejected = pref_column(cfg, pref, "chosen"), pref_column(cfg, pref, "rejected")
    if pref == "sharegpt":
        cols: dict[str, Any] = {"messages": column(cfg, "conversations"), "chosen": chosen, "rejected": rejected}
        if "system" in cfg.columns:
            cols["system"] = cfg.columns["system"]
        tags = dict(role_tag=column(cfg, "from"), content_tag=column(cfg, "value"), user_tag="human",
                    assistant_tag="gpt", system_tag="system")
        return {"formatting": "sharegpt", "ranking": True, "columns": cols, "tags": tags}
    if pref == "alpaca":
        cols = {"prompt": column(cfg, "instruction"), "query": column(cfg, "input")}
    else:
        cols = {"prompt": column(cfg, "prompt"), "query": None}
    cols.update(chosen=chosen, rejected=rejected)
    for opt in ("system",) + (("history",) if pref == "alpaca" else ()):
        if opt in cfg.columns:
            cols[opt] = cfg.columns[opt]
    return {"formatting": "alpaca", "ranking": True, "columns": cols}


def _pref_lf_notes(cfg: TrainConfig, pref: str) -> dict[str, str]:
    """What stage dpo cannot say of a preference config."""
    notes = pref_notes(cfg, "LLaMA-Factory")
    notes.update(pref_unknown_columns_note(cfg, pref))
    if cfg.precompute_ref:
        notes["precompute_ref"] = ("precompute_ref=True has no LLaMA-Factory key: its DPO computes the reference "
                                   "log-probs at every step, from a frozen copy of the model for a full fine-tune "
                                   "(more memory than this config's run); not written")
    if pref == "preference":
        # keyed without a field: data_format still reads back as 'preference'
        notes["conversational"] = ("data_format='preference' is written as alpaca ranking rows (prompt, chosen, "
                                   "rejected strings); TRL's conversational rows (lists of messages, or "
                                   "chosen/rejected holding the whole conversation) need converting to sharegpt "
                                   "ranking rows (conversations ending with the user's turn, chosen/rejected one "
                                   "message each)")
    return notes


def _lf_template(cfg: TrainConfig, model_name: str) -> Optional[str]:
    """LLaMA-Factory's ``template``: nbtrain's named template, or for "auto" the model's own where LLaMA-Factory has
    one by name (smollm2 for SmolLM2); None leaves it unset (LLaMA-Factory parses the tokenizer's)."""
    if cfg.chat_template in LF_TEMPLATES:
        return cfg.chat_template
    return lf_model_template(model_name) if cfg.chat_template == "auto" else None


def _sft_notes(cfg: TrainConfig, fmt: str, template_only: bool = False) -> dict[str, str]:
    notes = {} if template_only else unknown_columns_note(cfg, fmt)
    # "auto" on a model whose own template LLaMA-Factory names (smollm2) is written as that name: no note
    if cfg.chat_template == "auto" and not lf_model_template(export_model(cfg, "LLaMA-Factory")[0]):
        # keyed "template" (no field): "auto" reads back as "auto", so the round trip still checks chat_template
        notes["template"] = ("chat_template='auto': template is left unset, so LLaMA-Factory parses the tokenizer's "
                             "own chat template (as nbtrain does); set it to the model's LLaMA-Factory template "
                             "(e.g. qwen, llama3) where the model has one")
    elif cfg.chat_template != "auto" and cfg.chat_template not in LF_TEMPLATES:
        notes["chat_template"] = ("chat_template is a Jinja string, which has no LLaMA-Factory template name: put it "
                                  "in the tokenizer's chat_template (tokenizer_config.json) and leave template unset "
                                  "(LLaMA-Factory then parses it); it reads back as 'auto'")
    return notes


def _llamafactory_sections(cfg: TrainConfig, dataset_dir: Optional[str] = None
                           ) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    _refuse_grpo(cfg)
    if cfg.task != "causal-lm":
        raise ConfigError(f"task: LLaMA-Factory has no {cfg.task!r} stage (its stages are pt, sft, rm, ppo, "
                          "dpo, kto); only task='causal-lm' exports", field="task")
    notes: dict[str, str] = {}
    precision = resolve_precision(cfg.precision)
    if cfg.precision == "auto":
        notes["precision"] = f"precision='auto' resolved to {precision!r} on this machine"
    if cfg.method != "qlora" and cfg.quant_bits != 4:
        notes["quant_bits"] = f"quant_bits={cfg.quant_bits} is only written for method='qlora'"
    pref = pref_format(cfg)
    fmt = pref or chat_format(cfg)
    if cfg.data.startswith("builtin:"):
        notes["data"] = (f"{cfg.data!r} is an nbtrain builtin: write its rows ({fmt} format) as JSON lines to the "
                         "dataset_info entry's file_name" if fmt else
                         f"{cfg.data!r} is an nbtrain builtin: write its texts to a file and register that "
                         "file under this dataset name")
    if cfg.output_dir is None:
        notes["output_dir"] = "output_dir=None: written as 'runs/llamafactory' (LLaMA-Factory needs one)"
    notes.update(non_default_notes(cfg, ("nonfinite", "auto_batch_size", "resume_from"),
                                    "has no LLaMA-Factory key"))
    notes.update(non_default_notes(cfg, NBTRAIN_ONLY, "is an nbtrain speed/memory option with no LLaMA-Factory "
                                                       "key (the same training without it)"))
    notes.update(sample_notes(cfg, "LLaMA-Factory"))
    if pref:
        notes.update(_pref_lf_notes(cfg, pref))
        notes.update(_sft_notes(cfg, pref, template_only=True))
    else:
        notes.update(_sft_notes(cfg, fmt) if fmt else plain_text_chat_notes(cfg, "stage pt"))
    notes.update(stochastic_rounding_notes(cfg, "LLaMA-Factory"))
    if precision == "fp8":
        # keyed "fp8" (no field): precision reads back as fp8, so the round trip still checks it
        notes["fp8"] = ("fp8: LLaMA-Factory's torchao backend uses torchao's rowwise recipe and keeps embed / lm_head "
                        "/ output / classifier layers out; nbtrain's fp8 is torchao's default tensorwise recipe with "
                        "the output layer out (both skip sizes that are not multiples of 16)")
    model_name, model_notes = export_model(cfg, "LLaMA-Factory")
    notes.update(model_notes)
    model = {"model_name_or_path": model_name}
    if cfg.method == "qlora":
        model.update(quantization_bit=cfg.quant_bits, quantization_method="bitsandbytes")
        if cfg.quant_bits == 4:
            model.update(quantization_type="nf4", double_quantization=True)   # nbtrain's nf4 + double quant
    # LLaMA-Factory checkpoints by default; nbtrain only when asked
    model["disable_gradient_checkpointing"] = not cfg.gradient_checkpointing
    # plain text: language modelling on every token (pt); chat data: supervised on the answers (sft)
    method = dict(stage="dpo" if pref else "sft" if fmt else "pt", do_train=True,
                  finetuning_type="full" if cfg.method == "full" else "lora",
                  lora_rank=cfg.lora_r, lora_alpha=intlike(cfg.lora_alpha), lora_dropout=cfg.lora_dropout,
                  lora_target=targets_out(cfg.lora_targets, "all"))
    if pref:   # pref_beta is DPO's and SimPO's beta and ORPO's lambda in LLaMA-Factory too
        method.update(pref_loss=PREF_LOSS[cfg.objective], pref_beta=cfg.pref_beta)
        if cfg.objective == "simpo":
            method["simpo_gamma"] = cfg.simpo_gamma
    if fmt:
        if cfg.dataset_entry:   # the folder's own dataset_info.json names them: LLaMA-Factory reads it as it is
            dataset: dict[str, Any] = dict(dataset=cfg.dataset_entry, dataset_dir=cfg.data)
        else:
            dataset = dict(dataset=_dataset_name(cfg.data),
                           dataset_dir=dataset_dir if dataset_dir is not None else _default_dataset_dir(cfg))
        template = _lf_template(cfg, model_name)
        if template:
            dataset["template"] = template
        if not pref:   # stage dpo scores the answers only (train_on does not apply: see the notes)
            dataset.update(train_on_prompt=cfg.train_on == "all", mask_history=cfg.train_on == "last")
    else:
        dataset = dict(dataset=cfg.dataset_entry or cfg.data)
        if cfg.dataset_entry:
            dataset["dataset_dir"] = cfg.data
    dataset["cutoff_len"] = cfg.max_seq_len
    if cfg.subset is not None:
        dataset["max_samples"] = cfg.subset
    dataset["packing"] = cfg.packing   # explicit: stage pt packs by default
    if fmt and cfg.packing:
        dataset["neat_packing"] = True   # as nbtrain packs chat examples: none attends to another
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
    # LLaMA-Factory passes optim (and optim_args) on to TrainingArguments: transformers' names
    train.update(max_grad_norm=cfg.max_grad_norm or 0.0, weight_decay=cfg.weight_decay, seed=cfg.seed,
                 optim=OPTIM_NAMES[cfg.optimizer])
    if cfg.data_seed is not None:   # passed on to TrainingArguments(data_seed=...): the batch order's seed
        train["data_seed"] = cfg.data_seed
    if cfg.optimizer == "sgd":
        train["optim_args"] = SGD_OPTIM_ARGS
    # bf16-pure: LLaMA-Factory's pure_bf16 (bf16 weights, no autocast; its web UI writes bf16 false beside it);
    # fp8: fp8 with the torchao backend, bf16 autocast elsewhere (bf16 true, as its fp8 examples)
    train.update(bf16=precision in ("bf16", "fp8"), fp16=precision == "fp16")
    if precision == "bf16-pure":
        train["pure_bf16"] = True
    if precision == "fp8":
        train.update(fp8=True, fp8_backend="torchao")
    if precision == "tf32":
        train["tf32"] = True
    if cfg.sharding == "fsdp":
        # the option string: LLaMA-Factory pins transformers 4.55-5.8, which all take it (5.2x also fsdp=True);
        # gradient checkpointing stays LLaMA-Factory's own (disable_gradient_checkpointing), not FSDP's
        layer = fsdp_layer_class(cfg)
        train.update(fsdp=hf_fsdp_option(cfg), fsdp_config=hf_fsdp_config(cfg, layer))
        notes.update(fsdp_notes(cfg, layer, "LLaMA-Factory"))
        notes["sharding"] += ("; with LLaMA-Factory: accelerate launch --config_file <nbtrain export --to "
                              "accelerate-config> src/train.py <this file> in its checkout (as its FSDP examples), "
                              "or FORCE_TORCHRUN=1 llamafactory-cli train <this file>")
    notes.update(reshard_note(cfg))
    evals: dict[str, Any] = {"eval_strategy": "steps" if cfg.eval_every else "no"}
    if cfg.eval_every:
        evals.update(eval_steps=cfg.eval_every, per_device_eval_batch_size=cfg.micro_batch_size)
    sections = {"model": model, "method": method, "dataset": dataset, "output": output, "train": train,
                "eval": evals}
    return sections, notes


def to_llamafactory_yaml(cfg: TrainConfig, path=None) -> str:
    """A LLaMA-Factory training YAML (``llamafactory-cli train FILE``); written to ``path`` when given.

    For chat data written to a path, the dataset's entry (``llamafactory_dataset_info``) goes into
    ``dataset_info.json`` beside it (merged into one already there) and ``dataset_dir`` names that folder;
    printed, the header says where the entry goes. objective="grpo" is refused (LLaMA-Factory has no GRPO)."""
    _refuse_grpo(cfg)
    fmt = pref_format(cfg) or chat_format(cfg)
    ddir = str(Path(path).parent) if (fmt and path is not None and not cfg.dataset_entry) else None
    sections, notes = _llamafactory_sections(cfg, ddir)
    header = ["LLaMA-Factory config exported by nbtrain; run: llamafactory-cli train <this file>"]
    if cfg.dataset_entry:
        header.append(f"the dataset: {cfg.dataset_entry} in {Path(cfg.data) / DATASET_INFO}, as nbtrain read it")
        info = None
    elif fmt:
        info = llamafactory_dataset_info(cfg, sections["dataset"]["dataset_dir"])
        where = Path(sections["dataset"]["dataset_dir"]) / DATASET_INFO
        what = (f"{fmt} data" if cfg.objective == "lm" else
                "preference data (alpaca ranking)" if fmt == "preference" else f"{fmt} ranking data")
        header.append(f"{what}: the dataset's entry in {where}" + (" (written beside this file)" if ddir is not
                      None else "") + f": {json.dumps(info)}")
    else:
        info = ('"%s": {"file_name": "<your file>", "columns": {"prompt": "%s"}}' % (cfg.data, cfg.text_column))
        header.append(f"the dataset must be registered in data/dataset_info.json, e.g. {info}")
        if format_unreadable(cfg):
            header.append(f"data_format='auto' on {cfg.data!r}: its format cannot be read here without loading it "
                          "(a dataset id, or a path not on this machine), so it exports as plain text (stage pt): "
                          "set data_format to export instruction data as stage sft")
    text = yaml_text(list(sections.items()), header, notes)
    if ddir is not None:
        _merge_dataset_info(Path(ddir) / DATASET_INFO, info)
    return write_text(text, path)


def _merge_dataset_info(file: Path, entries: dict[str, Any]) -> None:
    # LLaMA-Factory's data folder holds one dataset_info.json for all its datasets: add ours, keep the rest
    try:
        current = json.loads(file.read_text()) if file.is_file() else {}
    except ValueError:
        raise ConfigError(f"{file}: not valid JSON; fix or remove it before exporting here") from None
    if not isinstance(current, dict):
        raise ConfigError(f"{file}: expected a mapping of dataset names")
    current.update(entries)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(current, indent=2) + "\n")


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
    if stage not in ("pt", "sft", "dpo"):
        r.hard["task"] = (f"stage: {stage!r} has no nbtrain equivalent (nbtrain runs pt, plain causal-lm, sft, "
                          "instruction data with the loss on the answers, and dpo with pref_loss sigmoid, orpo or "
                          "simpo)")
    if stage == "sft":
        _sft_in(r)
    elif stage == "dpo":
        _pref_in(r)
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

    if stage == "dpo" and not r.has("dataset_dir") and (Path(LF_DATASET_DIR) / DATASET_INFO).is_file():
        # a preference dataset is one whose entry says "ranking": look it up where LLaMA-Factory does (its default
        # dataset_dir, relative to where it runs)
        r.doc["dataset_dir"] = LF_DATASET_DIR
    dataset = r.take("dataset")
    if dataset is None:
        if "data" not in overrides:
            r.hard["data"] = "dataset: missing"
    elif "," in str(dataset):
        _lf_datasets(r, str(dataset), stage in ("sft", "dpo"), stage == "dpo")
    else:
        kw["data"] = _lf_dataset(r, str(dataset), stage == "sft", stage == "dpo")
    kw["max_seq_len"] = r.take("cutoff_len", int)
    kw["subset"] = r.take("max_samples", int)
    packing = r.take("packing")
    kw["packing"] = bool(packing) if packing is not None else stage == "pt"   # LLaMA-Factory packs pt by default
    if r.has("neat_packing"):
        if r.doc["neat_packing"] and stage == "sft":   # sft packing without cross-attention: nbtrain's chat packing
            kw["packing"] = True
            r.drop("neat_packing")
        elif not r.doc["neat_packing"]:
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
    if r.has("data_seed"):
        kw["data_seed"] = r.take("data_seed", int)
    kw["output_dir"] = str(r.take("output_dir"))
    log = r.take("logging_steps", float)
    if log >= 1 and float(log).is_integer():
        kw["log_every"] = int(log)
    else:
        r.reject("logging_steps", log, "a ratio of the run; nbtrain's log_every counts steps")
    optimizer_in(r, "optim", "optim_args")
    if r.has("report_to") and str(r.doc["report_to"]).lower() == "none":
        r.drop("report_to")

    _precision_in(r)

    gc = not bool(r.take("disable_gradient_checkpointing"))
    for key in ("gradient_checkpointing", "activation_checkpointing"):   # transformers' flags turn it on too
        if r.has(key):
            gc = gc or bool(r.take(key))
    kw["gradient_checkpointing"] = gc
    sharding_in(r)   # after: FSDP's activation_checkpointing turns gradient checkpointing on too

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


def _precision_in(r: Reader) -> None:
    """bf16 / fp16 / tf32 / pure_bf16 / fp8 (+ fp8_backend) as precision."""
    bf16, fp16 = bool(r.take("bf16")), bool(r.take("fp16"))
    pure, fp8 = bool(r.take("pure_bf16")), bool(r.take("fp8"))
    tf32 = r.take("tf32")
    both = [k for k, v in (("pure_bf16", pure), ("fp8", fp8), ("fp16", fp16)) if v]
    if len(both) > 1 or (bf16 and fp16):
        names = both if len(both) > 1 else ["bf16", "fp16"]
        r.hard["precision"] = " and ".join(names) + (" are both true" if len(names) == 2 else " are all true")
    if pure:
        precision = "bf16-pure"
        if bf16:   # LLaMA-Factory then autocasts over the bf16 weights; nbtrain's bf16-pure has no autocast
            r.unmapped["bf16"], r.why["bf16"] = True, ("with pure_bf16, bf16=True adds bf16 autocast over the bf16 "
                                                       "weights; nbtrain's bf16-pure runs without autocast")
    elif fp8:
        precision = "fp8"   # bf16 autocast elsewhere, with bf16 true or not (accelerate's fp8 autocasts bf16)
    else:
        precision = "bf16" if bf16 else "fp16" if fp16 else "tf32" if tf32 else "fp32"
    r.kw["precision"] = precision
    if tf32 and precision != "tf32":
        r.unmapped["tf32"], r.why["tf32"] = tf32, f"nbtrain's {precision} does not also enable tf32"
    backend = r.take("fp8_backend")
    gather = r.take("fp8_enable_fsdp_float8_all_gather")
    if fp8:
        if str(backend).lower() not in ("torchao", "auto"):   # auto: LLaMA-Factory builds torchao's recipe
            r.unmapped["fp8_backend"] = backend
            r.why["fp8_backend"] = "nbtrain's fp8 is torchao's float8 training (fp8_backend torchao)"
        if gather:
            r.unmapped["fp8_enable_fsdp_float8_all_gather"] = gather
            r.why["fp8_enable_fsdp_float8_all_gather"] = "nbtrain's fp8 all-gathers in the weights' dtype"


def _sft_in(r: Reader) -> None:
    """template / train_on_prompt / mask_history of stage sft as chat_template and train_on."""
    kw = r.kw
    kw["data_format"] = "auto"   # unless dataset_info.json says (see _lf_format)
    _template_in(r)
    prompt, history = bool(r.take("train_on_prompt")), bool(r.take("mask_history"))
    if prompt and history:   # LLaMA-Factory refuses the pair too
        r.hard["train_on"] = "train_on_prompt and mask_history are both true (LLaMA-Factory refuses the pair)"
    kw["train_on"] = "all" if prompt else "last" if history else "completion"


def _pref_in(r: Reader) -> None:
    """Stage dpo's pref_loss / pref_beta / simpo_gamma as objective, pref_beta and simpo_gamma (pref_beta is also
    ORPO's lambda in both), its template as chat_template; its keys for what nbtrain's objectives lack (an SFT
    term, label smoothing, a separate reference model) are unmapped unless they are off."""
    kw = r.kw
    kw["data_format"] = "auto"   # unless dataset_info.json says (see _lf_ranking)
    _template_in(r)
    loss = str(r.take("pref_loss"))
    if loss in PREF_LOSS_IN:
        kw["objective"] = PREF_LOSS_IN[loss]
    else:
        r.hard["objective"] = (f"pref_loss: {loss!r} has no nbtrain objective (sigmoid is objective='dpo'; orpo "
                               "and simpo are 'orpo' and 'simpo')")
    kw["pref_beta"] = r.take("pref_beta", float)
    kw["simpo_gamma"] = r.take("simpo_gamma", float)
    for key, off in _LF_PREF_OFF.items():
        if r.has(key):
            v = r.doc[key]
            if v == off or (off is not None and v is not None and r.take(key, float) == off):
                r.drop(key)
            else:
                r.reject(key, v, _LF_PREF_WHY[key])
    for key in ("train_on_prompt", "mask_history"):
        if bool(r.take(key)):
            r.unmapped[key], r.why[key] = True, ("nbtrain's preference objectives score the final answers only "
                                                 "(train_on does not apply)")


def _template_in(r: Reader) -> None:
    """LLaMA-Factory's template as chat_template (unset: the tokenizer's own, "auto")."""
    kw = r.kw
    if r.has("template") and r.doc["template"] is not None:
        name = str(r.take("template"))
        model = str(r.doc.get("model_name_or_path", kw.get("model", "")))
        if name.lower() in LF_TEMPLATES:
            kw["chat_template"] = name.lower()
        elif name.lower() == lf_model_template(model):
            kw["chat_template"] = "auto"   # the model's own template is that one (smollm2: SmolLM2's ChatML)
        else:
            # never replaced silently: the tokenizer's own template ("auto") may or may not be the same layout
            r.hard["chat_template"] = (f"template: {name!r} is not a template nbtrain has ({', '.join(LF_TEMPLATES)}; "
                                       "chat_template='auto' is the tokenizer's own, as LLaMA-Factory with no "
                                       "template; or a Jinja string)")
    else:
        r.drop("template")
        kw["chat_template"] = "auto"   # LLaMA-Factory without a template parses the tokenizer's


def _lf_dataset(r: Reader, name: str, sft: bool = False, ranking: bool = False) -> str:
    """A name in ``dataset_dir/dataset_info.json`` becomes its file or Hub id (and text column, or for sft and dpo
    (``ranking``) its format and columns), else as-is."""
    ddir = r.take("dataset_dir")
    if ddir is None:
        return name
    info_file = Path(str(ddir)) / DATASET_INFO
    try:
        entry = json.loads(info_file.read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        entry = None
    if not isinstance(entry, dict):
        r.unmapped["dataset_dir"], r.why["dataset_dir"] = ddir, f"{name!r} is not in {info_file}"
        return name
    _ranking_matches(r, name, entry, ranking)
    if ranking:
        _lf_ranking(r, name, entry)
    elif sft:
        _lf_format(r, name, entry)
    else:
        prompt = (entry.get("columns") or {}).get("prompt")
        if prompt:
            r.kw["text_column"] = prompt
    if entry.get("file_name"):
        # normpath: a file_name relative to dataset_dir ("../data/x.jsonl") reads back as the path it names
        return os.path.normpath(Path(str(ddir)) / entry["file_name"])
    return str(entry.get("hf_hub_url") or name)


def _lf_datasets(r: Reader, names: str, sft: bool, ranking: bool = False) -> None:
    """Several sft datasets (``dataset: a,b``) of one ``dataset_dir`` as data= that folder and dataset_entry= the
    names, which nbtrain concatenates in that order, each read with its own entry."""
    ddir = r.doc.get("dataset_dir")
    listed = [n.strip() for n in names.split(",") if n.strip()]
    try:
        info = json.loads((Path(str(ddir)) / DATASET_INFO).read_text()) if ddir is not None else None
    except (OSError, ValueError):
        info = None
    local = isinstance(info, dict) and all(isinstance(info.get(n), dict) and info[n].get("file_name") for n in listed)
    if not (local and sft):
        # nbtrain concatenates entries as instruction data only; plain-text (pt) entries train one at a time
        r.hard["data"] = (f"dataset: {names!r} names several datasets, which nbtrain reads only for stage sft, as "
                          f"entries with a file_name in dataset_dir's {DATASET_INFO}"
                          + ("" if ddir is not None else " (dataset_dir is not set)"))
        return
    for n in listed:
        _ranking_matches(r, n, info[n], ranking)
    r.drop("dataset_dir")
    r.kw["data"] = str(ddir)
    r.kw["dataset_entry"] = ",".join(listed)


def _ranking_matches(r: Reader, name: str, entry: dict, ranking: bool) -> None:
    # LLaMA-Factory refuses a ranking dataset outside stage rm/dpo and a plain one inside ("not applicable")
    if bool(entry.get("ranking")) != ranking:
        r.hard["data"] = (f"dataset_info[{name!r}]: " + ("stage dpo needs a preference dataset (\"ranking\": true "
                          "with chosen and rejected columns)" if ranking else "a preference dataset (\"ranking\": "
                          "true) trains with stage dpo; LLaMA-Factory refuses it in stage sft and pt"))


def _lf_ranking(r: Reader, name: str, entry: dict) -> None:
    """A ranking entry's formatting / columns / tags as data_format and columns: alpaca with no input column
    (``query: null``) and no system or history is TRL's prompt/chosen/rejected (data_format "preference"); other
    alpaca rows are "alpaca", sharegpt rows with human / gpt roles "sharegpt"."""
    where = f"dataset_info[{name!r}]"
    formatting = str(entry.get("formatting", "alpaca"))
    cols = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    answers = {"chosen": cols.get("chosen", "chosen"), "rejected": cols.get("rejected", "rejected")}
    if formatting == "alpaca":
        if "query" in cols and cols["query"] is None and not cols.get("system") and not cols.get("history"):
            fmt = "preference"
            names = {"prompt": cols.get("prompt", "instruction"), **answers}
        else:
            fmt = "alpaca"
            names = {"instruction": cols.get("prompt", "instruction"), "input": cols.get("query", "input"),
                     **answers, "system": cols.get("system"), "history": cols.get("history")}
    elif formatting == "sharegpt":
        user, assistant = tags.get("user_tag", "human"), tags.get("assistant_tag", "gpt")
        if (user, assistant) != ("human", "gpt") or tags.get("system_tag", "system") != "system":
            r.unmapped[f"{where}.tags"] = tags
            r.why[f"{where}.tags"] = ("roles %r / %r: nbtrain's sharegpt ranking columns name human / gpt (and a "
                                      "'system' role); data_format left 'auto', the loader reads the entry's tags"
                                      % (user, assistant))
            return
        fmt = "sharegpt"
        names = {"conversations": cols.get("messages", "conversations"), **answers,
                 "from": tags.get("role_tag", "from"), "value": tags.get("content_tag", "value"),
                 "system": cols.get("system")}
    else:
        r.unmapped[f"{where}.formatting"] = formatting
        r.why[f"{where}.formatting"] = "nbtrain reads alpaca and sharegpt ranking data; data_format left 'auto'"
        return
    r.kw["data_format"] = fmt
    columns = {k: v for k, v in names.items() if v and v != k}
    if columns:
        r.kw["columns"] = columns


def _lf_format(r: Reader, name: str, entry: dict) -> None:
    """A dataset_info entry's formatting / columns / tags as data_format and columns."""
    where = f"dataset_info[{name!r}]"
    formatting = str(entry.get("formatting", "alpaca"))
    cols = entry.get("columns") or {}
    tags = entry.get("tags") or {}
    if formatting == "alpaca":
        if "query" in cols and cols["query"] is None and not cols.get("system") and not cols.get("history"):
            fmt = "prompt-completion"   # alpaca without an input column: how prompt-completion rows export
            names = {"prompt": cols.get("prompt", "instruction"), "completion": cols.get("response", "output")}
        else:
            fmt = "alpaca"
            names = {"instruction": cols.get("prompt", "instruction"), "input": cols.get("query", "input"),
                     "output": cols.get("response", "output"), "system": cols.get("system"),
                     "history": cols.get("history")}
    elif formatting in ("sharegpt", "openai"):   # openai: sharegpt's converter with the same tags
        user, assistant = tags.get("user_tag", "human"), tags.get("assistant_tag", "gpt")
        role, content = tags.get("role_tag", "from"), tags.get("content_tag", "value")
        if (user, assistant) == ("user", "assistant"):
            fmt = "messages"
            names = {"messages": cols.get("messages", "conversations"), "role": role, "content": content}
        elif (user, assistant) == ("human", "gpt"):
            fmt = "sharegpt"
            names = {"conversations": cols.get("messages", "conversations"), "from": role, "value": content,
                     "system": cols.get("system")}
        else:
            r.unmapped[f"{where}.tags"] = tags
            r.why[f"{where}.tags"] = ("roles %r / %r: nbtrain's sharegpt reads human / gpt, messages user / "
                                      "assistant; data_format left 'auto'" % (user, assistant))
            return
        other = {k: v for k, v in tags.items() if k in ("system_tag",) and v != "system"}
        if other:
            r.unmapped[f"{where}.tags"], r.why[f"{where}.tags"] = other, "nbtrain's system role is 'system'"
    else:
        r.unmapped[f"{where}.formatting"] = formatting
        r.why[f"{where}.formatting"] = "nbtrain reads alpaca and sharegpt formatting; data_format left 'auto'"
        return
    r.kw["data_format"] = fmt
    columns = {k: v for k, v in names.items() if v and v != k}
    if columns:
        r.kw["columns"] = columns


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


