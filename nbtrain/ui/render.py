"""The panel's HTML: status, result and error lines, notes, and the info lines under the fields.
Pure functions from values to strings; no widgets, no state. (The memory readout is
:func:`nbtrain.memory.estimate_html`.)"""

from __future__ import annotations

import html
import math
from typing import Any, Optional

RED, AMBER, GREEN, GREY = "#c62828", "#ef6c00", "#2e7d32", "#666"
INVALID_BORDER = f"1px solid {RED}"


def esc(x: Any) -> str:
    return html.escape(str(x))


def small(text: str, color: str = GREY) -> str:
    return f'<span style="color:{color};font-size:0.92em">{text}</span>'


def status_html(text: str, color: str) -> str:
    return f'<span style="color:{color}">{text}</span>'


def header_html(caps, precision: str = "auto") -> str:
    """The panel's first line: the device and the precision the Precision field holds ("auto → bf16": what auto
    resolves to here)."""
    chosen = f"auto → {esc(caps.auto_precision)}" if precision == "auto" else esc(precision)
    device_line = f"· {esc(caps.device)}: {esc(caps.name)} · {caps.total_memory_gib:.1f} GiB · precision {chosen}"
    return f"<b>nbtrain</b> {small(device_line)}"


def errors_html(errors: list[dict], where: dict[str, str]) -> str:
    """The error box: one line per error, ``where`` maps a field to its tab; "" when there are none."""
    if not errors:
        return ""
    lines = []
    for e in errors:
        field = e.get("field") or "config"
        place = f"{where[field]} › " if field in where else ""
        lines.append(f"⚠ {esc(place)}<b>{esc(field)}</b>: {esc(e.get('message', 'invalid'))}")
    return (f'<div style="color:{RED};border-left:3px solid {RED};padding:2px 8px">'
            + "<br>".join(lines) + "</div>")


# -- info lines under the fields ------------------------------------------------------------------
def precision_info_html(caps, chosen: str, hints: dict[str, str], precisions) -> str:
    """Every precision with its hint, or why this device cannot run it; the chosen one highlighted."""
    lines = []
    for p in ("auto", *precisions):
        why = caps.reasons.get(p)
        if why:
            line = f"<b>{p}</b>: <span style='color:{RED}'>unavailable</span> — {esc(why)}"
        else:
            if p == "auto":
                line = (f"<b>{p}</b>: {esc(hints[p])} → <b>{esc(caps.auto_precision)}</b> "
                        f"on this {esc(caps.device)}")
            else:
                line = f"<b>{p}</b>: {esc(hints[p])}"
            if p in caps.notes:
                line += f" {small('(' + esc(caps.notes[p]) + ')', AMBER)}"
        if p == chosen:
            line = f"<span style='background:#e3f2fd'>▶ {line}</span>"
        lines.append(line)
    return "<div style='line-height:1.6'>" + "<br>".join(lines) + "</div>"


def optimizer_info_html(caps, chosen: str, hints: dict[str, str], optimizers) -> str:
    """Every optimizer with its hint, or why this device cannot run it; the chosen one highlighted (the precision
    line's form)."""
    notes = getattr(caps, "notes", {}) or {}
    lines = []
    for o in optimizers:
        why = caps.reasons.get(o)
        if why:
            line = f"<b>{esc(o)}</b>: <span style='color:{RED}'>unavailable</span> — {esc(why)}"
        else:
            line = f"<b>{esc(o)}</b>: {esc(hints.get(o, ''))}"
            if o in notes:
                line += f" {small('(' + esc(notes[o]) + ')', AMBER)}"
        if o == chosen:
            line = f"<span style='background:#e3f2fd'>▶ {line}</span>"
        lines.append(line)
    return "<div style='line-height:1.6'>" + "<br>".join(lines) + "</div>"


def accumulation_info_html(micro: int, accum: int, seq: int, task: str, packing: bool,
                           steps: Optional[int]) -> str:
    eff = micro * accum
    tokens = eff * seq
    if task == "sequence-classification":
        tok_note = "input tokens (up to); the loss counts one target per example"
    elif packing:
        tok_note = "tokens, exactly (packing fills every row)"
    else:
        tok_note = "tokens at most (fewer when texts are shorter than max_seq_len)"
    seen = f" · {steps:,} steps see {steps * eff:,} examples" if steps else ""
    return (f"effective batch <b>{micro} × {accum} = {eff:,}</b> examples per optimizer step · "
            f"<b>{eff:,} × {seq:,} = {tokens:,}</b> {tok_note}{esc(seen)}<br>"
            + small("same effective batch, smaller micro batch: less activation memory, same loss "
                    "(token-weighted), more time per step"))


def method_info_html(method: str, hint: str, why: Optional[str]) -> str:
    if why:
        return small(f"<b>{esc(method)}</b>: unavailable — {esc(why)}", RED)
    return small(esc(hint))


# -- results ------------------------------------------------------------------------------------
def processes_info_html(caps, processes: int, sharding: str, reshard: bool, problem: str = "") -> str:
    """What a Train does with ``processes`` and ``sharding``: in this kernel, or launched with torchrun, DDP or
    FSDP2, on which devices; ``problem`` (e.g. more processes than GPUs) in red."""
    if processes <= 1:
        text = "one process: Train runs in this kernel (a background thread)"
        if sharding == "fsdp":
            text += (f" · <span style='color:{AMBER}'>sharding fsdp with one process: nothing to shard, it runs as "
                     "none; set processes to 2 or more</span>")
        return small(text)
    where = (f"one GPU each ({caps.device}: {esc(caps.name)})" if caps.device == "cuda"
             else "CPU processes (gloo), sharing this machine's cores and memory")
    how = (f"FSDP2: weights, gradients and optimizer state split {processes} ways"
           + (", layers gathered again in backward" if reshard else ", layers kept gathered from forward to backward")
           if sharding == "fsdp" else "DDP: every process holds the whole model; gradients are all-reduced")
    text = (f"Train launches <b>{processes} processes</b> with torchrun ({where}) · {how} · each micro-batch is "
            "split over them · the live view follows rank 0 · the trained model is saved by rank 0 to "
            "output_dir/model (result.model is None here) · Compare runs in this kernel: set processes to 1 for it")
    return small(text) + (f"<br>{small(esc(problem), RED)}" if problem else "")


def _stopped_reason(result) -> Optional[str]:
    return (getattr(result, "summary", None) or {}).get("stopped_reason")


def status_color(result) -> str:
    reason = _stopped_reason(result)
    if reason in ("max_steps", "epochs"):
        return GREEN
    return AMBER if reason in ("stopped", "interrupted") else RED


def result_line(result) -> str:
    """The status line of a finished Train: how it ended, steps, losses, speed, precision."""
    s = getattr(result, "summary", None) or {}
    reason = _stopped_reason(result)
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
    return esc(f"{head} — " + " · ".join(bits) + (f" ({reason})" if reason in ("max_steps", "epochs") else ""))


def notes_block(runs: list) -> str:
    """The notes and out-of-memory advice of ``(name, TrainResult)`` pairs, as short lists; "" when none."""
    from ..viz.text import notes_html

    parts = []
    for name, result in runs:
        body = notes_html(result)
        if body:
            parts.append((f"<b>{esc(name)}</b>" if name else "") + body)
    return "<div style='margin-top:2px'>" + "".join(parts) + "</div>" if parts else ""


def comparison_line(cmp) -> str:
    """The status line of a finished Compare: how it ended and, unless every variant finished, what became
    of each ("stopped — finished: fp32; cut at step 3: fp16; not run: bf16")."""
    if not cmp.stopped and len(cmp.finished) == len(cmp.completion):
        return esc(f"done — compared {', '.join(cmp.finished)}")
    groups: dict[str, list[str]] = {}
    for name in cmp.completion:
        groups.setdefault(cmp.ended(name) or "finished", []).append(name)
    return esc(f"{cmp.stopped or 'done'} — " + "; ".join(f"{how}: {', '.join(names)}"
                                                       for how, names in groups.items()))


def comparison_color(cmp) -> str:
    """Green when every variant finished, red when none has anything to show, amber in between."""
    if not cmp.stopped and len(cmp.finished) == len(cmp.completion):
        return GREEN
    return AMBER if cmp.results or cmp.stopped else RED

