"""``nbt.Panel()``: every TrainConfig knob as a widget, a live memory estimate, and Train / Stop / Compare.

Plain ipywidgets plus the dashboard's plotly ``FigureWidget``, so it renders wherever widgets do
(JupyterLab, Notebook 7, VS Code, Colab) with no frontend extension of its own. Training runs through
``nbt.start()`` in a background thread, so the panel and the kernel stay responsive. Nothing here
raises at the user on a bad value: errors become an inline message naming the field.

Every thread and timer of the panel goes through :mod:`nbtrain.engine.threads`: heavy imports are
finished on the user's thread first, and interpreter exit stops and joins whatever is still running.
"""

from __future__ import annotations

import asyncio
import html
import math
import threading
from pathlib import Path
from typing import Any, Optional

import ipywidgets as widgets

from ..config import ConfigError, TrainConfig
from ..engine import StopTraining, start
from ..engine.threads import complete_imports, spawn, track
from ..hardware import PRECISIONS, capabilities
from .controls import Choice, Codec, make_codecs, yaml_codec

# Which tab each field lives on. Fields added to TrainConfig later land on "Training" (see _section_of).
SECTIONS: dict[str, tuple[str, ...]] = {
    "Model": ("model", "task"),
    "Data": ("data", "text_column", "label_column", "max_seq_len", "subset", "packing", "eval_fraction"),
    "Precision": ("precision",),
    "Accumulation": ("micro_batch_size", "grad_accum_steps", "auto_batch_size"),
    "Method": ("method", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_bits",
               "gradient_checkpointing", "lean_layers"),
    "Training": ("lr", "weight_decay", "scheduler", "warmup_steps", "max_steps", "epochs", "max_grad_norm",
                 "eval_every", "log_every", "seed", "nonfinite", "output_dir", "save_every", "resume_from",
                 "chunked_loss", "loss_chunk_tokens", "compile"),
}

HELP: dict[str, str] = {
    "task": "next-token prediction, or one label per example",
    "text_column": "column with the text (files and dataset ids)",
    "label_column": "column with the class label (classification only)",
    "max_seq_len": "tokens per example; longer ones are cut (a.k.a. cutoff_len)",
    "subset": "first N examples only (before the eval split); blank = all",
    "packing": "concatenate texts and cut into max_seq_len blocks: no padding",
    "eval_fraction": "share of examples held out for evaluation; 0 = none",
    "micro_batch_size": "examples per forward/backward: drives activation memory",
    "grad_accum_steps": "micro-batches whose gradients add up to one optimizer step",
    "lora_r": "adapter rank: trainable parameters grow linearly with r",
    "lora_alpha": "adapter scale = alpha / r",
    "lora_dropout": "dropout on the adapter input",
    "lora_targets": "module names, comma-separated, or all-linear",
    "quant_bits": "how the frozen base is stored (bitsandbytes)",
    "gradient_checkpointing": "recompute activations in backward: less memory, ~30% slower",
    "lean_layers": "Llama-style MLP and norms recompute cheap intermediates in backward: same results, less memory",
    "lr": "peak learning rate (AdamW)",
    "weight_decay": "AdamW's decoupled weight decay",
    "scheduler": "how the learning rate moves after warmup",
    "warmup_steps": "optimizer steps of linear warmup from 0",
    "max_steps": "optimizer steps to run; wins over epochs",
    "epochs": "passes over the training set, when max steps is blank",
    "max_grad_norm": "clip the total gradient L2 norm; blank or 0 = off (still measured)",
    "eval_every": "evaluate every N optimizer steps; blank = only at the end",
    "log_every": "print every N steps (every step is recorded)",
    "seed": "data order, eval split and initial weights",
    "nonfinite": "what a step with inf/nan does when no GradScaler skips it",
    "auto_batch_size": "find the largest micro batch that fits; accumulation keeps the effective batch",
    "save_every": "write a checkpoint (weights, optimizer, RNG, history) every N steps into output_dir",
    "resume_from": "a checkpoint directory, or output_dir: continue that run exactly",
    "chunked_loss": "compute the loss chunk by chunk: the full fp32 logits never exist (less memory)",
    "loss_chunk_tokens": "target tokens per chunk of the chunked loss",
    "compile": "torch.compile each layer: faster steps after a slow first one",
    "output_dir": "write config, history and summary here",
}

PRECISION_HINTS: dict[str, str] = {
    "auto": "picks bf16 where supported, else fp16 on CUDA, else fp32",
    "fp32": "full precision, the reference: most memory, slowest on GPUs",
    "tf32": "fp32 storage, matmuls with a 10-bit mantissa on tensor cores (Ampere+)",
    "fp16": "needs loss scaling (GradScaler); overflow above 65504",
    "bf16": "fp32 range, less mantissa (8 bits); no loss scaling needed",
}

METHOD_HINTS: dict[str, str] = {
    "full": "every weight trains: gradients and AdamW state for all of them",
    "lora": "base frozen; small rank-r adapters train (little gradient and optimizer memory)",
    "qlora": "LoRA on a 4/8-bit quantised frozen base (bitsandbytes): the least weight memory",
}

_LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets")
_RED, _AMBER, _GREEN, _GREY = "#c62828", "#ef6c00", "#2e7d32", "#666"
_INVALID_BORDER = f"1px solid {_RED}"


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _small(text: str, color: str = _GREY) -> str:
    return f'<span style="color:{color};font-size:0.92em">{text}</span>'


def fmt_gib(x: Optional[float]) -> str:
    """A memory size for people: GiB from 1 GiB up, else MiB (else KiB), three significant figures."""
    if x is None or not math.isfinite(x):
        return "?"
    if abs(x) >= 1024:
        return f"{x / 1024:.2f} TiB"
    if abs(x) >= 1:
        return f"{x:.2f} GiB"
    if abs(x) * 1024 >= 1:
        return f"{x * 1024:.1f} MiB"
    return f"{x * 1024 * 1024:.0f} KiB"


def _section_of(field: str) -> str:
    for section, fields in SECTIONS.items():
        if field in fields:
            return section
    return "Training"


class _Job:
    """One Train or Compare press: its kind, stop request, run (Train) and completion."""

    def __init__(self, kind: str):
        self.kind = kind
        self.stop = threading.Event()
        self.done = threading.Event()
        self.finished = False
        self.run = None

    def halt(self) -> None:
        """Ask this job to end after the current step (no widget updates: also called at interpreter exit)."""
        self.stop.set()
        if self.run is not None:
            self.run.stop()


class _PanelCallback:
    """The panel's own callback: status line while running, result and buttons when the run ends."""

    _MIN_INTERVAL = 0.25  # status updates per second are capped: each one is a message to the frontend

    def __init__(self, panel: Panel, job: _Job):
        self.panel, self.job = panel, job
        self.total = None
        self.variant = None
        self._last = 0.0

    def on_run_start(self, info) -> None:
        # A Stop during a comparison ends each later variant at its first step (on_step_end below), so
        # its row says "stopped"; raising here would end it with no steps but an untrue "max_steps".
        self.total, self.variant = info.total_steps, info.variant
        where = f"{info.device} · {info.precision_used}" + (" + GradScaler" if info.scaler_enabled else "")
        self.panel._set_status(f"running{self._name()}: step 0/{self.total} ({where})", _GREY)

    def on_step_end(self, record) -> None:
        if self.job.stop.is_set():
            raise StopTraining
        import time

        now = time.monotonic()
        if now - self._last >= self._MIN_INTERVAL or record.step == self.total:
            self._last = now
            loss = f"{record.loss:.4g}" if record.loss is not None and math.isfinite(record.loss) else record.loss
            self.panel._set_status(f"running{self._name()}: step {record.step}/{self.total} · loss {loss}",
                                   _GREY)

    def on_run_end(self, result) -> None:
        if self.job.kind == "train":
            self.panel._finish(self.job, result=result)

    def _name(self) -> str:
        return f" {self.variant}" if self.variant else ""


class Panel:
    """Widgets for every TrainConfig field, a live memory estimate, and Train / Stop / Compare buttons.

    ``panel.config`` is the validated config of the current values; ``Panel(config=cfg)`` shows ``cfg``;
    ``panel.controls`` maps each TrainConfig field to its widget. ``panel.run``, ``panel.result`` and
    ``panel.comparison`` give the last run, its TrainResult and the last ComparisonResult; the run's
    notes and out-of-memory advice are listed under the status line (``panel.notes``).
    ``callbacks`` are added to every run the panel starts. ``debounce_s`` delays the memory estimate
    after a change (0: recompute at once); meanwhile the readout says "estimating…" and
    ``memory_estimate`` is None.
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, callbacks=None, debounce_s: float = 0.25):
        # On the user's thread, before the first timer or thread: a first `import transformers` on a
        # background thread can break other threads' imports of it.
        complete_imports()
        self.caps = capabilities()
        self.callbacks = list(callbacks or [])
        self.debounce_s = float(debounce_s)
        self.run = None
        self.result = None
        self.comparison = None
        self.dashboard = None
        self.memory_estimate = None
        self.comparison_table = None
        self.errors: list[dict] = []
        self._job: Optional[_Job] = None
        self._compare_thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()
        self._mem_lock = threading.Lock()
        self._mem_timer = None
        self._mem_gen = 0   # bumped on every change: an estimate for older values is never shown
        self._holding = False

        self._codecs = self._make_codecs()
        self.controls: dict[str, widgets.Widget] = {name: codec.make() for name, codec in self._codecs.items()}
        self._help = {name: widgets.HTML(_small(_esc(HELP.get(name, "")))) for name in self.controls}
        self._rows = {name: self._row(name) for name in self.controls}
        self._build()
        self.config = config if config is not None else TrainConfig()
        for w in self.controls.values():
            w.observe(self._on_change, names="value")

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
        codecs = make_codecs(presets, builtins,
                             precision_disabled={p: caps.reasons[p] for p in PRECISIONS if p in caps.reasons},
                             method_disabled={m: caps.reasons[m] for m in METHOD_HINTS if m in caps.reasons},
                             precision_tips=tips, method_tips=METHOD_HINTS)
        # A field added to TrainConfig after this panel was written still gets a (YAML text) control.
        return {name: codecs.get(name) or yaml_codec(name) for name in TrainConfig.model_fields}

    def _row(self, name: str) -> widgets.Widget:
        w = self.controls[name]
        if isinstance(w, Choice):
            return widgets.VBox([w, self._help[name]])
        return widgets.HBox([w, self._help[name]], layout=widgets.Layout(align_items="center"))

    def _build(self) -> None:
        caps = self.caps
        device_line = (f"· {_esc(caps.device)}: {_esc(caps.name)} · {caps.total_memory_gib:.1f} GiB"
                       f" · precision auto → {_esc(caps.auto_precision)}")
        self.header = widgets.HTML(f"<b>nbtrain</b> {_small(device_line)}")
        self.model_info = widgets.HTML()
        self.data_info = widgets.HTML()
        self.precision_info = widgets.HTML()
        self.accumulation_info = widgets.HTML()
        self.method_info = widgets.HTML()
        extra = {"Model": [self.model_info], "Data": [self.data_info], "Precision": [self.precision_info],
                 "Accumulation": [self.accumulation_info], "Method": [self.method_info]}
        placed = {f for fields in SECTIONS.values() for f in fields}
        pages = []
        for section, fields in SECTIONS.items():
            rows = [self._rows[f] for f in fields]
            if section == "Training":
                rows += [self._rows[f] for f in self.controls if f not in placed]
            # The info line sits right under the field it explains (the first one of the section).
            pages.append(widgets.VBox(rows[:1] + extra.get(section, []) + rows[1:],
                                      layout=widgets.Layout(padding="6px")))
        self.tabs = widgets.Tab(children=pages, titles=tuple(SECTIONS))

        self.memory = widgets.HTML()
        self.error = widgets.HTML()
        self.status = widgets.HTML()
        self.notes = widgets.HTML()   # the last run's notes and out-of-memory advice, under the status
        self.train_button = widgets.Button(description="Train", button_style="success", icon="play",
                                           tooltip="train with these settings (background thread)")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                          tooltip="end the run after the current step; history is kept")
        self.compare_button = widgets.Button(description="Compare precisions", icon="balance-scale",
                                             layout=widgets.Layout(width="auto"),
                                             tooltip="run these settings once per ticked precision")
        self.compare_choices = {
            p: widgets.Checkbox(value=p not in caps.reasons, disabled=p in caps.reasons, description=p,
                                indent=False, layout=widgets.Layout(width="auto", margin="0 8px 0 0"),
                                tooltip=caps.reasons.get(p) or PRECISION_HINTS[p])
            for p in PRECISIONS}
        self.yaml_path = widgets.Text(value="nbtrain.yaml", description="YAML", style={"description_width": "40px"},
                                      layout=widgets.Layout(width="260px"))
        self.load_button = widgets.Button(description="Load", layout=widgets.Layout(width="70px"),
                                          tooltip="load the settings from this YAML file")
        self.save_button = widgets.Button(description="Save", layout=widgets.Layout(width="70px"),
                                          tooltip="save the settings to this YAML file")
        self.dashboard_area = widgets.VBox()

        self.train_button.on_click(lambda _b: self._guard(self._on_train))
        self.stop_button.on_click(lambda _b: self._guard(self.stop))
        self.compare_button.on_click(lambda _b: self._guard(self._on_compare))
        self.load_button.on_click(lambda _b: self._guard(self.load_yaml, self.yaml_path.value))
        self.save_button.on_click(lambda _b: self._guard(self.save_yaml, self.yaml_path.value))
        self._set_status("ready", _GREY)

        compare_row = widgets.HBox([widgets.HTML(_small("compare:")), *self.compare_choices.values()],
                                   layout=widgets.Layout(align_items="center", margin="0 0 0 12px"))
        run_row = widgets.HBox([self.train_button, self.stop_button, self.compare_button, compare_row],
                               layout=widgets.Layout(align_items="center", flex_flow="row wrap"))
        yaml_row = widgets.HBox([self.yaml_path, self.load_button, self.save_button])
        box = widgets.Layout(border="1px solid #ddd", padding="6px", margin="4px 0")
        self.widget = widgets.VBox([
            self.header, self.tabs,
            widgets.VBox([self.memory], layout=box),
            self.error,
            widgets.VBox([run_row, self.status, self.notes, yaml_row], layout=box),
            self.dashboard_area,
        ])

    # -- display -----------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- config <-> widgets ------------------------------------------------------------------
    @property
    def config(self) -> TrainConfig:
        """The validated TrainConfig of the current values; raises ConfigError (also shown inline) when invalid."""
        cfg, errors = self._validate()
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
            for name, value in cfg.to_dict().items():
                self.controls[name].value = self._codecs[name].encode(value)
        finally:
            self._holding = False
        self._refresh()

    def _values(self) -> tuple[dict, list[dict]]:
        values, errors = {}, []
        for name, w in self.controls.items():
            try:
                values[name] = self._codecs[name].decode(w.value)
            except ValueError as e:
                errors.append({"field": name, "message": str(e)})
        return values, errors

    def _validate(self) -> tuple[Optional[TrainConfig], list[dict]]:
        values, errors = self._values()
        if errors:
            return None, errors
        try:
            return TrainConfig(**values), []
        except ConfigError as e:
            return None, list(e.errors)
        except Exception as e:  # a check that itself failed (e.g. a model that cannot be inspected)
            return None, [{"field": "config", "message": f"{type(e).__name__}: {e}"}]

    def load_yaml(self, path) -> TrainConfig:
        """Show the config in a YAML file; on error the controls stay as they were and the error is shown."""
        try:
            cfg = TrainConfig.from_yaml(path)
        except (ConfigError, OSError) as e:
            self._show_errors([{"field": getattr(e, "field", None) or "yaml", "message": str(e)}])
            raise
        self.config = cfg
        self._set_status(f"loaded {_esc(path)}", _GREY)
        return cfg

    def save_yaml(self, path) -> Path:
        """Write the current config to a YAML file (raises ConfigError, also shown, when it is invalid)."""
        cfg = self.config
        cfg.to_yaml(path)
        self._set_status(f"saved {_esc(path)}", _GREY)
        return Path(path)

    # -- reacting to changes -----------------------------------------------------------------
    def _on_change(self, _change=None) -> None:
        if not self._holding:
            self._refresh()

    def _refresh(self) -> None:
        raw = {name: w.value for name, w in self.controls.items()}
        self._update_model_info(raw)
        self._update_data_info(raw)
        self._update_precision_info(raw)
        self._update_accumulation_info(raw)
        self._update_method_fields(raw)
        self._show_errors(self._validate()[1])
        self._schedule_memory()

    def _show_errors(self, errors: list[dict]) -> None:
        self.errors = list(errors)
        bad = {e["field"] for e in errors}
        for name, w in self.controls.items():
            w.layout.border = _INVALID_BORDER if name in bad else ""
        if not errors:
            self.error.value = ""
            return
        lines = []
        for e in errors:
            field = e.get("field") or "config"
            where = f"{_section_of(field)} › " if field in self.controls else ""
            lines.append(f"⚠ {_esc(where)}<b>{_esc(field)}</b>: {_esc(e.get('message', 'invalid'))}")
        self.error.value = (f'<div style="color:{_RED};border-left:3px solid {_RED};padding:2px 8px">'
                            + "<br>".join(lines) + "</div>")

    def _update_model_info(self, raw: dict) -> None:
        name = str(raw["model"]).strip()
        try:
            from ..models import PRESETS, resolve_source

            src = resolve_source(name)
            if src.kind == "preset":
                text = f"preset: {_esc(PRESETS[name].description)}"
            elif src.kind == "local":
                text = f"local directory {_esc(src.name)}"
            else:
                text = "Hugging Face Hub id: downloaded on first use (needs network, or the local cache)"
            self.model_info.value = _small(text)
        except Exception as e:
            self.model_info.value = _small(_esc(e), _AMBER)

    def _update_data_info(self, raw: dict) -> None:
        name = str(raw["data"]).strip()
        if name.startswith("builtin:"):
            try:
                from ..data import BUILTINS

                desc = BUILTINS.get(name[len("builtin:"):])
            except Exception:
                desc = None
            text = f"builtin: {_esc(desc)}" if desc else _esc(f"unknown builtin dataset {name!r}")
        elif name and Path(name).expanduser().exists():
            p = Path(name).expanduser()
            text = f"local {'directory' if p.is_dir() else (p.suffix.lstrip('.') or 'file')}: {_esc(p.resolve())}"
        else:
            text = "dataset id (Hugging Face Hub): downloaded on first use"
        self.data_info.value = _small(text)
        # The label column only matters for classification; packing only for causal LM.
        self.controls["label_column"].disabled = raw["task"] != "sequence-classification"

    def _update_precision_info(self, raw: dict) -> None:
        caps, chosen = self.caps, raw["precision"]
        lines = []
        for p in ("auto", *PRECISIONS):
            why = caps.reasons.get(p)
            if why:
                line = f"<b>{p}</b>: <span style='color:{_RED}'>unavailable</span> — {_esc(why)}"
            else:
                hint = PRECISION_HINTS[p]
                if p == "auto":
                    hint += f" → <b>{_esc(caps.auto_precision)}</b> on this {_esc(caps.device)}"
                line = f"<b>{p}</b>: {hint}" if p == "auto" else f"<b>{p}</b>: {_esc(hint)}"
                if p in caps.notes:
                    line += f" {_small('(' + _esc(caps.notes[p]) + ')', _AMBER)}"
            if p == chosen:
                line = f"<span style='background:#e3f2fd'>▶ {line}</span>"
            lines.append(line)
        self.precision_info.value = "<div style='line-height:1.6'>" + "<br>".join(lines) + "</div>"

    def _update_accumulation_info(self, raw: dict) -> None:
        micro, accum, seq = raw["micro_batch_size"], raw["grad_accum_steps"], raw["max_seq_len"]
        eff = micro * accum
        tokens = eff * seq
        if raw["task"] == "sequence-classification":
            tok_note = "input tokens (up to); the loss counts one target per example"
        elif raw["packing"]:
            tok_note = "tokens, exactly (packing fills every row)"
        else:
            tok_note = "tokens at most (fewer when texts are shorter than max_seq_len)"
        try:
            steps = self._codecs["max_steps"].decode(raw["max_steps"])
        except ValueError:
            steps = None   # the error line already says why
        seen = f" · {steps:,} steps see {steps * eff:,} examples" if steps else ""
        self.accumulation_info.value = (
            f"effective batch <b>{micro} × {accum} = {eff:,}</b> examples per optimizer step · "
            f"<b>{eff:,} × {seq:,} = {tokens:,}</b> {tok_note}{_esc(seen)}<br>"
            + _small("same effective batch, smaller micro batch: less activation memory, same loss "
                     "(token-weighted), more time per step"))

    def _update_method_fields(self, raw: dict) -> None:
        method = raw["method"]
        for f in _LORA_FIELDS:
            self._rows[f].layout.display = "" if method in ("lora", "qlora") else "none"
        self._rows["quant_bits"].layout.display = "" if method == "qlora" else "none"
        why = self.caps.reasons.get(method)
        text = METHOD_HINTS.get(method, "")
        self.method_info.value = (_small(f"<b>{_esc(method)}</b>: unavailable — {_esc(why)}", _RED) if why
                                  else _small(_esc(text)))

    # -- memory readout ----------------------------------------------------------------------
    def _schedule_memory(self) -> None:
        with self._mem_lock:
            self._mem_gen += 1
            gen = self._mem_gen
            if self._mem_timer is not None:
                self._mem_timer.cancel()
                self._mem_timer = None
            # The old readout belongs to the old values: never leave its verdict up while the new one is pending.
            self._show_estimating()
        if self.debounce_s <= 0:
            self._refresh_memory(gen)
            return
        with self._mem_lock:
            if gen != self._mem_gen:
                return
            try:   # in a kernel: run on its event loop, in the thread that owns the widgets
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if loop is not None:
                self._mem_timer = loop.call_later(self.debounce_s, self._refresh_memory_quietly, gen)
            else:
                timer = threading.Timer(self.debounce_s, self._refresh_memory_quietly, args=(gen,))
                timer.name = "nbtrain-panel-memory"
                timer.daemon = True
                track(timer, timer.cancel)   # interpreter exit cancels it, or waits for an estimate under way
                timer.start()
                self._mem_timer = timer

    def _show_estimating(self) -> None:
        self.memory_estimate = None
        self.memory.value = "<b>Memory</b>: " + _small("estimating…")

    def _refresh_memory_quietly(self, gen: int) -> None:
        try:
            self._refresh_memory(gen)
        except Exception as e:  # a timer has nowhere to raise to: show it instead
            with self._mem_lock:
                if gen == self._mem_gen:
                    self.memory.value = _small(f"memory estimate failed: {_esc(type(e).__name__)}: {_esc(e)}",
                                               _RED)

    def refresh_memory(self):
        """Recompute the memory readout now from the current values; returns the MemoryEstimate (None if invalid)."""
        with self._mem_lock:
            self._mem_gen += 1
            gen = self._mem_gen
            self._show_estimating()
        return self._refresh_memory(gen)

    def _refresh_memory(self, gen: int):
        if gen != self._mem_gen:
            return None   # the values changed again: a newer estimate is scheduled
        cfg = self._validate()[0]
        est, text = None, None
        if cfg is None:
            text = "<b>Memory</b>: " + _small("— fix the settings above to see the estimate")
        else:
            try:
                from ..memory import estimate_memory

                est = estimate_memory(cfg)
                text = memory_html(est, self.caps.device)
            except Exception as e:
                est = None
                text = "<b>Memory</b>: " + _small(f"no estimate for these settings: "
                                                  f"{_esc(type(e).__name__)}: {_esc(e)}", _AMBER)
        with self._mem_lock:
            if gen != self._mem_gen:
                return est   # computed for values that are no longer shown: not put up
            self.memory_estimate = est
            self.memory.value = text
        return est

    # -- running -----------------------------------------------------------------------------
    def _guard(self, fn, *args) -> None:
        # Button handlers never raise: ipywidgets would print a traceback into some output area.
        try:
            fn(*args)
        except ConfigError as e:
            self._show_errors(e.errors)
            self._set_status("not done: fix the settings marked above", _RED)
        except Exception as e:
            self._set_status(f"error: {_esc(type(e).__name__)}: {_esc(e)}", _RED)

    def _busy(self) -> bool:
        return self._job is not None and not self._job.finished

    def _set_status(self, text: str, color: str) -> None:
        self.status.value = f'<span style="color:{color}">{text}</span>'

    def _start_checks(self) -> Optional[TrainConfig]:
        if self._busy():
            self._set_status("a run is already going: Stop it first", _AMBER)
            return None
        cfg, errors = self._validate()
        self._show_errors(errors)
        if cfg is None:
            field = errors[0].get("field") if errors else None
            if field in self.controls:
                self.tabs.selected_index = list(SECTIONS).index(_section_of(field))
            self._set_status("not started: fix the settings marked above", _RED)
            return None
        return cfg

    def _new_dashboard(self):
        from ..viz.dashboard import LiveDashboard

        # display=False: the panel shows the dashboard's widget in its own area, never in whatever cell
        # the training thread happens to write to.
        try:
            dash = LiveDashboard(display=False, mode="widget")
        except ImportError:   # no anywidget: no FigureWidget; the static figure is shown at the end
            dash = LiveDashboard(display=False, mode="html")
        self.dashboard = dash
        self.dashboard_area.children = (dash.widget,) if dash.widget is not None else ()
        return dash

    def _begin(self, kind: str) -> _Job:
        job = _Job(kind)
        self._job = job
        self.notes.value = ""
        self.train_button.disabled = True
        self.compare_button.disabled = True
        self.stop_button.disabled = False
        return job

    def _on_train(self) -> None:
        cfg = self._start_checks()
        if cfg is None:
            return
        job = self._begin("train")
        dash = self._new_dashboard()
        self._set_status("starting… (loading data and model)", _GREY)
        try:
            run = start(cfg, callbacks=[dash, _PanelCallback(self, job), *self.callbacks])
        except Exception as e:
            self._finish(job, error=e)
            return
        self.run = run
        job.run = run
        # Interpreter exit stops the run and waits for it, so a script that ends after Stop ends cleanly.
        spawn(lambda: self._watch(job, run), "nbtrain-panel-watch", stop=job.halt)

    def _watch(self, job: _Job, run) -> None:
        # on_run_end normally finishes the job; this catches a run that died before it (bad data, ...).
        try:
            result = run.wait()
        except BaseException as e:
            self._finish(job, error=e)
        else:
            self._finish(job, result=result)

    def compare_precisions(self) -> tuple[str, ...]:
        """The precisions Compare runs: the ticked ones this device can run."""
        return tuple(p for p, box in self.compare_choices.items() if box.value and p not in self.caps.reasons)

    def _on_compare(self) -> None:
        cfg = self._start_checks()
        if cfg is None:
            return
        precisions = self.compare_precisions()
        if not precisions:
            self._set_status("tick at least one precision to compare", _RED)
            return
        from ..compare import compare

        job = self._begin("compare")
        dash = self._new_dashboard()
        self._set_status(f"comparing {', '.join(precisions)}…", _GREY)
        callbacks = [dash, _PanelCallback(self, job), *self.callbacks]

        def work():
            try:
                cmp = compare(cfg, precisions=precisions, callbacks=callbacks)
            except BaseException as e:
                self._finish(job, error=e)
            else:
                self._finish(job, comparison=cmp)

        self._compare_thread = spawn(work, "nbtrain-panel-compare", stop=job.halt, cfg=cfg)

    def stop(self) -> None:
        """Stop the running Train or Compare after the current step; history is kept."""
        job = self._job
        if job is None or job.finished:
            return
        job.halt()
        self.stop_button.disabled = True
        self._set_status("stopping after the current step…", _AMBER)

    def wait(self, timeout: Optional[float] = None):
        """Wait for the current Train or Compare to finish; returns panel.result or panel.comparison."""
        job = self._job
        if job is None:
            return None
        if not job.done.wait(timeout):
            return None
        return self.result if job.kind == "train" else self.comparison

    def _finish(self, job: _Job, result=None, comparison=None, error: Optional[BaseException] = None) -> None:
        with self._lock:
            if job.finished:
                return
            job.finished = True
        try:
            if error is not None:
                msg = f"{type(error).__name__}: {error}"
                self._set_status(f"error: {_esc(msg)}", _RED)
                # Errors like DataError("data: ...") name a field: mark it too, so the fix is one look away.
                field = getattr(error, "field", None) or str(error).split(":", 1)[0].strip()
                if field in self.controls:
                    self._show_errors([{"field": field, "message": str(error)}])
            elif job.kind == "train":
                self.result = result
                self._set_status(_result_line(result), _status_color(result))
                self.notes.value = _notes_block([(None, result)])
                self._show_static(result)
            else:
                self.comparison = comparison
                self._set_status(("stopped" if job.stop.is_set() else "done")
                                 + f" — compared {', '.join(map(str, comparison.results))}", _GREEN)
                self.notes.value = _notes_block(list((getattr(comparison, "results", None) or {}).items()))
                self._show_comparison(comparison)
        finally:
            self.train_button.disabled = False
            self.compare_button.disabled = False
            self.stop_button.disabled = True
            job.done.set()

    def _show_static(self, result) -> None:
        # Without a FigureWidget the live view is empty; show the finished figure instead.
        if self.dashboard is None or self.dashboard.widget is not None:
            return
        from ..viz.dashboard import static_bundle

        out = widgets.Output()
        out.outputs = ({"output_type": "display_data", "data": static_bundle(self.dashboard.figure),
                        "metadata": {}},)
        self.dashboard_area.children = (out,)

    def _show_comparison(self, cmp) -> None:
        table = getattr(cmp, "table", None)
        if table is None:
            return
        try:
            body = table.to_html(float_format=lambda v: f"{v:.4g}", border=0, na_rep="—")
        except Exception:
            body = f"<pre>{_esc(table)}</pre>"
        self.comparison_table = widgets.HTML(f"<div style='overflow-x:auto'>{body}</div>")
        if self.dashboard is not None and self.dashboard.widget is None:
            self._show_static(None)
        self.dashboard_area.children = (*self.dashboard_area.children, self.comparison_table)

    def __repr__(self) -> str:
        state = "running" if self._busy() else "idle"
        return f"Panel({state}, errors={len(self.errors)})"


def _reason(result) -> Optional[str]:
    return (getattr(result, "summary", None) or {}).get("stopped_reason")


def _status_color(result) -> str:
    reason = _reason(result)
    if reason in ("max_steps", "epochs"):
        return _GREEN
    return _AMBER if reason in ("stopped", "interrupted") else _RED


def _notes_block(runs: list) -> str:
    """The notes and out-of-memory advice of ``(name, TrainResult)`` pairs, as short lists; "" when none."""
    from ..viz.dashboard import notes_html

    parts = []
    for name, result in runs:
        body = notes_html(result)
        if body:
            parts.append((f"<b>{_esc(name)}</b>" if name else "") + body)
    return "<div style='margin-top:2px'>" + "".join(parts) + "</div>" if parts else ""


def _result_line(result) -> str:
    s = getattr(result, "summary", None) or {}
    reason = s.get("stopped_reason")
    loss = s.get("final_loss")
    bits = [f"{s.get('steps', 0)} steps"]
    if loss is not None:
        bits.append(f"final loss {loss:.4g}" if math.isfinite(loss) else f"final loss {loss}")
    if s.get("eval_loss") is not None:
        bits.append(f"eval loss {s['eval_loss']:.4g}")
    if s.get("tokens_per_s"):
        bits.append(f"{s['tokens_per_s']:,.0f} tok/s")
    if s.get("precision_used"):
        bits.append(str(s["precision_used"]))
    if reason in ("max_steps", "epochs"):
        head = "done"
    elif reason == "stopped":
        head = "stopped (history kept)"
    elif reason == "out_of_memory":
        head = "ended: out of memory (history kept)"
    else:
        head = f"ended: {reason}"
    return _esc(f"{head} — " + " · ".join(bits) + (f" ({reason})" if reason in ("max_steps", "epochs") else ""))


def _share(frac: float) -> str:
    return f"({100 * frac:.1f}% of it)" if frac < 10 else f"({frac:,.0f}× what there is)"


def memory_html(est, device: str = "") -> str:
    """The memory readout: total vs device memory, fits or not, the breakdown, and the first advice."""
    total, dev = getattr(est, "total_gib", None), getattr(est, "device_total_gib", None)
    fits = bool(getattr(est, "fits", True))
    frac = (total / dev) if total is not None and dev else None
    color = _GREEN if fits else _RED
    verdict = (f"<span style='color:{_GREEN}'>✓ fits</span>" if fits
               else f"<span style='color:{_RED}'>✗ does not fit</span>")
    bar = ""
    if frac is not None and math.isfinite(frac):
        pct = max(0.5, min(100.0, 100 * frac))
        bar = (f"<div style='display:inline-block;vertical-align:middle;width:160px;height:8px;background:#eee;"
               f"border-radius:4px;margin:0 8px'><div style='width:{pct:.1f}%;height:8px;background:{color};"
               f"border-radius:4px'></div></div>")
    where = f" ({_esc(device)})" if device else ""
    head = (f"<b>Memory</b> ≈ <b>{fmt_gib(total)}</b> of {fmt_gib(dev)}{where}{bar}{verdict}"
            + (f" {_small(_share(frac))}" if frac is not None and math.isfinite(frac) else ""))
    parts = []
    for key, label in (("weights_gib", "weights"), ("gradients_gib", "gradients"), ("optimizer_gib", "optimizer"),
                       ("activations_gib", "activations"), ("logits_gib", "logits + loss"),
                       ("overhead_gib", "overhead")):
        v = getattr(est, key, None)
        if isinstance(v, (int, float)):
            parts.append(f"{label} {fmt_gib(v)}")
    lines = [head]
    phase = getattr(est, "peak_phase", "")
    if phase:
        parts.append(f"peak during {_esc(phase)}")
    if parts:
        lines.append(_small(" · ".join(parts)))
    advice = list(getattr(est, "advice", None) or [])
    if not fits and advice:
        a = advice[0]
        change = getattr(a, "change", "")
        if isinstance(change, dict):
            change = ", ".join(f"{k}={v!r}" for k, v in change.items())
        after = getattr(a, "total_gib", None)
        lines.append(f"<span style='color:{_AMBER}'>try <b>{_esc(change)}</b>: {_esc(getattr(a, 'description', ''))}"
                     + (f" → {fmt_gib(after)}" + (" (fits)" if getattr(a, "fits", False) else "")
                        if after is not None else "") + "</span>")
    return "<div style='line-height:1.5'>" + "<br>".join(lines) + "</div>"
