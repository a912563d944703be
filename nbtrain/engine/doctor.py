"""The precision doctor: findings with evidence and advice, from a run's history (and one fp32 probe).

Advice follows the guides' order: keep the GradScaler, lower the learning rate (e.g. 1e-5), clip at 1.0,
use bf16 where supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import pandas as pd
import torch

from ..hardware import capabilities, resolve_precision

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 6.103515625e-05


@dataclass
class Finding:
    """One diagnosis: what (kind), how bad, where, the evidence, and what to change."""

    kind: str            # "fp16_overflow" | "nonfinite" | "loss_spike" | "fp16_underflow" | "scale_stuck"
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
        found.append(Finding("fp16_underflow", "warning" if not scaler else "info",
                             f"{share:.0%} of sampled non-zero gradient elements are below fp16's smallest normal "
                             f"({FP16_MIN_NORMAL:.2e}): they would flush to zero in fp16 without loss scaling",
                             {"share": share}, _advice(cfg, scaler=True)))
    return found


def grad_underflow_share(params, samples_per_tensor: int = 1024) -> torch.Tensor:
    """Share of sampled non-zero gradient elements below fp16's smallest normal (a device tensor, no sync)."""
    small = total = None
    for p in params:
        g = p.grad
        if g is None:
            continue
        flat = g.detach().reshape(-1)
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
