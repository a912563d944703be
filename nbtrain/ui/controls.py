"""One widget per TrainConfig field, and the codecs that turn config values into widget values and back.

Every codec round-trips exactly: ``decode(encode(v)) == v`` for every value a TrainConfig can hold,
including ``None`` for the optional fields (a blank text box) and lists for ``lora_targets``.
Decoding fails with a ``ValueError`` whose message says what the box accepts; the panel shows it
next to the field name instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import json
import re

import ipywidgets as widgets
import traitlets

from ..config import OBJECTIVES, OPTIMIZERS, TRACKERS, TrainConfig, reward_kind, reward_reference
from ..hardware import PRECISIONS

# Sized for JupyterLab's 13 px widget font (about 7 px a character): every description fits its 170 px
# (up to ~22 characters), and a 390 px control leaves ~500 px of a 968 px output for the help beside it.
# Fields that hold paths or lists get the wide box, so a typical value is readable without scrolling in it.
DESCRIPTION_WIDTH = "170px"
CONTROL_WIDTH = "390px"
WIDE_CONTROL_WIDTH = "560px"

# The "default" choice of the non-finite policy, spelled out where the dropdown is too narrow for it.
NONFINITE_TIP = ("default: skip the step when a GradScaler is in use (fp16), else stop the run · "
                 "skip: drop the update and go on · stop: end the run, naming the step · "
                 "continue: apply the update anyway")


# How many processes a Train from the panel may launch: one per GPU on a node; beyond 64 a notebook is not the tool.
MAX_PROCESSES = 64

SHARDING_TIP = ("none: with several processes each holds the whole model (DDP, gradients all-reduced) · "
                "fsdp: FSDP2 splits weights, gradients and optimizer state over the processes")


def processes_control() -> widgets.BoundedIntText:
    """The panel's own "Processes" box (1 to MAX_PROCESSES; not a TrainConfig field): how many processes a Train
    launches (``nbt.launch``); 1 trains in this kernel."""
    return widgets.BoundedIntText(value=1, min=1, max=MAX_PROCESSES, description="Processes", style=_style(),
                                  layout=_layout(),
                                  tooltip=f"1: train in this kernel · 2-{MAX_PROCESSES}: Train launches that many "
                                          "worker processes with torchrun (one per GPU) and streams rank 0's steps "
                                          "here")


def _style() -> dict:
    return {"description_width": DESCRIPTION_WIDTH}


def _layout(width: str = CONTROL_WIDTH) -> widgets.Layout:
    return widgets.Layout(width=width)


class Choice(widgets.HBox):
    """A row of toggle buttons with one selected: ``.value`` is the selected option's name.

    Unlike ``ToggleButtons``, each option can be disabled on its own (with its reason as the tooltip),
    which ``Dropdown``/``ToggleButtons`` cannot do. Setting ``.value`` to a disabled option is possible
    from code; the panel then reports it as an error instead of producing a config.
    """

    value = traitlets.Unicode("")  # not synced: the buttons are what the frontend sees

    def __init__(self, options: tuple[str, ...], labels: Optional[dict] = None, tooltips: Optional[dict] = None,
                 disabled: Optional[dict] = None, description: str = "", **kwargs):
        labels, tooltips, disabled = labels or {}, tooltips or {}, disabled or {}
        self.buttons: dict[str, widgets.ToggleButton] = {}
        for name in options:
            why = disabled.get(name)
            self.buttons[name] = widgets.ToggleButton(
                value=False, description=labels.get(name, name), disabled=bool(why),
                tooltip=f"unavailable here: {why}" if why else tooltips.get(name, ""),
                layout=widgets.Layout(width="auto", min_width="64px"))
        self._syncing = False
        self.label = widgets.Label(description, layout=widgets.Layout(width=DESCRIPTION_WIDTH))
        super().__init__([self.label, *self.buttons.values()], **kwargs)
        for name, button in self.buttons.items():
            button.observe(lambda ch, name=name: self._pressed(name, ch["new"]), names="value")
        self.observe(self._show, names="value")

    @property
    def options(self) -> tuple[str, ...]:
        return tuple(self.buttons)

    def _pressed(self, name: str, pressed: bool) -> None:
        if self._syncing:
            return
        if pressed:
            self.value = name
        elif name == self.value:
            # A click on the selected button would leave nothing selected: keep it pressed.
            self._show({"new": self.value})

    def _show(self, change) -> None:
        self._syncing = True
        try:
            for name, button in self.buttons.items():
                button.value = name == change["new"]
                button.button_style = "info" if name == change["new"] else ""
        finally:
            self._syncing = False


class _NumberUnicode(traitlets.Unicode):
    """Text that also takes a number from code (``box.value = 64`` shows "64"), so scripts and notebooks that
    set numbers keep working; what the browser sends is text either way."""

    def validate(self, obj, value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value) if isinstance(value, int) else repr(float(value))
        return super().validate(obj, value)


class NumberText(widgets.Text):
    """A text box for a number, read in Python: a browser-side IntText/FloatText would silently put back the old
    value when letters are typed; here the text stays and the panel says under the field what is allowed."""

    value = _NumberUnicode("", help="String value").tag(sync=True)


class Codec:
    """How one TrainConfig field is edited: the widget, and value <-> widget value conversions."""

    def __init__(self, make: Callable[[], widgets.Widget], encode: Callable[[Any], Any] = lambda v: v,
                 decode: Callable[[Any], Any] = lambda x: x):
        self.make, self.encode, self.decode = make, encode, decode


# -- text boxes for values that may be None --------------------------------------------------------
def _is_none_text(text: str) -> bool:
    return text.strip().lower() in ("", "none", "null")


def _optional_int(blank: str) -> Codec:
    def decode(text: str) -> Optional[int]:
        if _is_none_text(text):
            return None
        try:
            return int(text.strip())
        except ValueError:
            raise ValueError(f"must be a whole number, or blank for {blank} (got {text.strip()!r})") from None

    return Codec(lambda: None, lambda v: "" if v is None else str(v), decode)


def _optional_float(blank: str) -> Codec:
    def decode(text: str) -> Optional[float]:
        if _is_none_text(text):
            return None
        try:
            return float(text.strip())
        except ValueError:
            raise ValueError(f"must be a number, or blank for {blank} (got {text.strip()!r})") from None

    return Codec(lambda: None, lambda v: "" if v is None else repr(float(v)), decode)


def _optional_str(blank: str) -> Codec:
    return Codec(lambda: None, lambda v: "" if v is None else str(v),
                 lambda text: None if not text.strip() else text.strip())


def encode_targets(value) -> str:
    """``"all-linear"`` stays as is; a list becomes comma-separated names (a lone "all-linear" list
    gets a trailing comma so it reads back as a list, keeping the round trip exact)."""
    if isinstance(value, str):
        return value
    text = ", ".join(value)
    return text + "," if len(value) == 1 and value[0] == "all-linear" else text


def decode_targets(text: str):
    """Inverse of :func:`encode_targets`: a comma means a list, a single name is a one-item list."""
    text = text.strip()
    if text.startswith("[") and _json_as(text, list) is not None:   # what a name with a comma is shown as
        return _json_as(text, list)
    if "," in text:
        return [t.strip() for t in text.split(",") if t.strip()]
    if text == "all-linear" or not text:
        return text   # blank: let TrainConfig say what is allowed
    return [text]


# -- numbers: text boxes parsed here, each bad entry said under its field -----------------------------
def _range_words(name: str) -> str:
    """A field's bounds in words from TrainConfig's own (``Field(gt=0, le=10)``): " greater than 0, at most 10"."""
    words = {"gt": "greater than {}", "ge": "at least {}", "lt": "below {}", "le": "at most {}"}
    parts = [words[k].format(getattr(m, k)) for m in TrainConfig.model_fields[name].metadata
             for k in words if hasattr(m, k)]
    return " " + ", ".join(parts) if parts else ""


def _got(text: str) -> str:
    return f"got {text.strip()!r}" if text.strip() else "got a blank box"


_WHOLE = re.compile(r"[+-]?\d[\d_]*")


def _int(name: str, desc: str) -> Codec:
    """A whole-number field: "64"; a wrong entry says so, with the field's bounds."""
    def decode(text: str) -> int:
        if not _WHOLE.fullmatch(str(text).strip()):
            raise ValueError(f"must be a whole number{_range_words(name)}; {_got(str(text))}")
        return int(str(text).strip())

    return Codec(lambda: NumberText(description=desc, placeholder="a whole number", style=_style(),
                                    layout=_layout(), continuous_update=False), str, decode)


def _float(name: str, desc: str, example: str) -> Codec:
    """A number field: "0.001" or "1e-3"; a wrong entry says so, with the field's bounds and an example."""
    def decode(text: str) -> float:
        try:
            return float(str(text).strip())
        except ValueError:
            raise ValueError(f"must be a number{_range_words(name)}, e.g. {example}; {_got(str(text))}") from None

    return Codec(lambda: NumberText(description=desc, placeholder=f"e.g. {example}", style=_style(),
                                    layout=_layout(), continuous_update=False),
                 lambda v: repr(float(v)), decode)


# -- lists and dicts: text a person would type ----------------------------------------------------------
def _exact(friendly: Callable[[Any], str], decode: Callable[[str], Any]) -> Callable[[Any], str]:
    """The friendly text when it reads back as the same value, else JSON (which ``decode`` also reads): a value no
    friendly text can hold (a name with a comma, a prompt over several lines) still round-trips exactly."""
    def encode(v) -> str:
        text = friendly(v)
        try:
            if decode(text) == v:
                return text
        except ValueError:
            pass
        return json.dumps(v, ensure_ascii=False)

    return encode


def _json_as(text: str, kind: type):
    """``text`` read as JSON when it is JSON of ``kind`` (a list of strings, a dict of strings), else None."""
    try:
        v = json.loads(text)
    except ValueError:
        return None
    items = v.items() if isinstance(v, dict) else v if isinstance(v, list) else None
    if not isinstance(v, kind) or items is None:
        return None
    flat = [x for pair in items for x in (pair if isinstance(v, dict) else (pair,))]
    return v if all(isinstance(x, str) for x in flat) else None


def decode_columns(text: str) -> dict:
    """``"prompt=question, response=answer"`` -> ``{"prompt": "question", "response": "answer"}``; blank -> {}."""
    text = str(text).strip()
    if text.startswith("{"):
        v = _json_as(text, dict)
        if v is None:   # YAML flow ({output: answer}), as the CLI's --set writes it
            import yaml

            try:
                v = yaml.safe_load(text)
            except yaml.YAMLError:
                v = None
        if isinstance(v, dict):
            return v
        raise ValueError(f"write it as format_name=your_column, separated by commas, e.g. output=answer; "
                         f"{_got(text)}")
    out = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, col = (x.strip() for x in item.partition("="))
        if not sep or not key or not col:
            raise ValueError(f"each entry is format_name=your_column (e.g. output=answer, instruction=question); "
                             f"{_got(item)}")
        out[key] = col
    return out


def decode_trackers(text: str) -> list:
    """``"tensorboard, mlflow"`` -> the list; blank -> [] (TrainConfig says which names are allowed)."""
    text = str(text).strip()
    if text.startswith("["):   # YAML/JSON flow list, as the CLI's --set writes it
        import yaml

        try:
            v = yaml.safe_load(text)
        except yaml.YAMLError:
            v = None
        if isinstance(v, list) and all(isinstance(t, str) for t in v):
            return v
        raise ValueError(f"write tracker names separated by commas ({', '.join(TRACKERS)}); {_got(text)}")
    return [t.strip() for t in text.split(",") if t.strip()]


def decode_lines(text: str) -> list:
    """One item per line, blank lines dropped; a JSON list of strings (what a multi-line prompt is shown as) too."""
    text = str(text)
    if text.strip().startswith("["):
        v = _json_as(text.strip(), list)
        if v is not None:
            return v
    return [t.strip() for t in text.splitlines() if t.strip()]


# -- widgets ---------------------------------------------------------------------------------------


def _text(desc: str, placeholder: str = "", width: str = CONTROL_WIDTH) -> Callable[[], widgets.Widget]:
    return lambda: widgets.Text(description=desc, placeholder=placeholder, style=_style(), layout=_layout(width),
                                continuous_update=False)


def _combo(desc: str, options: list[str], placeholder: str) -> Callable[[], widgets.Widget]:
    return lambda: widgets.Combobox(description=desc, options=options, placeholder=placeholder,
                                    ensure_option=False, style=_style(), layout=_layout(WIDE_CONTROL_WIDTH),
                                    continuous_update=False)


def _dropdown(desc: str, options, tooltip: str = "") -> Callable[[], widgets.Widget]:
    return lambda: widgets.Dropdown(description=desc, options=options, tooltip=tooltip, style=_style(),
                                    layout=_layout())


def _check(desc: str) -> Callable[[], widgets.Widget]:
    return lambda: widgets.Checkbox(description=desc, indent=True, style=_style(), layout=_layout())


def _lines(desc: str, placeholder: str) -> Codec:
    """A text area, one item per line (blank lines dropped): for a list of strings such as sample prompts."""
    def make() -> widgets.Widget:
        return widgets.Textarea(description=desc, placeholder=placeholder, rows=3, style=_style(),
                                layout=_layout(WIDE_CONTROL_WIDTH), continuous_update=False)

    return Codec(make, _exact(lambda v: "\n".join(v or []), decode_lines), decode_lines)


def _with_widget(codec: Codec, make: Callable[[], widgets.Widget]) -> Codec:
    codec.make = make
    return codec


_NONFINITE_DEFAULT = "default"
GRPO_LOSS_TIP = ("how the token losses are averaged (TRL's loss_type) · dapo: over all the step's completion tokens · "
                 "grpo: per completion, then over completions (short ones weigh more per token) · dr_grpo: over "
                 "completions x max_new_tokens (no length bias)")


OBJECTIVE_LABELS = {"lm": "LM", "dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "grpo": "GRPO"}
# the beta box's label: pref_beta is DPO's and SimPO's beta, ORPO's lambda (LLaMA-Factory's pref_beta)
BETA_LABEL = "Beta β"
ORPO_LAMBDA_LABEL = "Lambda λ (ORPO)"

OPTIMIZER_LABELS = {"adamw": "AdamW", "adamw_8bit": "AdamW 8-bit", "paged_adamw_8bit": "paged AdamW 8-bit",
                    "adafactor": "Adafactor", "sgd": "SGD"}


# -- GRPO's rewards ----------------------------------------------------------------------------------------
# what the reward box offers: each built-in kind once, with an example argument
REWARD_EXAMPLES = ["length:32", "format:^[0-9]+$", "exact", "contains"]
# Several rewards are summed (reward_weights: weighted), so they are written as a sum. A comma would be the form's
# usual list separator, but a regex holds commas ({1,3}); a list of names that all read as rewards is taken too.
REWARD_JOIN = " + "
SAMPLER_AS_TRAINING = ""   # the sampler-precision choice that stands for None: the training precision


def _is_reward_name(text: str) -> bool:
    try:
        reward_kind(text)
    except ValueError:
        return False
    return True


def split_rewards(text: str) -> list[str]:
    """The reward names in a box's text: ``length:32 + exact`` (or ``length:32, exact`` when every piece reads as a
    reward name) -> ``["length:32", "exact"]``; a JSON list of strings as it is; blank -> []."""
    text = str(text).strip()
    if text.startswith("["):
        v = _json_as(text, list)
        if v is not None:
            return v
    if not text:
        return []
    parts = [t.strip() for t in re.split(r"\s\+\s", text) if t.strip()]
    if len(parts) == 1 and "," in text:
        pieces = [t.strip() for t in text.split(",") if t.strip()]
        if len(pieces) > 1 and all(_is_reward_name(t) for t in pieces):
            return pieces
    return parts


def reward_codec() -> Codec:
    """The reward box: names joined by " + " (:func:`split_rewards`), blank = None. A Python function (a config made
    in code) is shown by its 'module:function' name and read back as the same function, so the round trip stays
    exact; one that cannot be imported stays a function while its name is in the box."""
    functions: dict[str, Any] = {}

    def name_of(r) -> str:
        if isinstance(r, str):
            return r
        text = reward_reference(r)
        functions[text] = r
        return text

    def decode(text: str):
        names = split_rewards(text)
        return [functions.get(n, n) for n in names] or None

    def encode(v) -> str:
        if v is None:
            return ""
        names = [name_of(r) for r in (v if isinstance(v, (list, tuple)) else [v])]
        text = REWARD_JOIN.join(names)
        return text if split_rewards(text) == names else json.dumps(names, ensure_ascii=False)

    def make() -> widgets.Widget:
        return widgets.Combobox(description="Reward(s)", options=REWARD_EXAMPLES, ensure_option=False,
                                placeholder="length:32 · format:REGEX · exact · contains", style=_style(),
                                layout=_layout(WIDE_CONTROL_WIDTH), continuous_update=False)

    return Codec(make, encode, decode)


def decode_weights(text: str) -> Optional[list]:
    """``"1, 0.5"`` -> ``[1.0, 0.5]``; blank -> None (1 each)."""
    text = str(text).strip()
    if _is_none_text(text):
        return None
    items = [t.strip() for t in text.strip("[]").split(",") if t.strip()]
    try:
        return [float(t) for t in items]
    except ValueError:
        raise ValueError(f"must be numbers separated by commas, one per reward (e.g. 1, 0.5), or blank for 1 each; "
                         f"{_got(text)}") from None


def make_codecs(model_options: list[str], data_options: list[str], precision_disabled: dict,
                method_disabled: dict, precision_tips: dict, method_tips: dict,
                optimizer_disabled: Optional[dict] = None, optimizer_tips: Optional[dict] = None,
                objective_tips: Optional[dict] = None) -> dict[str, Codec]:
    """A codec for every TrainConfig field, in declaration order. ``*_disabled`` maps an option this machine
    cannot run to the reason (its button is greyed with it), ``*_tips`` an option to its tooltip."""
    return {
        "model": Codec(_combo("Model", model_options, "preset, Hub id (org/name) or local directory")),
        "task": Codec(_dropdown("Task", [("causal LM (next token)", "causal-lm"),
                                         ("sequence classification", "sequence-classification"),
                                         ("image classification", "image-classification")])),
        "data": Codec(_combo("Data", data_options, "builtin:<name>, a file/dir, or a dataset id")),
        "text_column": Codec(_text("Text column")),
        "label_column": Codec(_text("Label column")),
        "image_column": Codec(_text("Image column")),
        "max_seq_len": _int("max_seq_len", "Max seq len (tokens)"),
        "subset": _with_widget(_optional_int("all examples"), _text("Subset (examples)", "all")),
        "precision": Codec(lambda: Choice(("auto", *PRECISIONS), description="Precision",
                                          disabled=precision_disabled, tooltips=precision_tips)),
        "optimizer": Codec(lambda: Choice(OPTIMIZERS, labels=OPTIMIZER_LABELS, description="Optimizer",
                                          disabled=optimizer_disabled, tooltips=optimizer_tips)),
        "stochastic_rounding": Codec(_check("Stochastic rounding")),
        "micro_batch_size": _int("micro_batch_size", "Micro batch (examples)"),
        "grad_accum_steps": _int("grad_accum_steps", "Accumulation steps"),
        "method": Codec(lambda: Choice(("full", "lora", "qlora"), labels={"lora": "LoRA", "qlora": "QLoRA"},
                                       description="Method", disabled=method_disabled, tooltips=method_tips)),
        "lora_r": _int("lora_r", "LoRA rank r"),
        "lora_alpha": _float("lora_alpha", "LoRA alpha", "16"),
        "lora_dropout": _float("lora_dropout", "LoRA dropout (0-1)", "0.05"),
        "lora_targets": Codec(_text("LoRA targets", "all-linear, or q_proj, v_proj", WIDE_CONTROL_WIDTH),
                              _exact(encode_targets, decode_targets), decode_targets),
        "quant_bits": Codec(_dropdown("Quantised base", [("4-bit (nf4)", 4), ("8-bit (int8)", 8)])),
        "gradient_checkpointing": Codec(_check("Gradient checkpointing")),
        "lr": _float("lr", "Learning rate", "1e-3 or 0.001"),
        "weight_decay": _float("weight_decay", "Weight decay", "0.01"),
        "scheduler": Codec(_dropdown("LR schedule", ["constant", "linear", "cosine"])),
        "warmup_steps": _int("warmup_steps", "Warmup (steps)"),
        "max_steps": _with_widget(_optional_int("using epochs"), _text("Max steps", "blank: use epochs")),
        "epochs": _with_widget(_optional_float("using max_steps"), _text("Epochs", "blank: use max steps")),
        "max_grad_norm": _with_widget(_optional_float("no clipping"), _text("Clip grad norm", "blank: off")),
        "packing": Codec(_check("Packing (causal LM)")),
        "eval_fraction": _float("eval_fraction", "Eval fraction (0-1)", "0.05"),
        "eval_every": _with_widget(_optional_int("evaluating only at the end"),
                                   _text("Eval every (steps)", "blank: at the end")),
        "log_every": _int("log_every", "Log every (steps)"),
        "seed": _int("seed", "Seed"),
        "data_seed": _with_widget(_optional_int("the seed's order"), _text("Data seed", "blank: = seed")),
        "output_dir": _with_widget(_optional_str("not saving"),
                                   _text("Output dir", "blank: don't save", WIDE_CONTROL_WIDTH)),
        "nonfinite": Codec(_dropdown("Non-finite step", [("default", _NONFINITE_DEFAULT), ("skip it", "skip"),
                                                         ("stop the run", "stop"),
                                                         ("continue (apply it)", "continue")], NONFINITE_TIP),
                           lambda v: _NONFINITE_DEFAULT if v is None else v,
                           lambda x: None if x == _NONFINITE_DEFAULT else x),
        "chunked_loss": Codec(_check("Chunked loss (causal LM)")),
        "loss_chunk_tokens": _int("loss_chunk_tokens", "Loss chunk (tokens)"),
        "compile": Codec(_check("torch.compile")),
        "lean_layers": Codec(_check("Lean layers")),
        "auto_batch_size": Codec(_check("Auto micro batch")),
        "save_every": _with_widget(_optional_int("no checkpoints"), _text("Checkpoint every", "blank: never")),
        "resume_from": _with_widget(_optional_str("starting fresh"),
                                    _text("Resume from", "blank: fresh run", WIDE_CONTROL_WIDTH)),
        "data_format": Codec(_dropdown("Data format", [("auto (from the columns)", "auto"), ("plain text", "text"),
                                                       ("alpaca", "alpaca"), ("sharegpt", "sharegpt"),
                                                       ("messages", "messages"),
                                                       ("prompt-completion", "prompt-completion"),
                                                       ("preference pairs", "preference"),
                                                       ("prompts only (GRPO)", "prompt")])),
        "dataset_entry": _with_widget(_optional_str("the folder's only entry"),
                                      _text("Dataset entry", "blank: its only entry")),
        "chat_template": Codec(_combo("Chat template", ["auto", "chatml", "llama3", "alpaca"],
                                      "auto, chatml, llama3, alpaca or a Jinja string")),
        "train_on": Codec(_dropdown("Loss on", [("every answer", "completion"), ("last answer", "last"),
                                                ("all tokens", "all")])),
        "columns": Codec(_text("Columns", "blank: the format's names · output=answer",
                               WIDE_CONTROL_WIDTH),
                         _exact(lambda v: ", ".join(f"{k}={c}" for k, c in (v or {}).items()), decode_columns),
                         decode_columns),
        "sample_prompts": _lines("Sample prompts", "one prompt per line: answered while it trains"),
        "sample_every": _with_widget(_optional_int("sampling at the end only"),
                                     _text("Sample every (steps)", "blank: at the end")),
        "max_new_tokens": _int("max_new_tokens", "Answer length (tokens)"),
        "objective": Codec(lambda: Choice(OBJECTIVES, labels=OBJECTIVE_LABELS, description="Objective",
                                          tooltips=objective_tips)),
        "pref_beta": _float("pref_beta", BETA_LABEL, "0.1"),
        "simpo_gamma": _float("simpo_gamma", "Gamma γ (SimPO)", "0.5"),
        "precompute_ref": Codec(_check("Precompute reference")),
        "reward": reward_codec(),
        "reward_weights": Codec(_text("Reward weights", "blank: 1 each · 1, 0.5"),
                                lambda v: "" if v is None else ", ".join(repr(float(w)) for w in v), decode_weights),
        "num_generations": _int("num_generations", "Generations / prompt"),
        "temperature": _float("temperature", "Temperature", "1.0"),
        "top_p": _float("top_p", "Top-p", "0.95"),
        "grpo_epsilon": _float("grpo_epsilon", "Clip range ε", "0.2"),
        "grpo_beta": _float("grpo_beta", "KL weight β (GRPO)", "0.04"),
        "grpo_loss": Codec(_dropdown("Loss averaging", [("dapo: all tokens", "dapo"),
                                                        ("grpo: per completion", "grpo"),
                                                        ("dr_grpo: fixed length", "dr_grpo")], GRPO_LOSS_TIP)),
        "grpo_iterations": _int("grpo_iterations", "Steps per rollout"),
        "sampler_precision": Codec(lambda: Choice((SAMPLER_AS_TRAINING, *PRECISIONS),
                                                  labels={SAMPLER_AS_TRAINING: "as training"},
                                                  description="Sampler precision", disabled=precision_disabled,
                                                  tooltips={SAMPLER_AS_TRAINING: "sample in the training precision",
                                                            **precision_tips}),
                                   lambda v: SAMPLER_AS_TRAINING if v is None else v,
                                   lambda x: None if x == SAMPLER_AS_TRAINING else x),
        "is_correction": Codec(_dropdown("Mismatch correction", [("none", "none"),
                                                                 ("token_truncate (TIS)", "token_truncate")])),
        "is_cap": _float("is_cap", "IS weight cap", "2"),
        "sharding": Codec(_dropdown("Sharding", [("none (DDP)", "none"), ("fsdp (FSDP2)", "fsdp")],
                                    SHARDING_TIP)),
        "reshard_after_forward": Codec(_check("Reshard after forward")),
        "report_to": Codec(_text("Report to", "blank: none · " + ", ".join(TRACKERS), WIDE_CONTROL_WIDTH),
                           _exact(lambda v: ", ".join(v or []), decode_trackers), decode_trackers),
    }


def yaml_codec(name: str) -> Codec:
    """A text box read as YAML (numbers, null, lists): for a TrainConfig field this module does not know."""
    import yaml

    def encode(v) -> str:
        return yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("...").strip()

    def decode(text: str):
        try:
            return yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML: {e}") from None

    return Codec(_text(name), encode, decode)
