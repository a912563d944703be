"""The report of a MemoryEstimate: one row model (``estimate_report``) and two thin formatters over it, the text
``nbtrain estimate`` prints (``estimate_text``) and the HTML of the Panel's readout and of a notebook
(``estimate_html``). Both read the same rows, so what they say cannot drift apart."""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence


class MemoryEstimate(Protocol):
    """What a report reads of an estimate (``estimate.MemoryEstimate`` has it): named here, not imported, so
    that the estimate can print itself with this module and this module needs nothing of it."""

    config: Any
    precision: str
    total_params: int
    trainable_params: int
    total_gib: float
    peak_phase: str
    device: str
    device_total_gib: float
    fits: bool
    notes: Sequence[str]
    advice: Sequence[Any]
    # and, read with defaults (an estimate made before issue 27 has none): optimizer, weights_dtype,
    # master_weights_gib, dtypes (part label -> dtype text)

# (label, MemoryEstimate attribute): the parts, then the step's peak
PART_ROWS = (("weights", "weights_gib"), ("gradients", "gradients_gib"), ("optimizer", "optimizer_gib"),
             ("activations", "activations_gib"), ("logits + loss", "logits_gib"), ("overhead", "overhead_gib"),
             ("total (peak)", "total_gib"))
# the part labels whose dtype the report shows beside them (MemoryEstimate.dtypes, keyed by label)
DTYPE_PARTS = ("weights", "gradients", "optimizer", "activations", "logits + loss", "gathered", "ddp buckets",
               "reference weights", "rollout KV cache", "sampling forward", "rollout tensors")
# parts of several processes, shown (before the overhead) only when there is some: FSDP's gathered groups, DDP's
# gradient buckets
RANK_ROWS = (("gathered", "gathered_gib"), ("ddp buckets", "buckets_gib"))
# DPO's frozen reference copy (a full fine-tune without precompute_ref), shown after the optimizer state only when
# there is one
REFERENCE_ROWS = (("reference weights", "reference_weights_gib"),)
# GRPO's rollouts (objective="grpo"), shown after the update's logits only when there are some: one prompt's group's
# KV cache, the sampling forward's transient beyond it, the rollout batch the step keeps
ROLLOUT_ROWS = (("rollout KV cache", "rollout_kv_cache_gib"), ("sampling forward", "sampling_forward_gib"),
                ("rollout tensors", "rollout_tensors_gib"))

RED, AMBER, GREEN, GREY = "#c62828", "#ef6c00", "#2e7d32", "#666"


@dataclass(frozen=True)
class EstimateReport:
    """What a report of an estimate says, once, for every format."""

    title: str                              # the config in one line
    total_params: int
    trainable_params: int
    parts: tuple[tuple[str, float], ...]    # (label, GiB) of each part; the total is not their sum
    total_gib: float                        # the step's peak, overhead included
    peak_phase: str
    device: str
    device_total_gib: float
    fits: bool
    notes: tuple[str, ...]
    advice: tuple[Any, ...]                 # Advice items, cumulative, in order
    dtypes: tuple[str, ...] = ()            # beside each part: the dtype(s) of its tensors ("" for none)
    optimizer: str = "adamw"
    weights_dtype: str = "fp32"
    master_weights_gib: float = 0.0         # of the weights: the fp32 master copy (autocast precisions)
    scale_line: str = ""                    # from how many processes it fits under fsdp ("" when not asked)
    # on the CPU: what the run will record as host_tensors_gib, to compare a run with (0 elsewhere)
    run_tensors_gib: float = 0.0
    tensors_peak_gib: float = 0.0           # the peak without overhead, beside it
    phases_line: str = ""                   # GRPO: the rollouts' peak and the update's ("" otherwise)

    @property
    def share(self) -> Optional[float]:
        """The total as a fraction of the device's memory (None when that is unknown or infinite)."""
        if self.total_gib is None or not self.device_total_gib:
            return None
        frac = self.total_gib / self.device_total_gib
        return frac if math.isfinite(frac) else None


def estimate_report(est: MemoryEstimate) -> EstimateReport:
    """The rows, verdict and advice of ``est``."""
    cfg = est.config
    optimizer = getattr(est, "optimizer", "adamw")
    weights_dtype = getattr(est, "weights_dtype", "fp32")
    dtypes = getattr(est, "dtypes", None) or {}
    world = int(getattr(est, "world_size", 1) or 1)
    sharding = getattr(est, "sharding", "none")
    per_rank = ""
    if world > 1:
        per_rank = (f", per process of {world} (fsdp: split {world} ways)" if sharding == "fsdp"
                    else f", per process of {world} (DDP: a whole copy each)")
    objective = getattr(cfg, "objective", "lm")
    prompt = int(getattr(est, "prompt_tokens", 0) or 0)
    if objective == "grpo":
        objective = (f", grpo: {cfg.num_generations} completions per prompt, {cfg.micro_batch_size} per update "
                     f"forward, prompt {prompt or cfg.max_seq_len} + {cfg.max_new_tokens} new tokens")
    else:
        # a preference micro-batch is its pairs' chosen and rejected rows, in one forward
        objective = (f", {objective}: {2 * cfg.micro_batch_size} rows per forward (chosen + rejected)"
                     if objective != "lm" else "")
    title = (f"{cfg.model} {cfg.task}, {cfg.method}, {est.precision} ({weights_dtype} weights), {optimizer}, "
             f"micro batch {cfg.micro_batch_size} x accum "
             f"{cfg.grad_accum_steps}, seq {cfg.max_seq_len}"
             f"{', gradient checkpointing' if cfg.gradient_checkpointing else ''}{objective}{per_rank}")
    rows = [(name, attr) for name, attr in PART_ROWS[:-2]]
    rows[3:3] = [(name, attr) for name, attr in REFERENCE_ROWS if getattr(est, attr, 0.0)]
    rows += [(name, attr) for name, attr in ROLLOUT_ROWS if getattr(est, attr, 0.0)]
    rows += [(name, attr) for name, attr in RANK_ROWS if getattr(est, attr, 0.0)]
    rows.append(PART_ROWS[-2])
    return EstimateReport(
        title=title, total_params=est.total_params, trainable_params=est.trainable_params,
        parts=tuple((name, getattr(est, attr)) for name, attr in rows), total_gib=est.total_gib,
        peak_phase=est.peak_phase, device=est.device, device_total_gib=est.device_total_gib, fits=est.fits,
        notes=tuple(est.notes), advice=tuple(est.advice),
        dtypes=tuple(dtypes.get(name, "") if name in DTYPE_PARTS else "" for name, _ in rows),
        optimizer=optimizer, weights_dtype=weights_dtype,
        master_weights_gib=float(getattr(est, "master_weights_gib", 0.0) or 0.0), scale_line=scale_line(est),
        run_tensors_gib=float(getattr(est, "run_tensors_gib", 0.0) or 0.0) if str(est.device).startswith("cpu")
        else 0.0, tensors_peak_gib=float(getattr(est, "tensors_peak_gib", 0.0) or 0.0), phases_line=phases_line(est))


def phases_line(est: MemoryEstimate) -> str:
    """GRPO: the rollouts' tensor peak and the update's, and which is the step's ("" for other objectives)."""
    rollout, update = (float(getattr(est, name, 0.0) or 0.0) for name in ("rollout_peak_gib", "update_peak_gib"))
    if not (rollout and update):
        return ""
    which = "the rollouts'" if rollout > update else "the update's"
    return (f"grpo: the rollouts peak at {fmt_gib(rollout)} of tensors (sampling with the KV cache, no_grad), the "
            f"update at {fmt_gib(update)} (its activations); the step's peak is {which}")


def run_tensors_line(r: EstimateReport) -> str:
    """On the CPU, the figure a run's host_tensors_gib is to be compared with, and why it is below the peak (""
    elsewhere). Set beside the peak instead, a run's record reads low, the more so the larger the vocabulary (the
    loss backward's fp32 logit gradients are short-lived): the tracer's blind spot, not the estimate's error."""
    if not r.run_tensors_gib:
        return ""
    return (f"a CPU run records {fmt_gib(r.run_tensors_gib)} as host_tensors_gib (weights, optimizer state and "
            f"the tensors saved for backward), not the peak's {fmt_gib(r.tensors_peak_gib)} of tensors: its tracer "
            "sees no short-lived tensor and no gradient made during backward")


METHOD_NAMES = {"full": "full fine-tune", "lora": "LoRA", "qlora": "QLoRA"}


def scale_line(est: MemoryEstimate) -> str:
    """One line on how many processes this config needs under fsdp ("Qwen2.5-7B full fine-tune bf16: fits from
    4 x 80 GiB"); "" for an estimate that did not work it out."""
    if not hasattr(est, "min_world_size") or str(est.device).startswith("cpu"):
        return ""   # on the CPU the processes share one machine's memory: no count of them makes it fit
    cfg = est.config
    name = str(cfg.model).rstrip("/").rsplit("/", 1)[-1] or str(cfg.model)
    what = f"{name} {METHOD_NAMES.get(cfg.method, cfg.method)} {est.precision}"
    size = f"{est.device_total_gib:.0f} GiB" if est.device_total_gib >= 10 else fmt_gib(est.device_total_gib)
    n = est.min_world_size
    if n is not None:
        how = "" if n == 1 else " (sharding='fsdp')"
        return f"{what}: fits from {n} x {size}{how}"
    why = getattr(est, "fsdp_refused", "")
    if why:
        return f"{what}: fsdp cannot shard it ({why})"
    return f"{what}: does not fit on up to 512 x {size}, even with sharding='fsdp'"


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


# -- text ------------------------------------------------------------------------------------------------------
def estimate_text(est: MemoryEstimate) -> str:
    """The text table ``nbtrain estimate`` prints: the parts, the peak, the verdict and any advice."""
    r = estimate_report(est)
    lines = [f"memory estimate: {r.title}",
             f"  parameters: {r.total_params:,} ({r.trainable_params:,} trainable)", ""]
    rows = [*r.parts, (PART_ROWS[-1][0], r.total_gib)]
    width = max(len(name) for name, _ in rows)
    lines.append(f"  {'part':<{width}}  {'GiB':>9}  dtype")
    for (name, gib), dtype in zip(r.parts, r.dtypes or ("",) * len(r.parts)):
        lines.append(f"  {name:<{width}}  {gib:>9.2f}  {dtype}".rstrip())
    lines.append(f"  {'-' * width}  {'-' * 9}")
    lines.append(f"  {PART_ROWS[-1][0]:<{width}}  {r.total_gib:>9.2f}")
    lines.append("")
    if r.master_weights_gib:
        lines.append(f"  of the weights, {fmt_gib(r.master_weights_gib)} are the fp32 master copy the optimizer "
                     "updates (the forward reads autocast's casts of it)")
    lines.append(f"  total: the step's peak, at {r.peak_phase}; not the sum of the parts, since")
    lines.append("  gradients are created in backward as the activations are freed")
    if r.phases_line:
        lines += textwrap.wrap(r.phases_line, 108, initial_indent="  ", subsequent_indent="  ")
    if run_tensors_line(r):
        lines += textwrap.wrap(run_tensors_line(r), 108, initial_indent="  ", subsequent_indent="  ")
    lines.append(f"  {r.device}: {r.device_total_gib:.2f} GiB -> {'fits' if r.fits else 'DOES NOT FIT'}")
    if r.scale_line:
        lines.append(f"  {r.scale_line}")
    for n in r.notes:
        lines.append(f"  note: {n}")
    if r.advice:
        lines.append("")
        lines.append("  to make it fit (each step keeps the previous ones):")
        for k, a in enumerate(r.advice, 1):
            lines.append(f"  {k}. {a.description}: {a.total_gib:.2f} GiB{'  fits' if a.fits else ''}")
        last = r.advice[-1]
        sets = " ".join(f"--set {k}={v}" for k, v in last.change.items())
        world = int(getattr(last, "world_size", 1) or 1)
        lines.append(f"  {'use' if last.fits else 'closest'}: {sets}"
                     + (f" on {world} processes (torchrun --nproc_per_node {world})" if world > 1 else ""))
    return "\n".join(lines)


# -- HTML ------------------------------------------------------------------------------------------------------
def _esc(x: Any) -> str:
    return html.escape(str(x))


def _small(text: str, color: str = GREY) -> str:
    return f'<span style="color:{color};font-size:0.92em">{text}</span>'


def _share_text(frac: float) -> str:
    return f"({100 * frac:.1f}% of it)" if frac < 10 else f"({frac:,.0f}× what there is)"


def estimate_html(est: MemoryEstimate, device: str = "", *, details: bool = False) -> str:
    """The estimate as HTML: the total against the device's memory with a bar and the verdict, then the parts
    and the peak's phase on one line, and the first advice when it does not fit (the Panel's readout; ``device``
    is named beside the memory). ``details`` (a notebook's display): the config, the parts as a table, the
    notes and every step of the advice."""
    r = estimate_report(est)
    frac = r.share
    color = GREEN if r.fits else RED
    verdict = (f"<span style='color:{GREEN}'>✓ fits</span>" if r.fits
               else f"<span style='color:{RED}'>✗ does not fit</span>")
    bar = ""
    if frac is not None:
        pct = max(0.5, min(100.0, 100 * frac))
        bar = (f"<div style='display:inline-block;vertical-align:middle;width:160px;height:8px;background:#eee;"
               f"border-radius:4px;margin:0 8px'><div style='width:{pct:.1f}%;height:8px;background:{color};"
               f"border-radius:4px'></div></div>")
    where = f" ({_esc(device)})" if device else ""
    head = (f"<b>Memory</b> ≈ <b>{fmt_gib(r.total_gib)}</b> of {fmt_gib(r.device_total_gib)}{where}{bar}{verdict}"
            + (f" {_small(_share_text(frac))}" if frac is not None else ""))
    lines = [head]
    if details:
        lines.append(_small(_esc(f"{r.title}; {r.total_params:,} parameters ({r.trainable_params:,} trainable)")))
        dts = (*(r.dtypes or ("",) * len(r.parts)), "")
        rows = "".join(f"<tr><td>{name}</td><td style='text-align:right'>{gib:,.2f}</td><td>{_esc(dt)}</td></tr>"
                       for (name, gib), dt in zip((*r.parts, (PART_ROWS[-1][0], r.total_gib)), dts))
        lines.append(f"<table><tr><th>part</th><th>GiB</th><th>dtype</th></tr>{rows}</table>"
                     + _small(f"the total is the step's peak, during {_esc(r.peak_phase)}"
                              + (f"; the weights hold the fp32 master copy ({fmt_gib(r.master_weights_gib)})"
                                 if r.master_weights_gib else "")))
        if r.phases_line:
            lines.append(_small(_esc(r.phases_line)))
        if r.scale_line:
            lines.append(_esc(r.scale_line))
        if run_tensors_line(r):
            lines.append(_small(_esc(run_tensors_line(r))))
        lines += [_small(f"note: {_esc(n)}") for n in r.notes]
        if r.advice:
            items = "".join(f"<li>{_esc(a.description)}: {fmt_gib(a.total_gib)}{' (fits)' if a.fits else ''}</li>"
                            for a in r.advice)
            lines.append(f"<span style='color:{AMBER}'>to make it fit, in order (each keeps the previous ones):"
                         f"</span><ol>{items}</ol>")
        return "<div style='line-height:1.5'>" + "<br>".join(lines) + "</div>"
    parts = [f"{label} {fmt_gib(gib)}" + (f" ({r.weights_dtype})" if label == "weights" else
                                          f" ({r.optimizer})" if label == "optimizer" else "")
             for label, gib in r.parts if isinstance(gib, (int, float))]
    if r.peak_phase:
        parts.append(f"peak during {_esc(r.peak_phase)}")
    if parts:
        lines.append(_small(" · ".join(parts)))
    if not r.fits and r.advice:
        a = r.advice[0]
        change = ", ".join(f"{k}={v!r}" for k, v in a.change.items())
        lines.append(f"<span style='color:{AMBER}'>try <b>{_esc(change)}</b>: {_esc(a.description)}"
                     + (f" → {fmt_gib(a.total_gib)}" + (" (fits)" if a.fits else "")
                        if a.total_gib is not None else "") + "</span>")
    return "<div style='line-height:1.5'>" + "<br>".join(lines) + "</div>"
