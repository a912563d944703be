"""What the dashboard says in words: the live status line, the end-of-run summary, a run's notes and advice.

Pure functions of records, run info and results; no plotly, no widgets.
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Optional, Sequence

RATE_WINDOW = 20   # steps averaged for tokens/s and ETA in the status line
_MAX_ADVICE = 3    # the first few changes are the ones that matter; the rest stay in summary["advice"]


def _hms(seconds: float) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _batch_text(info: Any, micro_steps: Optional[int]) -> Optional[str]:
    cfg = getattr(info, "config", None)
    micro = getattr(cfg, "micro_batch_size", None)
    accum = getattr(cfg, "grad_accum_steps", None) or micro_steps
    if micro is None:
        return f"accum {accum}" if accum else None
    accum = accum or 1
    return f"micro {micro} × accum {accum} = {micro * accum}"


def _mfu_text(value: float) -> str:
    return f"MFU {100 * value:.{1 if value >= 0.01 else 2}f}%"


def reward_text(record: Any, prefix: str = "") -> Optional[str]:
    """A preference step's reward margin and accuracy in a few words ("margin 0.412 · accuracy 75%", ``prefix``
    before the first; a non-finite value as it is, "margin nan"); None for a record without rewards
    (objective="lm")."""
    margin, acc = getattr(record, "reward_margin", None), getattr(record, "reward_accuracy", None)
    if margin is None and acc is None:
        return None
    parts = []
    if margin is not None:
        parts.append(f"{prefix}margin {margin:.3g}" if math.isfinite(margin) else f"{prefix}margin {margin}")
    if acc is not None:
        word = "accuracy" if parts else f"{prefix}accuracy"   # the prefix once: "reward margin 0.41 · accuracy 75%"
        parts.append(f"{word} {acc:.0%}" if math.isfinite(acc) else f"{word} {acc}")
    return " · ".join(parts)


def _short(value: float, fmt: str) -> str:
    return format(value, fmt) if math.isfinite(value) else str(value)


def grpo_text(record: Any, prefix: str = "") -> Optional[str]:
    """A GRPO step's reward mean (± its std over the completions) and its sampler/trainer mismatch, in a few words
    ("reward 0.412 ± 0.13 · mismatch 0.0021 nats/token", ``prefix`` before the first; a non-finite value as it is);
    None for a record without them (every other objective)."""
    mean, std = getattr(record, "reward_mean", None), getattr(record, "reward_std", None)
    mismatch = getattr(record, "mismatch_mean", None)
    if mean is None and mismatch is None:
        return None
    parts = []
    if mean is not None:
        parts.append(f"{prefix}reward {_short(mean, '.3g')}" + (f" ± {_short(std, '.2g')}" if std is not None else ""))
    if mismatch is not None:
        word = "mismatch" if parts else f"{prefix}mismatch"
        parts.append(f"{word} {_short(mismatch, '.2g')} nats/token")
    return " · ".join(parts)


def status_line(records: list, info: Any = None, total_steps: Optional[int] = None,
                run: Optional[str] = None) -> str:
    """One line: step/total, tokens/s, elapsed, ETA, precision, micro × accum = effective batch, method, the
    latest loss (and a preference objective's latest reward margin and accuracy, or GRPO's reward and mismatch)."""
    last = records[-1] if records else None
    total = total_steps or getattr(info, "total_steps", None)
    parts = []
    if run and run != "run":
        parts.append(run)
    step = last.step if last is not None else 0
    parts.append(f"step {step}/{total}" if total else f"step {step}")
    recent = records[-RATE_WINDOW:]
    dts = [r.step_time_s for r in recent if r.step_time_s and math.isfinite(r.step_time_s)]
    dt = sum(dts)
    if recent:
        toks = sum((r.tokens_per_s or 0) * (r.step_time_s or 0) for r in recent
                   if r.tokens_per_s is not None and math.isfinite(r.tokens_per_s)
                   and r.step_time_s is not None and math.isfinite(r.step_time_s))
        if toks > 0 and dt > 0:
            parts.append(f"{toks / dt:,.0f} tok/s" + _timing_text(info))
            flops, peak = getattr(info, "model_flops_per_token", None), getattr(info, "peak_tflops", None)
            if flops and peak:   # model FLOPs per second over the devices' peak (summary["mfu"] at the end)
                parts.append(_mfu_text(flops * toks / dt / (peak * 1e12)))
        elif dts:
            parts.append(f"{dt / len(dts):.2f} s/step")
    if last is not None:
        parts.append(f"elapsed {_hms(last.elapsed_s)}")
        if total and dts:
            parts.append(f"ETA {_hms(max(0, total - step) * dt / len(dts))}")
    if info is not None:
        prec = str(getattr(info, "precision_used", "") or "")
        if prec:
            parts.append(prec + (" + GradScaler" if getattr(info, "scaler_enabled", False) else ""))
    batch = _batch_text(info, last.micro_steps if last is not None else None)
    if batch:
        parts.append(batch)
    method = getattr(getattr(info, "config", None), "method", None)
    if method:
        parts.append(str(method))
    if last is not None and not math.isfinite(last.loss if last.loss is not None else math.nan):
        parts.append(f"loss {last.loss}")
    elif last is not None:
        parts.append(f"loss {last.loss:.4g}")
    rewards = reward_text(last, "reward ") if last is not None else None
    if rewards:
        parts.append(rewards)
    grpo = grpo_text(last) if last is not None else None
    if grpo:
        parts.append(grpo)
    return " · ".join(parts)


def _timing_text(info: Any) -> str:
    """In a comparison, which of its runs this one is, beside its tok/s: " (repeat 1 of 1, timed from step 2)",
    " (drawn live, untimed: ...)"; "" outside one."""
    timing = getattr(info, "timing", None)
    return f" ({timing})" if timing else ""


def summary_text(records: list, evals: list, info: Any = None, result: Any = None,
                 run: Optional[str] = None) -> str:
    """The end-of-run line left in the output next to the static figure."""
    summ = getattr(result, "summary", None) or {}
    n = len(records)
    head = f"{run}: " if run and run != "run" else ""
    if not n:
        return head + "no steps recorded" + (f" ({summ['stopped_reason']})" if summ.get("stopped_reason") else "")
    last = records[-1]
    losses = [r.loss for r in records if r.loss is not None and math.isfinite(r.loss)]
    parts = [f"{head}{last.step} steps in {_hms(last.elapsed_s)}"]
    if losses:
        parts.append(f"final loss {losses[-1]:.4g}")
    if evals:
        parts.append(f"eval loss {evals[-1].eval_loss:.4g}")
    rewards = reward_text(last, "final reward ")
    if rewards:
        parts.append(rewards)
    grpo = grpo_text(last, "final ")
    if grpo:
        parts.append(grpo)
    skipped = sum(bool(r.skipped) for r in records)
    nonfin = sum(bool(r.nonfinite) or not math.isfinite(r.loss if r.loss is not None else math.nan)
                 for r in records)
    parts.append(f"{skipped} skipped")
    parts.append(f"{nonfin} non-finite")
    peaks = [r.vram_peak_gib for r in records if r.vram_peak_gib is not None]
    tensors = [v for r in records if (v := getattr(r, "host_tensors_gib", None)) is not None]
    if peaks:
        parts.append(f"peak VRAM {max(peaks):.2f} GiB")
    elif tensors:   # the run's own memory; RSS counts the whole process
        parts.append(f"peak run tensors {max(tensors):.3g} GiB")
    else:
        rss = [r.host_rss_gib for r in records if r.host_rss_gib is not None]
        if rss:
            parts.append(f"host RSS {max(rss):.2f} GiB")
    tps = summ.get("tokens_per_s")
    if tps is None:
        tt = sum((r.tokens_per_s or 0) * (r.step_time_s or 0) for r in records
                 if r.tokens_per_s is not None and math.isfinite(r.tokens_per_s))
        st = sum(r.step_time_s or 0 for r in records)
        tps = tt / st if st > 0 and tt > 0 else None
    if tps:
        parts.append(f"{tps:,.0f} tok/s" + _timing_text(info))
    run_mfu = summ.get("mfu")
    if run_mfu is not None and math.isfinite(run_mfu):   # model FLOPs over the device's peak (engine.flops)
        parts.append(_mfu_text(run_mfu))
    if info is not None and getattr(info, "precision_used", None):
        parts.append(str(info.precision_used))
    if summ.get("stopped_reason"):
        parts.append(f"stopped: {summ['stopped_reason']}")
    return " · ".join(parts)


def figure_title(infos: dict, limit: int = 90) -> str:
    """One short line naming the runs of a figure, with their precisions (``{run name: RunInfo}``)."""
    labels = []
    for name, info in infos.items():
        prec = str(getattr(info, "precision_used", "") or "")
        if prec and getattr(info, "scaler_enabled", False):
            prec += " + GradScaler"
        if name == "run" or name == getattr(info, "precision_used", None):
            labels.append(prec or name)
        else:
            labels.append(f"{name} ({prec})" if prec else name)
    text = " · ".join(labels)
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def run_notes(result: Any) -> tuple[list[str], list[str]]:
    """``(notes, advice)`` of a finished run: the engine's ``summary["notes"]`` and, after an out-of-memory
    stop, the first few changes of ``summary["advice"]`` (with a pointer to the rest)."""
    summ = getattr(result, "summary", None) or {}
    notes = [str(n) for n in (summ.get("notes") or [])]
    advice = [str(a) for a in (summ.get("advice") or [])]
    if len(advice) > _MAX_ADVICE:
        advice = advice[:_MAX_ADVICE] + [f"… {len(advice) - _MAX_ADVICE} more in result.summary['advice']"]
    return notes, advice


def said_once(notes: Mapping[str, Sequence[str]], ran: Sequence[str],
              word: str = "variants") -> tuple[list[str], dict[str, list[str]]]:
    """``(lines, rest)``: each note that every run in ``ran`` (two or more) has, as one line "all variants: …" ("all
    variants that ran: …" when a variant in ``notes`` lacks it), and name -> that variant's other notes. For any view
    that lists notes per variant (the comparison's notes, a dashboard's end-of-run summaries)."""
    ran = [n for n in ran if n in notes]
    shared = [n for n in notes[ran[0]] if all(n in notes[m] for m in ran[1:])] if len(ran) > 1 else []
    lines = [f"all {word}{'' if all(n in v for v in notes.values()) else ' that ran'}: {n}"
             for n in shared]
    return lines, {name: [n for n in v if n not in shared] for name, v in notes.items()}


def notes_text(result: Any, indent: str = "  ", notes: Optional[Sequence[str]] = None) -> str:
    """The run's notes (``notes`` instead, when given) and advice as indented plain-text lines ("" when none)."""
    own, advice = run_notes(result)
    notes = own if notes is None else notes
    lines = [f"{indent}note: {n}" for n in notes]
    if advice:
        lines.append(f"{indent}to fit in memory, try:")
        lines += [f"{indent}  - {a}" for a in advice]
    return "\n".join(lines)


def notes_html(result: Any, notes: Optional[Sequence[str]] = None) -> str:
    """The run's notes (``notes`` instead, when given) and advice as a short HTML list ("" when none)."""
    own, advice = run_notes(result)
    notes = own if notes is None else notes
    if not notes and not advice:
        return ""
    items = [f"<li>{html.escape(n)}</li>" for n in notes]
    if advice:
        items.append("<li><span style='color:#ef6c00'>to fit in memory, try:</span><ul style='margin:0;"
                     "padding-left:18px'>" + "".join(f"<li>{html.escape(a)}</li>" for a in advice)
                     + "</ul></li>")
    return ("<ul style='margin:2px 0;padding-left:18px;color:#555;font-size:0.92em'>"
            + "".join(items) + "</ul>")


def samples_html(table: Any, title: str = "samples") -> str:
    """The answers of a side-by-side table (``engine.sampling.side_by_side``: prompt rows x run columns) as a
    small HTML table, each column headed by its run and step; "" when it is empty."""
    if table is None or not len(table.columns) or not len(table.index):
        return ""
    steps = table.attrs.get("steps", {})
    same = len(set(steps.values())) == 1
    heads = "".join(f"<th style='text-align:left;padding:2px 8px'>{html.escape(str(c))}"
                    + ("" if same or c not in steps else f" <span style='color:#777'>(step {steps[c]})</span>")
                    + "</th>" for c in table.columns)
    rows = []
    for prompt, answers in table.iterrows():
        cells = "".join("<td style='text-align:left;vertical-align:top;padding:2px 8px;white-space:pre-wrap'>"
                        + ("<span style='color:#999'>—</span>" if not isinstance(a, str)
                           else html.escape(a) if a else "<i style='color:#999'>(empty)</i>") + "</td>"
                        for a in answers)
        rows.append(f"<tr><th style='text-align:left;vertical-align:top;padding:2px 8px;font-weight:600'>"
                    f"{html.escape(str(prompt))}</th>{cells}</tr>")
    when = f" at step {next(iter(steps.values()))}" if same and steps else ""
    return (f"<div class='nbt-samples' style='font-size:12px;margin:6px 0'><b>{html.escape(title)}{when}</b>"
            f"<table style='border-collapse:collapse;margin-top:2px'><thead><tr>"
            f"<th style='text-align:left;padding:2px 8px'>prompt</th>{heads}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def samples_text(records: list) -> str:
    """Sample records as plain lines for a terminal: ``step N · prompt -> answer``."""
    return "\n".join(f"step {r.step}" + (f" [{r.variant}]" if getattr(r, "variant", None) else "")
                     + f" · {r.prompt!r} -> {r.answer!r}" for r in records)
