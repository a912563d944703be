"""The precision doctor: findings with evidence and advice, from a run's history (and one fp32 probe).

Advice follows the guides' order: keep the GradScaler, lower the learning rate (e.g. 1e-5), clip at 1.0,
use bf16 where supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import pandas as pd
import torch

from ..hardware import capabilities, resolve_precision
from .distributed import local

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05


@dataclass
class Finding:
    """One diagnosis: what (kind), how bad, where, the evidence, and what to change."""

    kind: str            # "fp16_overflow" | "nonfinite" | "loss_spike" | "fp16_underflow" | "scale_stuck" |
    #                      "lost_updates"
    severity: str        # "info" | "warning" | "error"
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)
    step: Optional[int] = None

    def __str__(self) -> str:
        adv = "; ".join(self.advice)
        return f"[{self.severity}] {self.message}" + (f" -> {adv}" if adv else "")


def _advice(cfg, *, scaler: bool) -> list[str]:
    out = []
    if scaler:
        out.append("keep the GradScaler on (it skips overflowing steps and lowers the scale)")
    if cfg is not None and cfg.lr > 1e-5:
        out.append(f"lower the learning rate (lr={cfg.lr:g} -> e.g. 1e-5)")
    if cfg is not None and (not cfg.max_grad_norm or cfg.max_grad_norm > 1.0):
        out.append("clip gradients at max_grad_norm=1.0")
    caps = capabilities()
    if "bf16" in caps.allowed_precisions and (cfg is None or resolve_precision(cfg.precision) != "bf16"):
        out.append("use precision='bf16' (fp32's range, no loss scaling needed)")
    return out


def diagnose(history, summary: dict, cfg=None) -> list[Finding]:
    """Read a run's history and summary and return what went wrong with precision, and what to try."""
    h = history if isinstance(history, pd.DataFrame) else pd.DataFrame([r.to_dict() for r in history])
    found: list[Finding] = []
    if h.empty:
        return found
    scaler = h["scale"].notna().any()
    if scaler:
        skipped = h[h["skipped"]]
        if len(skipped):
            scales = h["scale"].astype(float)
            found.append(Finding(
                "fp16_overflow", "warning" if len(skipped) < max(3, 0.1 * len(h)) else "error",
                f"fp16 overflow: {len(skipped)} of {len(h)} steps skipped by the GradScaler; scale fell to "
                f"{scales.min():g}",
                {"skipped_steps": skipped["step"].tolist(), "min_scale": float(scales.min()),
                 "first_scale": float(scales.iloc[0]), "last_scale": float(scales.iloc[-1])},
                _advice(cfg, scaler=True), int(skipped["step"].iloc[0])))
        # The scale grows every growth_interval (2000) clean steps; a long run that never grew is stuck.
        if len(h) > 2000 and not (h["scale"].diff().dropna() > 0).any():
            found.append(Finding("scale_stuck", "info", "the loss scale never grew in a long run: overflow "
                                 "keeps recurring", {"steps": len(h)}, _advice(cfg, scaler=True)))
    bad = h[h["nonfinite"] & ~h["skipped"]] if scaler else h[h["nonfinite"]]
    if len(bad):
        k = int(bad["step"].iloc[0])
        found.append(Finding("nonfinite", "error", f"nan/inf loss or gradients at step {k}"
                             + (f" ({len(bad)} steps)" if len(bad) > 1 else ""),
                             {"steps": bad["step"].tolist(), "stopped_reason": summary.get("stopped_reason")},
                             _advice(cfg, scaler=False), k))
    loss = h["loss"].astype(float)
    finite = loss[loss.map(math.isfinite)]
    if len(finite) >= 10:
        # A spike: a step far above the running median, judged by the median absolute deviation.
        med = finite.rolling(10, min_periods=5).median().shift(1)
        mad = (finite - med).abs().rolling(10, min_periods=5).median().shift(1)
        spikes = finite[(finite - med) > 6 * mad.clip(lower=0.05)]
        if len(spikes):
            k = int(h.loc[spikes.index[0], "step"])
            found.append(Finding("loss_spike", "warning", f"loss spike at step {k} ({spikes.iloc[0]:.3f} vs a "
                                 f"running median of {med[spikes.index[0]]:.3f})",
                                 {"steps": [int(h.loc[i, "step"]) for i in spikes.index]},
                                 _advice(cfg, scaler=bool(scaler))[1:] or ["lower the learning rate"], k))
    share = summary.get("grad_fp16_underflow_share")
    if share is not None and share > 0.05:
        # information, not a fault: fp16 runs have their GradScaler, and other runs are not in fp16 at all
        found.append(Finding("fp16_underflow", "info",
                             f"{share:.0%} of sampled non-zero gradient elements are below fp16's smallest normal "
                             f"({FP16_MIN_NORMAL:.2e}): they would flush to zero in fp16 without loss scaling"
                             + ("" if scaler else " (this run is not in fp16; a note for if you move it there)"),
                             {"share": share},
                             ["keep the GradScaler on (it scales these gradients up into fp16's range)" if scaler else
                              "in fp16, keep the GradScaler on: it scales these gradients up into fp16's range"]))
    by_step = summary.get("lost_updates_by_step")
    precision = summary.get("precision_used") or (cfg.precision if cfg is not None else "")
    lrs = history_lrs(h)
    line = lost_updates_line(precision, by_step, bool(cfg is not None and cfg.stochastic_rounding), lrs)
    if line:
        first = min(int(k) for k in by_step)
        advice = ([] if cfg is not None and cfg.stochastic_rounding else
                  ["stochastic_rounding=True"] if precision == "bf16-pure" else []) + \
            (["precision='bf16' (autocast over fp32 master weights)"] if precision == "bf16-pure" else [])
        found.append(Finding("lost_updates", "warning" if not (cfg is not None and cfg.stochastic_rounding)
                             else "info", line, {"share": summary.get("lost_updates"), "by_step": dict(by_step)},
                             advice or ["a larger learning rate"], first))
    return found


def grad_underflow_share(params, samples_per_tensor: int = 1024) -> torch.Tensor:
    """Share of sampled non-zero gradient elements below fp16's smallest normal (a device tensor, no sync)."""
    small = total = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        flat = local(g).detach().reshape(-1)   # sharded: this rank's shard (a sample either way)
        s = flat[:: max(1, flat.numel() // samples_per_tensor)].float().abs()
        nz = s > 0
        a, b = ((s < FP16_MIN_NORMAL) & nz).sum(), nz.sum()
        small, total = (a, b) if small is None else (small + a, total + b)
    if small is None:
        return torch.zeros(())
    return small.float() / total.clamp(min=1).float()


@torch.no_grad()
def scan_fp16_overflow(model: torch.nn.Module, batch) -> list[dict[str, Any]]:
    """One fp32 forward; the modules whose outputs exceed fp16's range (|x| > 65504), largest first.

    ``batch`` is a MicroBatch, a dict of model inputs, or an input_ids tensor.
    """
    if hasattr(batch, "input_ids"):
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    elif isinstance(batch, dict):
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    else:
        inputs = {"input_ids": batch}
    dev = next(model.parameters()).device
    inputs = {k: v.to(dev) for k, v in inputs.items()}
    peaks: dict[str, float] = {}

    def hook(name):
        def fn(module, args, out):
            ts = [out] if isinstance(out, torch.Tensor) else [
                t for t in (out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list))
                            else []) if isinstance(t, torch.Tensor)]
            m = max((float(t.detach().float().abs().max()) for t in ts if t.is_floating_point() and t.numel()),
                    default=0.0)
            peaks[name] = max(peaks.get(name, 0.0), m)
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    was = model.training
    model.eval()
    try:
        model(**inputs)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    over = [{"module": n, "max_abs": v, "times_fp16_max": v / FP16_MAX} for n, v in peaks.items() if v > FP16_MAX]
    return sorted(over, key=lambda d: -d["max_abs"])


class LostUpdates:
    """The share of weight updates the weights' dtype could not hold, counted on a few sampled steps.

    On steps 1-3 and the last (``MEASURE``), before the optimizer steps, a strided sample of each trainable
    tensor (``samples_per_tensor`` elements) and of its gradient is kept; after the step, every sampled element
    whose gradient was not zero but whose value did not change is an update lost to rounding: smaller than half
    the spacing of the weights' dtype around it (bf16 keeps 8 significant bits, so an update below ~0.2% of a
    weight is lost; fp32's 24 bits lose almost none). Skipped steps and steps at lr 0 (warm-up's first) are not
    counted: nothing was meant to change. The counts stay on the device until ``shares()`` reads them, at the
    end of the run: no sync inside the loop."""

    MEASURE_FIRST = 3

    def __init__(self, params: list[torch.Tensor], total_steps: int, samples_per_tensor: int = 4096):
        self.params = params
        self.samples = samples_per_tensor
        self.steps = set(range(1, self.MEASURE_FIRST + 1)) | {total_steps}
        self._before: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self._step = 0
        self._counts: dict[int, tuple[Any, Any]] = {}   # step -> (lost, counted): device tensors or ints

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        flat = local(t).detach().reshape(-1)   # sharded (FSDP): this rank's shard, never a collective
        return flat[:: max(1, flat.numel() // self.samples)]

    def before(self, step: int, lr: float) -> None:
        """Keep the sample of the weights and gradients, on a measured step (call before the optimizer step)."""
        self._before = None
        if step not in self.steps or not lr:
            return
        self._step = step
        self._before = [(self._view(p).clone(), self._view(p.grad) != 0) for p in self.params if p.grad is not None]

    def after(self, skipped: bool) -> None:
        """Count, on a measured step that was not skipped, the sampled updates that did not change a weight."""
        if self._before is None:
            return
        before, self._before = self._before, None
        if skipped:
            return
        lost = counted = None
        pairs = zip(before, [p for p in self.params if p.grad is not None])
        for (old, meant), p in pairs:
            a = ((self._view(p) == old) & meant).sum()
            b = meant.sum()
            lost, counted = (a, b) if lost is None else (lost + a, counted + b)
        if lost is not None:
            self._counts[self._step] = (lost, counted)

    def shares(self) -> dict[int, float]:
        """{step: share of its sampled updates that were lost} (steps with no update to count are left out)."""
        out = {}
        for step, (lost, counted) in sorted(self._counts.items()):
            lost, counted = int(lost), int(counted)   # SYNC: once per measured step, at the end of the run
            self._counts[step] = (lost, counted)
            if counted:
                out[step] = lost / counted
        return out

    def share(self) -> Optional[float]:
        """All measured steps' lost updates over their counted ones; None when no step was measured."""
        self.shares()
        counted = sum(c for _, c in self._counts.values())
        return sum(lost for lost, _ in self._counts.values()) / counted if counted else None

    def state_dict(self) -> dict[int, list[int]]:
        self.shares()
        return {step: [int(a), int(b)] for step, (a, b) in self._counts.items()}

    def load_state_dict(self, state: dict) -> None:
        self._counts = {int(k): (int(v[0]), int(v[1])) for k, v in state.items()}


# a lost share above this is reported in the run notes, the verdicts and diagnose() (fp32 at usual learning
# rates loses well under 1%)
LOST_UPDATES_REPORTED = 0.05


def _where_in_schedule(step: int, lrs: Mapping[int, float]) -> str:
    """", the schedule's end" / ", early in warm-up" when the lr at ``step`` is under a tenth of the run's peak
    (there almost any update is below a 16-bit weight's spacing, whatever the precision); else ""."""
    peak = max((float(v) for v in lrs.values() if v is not None and math.isfinite(v)), default=0.0)
    lr = float(lrs[step])
    if not peak > 0 or lr >= 0.1 * peak:
        return ""
    top = max(k for k, v in lrs.items() if v is not None and float(v) == peak)
    return ", the schedule's end" if step > top else ", early in warm-up"


def lost_updates_line(precision: str, by_step: Optional[dict], stochastic_rounding: bool = False,
                      lrs: Optional[Mapping[int, float]] = None) -> Optional[str]:
    """The sentence the notes and verdicts show for a run's lost updates, or None when too few were lost.

    It leads with the largest share and the sampled step it fell at, with ``lrs`` (step -> learning rate, e.g. the
    history's ``lr`` column) the lr there (a share of 100% at the last step of a cosine schedule, where the lr is
    ~0, says nothing of the steps that trained), then the steps sampled and the first one's share. It does not
    name the run: the verdict and the notes it appears in do (``precision`` chooses the advice)."""
    if not by_step:
        return None
    shares = {int(k): float(v) for k, v in by_step.items()}
    steps = sorted(shares)
    first = steps[0]
    worst = max(shares.values())
    if worst < LOST_UPDATES_REPORTED:
        return None
    at = next(k for k in steps if shares[k] == worst)
    lrs = {int(k): v for k, v in (lrs or {}).items()}
    lr = lrs.get(at)
    where = (f" (where lr is {float(lr):.2g}{_where_in_schedule(at, lrs)})"
             if lr is not None and math.isfinite(lr) else "")
    line = f"{worst:.0%} of updates lost at step {at}{where}"
    if len(steps) > 1:
        line += (f", the most of sampled steps {', '.join(map(str, steps))}"
                 + (f" ({shares[first]:.0%} at step {first})" if at != first else ""))
    if stochastic_rounding:
        return line + "; stochastic rounding keeps them on average (a weight moves by one bf16 step with the " \
                      "update's share of it)"
    if precision == "bf16-pure":
        return line + "; try stochastic_rounding=True or bf16 autocast (precision='bf16': fp32 master weights)"
    return line + "; lr x gradient is below the weights' spacing there (a larger learning rate moves them)"


def history_lrs(history: Any) -> Optional[dict[int, float]]:
    """Step -> that step's learning rate, from a run's history (None without an ``lr`` column)."""
    if history is None or "lr" not in history or "step" not in history or not len(history):
        return None
    return dict(zip(pd.Series(history["step"]).astype(int), pd.Series(history["lr"]).astype(float)))


def lost_updates_of(result: Any) -> Optional[str]:
    """The lost-update sentence of a finished run (a TrainResult), with the lr of each sampled step."""
    s, cfg = getattr(result, "summary", None) or {}, getattr(result, "config", None)
    return lost_updates_line(s.get("precision_used") or getattr(cfg, "precision", ""), s.get("lost_updates_by_step"),
                             bool(getattr(cfg, "stochastic_rounding", False)),
                             history_lrs(getattr(result, "history", None)))

