"""What the export formats share: tool names for nbtrain's optimizer and schedules, notes, YAML text, and
the reader that maps a tool's keys to TrainConfig fields (and keeps the ones it cannot map)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from ...config import OPTIMIZERS, ConfigError, TrainConfig

ADAMW = ("adamw_torch", "adamw_torch_fused")   # torch.optim.AdamW, what nbtrain's optimizer="adamw" runs
# nbtrain's optimizer -> the name transformers' TrainingArguments(optim=...) takes for the same optimizer
# (transformers 5's OptimizerNames); LLaMA-Factory's ``optim`` and AutoTrain's ``params.optimizer`` are passed on
# to TrainingArguments(optim=...) as they are, so all three formats write these names. The Trainer builds them
# with nbtrain's settings: bitsandbytes' AdamW with optim_bits=8 (paged: is_paged) and torch's betas/eps;
# Adafactor with scale_parameter=False, relative_step=False (warmup_init's default False); SGD with the momentum
# of optim_args (SGD_OPTIM_ARGS).
OPTIM_NAMES = {"adamw": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
               "adafactor": "adafactor", "sgd": "sgd"}
# what each of those names, and transformers' aliases of them, reads back as
OPTIM_IN = {**{v: k for k, v in OPTIM_NAMES.items()}, "adamw_torch_fused": "adamw", "adamw_8bit": "adamw_8bit"}
# nbtrain's SGD momentum (nbtrain.engine.optimizers.SGD_MOMENTUM; a test keeps the two equal): the Trainer's
# "sgd" has none unless optim_args gives it
SGD_MOMENTUM = 0.9
SGD_OPTIM_ARGS = f"momentum={SGD_MOMENTUM}"
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
DATA_EXTS = (".csv", ".jsonl", ".json", ".parquet", ".txt")
# speed/memory options of nbtrain's own loop: no other tool has their keys, and a run without them computes the same
NBTRAIN_ONLY = ("chunked_loss", "loss_chunk_tokens", "compile", "lean_layers")


def hf_scheduler(cfg: TrainConfig) -> str:
    """The Hugging Face ``lr_scheduler_type`` of cfg's schedule (``transformers.get_scheduler`` names).

    Hugging Face's ``constant`` ignores ``warmup_steps``: a constant schedule with warm-up is its
    ``constant_with_warmup``."""
    return "constant_with_warmup" if cfg.scheduler == "constant" and cfg.warmup_steps else cfg.scheduler


def non_default_notes(cfg: TrainConfig, fields: tuple[str, ...], why: str) -> dict[str, str]:
    """Notes for fields the format cannot carry, when they differ from nbtrain's default."""
    out = {}
    for f in fields:
        v = getattr(cfg, f)
        if v != TrainConfig.model_fields[f].default:
            out[f] = f"{f}={v!r} {why}"
    return out


def yaml_text(sections: list[tuple[Optional[str], dict]], header: list[str], notes: dict[str, str]) -> str:
    """A YAML file's text: ``header`` and ``notes`` as comments, then each (titled) section."""
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


def write_text(text: str, path) -> str:
    """``text``, also written to ``path`` when given (its folder made)."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


def flatten(doc: dict, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys: ``{"params": {"lr": 1}}`` -> ``{"params.lr": 1}``."""
    out = {}
    for k, v in doc.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def number(v, kind=float):
    """``v`` as a float (or an int, which must be whole). PyYAML (YAML 1.1) reads "3e-5" as a string; the
    tools' own parsers convert it, so this does too."""
    if isinstance(v, str):
        v = float(v.strip())
    if kind is int:
        if float(v) != int(v):
            raise ValueError(f"expected an integer, got {v!r}")
        return int(v)
    return float(v)


def intlike(x: float):
    """A whole float as an int (16.0 -> 16), anything else as it is."""
    return int(x) if float(x).is_integer() else x


class Reader:
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
            return number(v, kind)
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


def scheduler_in(r: Reader, key: str, warmup: int) -> None:
    name = str(r.take(key)).lower()
    if name not in SCHEDULERS:
        r.hard["scheduler"] = f"{key}: {name!r} has no nbtrain equivalent (nbtrain has {SCHEDULERS})"
        return
    if name == "constant" and warmup:
        # the tool's "constant" runs without any warm-up, so the faithful import drops it
        r.unmapped["warmup_steps"] = warmup
        r.why["warmup_steps"] = f"{key}={name!r} runs without warm-up in the tool, so it was not used"
        warmup = 0
    r.kw["scheduler"] = "constant" if name == "constant_with_warmup" else name
    r.kw["warmup_steps"] = warmup


def parse_optim_args(text) -> dict[str, str]:
    """transformers' ``optim_args`` string ("momentum=0.9,nesterov=True") as a dict, as the Trainer parses it."""
    out = {}
    for item in str(text or "").replace(" ", "").split(","):
        if item:
            key, _, value = item.partition("=")
            out[key] = value
    return out


def optimizer_in(r: Reader, key: str, args_key: Optional[str] = None) -> None:
    """The tool's optimizer name (``key``; ``args_key``: its optim_args key, where the format has one) as
    cfg.optimizer. Missing: the tool's default, transformers' AdamW (nbtrain's adamw). A name nbtrain has no
    optimizer for, and an "sgd" whose momentum is not nbtrain's, are unmapped: nbtrain's default adamw runs."""
    if not r.has(key):
        return
    value = r.doc[key]
    name = str(value).strip().lower()
    opt = OPTIM_IN.get(name)
    if opt is None:
        r.reject(key, value, f"nbtrain has no such optimizer (it has {', '.join(OPTIMIZERS)}, written "
                             f"{', '.join(OPTIM_NAMES.values())}); nbtrain's default adamw was used")
        return
    if opt == "sgd":
        args = parse_optim_args(r.doc.get(args_key)) if args_key else {}
        try:
            momentum = float(args.get("momentum", 0))
        except ValueError:
            momentum = None
        if momentum != SGD_MOMENTUM or set(args) - {"momentum"}:
            where = (f"with {args_key}={r.doc.get(args_key)!r}" if args_key and r.has(args_key) else
                     f"without {args_key} (momentum 0)" if args_key else
                     "with momentum 0 (this format has no optim_args)")
            r.reject(key, value, f"the Trainer's sgd {where}; nbtrain's sgd is momentum {SGD_MOMENTUM} "
                                 f"({args_key or 'optim_args'}: {SGD_OPTIM_ARGS!r}); nbtrain's default adamw was used")
            if args_key and r.has(args_key):
                r.reject(args_key, r.doc[args_key], f"the arguments of {key}={name!r}, which was not used")
            return
        if args_key:
            r.drop(args_key)
    r.drop(key)
    r.kw["optimizer"] = opt


def stochastic_rounding_notes(cfg: TrainConfig, tool: str) -> dict[str, str]:
    """A note for stochastic_rounding, which no tool's optimizer names carry."""
    if not cfg.stochastic_rounding:
        return {}
    return {"stochastic_rounding": f"stochastic_rounding=True has no {tool} equivalent: its AdamW on bf16 weights "
                                   "rounds each update to nearest (updates below bf16's spacing are lost); not "
                                   "exported"}


def targets_out(targets, all_name: str) -> str:
    """LoRA targets as the tools write them: comma-separated names, or the tool's word for all-linear."""
    return all_name if isinstance(targets, str) else ",".join(targets)


def targets_in(value, all_names: tuple[str, ...]):
    """A tool's LoRA target value as nbtrain's lora_targets."""
    if value is None or str(value).strip().lower() in all_names:
        return "all-linear"
    return [t.strip() for t in str(value).split(",") if t.strip()]




# -- instruction / chat data -------------------------------------------------------------------------------
CHAT_FORMATS = ("alpaca", "sharegpt", "messages", "prompt-completion")
# nbtrain's builtin instruction sets and their layout: under data_format="auto" they are chat data
CHAT_BUILTINS = {"builtin:python-docs-qa": "messages"}
# each format's own column names (cfg.columns maps them to the data's); the keys inside one chat message are
# also remappable: "from"/"value" (sharegpt) and "role"/"content" (messages)
FORMAT_COLUMNS = {
    "alpaca": ("instruction", "input", "output", "system", "history"),
    "sharegpt": ("conversations", "system", "from", "value"),
    "messages": ("messages", "role", "content"),
    "prompt-completion": ("prompt", "completion"),
}
# nbtrain's readable samples while training: no other tool has them
SAMPLE_FIELDS = ("sample_prompts", "sample_every", "max_new_tokens")
CHAT_FIELDS = ("chat_template", "train_on", "columns")


def chat_format(cfg: TrainConfig) -> Optional[str]:
    """The instruction / chat format an export writes for ``cfg``, or None for plain text.

    A named format (alpaca, sharegpt, messages, prompt-completion) is chat data; ``"text"`` is plain text;
    ``"auto"`` is what a run would detect: nbtrain's builtin chat sets are chat data, and a local file (or data
    folder, or ``dataset_entry``) is read as the loader reads it, from its first row and ``dataset_info.json``
    (``nbtrain.data.loading.peek_format``). A dataset id, or a path not on this machine, cannot be read without
    loading it: it exports as plain text (LLaMA-Factory's header says so: ``format_unreadable``)."""
    if cfg.data_format in CHAT_FORMATS:
        return cfg.data_format
    if cfg.data_format != "auto" or cfg.task != "causal-lm":
        return None
    if cfg.data in CHAT_BUILTINS:
        return CHAT_BUILTINS[cfg.data]
    fmt = _peek(cfg)
    return fmt if fmt in CHAT_FORMATS else None


def _peek(cfg: TrainConfig) -> Optional[str]:
    from ...data.bundle import DataError
    from ...data.loading import peek_format

    try:
        return peek_format(cfg)
    except DataError as e:   # the run would refuse this data; the export names the config's own fields
        raise ConfigError(f"data_format='auto' on {cfg.data!r}: an export reads the data's format as a run does, "
                          f"and {e}", field="data") from None


def format_unreadable(cfg: TrainConfig) -> bool:
    """Whether ``data_format="auto"`` meets data whose format an export cannot read here (a dataset id, a path not on
    this machine), so that it exports as plain text."""
    return (cfg.data_format == "auto" and cfg.task == "causal-lm" and not cfg.data.startswith("builtin:")
            and _peek(cfg) is None)


# -- preference data (objective dpo / orpo / simpo) ----------------------------------------------------------------
# the TrainConfig fields of preference tuning (each export carries them or names them in its notes)
PREF_FIELDS = ("objective", "pref_beta", "simpo_gamma", "precompute_ref")
# the data formats a preference objective reads (cfg.data_format's names: TRL's prompt/chosen/rejected, and
# LLaMA-Factory's alpaca and sharegpt with "ranking": true) and each one's own column names (cfg.columns keys)
PREF_FORMATS = ("preference", "alpaca", "sharegpt")
PREF_COLUMNS = {
    "preference": ("prompt", "chosen", "rejected", "system"),
    "alpaca": ("instruction", "input", "chosen", "rejected", "system", "history"),
    "sharegpt": ("conversations", "chosen", "rejected", "system", "from", "value"),
}
# what the data loader calls LLaMA-Factory's ranking layouts (nbtrain.data.preference)
_RANKING_NAMES = {"alpaca-ranking": "alpaca", "sharegpt-ranking": "sharegpt"}


def pref_format(cfg: TrainConfig) -> Optional[str]:
    """The preference layout an export writes for ``cfg`` ("preference", "alpaca" or "sharegpt"), or None for
    objective="lm". A named data_format is that layout; under ``"auto"`` it is what a run detects where this machine
    can tell (a local file's first row, its folder's ``dataset_info.json`` entry), else TRL's prompt/chosen/rejected
    (what a dataset id of preference pairs usually holds, and nbtrain's builtin:python-docs-pref)."""
    if cfg.objective == "lm":
        return None
    if cfg.data_format in PREF_FORMATS:
        return cfg.data_format
    from ...data.bundle import DataError
    from ...data.loading import peek_format

    # the loader's detection raises on rows it would refuse; the export then falls back to the entry's own
    # formatting, which is what LLaMA-Factory itself reads
    try:
        found = peek_format(cfg)
    except DataError:
        found = None
    found = _RANKING_NAMES.get(found, found)
    if found in PREF_FORMATS:
        return found
    entry = _lf_entry(cfg)
    if entry is not None and str(entry.get("formatting", "alpaca")) in ("alpaca", "sharegpt"):
        return str(entry.get("formatting", "alpaca"))
    return "preference"


def _lf_entry(cfg: TrainConfig) -> Optional[dict]:
    """The LLaMA-Factory dataset_info.json entry a local cfg.data reads with, or None."""
    from ...data import chat
    from ...data.bundle import DataError

    path = Path(cfg.data).expanduser()
    if cfg.data.startswith("builtin:") or not path.exists():
        return None
    try:
        return chat.dataset_info(path, cfg.dataset_entry.split(",")[0] if cfg.dataset_entry else None)
    except DataError:
        return None


def pref_column(cfg: TrainConfig, fmt: str, role: str) -> str:
    """The data's column for a preference ``role`` (prompt, chosen, rejected) in layout ``fmt``: the prompt is
    alpaca's instruction and sharegpt's conversations."""
    own = {"alpaca": {"prompt": "instruction"}, "sharegpt": {"prompt": "conversations"}}.get(fmt, {})
    return column(cfg, own.get(role, role))


def pref_unknown_columns_note(cfg: TrainConfig, fmt: str) -> dict[str, str]:
    """A note for cfg.columns keys that are not the preference layout's own names (they would be dropped)."""
    extra = sorted(set(cfg.columns) - set(PREF_COLUMNS[fmt]))
    if not extra:
        return {}
    return {"columns": f"columns {extra} are not column names of {fmt} preference data "
                       f"({', '.join(PREF_COLUMNS[fmt])}) and are not written"}


def pref_notes(cfg: TrainConfig, tool: str) -> dict[str, str]:
    """Notes every preference export shares: train_on (the loss is on the final answers only) and simpo_gamma
    outside simpo, which change nothing and are not written."""
    notes = non_default_notes(cfg, ("train_on",), f"does not apply to objective={cfg.objective!r} (the "
                                                  "preference loss scores the final answers only); not written")
    if cfg.objective != "simpo":
        notes.update(non_default_notes(cfg, ("simpo_gamma",), f"only applies to objective='simpo'; not written to "
                                                              f"{tool}"))
    return notes


def column(cfg: TrainConfig, name: str) -> str:
    """The data's column (or message key) for the format's ``name``."""
    return cfg.columns.get(name, name)


def plain_text_chat_notes(cfg: TrainConfig, how: str) -> dict[str, str]:
    """Notes for chat settings of a config that exports as plain text (they change nothing there)."""
    why = ("only applies to chat data; data_format=%r exports as plain text (%s)" % (cfg.data_format, how)
           + (": name the data's format to export it as instruction data" if cfg.data_format == "auto" else ""))
    out = non_default_notes(cfg, CHAT_FIELDS, why)
    if cfg.data_format == "text":
        out["data_format"] = f"data_format='text' is written as {how}, which reads back as data_format='auto'"
    return out


def unknown_columns_note(cfg: TrainConfig, fmt: str) -> dict[str, str]:
    """A note for cfg.columns keys that are not the format's own names (they would be dropped)."""
    extra = sorted(set(cfg.columns) - set(FORMAT_COLUMNS[fmt]))
    if not extra:
        return {}
    return {"columns": f"columns {extra} are not {fmt} column names ({', '.join(FORMAT_COLUMNS[fmt])}) and are "
                       "not written"}


def sample_notes(cfg: TrainConfig, tool: str) -> dict[str, str]:
    """Notes naming nbtrain's sample settings (prompts answered while training), which no tool has."""
    return non_default_notes(cfg, SAMPLE_FIELDS, f"has no {tool} equivalent (nbtrain's readable samples while "
                                                 "training); not exported")


# -- the model a tool loads ----------------------------------------------------------------------------------
# LLaMA-Factory's templates for models nbtrain exports by name (its src/llamafactory/data/template.py): smollm2 is
# ChatML with SmolLM2's default system prompt, as SmolLM2's own tokenizer template
LF_MODEL_TEMPLATES = (("HuggingFaceTB/SmolLM2-", "smollm2"), ("HuggingFaceTB/SmolLM-", "smollm"))
_GGUF_QUANT = re.compile(r"[.-]((?:I?Q\d[A-Za-z0-9_]*)|BF16|F16|F32)\.gguf$", re.IGNORECASE)


def export_model(cfg: TrainConfig, tool: str) -> tuple[str, dict[str, str]]:
    """``(the model name `tool` loads, notes)``. A pretrained preset (``smollm2-135m-instruct``) is named by its Hub id,
    with a note that nbtrain trained its GGUF weights dequantized, not the Hub's; a ``.gguf`` file (or a folder holding
    one) keeps its path, with a note that the tool does not train from GGUF; anything else is ``cfg.model``."""
    from ...models.presets import PRESETS

    preset = PRESETS.get(cfg.model)
    hub_id = getattr(preset, "hub_id", None) or None
    if hub_id:
        gguf = getattr(preset, "gguf_file", "") or ""
        quant = _GGUF_QUANT.search(gguf)
        what = f"the {quant.group(1).upper()} GGUF weights" if quant else "GGUF weights"
        return hub_id, {"model": f"model={cfg.model!r} is nbtrain's preset of {what} of {gguf or hub_id}, "
                                 f"dequantized to fp32; {tool} loads the Hub's {hub_id!r} (its bf16 weights): the "
                                 "same architecture and tokenizer, not the same weights bit for bit"}
    gguf_file = _gguf_file(cfg.model)
    if gguf_file is not None:
        return cfg.model, {"model": f"model={cfg.model!r} is a GGUF file ({gguf_file}): {tool} cannot train from "
                                    "GGUF; give it the safetensors model the file was made from (its Hub id), or a "
                                    "folder saved from nbtrain's dequantized copy"}
    return cfg.model, {}


def _gguf_file(model: str) -> Optional[str]:
    p = Path(model).expanduser()
    if p.suffix.lower() == ".gguf":
        return p.name
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        return found[0].name if found else None
    return None


def lf_model_template(model: str) -> Optional[str]:
    """LLaMA-Factory's template name for a Hub model id it has one for (``smollm2`` for SmolLM2), else None."""
    return next((name for prefix, name in LF_MODEL_TEMPLATES if model.startswith(prefix)), None)


# -- sharding (FSDP2) ----------------------------------------------------------------------------------------
# what nbtrain's sharding="fsdp" is in the tools' words: each decoder layer wrapped (transformers' / accelerate's
# TRANSFORMER_BASED_WRAP), FSDP2, sharded checkpoints (nbtrain writes its final model as a full state dict)
FSDP_WRAP = "TRANSFORMER_BASED_WRAP"
FSDP_STATE_DICT = "SHARDED_STATE_DICT"
# transformers' ``fsdp`` options (FSDPOption) and what nbtrain makes of them
_FSDP_RESHARD = {"full_shard": True, "shard_grad_op": False}
_FSDP_HYBRID = ("hybrid_shard", "hybrid_shard_zero2")
_OFF = (None, False, "", "false", "none", "no")


def fsdp_layer_class(cfg: TrainConfig) -> Optional[str]:
    """The class name of the blocks nbtrain wraps under sharding="fsdp" (the model's largest ModuleList of identical
    blocks, nbtrain.engine.distributed.layer_stack's rule), read from the architecture without weights; None when
    the architecture cannot be read here (a Hub model that is not cached) or has no such stack."""
    return _layer_class(cfg.model, cfg.task)


@functools.lru_cache(maxsize=32)
def _layer_class(model_name: str, task: str) -> Optional[str]:
    # cached: one export asks several times, and a Hub model that is not cached costs a timeout each time
    from ...models.loading import ModelError, layer_stack, meta_model   # layer_stack: the blocks FSDP wraps

    try:
        model = meta_model(model_name, task)
    except ModelError:
        return None
    blocks = layer_stack(model)
    return type(blocks[0]).__name__ if blocks else None


def hf_fsdp_config(cfg: TrainConfig, layer: Optional[str] = None) -> dict[str, Any]:
    """TrainingArguments' ``fsdp_config`` for sharding="fsdp" (transformers 5's key names; transformers 4 reads the
    same ones): FSDP2, reshard_after_forward, each ``layer`` wrapped (left to the model's ``_no_split_modules`` when
    None), sharded checkpoints, every process loading the weights (as nbtrain does)."""
    out: dict[str, Any] = {"version": 2, "reshard_after_forward": cfg.reshard_after_forward,
                           "auto_wrap_policy": FSDP_WRAP}
    if layer:
        out["transformer_layer_cls_to_wrap"] = [layer]
    out.update(state_dict_type=FSDP_STATE_DICT, cpu_ram_efficient_loading=False)
    return out


def hf_fsdp_option(cfg: TrainConfig) -> str:
    """The legacy string form of TrainingArguments' ``fsdp`` (what transformers 4 and LLaMA-Factory's pinned
    versions take): full_shard (reshard after forward) or shard_grad_op (keep the gathered weights), auto_wrap."""
    return ("full_shard" if cfg.reshard_after_forward else "shard_grad_op") + " auto_wrap"


def fsdp_notes(cfg: TrainConfig, layer: Optional[str], tool: str) -> dict[str, str]:
    """What a Trainer-based tool's FSDP runs differently from nbtrain's (sharding="fsdp" only)."""
    if cfg.sharding != "fsdp":
        return {}
    from ...hardware import resolve_precision

    notes = {}
    what = [f"sharding='fsdp': {tool} runs FSDP2 through accelerate; launch it on several processes (accelerate "
            "launch --config_file <nbtrain export --to accelerate-config>, or torchrun)"]
    if resolve_precision(cfg.precision) in ("bf16", "fp16", "fp8"):
        what.append("accelerate's FSDP2 mixed precision reduces gradients in the parameters' dtype (bf16/fp16); "
                    "nbtrain reduces them in float32")
    what.append("its checkpoints are SHARDED_STATE_DICT, as nbtrain's; nbtrain also saves the final model whole, "
                "for the tool's run gather the shards with accelerate merge-weights (or set state_dict_type "
                "FULL_STATE_DICT)")
    notes["sharding"] = "; ".join(what)
    if not layer:
        notes["fsdp_config"] = ("the decoder layer class could not be read here (the model is not cached): "
                                "transformer_layer_cls_to_wrap is left out, so the wrap falls back to the model's "
                                "_no_split_modules (its decoder layers for transformers models)")
    return notes


def reshard_note(cfg: TrainConfig) -> dict[str, str]:
    """A note for reshard_after_forward set under sharding="none", where nothing carries it."""
    if cfg.sharding == "none" and cfg.reshard_after_forward != TrainConfig.model_fields["reshard_after_forward"].default:
        return {"reshard_after_forward": "reshard_after_forward=False only applies with sharding='fsdp'; not written"}
    return {}


def sharding_in(r: Reader, fsdp_key: str = "fsdp", config_key: str = "fsdp_config") -> None:
    """TrainingArguments' ``fsdp`` / ``fsdp_config`` (as a YAML tool passes them on) as sharding and
    reshard_after_forward. FSDP1 settings read as sharding="fsdp" with a warning that nbtrain runs FSDP2; CPU offload,
    hybrid sharding, other wrap policies and full-state-dict checkpoints are named in the warning."""
    fsdp = r.doc.pop(fsdp_key, None)
    raw = r.doc.pop(config_key, None)
    off = fsdp.strip().lower() in _OFF if isinstance(fsdp, str) else (fsdp in _OFF or fsdp == [])
    if off:
        r.kw["sharding"] = "none"
        if raw not in (None, {}, ""):
            r.unmapped[config_key], r.why[config_key] = raw, f"{fsdp_key} is off: the Trainer ignores it"
        return
    if not isinstance(raw, (dict, type(None))):
        r.unmapped[config_key], r.why[config_key] = raw, "a JSON file path: nbtrain reads fsdp_config as a mapping"
        raw = {}
    # transformers strips the fsdp_ prefix of fsdp_config keys; so does this
    conf = {(k[5:] if str(k).startswith("fsdp_") else str(k)): v for k, v in (raw or {}).items()}
    options = ([] if fsdp is True else str(fsdp).replace(",", " ").lower().split() if isinstance(fsdp, str)
               else [str(o).lower() for o in fsdp] if isinstance(fsdp, list) else None)
    if options is None:
        r.unmapped[fsdp_key], r.why[fsdp_key] = fsdp, "not a boolean, an option string or a list of options"
        return
    r.kw["sharding"] = "fsdp"
    reshard = True
    for opt in options:
        if opt in _FSDP_RESHARD:
            reshard = _FSDP_RESHARD[opt]
        elif opt == "no_shard":   # FSDP1's NO_SHARD is data parallel: nbtrain's DDP
            r.kw["sharding"] = "none"
        elif opt in _FSDP_HYBRID:
            r.unmapped[f"{fsdp_key}.{opt}"] = True
            r.why[f"{fsdp_key}.{opt}"] = ("FSDP1's hybrid sharding (shards within a node, replicas across nodes): "
                                          "nbtrain shards over every process (same training, other traffic)")
        elif opt == "offload":
            r.unmapped[f"{fsdp_key}.offload"] = True
            r.why[f"{fsdp_key}.offload"] = ("CPU offload of parameters and gradients: nbtrain's FSDP2 keeps them on "
                                            "the GPU (more GPU memory than this config's run)")
        elif opt != "auto_wrap":
            r.unmapped[f"{fsdp_key}.{opt}"], r.why[f"{fsdp_key}.{opt}"] = True, "not an FSDP option nbtrain knows"
    if "reshard_after_forward" in conf:   # the config's own value wins over the option string, as in transformers
        v = conf.pop("reshard_after_forward")
        text = str(v).strip().lower()
        if text in ("true", "false"):
            reshard = text == "true"
        elif text in _FSDP_RESHARD:   # FSDP1 writes the sharding strategy here
            reshard = _FSDP_RESHARD[text]
        elif text == "no_shard":
            r.kw["sharding"] = "none"
        else:
            r.unmapped[f"{config_key}.reshard_after_forward"] = v
            r.why[f"{config_key}.reshard_after_forward"] = ("hybrid sharding: nbtrain shards over every process"
                                                            if text in _FSDP_HYBRID else "not a bool or a strategy")
    version = conf.pop("version", None)
    if r.kw["sharding"] == "none":   # NO_SHARD: data parallel, nbtrain's DDP; its FSDP settings do nothing there
        return
    r.kw["reshard_after_forward"] = reshard
    if version is None or str(version) != "2":
        key = f"{config_key}.version"
        r.unmapped[key] = version
        r.why[key] = ("FSDP1 (version 1)" if version is not None else
                      "no version: transformers 4 runs FSDP1, transformers 5 FSDP2") + \
            "; nbtrain runs FSDP2 (fully_shard), the same sharding of parameters, gradients and optimizer state"
    policy = str(conf.pop("auto_wrap_policy", FSDP_WRAP)).upper()
    if policy != FSDP_WRAP:
        r.unmapped[f"{config_key}.auto_wrap_policy"] = policy
        r.why[f"{config_key}.auto_wrap_policy"] = "nbtrain wraps each decoder layer (TRANSFORMER_BASED_WRAP)"
    conf.pop("transformer_layer_cls_to_wrap", None)   # nbtrain finds the decoder layers itself
    if policy == FSDP_WRAP:
        conf.pop("min_num_params", None)   # only SIZE_BASED_WRAP reads it
    state = str(conf.pop("state_dict_type", "FULL_STATE_DICT")).upper()
    if state != FSDP_STATE_DICT:
        r.unmapped[f"{config_key}.state_dict_type"] = state
        r.why[f"{config_key}.state_dict_type"] = ("nbtrain's checkpoints are sharded (SHARDED_STATE_DICT); its "
                                                  "final model is saved whole")
    for key in ("cpu_offload", "offload_params"):
        if key in conf and str(conf[key]).lower() == "true":
            r.unmapped[f"{config_key}.{key}"] = conf.pop(key)
            r.why[f"{config_key}.{key}"] = "CPU offload: nbtrain's FSDP2 keeps parameters and gradients on the GPU"
        conf.pop(key, None)
    if str(conf.pop("activation_checkpointing", False)).lower() == "true":
        r.kw["gradient_checkpointing"] = True   # FSDP's checkpoint wrapper on each layer: nbtrain's checkpointing
    if str(conf.get("cpu_ram_efficient_loading", False)).lower() != "true":
        conf.pop("cpu_ram_efficient_loading", None)
    # inert for FSDP2 (transformers reads them for FSDP1 only) or what nbtrain does anyway
    for key in ("sync_module_states", "use_orig_params", "forward_prefetch", "backward_prefetch",
                "limit_all_gathers", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt"):
        if key in conf and (str(conf[key]).lower() in ("false", "no_prefetch") or key in ("sync_module_states",
                                                                                              "use_orig_params")):
            conf.pop(key)
    for key, v in conf.items():
        r.unmapped[f"{config_key}.{key}"] = v
        r.why[f"{config_key}.{key}"] = ("loads the weights in the first process only; nbtrain loads them in every "
                                        "process" if key == "cpu_ram_efficient_loading" else
                                        "an FSDP setting with no nbtrain equivalent")
