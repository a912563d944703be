"""The runner: Train / Stop / Compare, the status line and notes under them, and the live dashboard area.

A Train runs through ``nbt.start()`` and a Compare through ``compare()`` in a background thread, so the
panel and the kernel stay responsive; a Train on several processes goes through ``nbt.launch()`` (torchrun
workers, rank 0's records streamed back to the same callbacks), and Stop asks the workers to end. Every thread goes through :mod:`nbtrain.engine.threads` (``spawn``):
interpreter exit stops it and waits for it. Errors never reach the user as a traceback: they become the
status line, and a ConfigError (or another error that names a field) is handed to ``on_field_error``.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import ipywidgets as widgets

from ..engine import StopTraining, start
from ..engine.threads import spawn
from ..hardware import PRECISIONS
from . import render

MAX_EXTRA_SEEDS = 4   # each is one more run of the reference: the noise band's cost grows with it
# Ticked for Compare at first (where this device runs them): the autocast family. bf16-pure and fp8 change the
# weights' dtype or the matmuls' and are there to tick (fp8 off a GPU with fp8 tensor cores is emulated and slow).
DEFAULT_COMPARE = ("fp32", "tf32", "fp16", "bf16")
REPEATS_CHOICES = (1, 3, 5)   # 3 is the fewest that ranks a speed difference, 5 what a busy machine needs


class LiveFigureOutput:
    """The Panel's live figure where plotly's ``FigureWidget`` does not render (Colab; or without anywidget): an
    ``html``-mode dashboard's figure (plotly JSON plus HTML that loads plotly.js from its CDN), with its status
    line, in a core ``ipywidgets.Output``, resent whole after each of the dashboard's redraws (html mode redraws at
    most once a second). A callback placed right after the dashboard: it draws what the dashboard just drew."""

    def __init__(self, dashboard):
        self.dashboard = dashboard
        self.status = widgets.HTML(value="<i>waiting for the first step…</i>")
        self.output = widgets.Output(layout=widgets.Layout(max_width="100%"))
        self.widget = widgets.VBox([self.status, self.output])
        self.shown = 0   # the dashboard's redraws drawn here
        self._drawn = None

    def _draw(self) -> None:
        dash = self.dashboard
        if dash.redraws == self._drawn:
            return
        from ..viz.views import static_bundle

        self._drawn = dash.redraws
        text = dash.tracker.status()
        self.status.value = f"<code>{render.esc(text)}</code>"
        self.output.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": static_bundle(dash.figure, "cdn", text=text)},)
        self.shown += 1

    def on_run_start(self, info) -> None:
        self._draw()

    def on_step_end(self, record) -> None:
        self._draw()

    def on_run_end(self, result) -> None:
        self._draw()


PREVIOUS_WORDS = ("below: the previous run's results and figure; this run's figure replaces them at its first "
                  "step")
PREVIOUS_KEPT = "below: the previous run's results and figure (this one ended before its first step)"


def conversion_words(cfg) -> str:
    """What the first load of ``cfg``'s model adds ("" for none): a GGUF model not converted yet is dequantized
    on this first use."""
    try:
        from ..models import gguf
        from ..models.loading import resolve_source

        src = resolve_source(str(cfg.model))
        if src.kind == "gguf" and not gguf.is_converted(Path(src.name)):
            return "the GGUF model is converted on this first use: ~20-30 s for 135M parameters, then cached"
    except Exception:   # a model that does not resolve: its run says why
        return ""
    return ""


class Job:
    """One Train or Compare press: its kind, stop request, run (Train) and completion; for a Compare, its
    variants and the extra seeds of the reference run after them."""

    def __init__(self, kind: str):
        self.kind = kind
        self.stop = threading.Event()
        self.done = threading.Event()
        self.finished = False
        self.run = None
        self.variants: tuple[str, ...] = ()
        self.extra_seeds: tuple[int, ...] = ()
        self.processes = 1   # > 1: a launched Train (nbt.launch), whose workers hold the model
        self.revealed = False   # whether its live figure has replaced what the last job left on screen
        self.shown = None       # the widget that shows its live figure
        self.outcome = None     # its TrainResult or ComparisonResult (None: it failed, or has not ended)
        self.cfg = None         # the config it runs
        self.where = ""      # what the status line adds for a launched Train ("2 processes · fsdp")
        self.steps: Optional[int] = None   # a run's optimizer steps (the config's max_steps until a run says)
        self.eval_planned = False          # whether a run ends with an eval on held-out examples
        self.converting = ""               # said while the first model loads: a GGUF model converted on first use
        self.repeats = 1

    def halt(self) -> None:
        """Ask this job to end after the current step (no widget updates: also called at interpreter exit)."""
        self.stop.set()
        if self.run is not None:
            self.run.stop()


def time_left_words(seconds: float) -> str:
    """An estimate of the time left, rounded as a person reads it: "about 40 s left", "about 3 min left"."""
    s = max(1, int(round(seconds)))
    if s < 90:
        return f"about {s} s left"
    if s < 3600:
        return f"about {round(s / 60)} min left"
    h, m = divmod(round(s / 60), 60)
    return f"about {h} h {m:02d} min left"


def phase_label(phase: Optional[dict]) -> str:
    """What a Compare's run is, for the status line: "fp16 (2 of 3)", "fp32 (1 of 3), drawn live (untimed)",
    "bf16 (2 of 3), timed repeat 1 of 3", ..."""
    if not phase:
        return ""
    k, n, v = phase.get("k"), phase.get("n"), phase.get("variant")
    if phase.get("phase") == "live":
        return f"{v} ({k} of {n}), drawn live (untimed)"
    if phase.get("phase") == "seed":
        return f"noise band: {v} under seed {phase.get('seed')} ({k} of {n})"
    repeats = int(phase.get("repeats") or 1)
    return f"{v} ({k} of {n})" + (f", timed repeat {phase.get('repeat')} of {repeats}" if repeats > 1 else "")


class StatusCallback:
    """The runner's own callback: the status line from the first second (what is loading, which run of a Compare
    and how far it is, the end-of-run eval, the time left once a step is timed), and the result and buttons when
    the run ends. A Compare also tells it its phases (``on_phase``), the runs no callback sees included."""

    MIN_INTERVAL = 0.25  # step lines per second are capped: each one is a message to the frontend

    def __init__(self, runner: Runner, job: Job):
        self.runner, self.job = runner, job
        self.total = None
        self.variant = None
        self.phase: Optional[dict] = None   # the Compare's run now going (None: a Train)
        self.times: list[float] = []        # the step times of the run now going
        self.eval_examples = 0
        self._last = 0.0

    # -- a Compare's phases -----------------------------------------------------------------------
    def on_phase(self, phase: dict) -> None:
        """compare()'s ``progress``: a run about to load, and the start and steps of a run no callback sees."""
        event = phase.get("event")
        if event == "load":
            self.phase, self.times, self.total = phase, [], None
            self._say(f"{phase_label(phase)}: {self._loading()}")
        elif event == "start":
            self._started(phase.get("total"), phase.get("eval_examples"))
            self._say(f"{phase_label(phase)}: step 0/{self.total}")
        elif event == "step":
            self._stepped(phase.get("step"), phase.get("step_time_s"))

    # -- the recorded runs' callbacks ------------------------------------------------------------
    def on_run_start(self, info) -> None:
        # A Stop during a comparison ends it through compare(stop=...): the later variants never start.
        self.variant = info.variant
        self._started(info.total_steps, info.eval_examples)
        where = f"{info.device} · {info.precision_used}" + (" + GradScaler" if info.scaler_enabled else "")
        self._say(f"running{self._name()}: step 0/{self.total} ({where})")

    def on_step_end(self, record) -> None:
        # A launched run's callbacks fire on its reader thread, where StopTraining would only end the reading:
        # its workers are stopped by Job.halt (the stop file) instead.
        if self.job.stop.is_set() and self.job.processes <= 1:
            raise StopTraining
        loss = f"{record.loss:.4g}" if record.loss is not None and math.isfinite(record.loss) else record.loss
        self._stepped(record.step, record.step_time_s, f" · loss {loss}")

    def on_run_end(self, result) -> None:
        if self.job.kind == "train":
            self.runner.finish(self.job, result=result)

    # -- the words -------------------------------------------------------------------------------
    def _say(self, text: str) -> None:
        if not self.job.stop.is_set():   # after Stop the line says what is left to do: stopping, then the eval
            self.runner.set_status(text, render.GREY)

    def _loading(self) -> str:
        words = "loading data and model" + (f" ({self.job.converting})" if self.job.converting else "")
        return words + "…"

    def _started(self, total, eval_examples) -> None:
        self.total, self.times = total, []
        self.job.converting = ""   # loaded: a GGUF model is converted now, the next loads read its copy
        self.job.eval_planned = bool(eval_examples)
        self.eval_examples = int(eval_examples or 0)
        self.job.steps = total

    def _stepped(self, step, step_time_s, extra: str = "") -> None:
        if step_time_s is not None and math.isfinite(step_time_s) and step_time_s > 0:
            self.times.append(float(step_time_s))
        last = step is not None and self.total is not None and step >= self.total
        if last and self.eval_examples:
            # what follows the last step: the (sample prompts' answers and the) end-of-run eval, which can take a
            # while on a big held-out split; the line says so instead of holding the last step
            self._say(f"{self._what()}: step {step}/{self.total} done · {self._eval_words()}")
            return
        now = time.monotonic()
        if now - self._last < self.MIN_INTERVAL and not last:
            return
        self._last = now
        left = self._seconds_left(step)
        self._say(f"{self._what()}: step {step}/{self.total}{extra}"
                  + (f" · {time_left_words(left)}" if left is not None else ""))

    def _eval_words(self) -> str:
        # the recorded run answers them: a Train, a Compare's live pass, or its one repeat
        recorded = self.phase is None or self.phase.get("phase") == "live" or (
            self.phase.get("phase") == "run" and int(self.phase.get("repeats") or 1) == 1)
        prompts = (getattr(self.job.cfg, "sample_prompts", None) or []) if recorded else []
        answers = "answering the sample prompts, then " if prompts else ""
        return f"{answers}end-of-run eval on {self.eval_examples} held-out examples…"

    def _what(self) -> str:
        if self.phase is not None and self.phase.get("phase") == "seed":
            return phase_label(self.phase)
        return f"running{self._name()}"

    def _seconds_left(self, step) -> Optional[float]:
        """Steps still to run (this run's and, in a Compare, every run's to come) at this run's median step time;
        None before a step has been timed."""
        if not self.times or step is None or self.total is None:
            return None
        pace = sorted(self.times)[len(self.times) // 2]
        steps = max(0, self.total - step) + self._steps_to_come()
        return steps * pace

    def _steps_to_come(self) -> int:
        """In a Compare, the optimizer steps of the runs after this one (those whose length is known)."""
        phase, job = self.phase, self.job
        if phase is None:
            return 0
        per_run = job.steps or 0
        seeds = len(job.extra_seeds)
        k, n = int(phase.get("k") or 1), int(phase.get("n") or 1)
        if phase.get("phase") == "live":   # then every variant's timed repeats
            return ((n - k) + job.repeats * n + seeds) * per_run
        if phase.get("phase") == "seed":
            return (n - k) * per_run
        r = int(phase.get("repeat") or 1)
        return ((n - k) + (job.repeats - r) * n + seeds) * per_run

    def _name(self) -> str:
        # a launched Train says so on every line: "running (2 processes · fsdp): step 3/100 · ..."
        name = phase_label(self.phase) if self.phase is not None else (self.variant or "")
        return (f" {name}" if name else "") + (f" ({self.job.where})" if self.job.where else "")


class RevealCallback:
    """Among a press's callbacks: at its first step, the new live figure takes the dashboard area. Until then
    (loading the model and data, the first forward) what the last press left stays on screen, so that a run
    that fails before it has a step to show clears nothing; the status line says what is going on."""

    def __init__(self, runner: "Runner", job: "Job"):
        self.runner, self.job = runner, job

    def on_step_end(self, record) -> None:
        if not self.job.revealed:
            self.runner.reveal(self.job)


class AnswersCallback:
    """Puts the sample prompts' latest answers into the runner's answers block as they come (placed after the
    dashboard, which has just recorded the answer)."""

    def __init__(self, runner: "Runner", job: "Job"):
        self.runner, self.job = runner, job

    def on_sample(self, record) -> None:
        dash = self.runner.dashboard
        runner = self.runner
        if dash is not None and runner.job is self.job:
            runner.answers.value = dash.samples_html()
            area = runner.dashboard_area
            if runner.answers.value and runner.answers not in area.children:   # shown from the first answer on
                area.children = (*area.children, runner.answers)


def answers_html(samples) -> str:
    """A finished Train's answers (``result.samples``): each prompt's answer at the last step, as HTML ("" without
    sample prompts)."""
    from ..engine.sampling import side_by_side
    from ..viz.text import samples_html

    if samples is None or getattr(samples, "empty", True):
        return ""
    return samples_html(side_by_side(samples, own_last=True), title="answers")


class Runner:
    """The Train / Stop / Compare buttons, the precisions to compare, the status and notes, the dashboard.

    ``run``, ``result`` and ``comparison`` are the last run, its TrainResult and the last ComparisonResult;
    ``job`` the last press. ``callbacks`` are added to every run. ``on_field_error(errors)`` receives the
    errors of a run that failed on a field (``[{"field", "message"}]``).
    """

    def __init__(self, caps, hints: dict[str, str], *, callbacks=(),
                 on_field_error: Callable[[list], None] = lambda errors: None,
                 on_busy: Callable[[bool], None] = lambda busy: None):
        self.caps = caps
        self.callbacks = list(callbacks)
        self.on_field_error = on_field_error
        self.on_busy = on_busy   # told True when a press starts a job, False when it ends (the Panel folds its settings)
        self.run = None
        self.result = None
        self.comparison = None
        self.comparison_table = None
        self.table_notes = None   # after a Compare: the table's notes and its full table, under the figure
        self.dashboard = None
        self.live_figure: Optional[LiveFigureOutput] = None   # the live figure where no FigureWidget renders
        self.job: Optional[Job] = None
        self.compare_thread: Optional[threading.Thread] = None
        self._lock = threading.RLock()

        self.status = widgets.HTML()
        self.status.add_class("nbtrain-status")
        self.notes = widgets.HTML()   # the last run's notes and out-of-memory advice, under the status
        self.train_button = widgets.Button(description="Train", button_style="success", icon="play",
                                           tooltip="train with these settings (background thread)")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                          tooltip="end the run after the current step; history is kept")
        self.compare_button = widgets.Button(description="Compare precisions", icon="balance-scale",
                                             layout=widgets.Layout(width="auto"),
                                             tooltip="run these settings once per ticked precision")
        self.compare_choices = {
            p: widgets.Checkbox(value=p not in caps.reasons and p in DEFAULT_COMPARE, disabled=p in caps.reasons,
                                description=p, indent=False, layout=widgets.Layout(width="auto", margin="0 8px 0 0"),
                                tooltip=caps.reasons.get(p) or hints.get(p, p))
            for p in PRECISIONS}
        # Labelled as compare()'s arguments; a Panel comparison's advice names these controls ("set repeats to 5").
        self.repeats_control = widgets.Dropdown(
            options=[(str(n), n) for n in REPEATS_CHOICES], value=1, description="repeats:",
            style={"description_width": "60px"}, layout=widgets.Layout(width="130px", margin="0 0 0 8px"),
            tooltip="time every precision this many times, in a rotated order: speed is ranked from 3 repeats on "
                    "(5 on a busy machine); 1 gives one timing, not ranked")
        # value: how many seeds besides the config's own (0: the config's seed alone, no band)
        self.seeds_control = widgets.Dropdown(
            options=[("1 (no band)", 0)] + [(str(n + 1), n) for n in range(1, MAX_EXTRA_SEEDS + 1)],
            value=0, description="seeds:", style={"description_width": "50px"},
            layout=widgets.Layout(width="200px", margin="0 0 0 8px"),
            tooltip="seeds=(0, 1, 2) is 3: the first precision runs again under each other seed after the "
                    "comparison, and the spread of their loss is the noise band a difference is judged against "
                    "(one extra run each)")
        self.difference_view = None   # the figure whose difference row is read after a Compare
        self.verdicts = widgets.HTML(layout=widgets.Layout(max_width="100%"))   # after a Compare, above the table
        self.verdicts.add_class("nbtrain-verdicts")
        # After a Compare the verdicts and the table go in summary_area, above the figure's own area: the figure is
        # never moved to another place in the page, where a new view of it would be drawn at plotly.js's default
        # width (a view is drawn before the page holds it).
        self.summary_area = widgets.VBox()
        self.dashboard_area = widgets.VBox()
        # over what the last press left while a new one has not drawn its first step: says whose it is
        self.previous = widgets.HTML(layout=widgets.Layout(display="none"))
        self.board = widgets.VBox([self.previous, self.summary_area, self.dashboard_area])
        self.board.add_class("nbtrain-dashboard")
        # The sample prompts' answers, under the figure: the latest during a run, the last step's after a Train
        # (after a Compare the comparison's table shows each variant's answers side by side instead).
        self.answers = widgets.HTML(layout=widgets.Layout(max_width="100%"))
        compare_row = widgets.HBox([widgets.HTML(render.small("compare:")), *self.compare_choices.values(),
                                    self.repeats_control, self.seeds_control],
                                   layout=widgets.Layout(align_items="center", margin="0 0 0 12px"))
        self.buttons_row = widgets.HBox([self.train_button, self.stop_button, self.compare_button, compare_row],
                                        layout=widgets.Layout(align_items="center", flex_flow="row wrap"))
        self.set_status("ready", render.GREY)

    # -- state ------------------------------------------------------------------------------
    def busy(self) -> bool:
        return self.job is not None and not self.job.finished

    def set_status(self, text: str, color: str) -> None:
        self.status.value = render.status_html(text, color)

    def compare_precisions(self) -> tuple[str, ...]:
        """The precisions Compare runs: the ticked ones this device can run."""
        return tuple(p for p, box in self.compare_choices.items() if box.value and p not in self.caps.reasons)

    def compare_seeds(self, cfg) -> tuple[int, ...]:
        """The ``seeds`` Compare passes: cfg's own seed and the next N (the noise-band control), or ()."""
        n = int(self.seeds_control.value or 0)
        return tuple((cfg.seed + i) % 2 ** 32 for i in range(n + 1)) if n else ()

    # -- starting -------------------------------------------------------------------------------
    def begin(self, kind: str, cfg=None) -> Job:
        """A new job: Train and Compare disabled, Stop enabled, the settings folded (``on_busy``). What the last run
        or comparison left on screen stays until this one's first run starts (:meth:`reveal`), marked as the
        previous run's: a start that fails clears nothing."""
        job = Job(kind)
        job.cfg = cfg
        job.steps = getattr(cfg, "max_steps", None)
        job.eval_planned = float(getattr(cfg, "eval_fraction", 0) or 0) > 0   # until a run says how many it holds
        job.converting = conversion_words(cfg) if cfg is not None else ""
        self.job = job
        if self.summary_area.children or self.dashboard_area.children:
            self.previous.value = render.small(PREVIOUS_WORDS, render.AMBER)
            self.previous.layout.display = ""
        self.train_button.disabled = True
        self.compare_button.disabled = True
        self.stop_button.disabled = False
        self.on_busy(True)
        return job

    def reveal(self, job: Job) -> None:
        """The job's first step is done: its live figure replaces what the last one left (notes, answers,
        verdicts and table)."""
        with self._lock:
            if job.revealed or job is not self.job:
                return
            job.revealed = True
        self.previous.value = ""
        self.previous.layout.display = "none"
        self.notes.value = ""
        self.answers.value = ""
        self.verdicts.value = ""
        self.summary_area.children = ()
        self.dashboard_area.children = (job.shown,) if job.shown is not None else ()

    def _new_dashboard(self) -> list:
        """A new dashboard in the dashboard area; returns the callbacks that draw it (the dashboard first)."""
        from ..viz.dashboard import LiveDashboard, panel_mode

        # display=False: the runner shows the dashboard's widget in its own area, never in whatever cell
        # the training thread happens to write to.
        dash = None
        if panel_mode() == "widget":
            try:
                dash = LiveDashboard(display=False, mode="widget")
            except ImportError:   # no anywidget: no FigureWidget; the html figure below instead
                dash = None
        self.live_figure = None
        if dash is None:   # Colab (no FigureWidget there) or no anywidget
            dash = LiveDashboard(display=False, mode="html")
            self.live_figure = LiveFigureOutput(dash)
        self.dashboard = dash
        job = self.job
        # The figure alone: the runner's status line is the one status (the dashboard's own would repeat it), and
        # the runner's answers block the one block of answers.
        job.shown = dash.figure if dash.widget is not None else self.live_figure.widget
        # after the dashboard: at the first step the figure it shows already holds that step
        return ([dash, RevealCallback(self, job)] + ([self.live_figure] if self.live_figure is not None else [])
                + [AnswersCallback(self, job)])

    def train(self, cfg, processes: int = 1) -> None:
        """Start a Train of ``cfg`` in the background: in this process, or with ``processes`` > 1 launched on
        that many worker processes (``nbt.launch``, torchrun)."""
        job = self.begin("train", cfg)
        job.processes = max(1, int(processes))
        drawing = self._new_dashboard()
        callbacks = [*drawing, StatusCallback(self, job), *self.callbacks]
        try:
            if job.processes > 1:
                from ..engine.launch import launch

                job.where = f"{job.processes} processes · {cfg.sharding}"
                self.set_status(f"starting… (launching {job.where} with torchrun: each loads data and model)",
                                render.GREY)
                run = launch(cfg, num_processes=job.processes, callbacks=callbacks)
            else:
                self.set_status(f"starting: loading data and model"
                                f"{f' ({job.converting})' if job.converting else ''}…", render.GREY)
                run = start(cfg, callbacks=callbacks)
        except Exception as e:
            self.finish(job, error=e)
            return
        self.run = run
        job.run = run
        # Interpreter exit stops the run and waits for it, so a script that ends after Stop ends cleanly.
        spawn(lambda: self._watch(job, run), "nbtrain-panel-watch", stop=job.halt)

    def _watch(self, job: Job, run) -> None:
        # on_run_end normally finishes the job; this catches a run that died before it (bad data, ...).
        try:
            result = run.wait()
        except BaseException as e:
            self.finish(job, error=e)
        else:
            self.finish(job, result=result)

    def compare(self, cfg, precisions: tuple[str, ...], seeds: Optional[tuple[int, ...]] = None,
                repeats: Optional[int] = None) -> None:
        """Start a Compare of ``cfg`` over ``precisions`` in the background; ``seeds`` (default: from the seeds
        control) adds the reference's seed runs, ``repeats`` (default: the repeats control) times each variant
        that many times."""
        from ..compare import compare

        seeds = self.compare_seeds(cfg) if seeds is None else tuple(seeds)
        repeats = int(self.repeats_control.value if repeats is None else repeats)
        job = self.begin("compare", cfg)
        job.variants, job.extra_seeds = tuple(precisions), tuple(s for s in seeds if s != cfg.seed)
        job.repeats = repeats
        drawing = self._new_dashboard()
        n = len(job.extra_seeds)
        extra = (f" × {repeats} repeats" if repeats > 1 else "") + (f" + {n} seed run{'s' if n > 1 else ''}" if n else "")
        self.set_status(f"comparing {', '.join(precisions)}{extra}: starting…", render.GREY)
        status = StatusCallback(self, job)
        callbacks = [*drawing, status, *self.callbacks]

        variants = compare_variants(cfg, precisions)

        def work():
            try:
                what = dict(precisions=precisions) if variants is None else dict(variants=variants)
                cmp = compare(cfg, **what, callbacks=callbacks, stop=job.stop, seeds=seeds, repeats=repeats,
                              progress=status.on_phase)
                cmp.advice = "panel"   # the verdicts' advice names these controls: "set repeats to 5"
            except BaseException as e:
                self.finish(job, error=e)
            else:
                self.finish(job, comparison=cmp)

        self.compare_thread = spawn(work, "nbtrain-panel-compare", stop=job.halt, cfg=cfg)

    # -- stopping and ending --------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the running Train, or the whole Compare, after the current step; history is kept."""
        job = self.job
        if job is None or job.finished:
            return
        job.halt()
        self.stop_button.disabled = True
        # a stopped run still ends with its eval on the held-out examples, which can take a while: said, so that
        # the wait after Stop is not a mystery
        planned = job.eval_planned
        self.set_status("stopping after the current step" + (", then the end-of-run eval on the held-out examples"
                                                             if planned else "") + "…", render.AMBER)

    def wait(self, timeout: Optional[float] = None):
        """Wait for the current Train or Compare to finish; returns its result or comparison (None if it failed)."""
        job = self.job
        if job is None:
            return None
        if not job.done.wait(timeout):
            return None
        return job.outcome   # a press that failed returns None; panel.result keeps the last one that ran

    def finish(self, job: Job, result=None, comparison=None, error: Optional[BaseException] = None) -> None:
        """End ``job`` once: show its result, comparison or error, then free the buttons."""
        with self._lock:
            if job.finished:
                return
            job.finished = True
        try:
            if not job.revealed and self.previous.value:
                self.previous.value = render.small(PREVIOUS_KEPT, render.GREY)
            if error is not None:
                message = f"{type(error).__name__}: {error}"
                if job.processes > 1 and "\n" in message:
                    # a launched run's error ends with the workers' last lines: those go under the status line
                    message, _, tail = message.partition("\n")
                    self.notes.value = launched_log_html(tail)
                self.set_status(f"error: {render.esc(message)}", render.RED)
                self._settle_dashboard(job)
                errors = _field_errors(error)
                if errors:
                    self.on_field_error(errors)
            elif job.kind == "train":
                self.result = job.outcome = result
                line = render.result_line(result) + (f" · {render.esc(job.where)}" if job.where else "")
                self.set_status(line, render.status_color(result))
                self.notes.value = render.notes_block([(None, result)]) + self._launched_note(job)
                self.answers.value = answers_html(getattr(result, "samples", None))
                self._settle_dashboard(job)
            else:
                self.comparison = job.outcome = comparison
                self.set_status(*_comparison_status(comparison))
                # Under the status only what the comparison's own summary (verdicts, table, its notes) does not say.
                self.notes.value = _folded_notes(_unshown_notes(comparison))
                self.answers.value = ""   # the comparison's summary shows them side by side, variant by variant
                self._settle_dashboard(job)
                self._show_comparison(comparison, job)
        finally:
            self.train_button.disabled = False
            self.compare_button.disabled = False
            self.stop_button.disabled = True
            self.on_busy(False)
            job.done.set()

    def _launched_note(self, job: Job) -> str:
        """Where a launched Train's model and files are: rank 0 saved the model under output_dir/model."""
        if job.processes <= 1:
            return ""
        out = getattr(job.run, "output_dir", None)
        return render.small(f"launched on {render.esc(job.where)}: the trained model lived in the workers "
                            "(result.model is None)" + (f"; rank 0 saved it to {render.esc(out)}/model, beside the "
                                                        "config, history and summary" if out else ""))

    def _settle_dashboard(self, job: Job) -> None:
        """The finished figure (the runner's status line above says how it ended). A line instead of an empty
        figure when no step ran (a run that failed after it started, a Compare stopped before its first step);
        a job whose run never started leaves the last job's figure, table and answers as they were."""
        dash = self.dashboard
        if dash is None or not job.revealed:
            return
        answers = (self.answers,) if self.answers.value else ()
        if not dash.records:
            self.dashboard_area.children = (widgets.HTML(render.small("no steps ran: nothing to plot")), *answers)
        elif dash.widget is not None:
            self.dashboard_area.children = (dash.figure, *answers)
        else:   # no FigureWidget (Colab, no anywidget): the finished figure, drawn the html way
            from ..viz.views import static_bundle

            out = widgets.Output()
            out.outputs = ({"output_type": "display_data", "data": static_bundle(dash.figure), "metadata": {}},)
            self.dashboard_area.children = (out, *answers)

    def _show_comparison(self, cmp, job: Job) -> None:
        """After a Compare, top to bottom: the verdicts, the compact table (its notes, and the full table behind a
        toggle), then the finished figure, whose difference row gets the seed-noise band the verdicts were
        judged against."""
        if getattr(cmp, "table", None) is None or not job.revealed:
            return
        verdicts, rest = _summary_parts(cmp)
        table, after = _table_and_notes(rest)
        self.verdicts.value = verdicts
        self.comparison_table = widgets.HTML(table, layout=widgets.Layout(max_width="100%"))
        self.comparison_table.add_class("nbtrain-table")
        # the table's notes, fairness line and full table go under the figure: above it they would push the
        # figure off a 900 px screen (the answer is the status, the verdicts, the table and the figure)
        self.table_notes = widgets.HTML(after, layout=widgets.Layout(max_width="100%")) if after else None
        if self.table_notes is not None:
            self.table_notes.add_class("nbtrain-table-notes")
        self.difference_view = None
        figure = self.dashboard.figure if self.dashboard is not None and self.dashboard.records else None
        if figure is not None and getattr(cmp, "band", None) is not None:
            _add_band(figure, cmp)
            if self.live_figure is not None:   # the html figure: drawn again, with its band
                self._settle_dashboard(job)
        extra = ()
        if figure is not None and any((t.meta or {}).get("kind") == "loss_diff" for t in figure.data):
            self.difference_view = self.dashboard_area.children[0]
        elif getattr(cmp, "band", None) is not None and hasattr(cmp, "difference_figure"):
            # One variant and its seed runs: the live figure had nothing to difference; the panel comes on its own.
            from ..viz.views import static_bundle

            self.difference_view = widgets.Output(layout=widgets.Layout(max_width="100%"))
            self.difference_view.outputs = ({"output_type": "display_data", "metadata": {},
                                             "data": static_bundle(cmp.difference_figure())},)
            extra = (self.difference_view,)
        self.summary_area.children = ((self.verdicts,) if verdicts else ()) + (self.comparison_table,)
        notes = (self.table_notes,) if self.table_notes is not None else ()
        if extra or notes:
            self.dashboard_area.children = (*self.dashboard_area.children, *extra, *notes)


def _folded_notes(notes: str) -> str:
    """A comparison's leftover run notes behind one line: between the status and the verdicts they would push the
    answer (verdicts, table, figure) down the screen."""
    if not notes:
        return ""
    n = notes.count("<li")
    return (f"<details><summary>{render.small(f'notes of the runs ({n})' if n else 'notes of the runs')}</summary>"
            f"{notes}</details>")


def _unshown_notes(cmp) -> str:
    """The notes and advice of a comparison's runs that its summary HTML does not show already, per variant."""
    from types import SimpleNamespace

    from ..viz.text import run_notes

    shown = cmp.summary_html(details=False) if getattr(cmp, "table", None) is not None else ""
    runs = []
    for name, result in (getattr(cmp, "results", None) or {}).items():
        notes, advice = run_notes(result)
        notes = [n for n in notes if render.esc(n) not in shown]
        if advice and all(render.esc(a) in shown for a in advice):
            advice = []
        if notes or advice:
            runs.append((name, SimpleNamespace(summary={"notes": notes, "advice": advice})))
    return render.notes_block(runs)


def _summary_parts(cmp) -> tuple[str, str]:
    """A comparison's summary as (verdicts, the rest): the verdicts go above the table, on their own."""
    full = cmp.summary_html(details=True)
    verdicts = cmp._verdicts_html() if hasattr(cmp, "_verdicts_html") else ""
    if verdicts and verdicts in full:
        return verdicts, full.replace(verdicts, "", 1)
    return "", full


def _table_and_notes(rest: str) -> tuple[str, str]:
    """A comparison's summary without its verdicts, as (the compact table, what follows it: its notes, the fairness
    line and the full table behind a toggle); ("rest", "") when it has no notes part to split at."""
    mark = '<div class="nbt-compare-notes"'
    at = rest.find(mark)
    if at < 0 or not rest.startswith("<div>") or not rest.endswith("</div>"):
        return rest, ""
    return rest[:at] + "</div>", "<div>" + rest[at:]


def _add_band(figure, cmp) -> None:
    """The comparison's seed-noise band (behind its lines) in ``figure``'s difference row, which the live figure
    drew without one (the seed runs come after the variants); the row's title says what the grey is."""
    from ..viz.figures import _diff_title, difference_traces

    diffs = [t for t in figure.data if (t.meta or {}).get("kind") == "loss_diff"]
    if not diffs:
        return
    band = [t for t in difference_traces({n: r.history for n, r in cmp.results.items()}, cmp.reference,
                                         band=cmp.band) if t.meta["kind"].startswith("noise_band")]
    for t in band:
        t.update(xaxis=diffs[0].xaxis, yaxis=diffs[0].yaxis)
    with figure.batch_update():
        figure.add_traces(band)
        plain = _diff_title(cmp.reference, None)
        for a in figure.layout.annotations:
            if a.text == plain:
                a.text = _diff_title(cmp.reference, cmp.band)


def launched_log_html(tail: str) -> str:
    """The workers' last output lines (a launched run that failed), scrollable under the status line."""
    return ("<details open><summary>" + render.small("the workers' last lines") + "</summary>"
            f"<pre style='max-height:16em;overflow:auto;font-size:0.85em;margin:2px 0'>{render.esc(tail.strip())}"
            "</pre></details>")


def compare_variants(cfg, precisions: tuple[str, ...]) -> Optional[dict]:
    """What Compare passes as ``variants``, or None to pass ``precisions`` as they are: with stochastic rounding
    ticked (which only bf16-pure can hold), bf16-pure keeps it and every other precision runs without it, as
    TrainConfig requires; each variant is still named after its precision."""
    if not getattr(cfg, "stochastic_rounding", False):
        return None
    return {p: {"precision": p} if p == "bf16-pure" else {"precision": p, "stochastic_rounding": False}
            for p in precisions}


def _comparison_status(cmp) -> tuple[str, str]:
    if getattr(cmp, "completion", None) is None:   # a stand-in without the ComparisonResult API
        names = ", ".join(map(str, getattr(cmp, "results", None) or {}))
        return render.esc(f"done — compared {names}"), render.GREEN
    return render.comparison_line(cmp), render.comparison_color(cmp)


def _field_errors(error: BaseException) -> list[dict]:
    """The fields a run's error names: a ConfigError's own list (``field`` "precision", "method", ...),
    else an error whose message starts with a field name (``DataError("data: ...")``). The messages lose
    that leading "field:": the error box shows the field already, and "data: data: ..." reads as a glitch."""
    errors = [e for e in (getattr(error, "errors", None) or []) if isinstance(e, dict) and e.get("field")]
    if not errors:
        field = getattr(error, "field", None) or str(error).split(":", 1)[0].strip()
        errors = [{"field": field, "message": str(error)}] if field else []
    return [{**e, "message": _without_field(e["field"], e.get("message", ""))} for e in errors]


def _without_field(field: str, message: str) -> str:
    head, sep, rest = str(message).partition(":")
    return rest.strip() if sep and head.strip() == field and rest.strip() else str(message)
