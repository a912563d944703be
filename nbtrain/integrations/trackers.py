"""Runs logged where users keep them: TensorBoard, Trackio, MLflow and Weights & Biases as nbtrain callbacks.

Two ways in::

    nbt.train(nbt.TrainConfig(..., report_to=["tensorboard", "mlflow"]))        # prepare() adds them
    nbt.train(cfg, callbacks=[TensorBoardCallback("runs/bf16"), MLflowCallback(tracking_uri="file:./mlruns")])

What each writes, at the optimizer step it belongs to:

- every ``StepRecord`` (one per optimizer step, whatever ``log_every`` says) as ``train/<field>``: loss, lr,
  grad_norm, scale, clipped / skipped / nonfinite (0 or 1), memory (vram_*_gib on an accelerator, host_rss_gib),
  step_time_s, tokens_per_s, tokens, epoch, elapsed_s... A field that is None (no GradScaler: ``scale``; the
  CPU: ``vram_*``) is left out, never written as 0; a nan or inf loss is written as it is.
- every ``EvalRecord`` as ``eval/<name>`` (``eval/loss``, ``eval/accuracy``, ``eval/perplexity``, ...).
- the config (every TrainConfig field) and what the run resolved (precision_used, device, parameter counts,
  total_steps, ...) as the tracker's hyperparameters / params / config, once, at the start.
- at the end, the summary's numbers where the tracker has a place for them (W&B's run summary, MLflow's run
  status and ``summary/...`` metrics, TensorBoard's ``summary`` text).

Where the logs go:

- ``tensorboard``: ``output_dir/tensorboard`` when the run has an output_dir, else ``runs/<time>_<name>`` in the
  working folder (``tensorboard --logdir runs``). A ``TensorBoardCallback(log_dir)`` under ``compare()`` writes
  each variant to ``log_dir/<variant>``.
- ``trackio``: trackio's own local store (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``), project
  ``nbtrain``; ``trackio show`` opens it. A ``TRACKIO_SPACE_ID`` in the environment sends it to that Space.
- ``mlflow``: ``MLFLOW_TRACKING_URI`` when set (a server, ``sqlite:///...``, ``file:...``), else mlflow's default
  store in the working folder; experiment ``MLFLOW_EXPERIMENT_NAME`` or ``nbtrain``. mlflow-skinny has no sqlite
  store: use the full ``mlflow`` package, or a ``file:`` URI with ``MLFLOW_ALLOW_FILE_STORE=true`` (mlflow 3).
- ``wandb``: Weights & Biases, project ``WANDB_PROJECT`` or ``nbtrain``, files in ``output_dir/wandb`` (else
  ``./wandb``); ``WANDB_MODE=offline`` keeps the run on disk (``wandb sync`` uploads it later).

The tracker packages are imported when a callback is made (for ``report_to``: when the run prepares, before any
data or model loads), never by ``import nbtrain`` or by building a TrainConfig. A missing one raises
``TrackerUnavailable`` (an ImportError) with the ``pip install`` that fixes it. Only rank 0 of a multi-process
run logs (the engine fires callbacks there alone).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib
import inspect
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from ..config import TRACKERS, TrainConfig

__all__ = ["TRACKERS", "MLflowCallback", "TensorBoardCallback", "TrackerCallback", "TrackerUnavailable",
           "TrackioCallback", "WandbCallback", "eval_metrics", "make_tracker", "run_params", "step_metrics",
           "tracker_callbacks"]

# a run that ended like this did not finish its work: trackers that keep a status mark it failed
_FAILED = ("callback_error", "out_of_memory", "nonfinite")
_KILLED = ("stopped", "interrupted")


class TrackerUnavailable(ImportError):
    """A tracker's package is not installed (or does not import); the message says what to pip install."""


def _require(module: str, tracker: str, pip: str):
    """Import ``module`` for ``tracker``, or raise TrackerUnavailable with the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerUnavailable(
            f"report_to: {tracker!r} needs the {pip.split()[0]} package, which does not import here ({e}). "
            f"Install it with: pip install {pip}   (all trackers: pip install 'nbtrain[trackers]')") from e


# -------------------------------------------------------------------------------------------------------------
# What gets logged: plain dicts, shared by every tracker
# -------------------------------------------------------------------------------------------------------------
def _fields(record: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    if isinstance(record, dict):
        return dict(record)
    return dict(vars(record))


def _number(v: Any) -> Optional[float]:
    """A loggable number: bools as 0/1, ints and floats as floats (nan/inf kept), anything else None."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:   # a 0-d tensor or numpy scalar
        return float(v.item())
    return None


def _metrics(record: Any, name: Any) -> dict[str, float]:
    """Every numeric field of ``record`` but ``step`` (the x axis), keyed ``name(field)``; None left out."""
    return {name(k): x for k, v in _fields(record).items() if k != "step" and (x := _number(v)) is not None}


def step_metrics(record: Any) -> dict[str, float]:
    """A StepRecord as ``{"train/<field>": number}``: every numeric field (bools as 0/1) but ``step`` (the x axis);
    None fields are left out."""
    return _metrics(record, lambda k: f"train/{k}")


def eval_metrics(record: Any) -> dict[str, float]:
    """An EvalRecord as ``{"eval/<name>": number}`` (``eval_loss`` -> ``eval/loss``); None fields left out."""
    return _metrics(record, lambda k: "eval/" + k.removeprefix("eval_"))


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if isinstance(config, dict):
        return dict(config)
    return _fields(config)


_INFO_KEYS = ("precision_used", "device", "device_name", "device_total_gib", "scaler_enabled", "total_steps",
              "train_examples", "eval_examples", "trainable_params", "total_params", "variant")


def run_params(info: Any) -> dict[str, Any]:
    """The run's hyperparameters: every config field, then what the run resolved (precision_used, device,
    parameter counts, total_steps, ...). Values as they are (lists stay lists, None stays None)."""
    out = _config_dict(getattr(info, "config", None))
    for k in _INFO_KEYS:
        if hasattr(info, k) and k not in out:
            out[k] = getattr(info, k)
    return out


def _flat(v: Any) -> Any:
    """A param value trackers with scalar params accept: lists as comma-separated text."""
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return v


def _summary_numbers(result: Any) -> dict[str, float]:
    summary = getattr(result, "summary", None) or {}
    out = {}
    for k in list(summary.keys()) if hasattr(summary, "keys") else []:
        x = _number(summary[k])
        if x is not None and k not in ("world_size",):
            out[k] = x
    return out


def _stopped_reason(result: Any) -> str:
    summary = getattr(result, "summary", None) or {}
    try:
        return str(summary["stopped_reason"])
    except (KeyError, TypeError):
        return ""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-") or "run"


def _output_dir(info: Any) -> Optional[str]:
    cfg = getattr(info, "config", None)
    return getattr(cfg, "output_dir", None) if cfg is not None else None


# -------------------------------------------------------------------------------------------------------------
# The callbacks
# -------------------------------------------------------------------------------------------------------------
class TrackerCallback:
    """The part the trackers share: one tracker run per nbtrain run (``on_run_start`` opens it, ``on_run_end``
    closes it), so one callback object can serve several runs in turn (``compare()`` variants).

    Subclasses implement ``_open(info)``, ``_log(metrics, step)`` and ``_close(result)``."""

    name = ""

    def __init__(self):
        self._open_run = False

    # -- the nbtrain callback protocol ---------------------------------------------------------------------
    def on_run_start(self, info: Any) -> None:
        if self._open_run:   # a run that never sent on_run_end (it raised): close it before the next one
            self._close(None)
        self._open(info)
        self._open_run = True

    def on_step_end(self, record: Any) -> None:
        if self._open_run:
            self._log(step_metrics(record), int(record.step))

    def on_eval(self, record: Any) -> None:
        if self._open_run:
            self._log(eval_metrics(record), int(record.step))

    def on_run_end(self, result: Any) -> None:
        if self._open_run:
            self._open_run = False
            self._close(result)

    # -- what each tracker does ----------------------------------------------------------------------------
    def _open(self, info: Any) -> None:
        raise NotImplementedError

    def _log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _close(self, result: Any) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TensorBoardCallback(TrackerCallback):
    """TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``, needs the ``tensorboard`` package).

    ``log_dir``: where this callback's runs go; None: ``output_dir/tensorboard`` of each run, or
    ``runs/<time>_<name>`` in the working folder when the run has no output_dir. With a ``log_dir`` and a
    ``compare()`` variant, the variant writes to ``log_dir/<variant>``. ``log_dir`` is set to the folder of
    the current (or last) run. Scalars ``train/*`` and ``eval/*`` at their step, the config as the
    ``config`` text and as HParams (with ``train/loss`` and ``eval/loss`` as its metrics), the summary as the
    ``summary`` text at the end."""

    name = "tensorboard"

    def __init__(self, log_dir: Optional[str | os.PathLike] = None, flush_secs: int = 10):
        super().__init__()
        _require("tensorboard", "tensorboard", "tensorboard")
        self._summary_writer = _require("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.base_dir = None if log_dir is None else str(log_dir)
        self.log_dir: Optional[str] = self.base_dir
        self.flush_secs = flush_secs
        self.writer = None

    def _dir_for(self, info: Any) -> str:
        variant = getattr(info, "variant", None)
        if self.base_dir is not None:
            return str(Path(self.base_dir) / _slug(variant)) if variant else self.base_dir
        out = _output_dir(info)
        if out:
            return str(Path(out) / "tensorboard")
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = _slug(variant or getattr(info, "precision_used", "") or "run")
        return str(Path("runs") / f"{stamp}_{name}_{uuid.uuid4().hex[:6]}")

    def _open(self, info: Any) -> None:
        import yaml
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = self._dir_for(info)
        self.writer = self._summary_writer(log_dir=self.log_dir, flush_secs=self.flush_secs)
        params = run_params(info)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(params, sort_keys=False) + "```", 0)
        hp = {k: _flat(v) for k, v in params.items()}
        hp = {k: v for k, v in hp.items() if isinstance(v, (bool, int, float, str))}
        # the HParams dashboard: one session per run, its metrics read from these scalar tags
        fw = self.writer._get_file_writer()
        for summary in hparams(hp, {"train/loss": 0.0, "eval/loss": 0.0}):
            fw.add_summary(summary)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def _close(self, result: Any) -> None:
        if self.writer is None:
            return
        try:
            numbers = _summary_numbers(result)
            if numbers:
                steps = int(numbers.get("steps", 0))
                lines = "\n".join(f"| {k} | {v:g} |" for k, v in numbers.items())
                self.writer.add_text("summary", f"stopped: {_stopped_reason(result)}\n\n| key | value |\n|---|---|\n"
                                     + lines, steps)
        finally:
            self.writer.close()
            self.writer = None

    def __repr__(self) -> str:
        return f"TensorBoardCallback(log_dir={self.base_dir!r})"


class TrackioCallback(TrackerCallback):
    """A Trackio run (``trackio.init`` / ``run.log`` / ``run.finish``), in trackio's local store unless
    ``TRACKIO_SPACE_ID`` (or ``space_id=``) says a Space. ``project`` defaults to ``nbtrain``; ``name`` to the
    compare() variant (trackio names it otherwise). Other keywords go to ``trackio.init`` (this callback turns
    off trackio's own CPU/GPU sampling and its notebook dashboard unless told otherwise: nbtrain records memory
    itself). Note: ``trackio.init`` ends trackio's current run of this thread, as it always does."""

    name = "trackio"

    def __init__(self, project: str = "nbtrain", name: Optional[str] = None, **init_kwargs: Any):
        super().__init__()
        self._trackio = _require("trackio", "trackio", "trackio")
        self.project, self.run_name = project, name
        self.init_kwargs = init_kwargs
        self.run = None

    def _open(self, info: Any) -> None:
        kw = dict(embed=False, auto_log_cpu=False, auto_log_gpu=False)
        accepted = inspect.signature(self._trackio.init).parameters
        kw = {k: v for k, v in kw.items() if k in accepted}   # older trackio lacks some of these
        kw.update(self.init_kwargs)
        name = self.run_name or getattr(info, "variant", None)
        self.run = self._trackio.init(project=self.project, name=name, config=run_params(info), **kw)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self.run.log(metrics, step=step)

    def _close(self, result: Any) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()

    def __repr__(self) -> str:
        return f"TrackioCallback(project={self.project!r})"


class MLflowCallback(TrackerCallback):
    """An MLflow run through ``mlflow.MlflowClient`` (no global active run: concurrent nbtrain runs, and the
    user's own active run, stay apart).

    ``tracking_uri``: None = ``MLFLOW_TRACKING_URI`` when set, else mlflow's default store in the working folder.
    ``experiment``: None = ``MLFLOW_EXPERIMENT_NAME`` or ``nbtrain`` (created when missing). ``run_name``: None =
    the compare() variant. Params: the config and the run's resolved facts; metrics ``train/*``, ``eval/*`` at
    their step, ``summary/*`` at the end; the config also as the artifact ``config.yaml``. The run ends FINISHED,
    KILLED (stopped, interrupted) or FAILED (callback error, out of memory, a non-finite stop).

    A local store (``file:``, ``sqlite:``, a path) is opened when the callback is made, so a store mlflow cannot
    open fails before training starts."""

    name = "mlflow"

    def __init__(self, tracking_uri: Optional[str] = None, experiment: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[dict[str, str]] = None):
        super().__init__()
        _require("mlflow", "mlflow", "mlflow")
        entities = _require("mlflow.entities", "mlflow", "mlflow")
        self._Metric, self._Param = entities.Metric, entities.Param
        from mlflow.tracking import MlflowClient

        import mlflow

        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
        self.experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "nbtrain"
        self.run_name, self.tags = run_name, dict(tags or {})
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            if self._is_local(self.tracking_uri):   # a local store fails now, not after the model has loaded
                self._experiment_id()
        except TrackerUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - mlflow raises many kinds; all mean "this store does not open"
            advice = ("pip install mlflow (the full package: mlflow-skinny has no sqlite store)"
                      if self.tracking_uri.startswith("sqlite") else
                      "set MLFLOW_ALLOW_FILE_STORE=true (mlflow 3 keeps file stores in maintenance mode) or use "
                      "sqlite:///mlflow.db with the full mlflow package" if self.tracking_uri.startswith("file")
                      else "check MLFLOW_TRACKING_URI")
            raise TrackerUnavailable(f"report_to: 'mlflow' cannot open the tracking store {self.tracking_uri!r}: "
                                     f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} -- {advice}"
                                     ) from e
        self.run_id: Optional[str] = None

    @staticmethod
    def _is_local(uri: str) -> bool:
        # a file: or sqlite: URI, or a plain path; never a server (or "databricks"), which is asked only when the
        # run starts
        return uri.startswith(("file:", "sqlite:", "/", ".", "~")) or os.path.isabs(uri) or (
            ":" not in uri and ("/" in uri or os.sep in uri))

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return exp.experiment_id
        return self.client.create_experiment(self.experiment)

    def _open(self, info: Any) -> None:
        import yaml

        tags = {"nbtrain.precision_used": str(getattr(info, "precision_used", "")), **self.tags}
        variant = getattr(info, "variant", None)
        if variant:
            tags["nbtrain.variant"] = str(variant)
        run = self.client.create_run(self._experiment_id(), run_name=self.run_name or variant, tags=tags)
        self.run_id = run.info.run_id
        params = [self._Param(k, str(_flat(v))) for k, v in run_params(info).items()]
        for i in range(0, len(params), 100):   # mlflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, yaml.safe_dump(run_params(info), sort_keys=False), "config.yaml")

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if not metrics:
            return
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._Metric(k, v, now, step) for k, v in metrics.items()])

    def _close(self, result: Any) -> None:
        if self.run_id is None:
            return
        run_id, self.run_id = self.run_id, None
        status = "FINISHED"
        try:
            reason = _stopped_reason(result)
            status = "FAILED" if result is None or reason in _FAILED else "KILLED" if reason in _KILLED \
                else "FINISHED"
            numbers = _summary_numbers(result)
            if numbers:
                now, step = int(time.time() * 1000), int(numbers.get("steps", 0))
                self.client.log_batch(run_id, metrics=[self._Metric(f"summary/{k}", v, now, step)
                                                       for k, v in numbers.items() if math.isfinite(v)],
                                      tags=[])
            if reason:
                self.client.set_tag(run_id, "nbtrain.stopped_reason", reason)
        finally:
            self.client.set_terminated(run_id, status=status)

    def __repr__(self) -> str:
        return f"MLflowCallback(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r})"


class WandbCallback(TrackerCallback):
    """A Weights & Biases run (``wandb.init(reinit="create_new")``: its own Run object, so concurrent runs
    stay apart). ``project``: None = ``WANDB_PROJECT`` or ``nbtrain``; ``dir``: None = the run's output_dir
    (files in ``output_dir/wandb``), else wandb's default (``./wandb``); ``mode``: None = wandb's choice
    (``WANDB_MODE``; ``"offline"`` keeps everything on disk). Other keywords go to ``wandb.init``. The summary's
    numbers go to the run summary; the run exits with code 1 after a callback error, out of memory or a
    non-finite stop."""

    name = "wandb"

    def __init__(self, project: Optional[str] = None, name: Optional[str] = None,
                 dir: Optional[str | os.PathLike] = None, mode: Optional[str] = None, **init_kwargs: Any):
        super().__init__()
        self._wandb = _require("wandb", "wandb", "wandb")
        self.project = project or os.environ.get("WANDB_PROJECT") or "nbtrain"
        self.run_name, self.dir, self.mode = name, None if dir is None else str(dir), mode
        self.init_kwargs = init_kwargs
        self.run = None

    def _open(self, info: Any) -> None:
        wdir = self.dir or _output_dir(info)
        if wdir:
            Path(wdir).mkdir(parents=True, exist_ok=True)
        kw = dict(project=self.project, name=self.run_name or getattr(info, "variant", None), dir=wdir,
                  config=run_params(info), reinit="create_new")
        if self.mode is not None:
            kw["mode"] = self.mode
        kw.update(self.init_kwargs)
        self.run = self._wandb.init(**kw)

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self.run.log(metrics, step=step)

    def _close(self, result: Any) -> None:
        if self.run is None:
            return
        run, self.run = self.run, None
        try:
            numbers = _summary_numbers(result)
            if numbers:
                run.summary.update({f"summary/{k}": v for k, v in numbers.items()})
            reason = _stopped_reason(result)
            if reason:
                run.summary["stopped_reason"] = reason
        finally:
            run.finish(exit_code=1 if result is None or _stopped_reason(result) in _FAILED else 0)

    def __repr__(self) -> str:
        return f"WandbCallback(project={self.project!r})"


_CLASSES = {"tensorboard": TensorBoardCallback, "trackio": TrackioCallback, "mlflow": MLflowCallback,
            "wandb": WandbCallback}
assert tuple(_CLASSES) == TRACKERS, "every name report_to allows has a callback"


def make_tracker(name: str, **kwargs: Any) -> TrackerCallback:
    """The callback of tracker ``name`` (one of ``TRACKERS``); ``kwargs`` go to its class."""
    if name not in _CLASSES:
        raise ValueError(f"report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
    return _CLASSES[name](**kwargs)


def tracker_callbacks(cfg: TrainConfig) -> list[TrackerCallback]:
    """The callbacks of ``cfg.report_to``, each with its defaults (called by the engine when a run prepares).

    Raises TrackerUnavailable, naming every tracker whose package is missing and the pip command, before any
    data or model loads."""
    made, missing = [], []
    for name in getattr(cfg, "report_to", None) or []:
        try:
            made.append(make_tracker(name))
        except TrackerUnavailable as e:
            missing.append((name, e))
    if len(missing) == 1:
        raise missing[0][1]
    if missing:
        names = " ".join(n for n, _ in missing)
        raise TrackerUnavailable(f"report_to: {', '.join(repr(n) for n, _ in missing)} need packages that do not "
                                 f"import here. Install them with: pip install {names}   "
                                 f"(all trackers: pip install 'nbtrain[trackers]')") from missing[0][1]
    return made
