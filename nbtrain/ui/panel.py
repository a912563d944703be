"""``nbt.Panel()``: every TrainConfig knob as a widget, a live memory estimate, and Train / Stop / Compare.

Plain ipywidgets plus the dashboard's plotly ``FigureWidget``, so it renders wherever widgets do
(JupyterLab, Notebook 7, VS Code) with no frontend extension of its own. Colab renders the core widgets but
not ``FigureWidget``: there the live figure is plotly's HTML in an ``ipywidgets.Output``, resent at most once a
second (``nbtrain.viz.dashboard.panel_mode``). The panel puts together
the form (:mod:`.form`: controls, validation, errors), the runner (:mod:`.runner`: Train / Stop / Compare
in background threads, status) and the memory readout kept here, which follows the form's values.
Nothing here raises at the user on a bad value: errors become an inline message naming the field.

Every thread and timer of the panel goes through :mod:`nbtrain.engine.threads`: heavy imports are
finished on the user's thread first, and interpreter exit stops and joins whatever is still running.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from pathlib import Path
from typing import Optional

import ipywidgets as widgets

from ..config import ConfigError, TrainConfig
from ..engine.threads import complete_imports, track
from ..hardware import capabilities
from . import render
from .form import PRECISION_HINTS, SECTIONS, Form, default_config, processes_problem, section_of
from .runner import Runner

__all__ = ["Panel", "SECTIONS", "section_of"]

SETTINGS_OPEN = "Settings"
SETTINGS_FOLDED = "Settings (folded while the run goes: click to open)"
SETTINGS_DONE = "Settings (folded: click to open)"


def _tensors_line(est, cfg: TrainConfig) -> str:
    """What the readout adds to an estimate that does not name the optimizer and the weights' dtype itself (one made
    before the estimate knew them): both, from the config and the precision table; "" otherwise."""
    if getattr(est, "optimizer", None) is not None and getattr(est, "weights_dtype", None) is not None:
        return ""   # estimate_html shows them beside the weights and the optimizer state
    from ..hardware import resolve_precision
    from ..precision import TENSOR_DTYPES

    dtypes = TENSOR_DTYPES.get(resolve_precision(cfg.precision), {})
    return render.small(f"optimizer {render.esc(cfg.optimizer)} · weights {render.esc(dtypes.get('weights', '?'))}")


def _estimate(cfg: TrainConfig, processes: int):
    """``estimate_memory`` for one of ``processes`` ranks, and whether it could say so (an estimate_memory without
    ``world_size`` gives one process's whole-model numbers)."""
    from ..memory import estimate_memory

    if processes > 1 and "world_size" in inspect.signature(estimate_memory).parameters:
        return estimate_memory(cfg, world_size=processes), True
    return estimate_memory(cfg), processes <= 1


def _processes_line(est, cfg: TrainConfig, processes: int, divided: bool, device: str) -> str:
    """Under a several-process estimate: that it is per process, and on a CPU what all of them need together."""
    if processes <= 1:
        return ""
    from ..memory import fmt_gib

    what = ("weights, gradients and optimizer state ÷ " + str(processes) if cfg.sharding == "fsdp"
            else "every process holds the whole model")
    line = f"per process, {processes} processes, {render.esc(cfg.sharding)}"
    if divided:
        line += f": {what}"
    else:
        line += (f" · <span style='color:{render.AMBER}'>this nbtrain's estimate_memory takes no world_size: "
                 "the numbers are one process's alone, nothing divided</span>")
    if device != "cuda":   # GPUs: one each; CPU processes share the host memory the total is read against
        line += f" · the {processes} processes share this machine's memory: ≈ {fmt_gib(processes * est.total_gib)}"
    return "<br>" + render.small(line)


def _fix_marked(errors: list[dict], label=str) -> str:
    """What the status says of settings to fix: where they are, by the labels the fields show (``label``: field ->
    its label), never their messages (those are under the fields)."""
    fields = list(dict.fromkeys(label(str(e.get("field"))) for e in errors if e.get("field")))
    if len(fields) == 1:
        return f"fix the setting marked in red ({render.esc(fields[0])})"
    return f"fix the settings marked in red ({render.esc(', '.join(fields))})" if fields else "see the ⚠ message"


class Panel:
    """Widgets for every TrainConfig field, a live memory estimate, and Train / Stop / Compare buttons.

    ``panel.config`` is the validated config of the current values; ``Panel(config=cfg)`` shows ``cfg``;
    ``panel.controls`` maps each TrainConfig field to its widget. ``panel.run``, ``panel.result`` and
    ``panel.comparison`` give the last run, its TrainResult and the last ComparisonResult; the run's
    notes and out-of-memory advice are listed under the status line (``panel.notes``).
    ``callbacks`` are added to every run the panel starts. ``debounce_s`` delays the memory estimate
    after a change (0: recompute at once); meanwhile the readout says "estimating…" and
    ``memory_estimate`` is None. ``panel.form`` and ``panel.runner`` are the two halves.
    ``processes`` (``Panel(processes=N)``, the Processes tab's box; not a config field): a Train on N > 1
    processes is launched with torchrun (``nbt.launch``) and the memory readout is per process.
    """

    def __init__(self, config: Optional[TrainConfig] = None, *, callbacks=None, debounce_s: float = 0.25,
                 processes: int = 1):
        # On the user's thread, before the first timer or thread: a first `import transformers` on a
        # background thread can break other threads' imports of it.
        complete_imports()
        self.caps = capabilities()
        self.debounce_s = float(debounce_s)
        self.memory_estimate = None
        self._mem_lock = threading.Lock()
        self._mem_timer = None
        self._mem_gen = 0   # bumped on every change: an estimate for older values is never shown

        self._fixing = None   # (what the status said, the marked fields' values then) while it says "fix ..."
        self.form = Form(self.caps, on_change=self._form_changed)
        self.runner = Runner(self.caps, PRECISION_HINTS, callbacks=callbacks or (),
                             on_field_error=self._mark_run_errors, on_busy=self._fold_settings)
        self._build()
        self.form.processes.value = int(processes)
        self.config = config if config is not None else default_config()

    def _build(self) -> None:
        self.header = widgets.HTML(render.header_html(self.caps))
        self.memory = widgets.HTML()
        self.yaml_path = widgets.Text(value="nbtrain.yaml", description="YAML", style={"description_width": "40px"},
                                      layout=widgets.Layout(width="260px"))
        self.load_button = widgets.Button(description="Load", layout=widgets.Layout(width="70px"),
                                          tooltip="load the settings from this YAML file")
        self.save_button = widgets.Button(description="Save", layout=widgets.Layout(width="70px"),
                                          tooltip="save the settings to this YAML file")
        self.train_button.on_click(lambda _b: self._guard(self._on_train))
        self.stop_button.on_click(lambda _b: self._guard(self.stop))
        self.compare_button.on_click(lambda _b: self._guard(self._on_compare))
        self.load_button.on_click(lambda _b: self._guard(self.load_yaml, self.yaml_path.value))
        self.save_button.on_click(lambda _b: self._guard(self.save_yaml, self.yaml_path.value))

        yaml_row = widgets.HBox([self.yaml_path, self.load_button, self.save_button])
        box = widgets.Layout(border="1px solid #ddd", padding="6px", margin="4px 0")
        # One screen (1440 x 900): the buttons and the status line come first, the settings under them fold away
        # while a run goes, and the live figure follows right under the status. Folding what lies *under* the
        # status moves neither the buttons nor the status line: the figure comes up to them.
        self.settings = widgets.Accordion(children=[widgets.VBox([
            self.form.tabs, widgets.VBox([self.memory], layout=box), self.form.error, yaml_row])],
            titles=(SETTINGS_OPEN,), selected_index=0)
        self.settings.add_class("nbtrain-settings")
        self.widget = widgets.VBox([
            self.header,
            widgets.VBox([self.runner.buttons_row, self.status, self.notes], layout=box),
            self.settings,
            self.runner.board,
        ])
        self.widget.add_class("nbtrain-panel")

    def _fold_settings(self, busy: bool) -> None:
        """Fold the settings while a run goes (the status and the live figure then share one screen), and keep
        them folded when it ends: the status, the verdicts, the table and the figure are the answer, and stay in
        view where the run left them (a click on the title opens the settings). A press that failed opens them
        again: the fix is in there."""
        if busy:
            self.settings.selected_index = None
            self.settings.set_title(0, SETTINGS_FOLDED)
            return
        job = self.runner.job
        if job is not None and job.outcome is None:
            self.settings.selected_index = 0
            self.settings.set_title(0, SETTINGS_OPEN)
        else:
            self.settings.set_title(0, SETTINGS_DONE)

    # -- the parts, by their names on the panel -----------------------------------------------
    controls = property(lambda self: self.form.controls, doc="TrainConfig field -> its widget")
    errors = property(lambda self: self.form.errors, doc="the errors shown now: [{'field', 'message'}]")
    error = property(lambda self: self.form.error, doc="the error box")
    tabs = property(lambda self: self.form.tabs)
    model_info = property(lambda self: self.form.model_info)
    data_info = property(lambda self: self.form.data_info)
    precision_info = property(lambda self: self.form.precision_info)
    accumulation_info = property(lambda self: self.form.accumulation_info)
    method_info = property(lambda self: self.form.method_info)
    objective_info = property(lambda self: self.form.objective_info,
                              doc="under the Objective: what the chosen objective does, DPO's reference, and a "
                                  "data without preference pairs")
    pref_data_button = property(lambda self: self.form.pref_data_button,
                                doc="shown when a preference objective meets a builtin without pairs: sets Data "
                                    "to builtin:python-docs-pref")
    grpo_info = property(lambda self: self.form.grpo_info,
                         doc="on the GRPO tab: the rewards and a step in words (prompts x generations, the KL's "
                             "reference, the sampler's precision), or what the tab is for under another objective")
    prompt_data_button = property(lambda self: self.form.prompt_data_button,
                                  doc="shown when objective grpo meets a builtin without prompts: sets Data to "
                                      "builtin:prompts")
    train_button = property(lambda self: self.runner.train_button)
    stop_button = property(lambda self: self.runner.stop_button)
    compare_button = property(lambda self: self.runner.compare_button)
    compare_choices = property(lambda self: self.runner.compare_choices, doc="precision -> its Compare tick box")
    seeds_control = property(lambda self: self.runner.seeds_control,
                             doc="Compare's seeds: how many seeds besides the config's own the reference runs "
                                 "under, for the noise band (0: none)")
    repeats_control = property(lambda self: self.runner.repeats_control,
                               doc="Compare's repeats: how many times each precision is timed")
    verdicts = property(lambda self: self.runner.verdicts, doc="the last Compare's verdicts, above its table")
    difference_view = property(lambda self: self.runner.difference_view,
                               doc="after the last Compare, the finished figure whose last row is the difference "
                                   "panel, with the seed-noise band (None before one)")
    status = property(lambda self: self.runner.status, doc="the status line")
    notes = property(lambda self: self.runner.notes, doc="the last run's notes and out-of-memory advice")
    dashboard_area = property(lambda self: self.runner.dashboard_area,
                              doc="the live figure, then the finished one (with the answers under it)")
    summary_area = property(lambda self: self.runner.summary_area,
                            doc="after a Compare: its verdicts and compact table, above the figure")
    answers = property(lambda self: self.runner.answers,
                       doc="the sample prompts' answers: the latest during a run, the last step's after a Train")
    dashboard = property(lambda self: self.runner.dashboard, doc="the LiveDashboard of the last press")
    live_figure = property(lambda self: self.runner.live_figure,
                           doc="where no FigureWidget renders (Colab): the live figure's output area, else None")
    run = property(lambda self: self.runner.run, doc="the last Run started by Train")
    result = property(lambda self: self.runner.result, doc="the TrainResult of the last Train")
    comparison = property(lambda self: self.runner.comparison, doc="the ComparisonResult of the last Compare")
    comparison_table = property(lambda self: self.runner.comparison_table)
    callbacks = property(lambda self: self.runner.callbacks, doc="added to every run the panel starts")
    processes_control = property(lambda self: self.form.processes,
                                 doc="the Processes box: how many processes a Train launches (1: in this kernel)")
    processes_info = property(lambda self: self.form.processes_info)

    @property
    def processes(self) -> int:
        """How many processes a Train runs on (1: in this kernel; more: launched with torchrun)."""
        return int(self.form.processes.value or 1)

    @processes.setter
    def processes(self, n: int) -> None:
        self.form.processes.value = int(n)

    def compare_precisions(self) -> tuple[str, ...]:
        """The precisions Compare runs: the ticked ones this device can run."""
        return self.runner.compare_precisions()

    # -- display -----------------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    # -- config --------------------------------------------------------------------------------
    @property
    def config(self) -> TrainConfig:
        """The validated TrainConfig of the current values; raises ConfigError (also shown inline) when invalid."""
        return self.form.config

    @config.setter
    def config(self, cfg: TrainConfig) -> None:
        self.form.config = cfg

    def load_yaml(self, path) -> TrainConfig:
        """Show the config in a YAML file; on error (raised) the controls stay as they were, the error is shown
        once in the ⚠ box by the YAML box, and the status says only that nothing was loaded."""
        try:
            cfg = self.form.load_yaml(path)
        except (ConfigError, OSError) as e:
            self.runner.set_status("not loaded: see the ⚠ message by the YAML box", render.RED)
            e.nbtrain_shown = True   # _guard: said already
            raise
        self.runner.set_status(f"loaded {render.esc(path)}", render.GREY)
        return cfg

    def save_yaml(self, path) -> Path:
        """Write the current config to a YAML file (raises ConfigError when it is invalid: each message is under
        its field already, the status says only that nothing was saved)."""
        try:
            out = self.form.save_yaml(path)
        except ConfigError as e:
            self.form.show_errors(e.errors)
            self._say_fix("not saved: ", e.errors)
            e.nbtrain_shown = True
            raise
        self.runner.set_status(f"saved {render.esc(path)}", render.GREY)
        return out

    # -- the status line of settings to fix ------------------------------------------------------
    def _say_fix(self, prefix: str, errors: list[dict]) -> None:
        """The status names the settings to fix; it follows them as they are fixed (see ``_follow_fixes``)."""
        self.runner.set_status(prefix + _fix_marked(errors, self.form.label), render.RED)
        fields = [f for f in dict.fromkeys(str(e.get("field")) for e in errors) if f in self.controls]
        self._fixing = ((prefix, self.status.value, {f: self.controls[f].value for f in fields})
                        if fields else None)

    def _follow_fixes(self) -> None:
        # A setting is fixed once its value changed and it is marked no more; the status then names only the ones
        # left, and none once all are: a fixed error is never left up there.
        if self._fixing is None:
            return
        prefix, said, values = self._fixing
        if self.status.value != said:   # something else was said since: not ours to change
            self._fixing = None
            return
        marked = {e.get("field") for e in self.form.errors}
        left = [f for f, v in values.items() if f in marked or self.controls[f].value == v]
        if len(left) == len(values):
            return
        if left:
            self._say_fix(prefix, [{"field": f} for f in left])
            self._fixing = (prefix, self.status.value, {f: values[f] for f in left})
        else:
            self._fixing = None
            self.runner.set_status("ready: " + ("the setting marked in red is fixed" if len(values) == 1
                                                else "the settings marked in red are fixed"), render.GREY)

    def _form_changed(self) -> None:
        self._follow_fixes()
        self._schedule_memory()

    # -- memory readout ----------------------------------------------------------------------
    def _schedule_memory(self) -> None:
        self._refresh_header()
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

    def _refresh_header(self) -> None:
        # The header names the precision the Precision field holds now (it follows every change of the form).
        header = getattr(self, "header", None)
        if header is not None:
            header.value = render.header_html(self.caps, str(self.form.controls["precision"].value or "auto"))

    def _show_estimating(self) -> None:
        self.memory_estimate = None
        self.memory.value = "<b>Memory</b>: " + render.small("estimating…")

    def _refresh_memory_quietly(self, gen: int) -> None:
        try:
            self._refresh_memory(gen)
        except Exception as e:  # a timer has nowhere to raise to: show it instead
            with self._mem_lock:
                if gen == self._mem_gen:
                    self.memory.value = render.small(f"memory estimate failed: {render.esc(type(e).__name__)}: "
                                                     f"{render.esc(e)}", render.RED)

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
        cfg = self.form.validate()[0]
        est, text, marked = None, None, []
        # Each message is said once, under its field: here only that the estimate waits for it.
        waiting = "<b>Memory</b>: " + render.small("— waits until you fix the settings marked above")
        if cfg is None or any(e["field"] == "model" for e in self.form.local_problems()):
            text = waiting   # a model that is not here has no size to estimate
        else:
            try:
                from ..memory import estimate_html

                n = self.processes
                est, divided = _estimate(cfg, n)
                text = (estimate_html(est, self.caps.device) + _tensors_line(est, cfg)
                        + _processes_line(est, cfg, n, divided, self.caps.device))
            except Exception as e:
                est = None
                marked = self._field_errors_of(e)
                text = waiting if marked else ("<b>Memory</b>: " + render.small(
                    f"no estimate for these settings: {render.esc(type(e).__name__)}: {render.esc(e)}",
                    render.AMBER))
        with self._mem_lock:
            if gen != self._mem_gen:
                return est   # computed for values that are no longer shown: not put up
            self.memory_estimate = est
            self.memory.value = text
            if marked:   # e.g. a Hub id that cannot be fetched: its message goes under the model field
                self.form.add_errors(marked)
        return est

    # -- running -----------------------------------------------------------------------------
    def _guard(self, fn, *args) -> None:
        # Button handlers never raise: ipywidgets would print a traceback into some output area.
        try:
            fn(*args)
        except Exception as e:
            if getattr(e, "nbtrain_shown", False):
                return   # fn said it where it belongs already; once is enough
            if isinstance(e, ConfigError):
                self.form.show_errors(e.errors)
                self._say_fix("not done: ", e.errors)
            else:
                self.runner.set_status(f"error: {render.esc(type(e).__name__)}: {render.esc(e)}", render.RED)

    def _start_checks(self) -> Optional[TrainConfig]:
        if self.runner.busy():
            self.runner.set_status("a run is already going: Stop it first", render.AMBER)
            return None
        cfg, errors = self.form.validate()
        # What this machine lacks (a model or data path that is not here) would only fail the run after it cleared
        # the screen: refused here, with the field marked; its message stays in the red line under the field.
        errors = errors + self.form.local_problems()
        self.form.show_errors(errors)
        if errors:
            self.form.select(errors[0].get("field"))
            self._say_fix("not started: ", errors)
            return None
        problem = processes_problem(self.caps, self.processes)
        if problem:
            self.form.select("sharding")   # the Processes tab
            self.runner.set_status(f"not started: {render.esc(problem)}", render.RED)
            return None
        return cfg

    def _run_error_field(self, error: dict) -> Optional[str]:
        """The control a run's error is about: its field, or the first word of it. A ModelError says
        "model 'NAME': ...", which reaches here as the field "model 'NAME'"."""
        for text in (str(error.get("field") or ""), str(error.get("message") or "")):
            if text in self.controls:
                return text
            head = re.match(r"[A-Za-z_]\w*", text)
            if head and head.group() in self.controls and text[head.end():head.end() + 1] in (" ", ":", ""):
                return head.group()
        return None

    def _field_errors_of(self, error: BaseException) -> list[dict]:
        """The errors of ``error`` that belong to a field (the runner's reading of it), with that field's name."""
        from .runner import _field_errors

        known = []
        for e in _field_errors(error):
            field = self._run_error_field(e)
            if field is not None:
                known.append({**e, "field": field})
        return known

    def _mark_run_errors(self, errors: list[dict]) -> None:
        # A run that failed on a field (a ConfigError from its prepare phase, a DataError "data: ...", a
        # ModelError "model 'x': ..."): its message goes under that field, once, and its tab is shown; the status
        # line, set before this with the whole message, then only names the error and points there.
        known = []
        for e in errors:
            field = self._run_error_field(e)
            if field is not None:
                known.append({**e, "field": field})
        if known:
            self.form.add_errors(known)
            self.form.select(known[0]["field"])
            kind = next((m.group(1) for m in [re.match(r'<span[^>]*>error: (\w+):', self.status.value or "")] if m),
                        "error")
            self._say_fix(f"error: {render.esc(kind)}: ", known)

    def _on_train(self) -> None:
        cfg = self._start_checks()
        if cfg is not None:
            self.runner.train(cfg, processes=self.processes)

    def _on_compare(self) -> None:
        if self.processes > 1 and not self.runner.busy():
            # Compare runs its variants one after another in this kernel: on several processes it would need one
            # launch per variant, and in here its speed and memory would not be the launched run's. Said, not
            # silently run on one process.
            self.form.select("sharding")
            self.runner.set_status(f"not compared: Compare runs each precision in this kernel, one process; set "
                                   f"processes to 1 to compare (now {self.processes})", render.AMBER)
            return
        cfg = self._start_checks()
        if cfg is None:
            return
        precisions = self.compare_precisions()
        if not precisions:
            self.runner.set_status("tick at least one precision to compare", render.RED)
            return
        self.runner.compare(cfg, precisions)

    def stop(self) -> None:
        """Stop the running Train or Compare after the current step; history is kept."""
        self.runner.stop()

    def wait(self, timeout: Optional[float] = None):
        """Wait for the current Train or Compare to finish; returns panel.result or panel.comparison."""
        return self.runner.wait(timeout)

    def __repr__(self) -> str:
        state = "running" if self.runner.busy() else "idle"
        return f"Panel({state}, errors={len(self.errors)})"
