"""Hugging Face Trainer integration: the nbtrain LiveDashboard fed from a ``transformers.Trainer`` run.

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[LiveDashboardCallback()])   # logging_steps=1 for a point per step

What the Trainer gives and how it becomes a StepRecord:

- ``loss``, ``grad_norm`` and ``learning_rate`` come from the Trainer's logs (``on_log``). The
  Trainer's ``grad_norm`` is measured by ``accelerator.clip_grad_norm_`` after unscaling and before
  clipping, the same quantity as nbtrain's. With ``logging_steps=N`` the loss is the Trainer's mean
  over the N steps and one record is made per log; ``skipped`` then means "a step in the window was
  skipped". By default the Trainer replaces a nan/inf loss by a running average
  (``logging_nan_inf_filter=True``): set it to False to see non-finite losses as they are.
- ``scale`` is read from the GradScaler that accelerate attaches to the prepared optimizer
  (``optimizer.scaler``, after its update). A step is ``skipped`` when that scale dropped or
  ``optimizer.step_was_skipped`` says so (the latter alone misses skips inside fused optimizers,
  the Trainer's default on CUDA). With ``logging_nan_inf_filter=False`` the Trainer's logged loss
  stays nan after the first nan (it resets its running sum by subtracting it from itself); the
  dashboard shows the logged values as they are. accelerate
  creates a scaler only for fp16 on an accelerator: fp16 on a CPU runs in fp32 there, and the
  dashboard labels such a run ``fp32``.
- memory (VRAM on CUDA, process RSS always), step time and tokens/s are measured in
  ``on_step_end``; tokens need ``include_num_input_tokens_seen`` (otherwise 0, and the status line
  shows seconds per step instead).
"""

from __future__ import annotations

import math
import platform
import time
from types import SimpleNamespace
from typing import Any, Optional

import psutil
import torch
from .._logs import deferred_bitsandbytes

with deferred_bitsandbytes():   # the Trainer's modules import peft, and peft bitsandbytes: left unrun until used
    from transformers import TrainerCallback

from ..engine import telemetry
from ..engine.records import EvalRecord, RunInfo, StepRecord


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _precision(args, scaler) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16" if scaler is not None else "fp32"  # accelerate ignores fp16 without a GPU
    return "tf32" if getattr(args, "tf32", False) else "fp32"


def _device_facts(device: str) -> tuple[str, float]:
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.name, props.total_memory / 2**30
    return platform.processor() or "CPU", psutil.virtual_memory().total / 2**30


class LiveDashboardCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that feeds an nbtrain LiveDashboard.

    Pass a dashboard to share it (e.g. several Trainer runs overlaid, each with its ``variant``),
    or keyword arguments for a new one. ``callback.dashboard.records`` holds the StepRecords made.
    """

    def __init__(self, dashboard: Any = None, *, variant: Optional[str] = None, **dashboard_kwargs: Any):
        if dashboard is None:
            from ..viz.dashboard import LiveDashboard

            dashboard = LiveDashboard(**dashboard_kwargs)
        elif dashboard_kwargs:
            raise TypeError("pass either a dashboard or keyword arguments for a new one, not both")
        self.dashboard = dashboard
        self.variant = variant
        self._reset()

    def _reset(self) -> None:
        self._t0 = self._t_last = time.monotonic()
        self._device = "cpu"
        self._scaler = None
        self._last_scale: Optional[float] = None
        self._max_grad_norm: Optional[float] = None
        self._tokens_seen = 0
        self._window: dict[str, Any] = {}
        self._new_window()
        self._steps = 0

    def _new_window(self) -> None:
        self._window = dict(steps=0, time=0.0, tokens=0, skipped=False, peak=None, alloc=None,
                            reserved=None, scale=None, rss=0.0)

    # -- Trainer events ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None,
                       **kwargs):
        self._reset()
        self._device = getattr(getattr(args, "device", None), "type", "cpu")
        self._scaler = getattr(optimizer, "scaler", None)
        self._last_scale = (float(self._scaler.get_scale())
                            if self._scaler is not None and self._scaler.is_enabled() else None)
        self._max_grad_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        self._tokens_seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        name, total_gib = _device_facts(self._device)
        try:
            n_train = len(train_dataloader.dataset)
        except (AttributeError, TypeError):
            n_train = 0
        params = list(model.parameters()) if model is not None else []
        method = "lora" if hasattr(model, "peft_config") else "full"
        cfg = SimpleNamespace(micro_batch_size=args.per_device_train_batch_size,
                              grad_accum_steps=args.gradient_accumulation_steps, method=method,
                              max_grad_norm=self._max_grad_norm, training_args=args)
        info = RunInfo(config=cfg, precision_used=_precision(args, self._scaler), device=self._device,
                       device_name=name, device_total_gib=total_gib, scaler_enabled=self._scaler is not None,
                       total_steps=int(state.max_steps or 0), train_examples=n_train, eval_examples=0,
                       trainable_params=sum(p.numel() for p in params if p.requires_grad),
                       total_params=sum(p.numel() for p in params), max_grad_norm=self._max_grad_norm,
                       variant=self.variant)
        telemetry.reset_peak(self._device)
        self._t0 = self._t_last = time.monotonic()
        self.dashboard.on_run_start(info)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        now = time.monotonic()
        w = self._window
        w["steps"] += 1
        w["time"] += now - self._t_last
        self._t_last = now
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        w["tokens"] += max(0, seen - self._tokens_seen)
        self._tokens_seen = seen
        scaler = getattr(optimizer, "scaler", None) or self._scaler
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        # accelerate's step_was_skipped misses skips inside fused optimizers (the Trainer's default
        # adamw_torch_fused on CUDA takes the scaler and skips in its kernel): a dropped scale does not.
        dropped = scale is not None and self._last_scale is not None and scale < self._last_scale
        w["skipped"] |= dropped or bool(getattr(optimizer, "step_was_skipped", False))
        w["scale"] = scale
        self._last_scale = scale
        alloc, reserved, peak = telemetry.device_memory_gib(self._device)
        if peak is not None:
            w["alloc"], w["reserved"] = alloc, reserved
            w["peak"] = peak if w["peak"] is None else max(w["peak"], peak)
            telemetry.reset_peak(self._device)
        w["rss"] = telemetry.host_rss_gib()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs or self._window["steps"] == 0:
            return  # eval logs and the end-of-training summary are not steps
        w = self._window
        loss = float(logs["loss"])
        gn = float(logs["grad_norm"]) if logs.get("grad_norm") is not None else math.nan
        clipped = self._max_grad_norm is not None and _finite(gn) and gn > self._max_grad_norm
        dt = w["time"] / w["steps"]
        rec = StepRecord(
            step=int(state.global_step), epoch=float(state.epoch or logs.get("epoch") or 0.0),
            micro_steps=int(args.gradient_accumulation_steps), tokens=int(w["tokens"]), loss=loss,
            lr=float(logs.get("learning_rate", math.nan)), grad_norm=gn, clipped=bool(clipped),
            scale=w["scale"], skipped=bool(w["skipped"]),
            nonfinite=not (_finite(loss) and (_finite(gn) or logs.get("grad_norm") is None)),
            vram_allocated_gib=w["alloc"], vram_reserved_gib=w["reserved"], vram_peak_gib=w["peak"],
            host_rss_gib=float(w["rss"]), step_time_s=dt,
            tokens_per_s=w["tokens"] / w["time"] if w["time"] > 0 else 0.0,
            elapsed_s=time.monotonic() - self._t0, variant=self.variant)
        self._steps += 1
        self._new_window()
        self.dashboard.on_step_end(rec)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics = metrics or {}
        if "eval_loss" not in metrics:
            return
        loss = float(metrics["eval_loss"])
        self.dashboard.on_eval(EvalRecord(
            step=int(state.global_step), eval_loss=loss, eval_tokens=0,
            eval_perplexity=math.exp(loss) if _finite(loss) and loss < 700 else None,
            variant=self.variant))

    def on_train_end(self, args, state, control, **kwargs):
        recs = [r for r in self.dashboard.records if r.variant == self.variant]
        tokens = sum(r.tokens for r in recs)
        wall = time.monotonic() - self._t0
        summary = dict(steps=int(state.global_step), tokens=tokens,
                       tokens_per_s=tokens / wall if tokens and wall > 0 else None,
                       skipped_steps=sum(r.skipped for r in recs),
                       nonfinite_steps=sum(r.nonfinite for r in recs), wall_s=wall,
                       stopped_reason="max_steps" if state.global_step >= (state.max_steps or 0)
                       else "stopped",
                       device=self._device)
        self.dashboard.on_run_end(SimpleNamespace(summary=summary, history=None))
