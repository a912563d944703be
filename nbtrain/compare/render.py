"""How a ComparisonResult reads: the compact table, the notes under it, the verdict lines, the HTML summary and
report, the plain-text table, the figures, and environment().

``ComparisonViews`` is a mixin of ComparisonResult (result.py): its methods read the result's attributes
(``table``, ``results``, ``verdicts``, ``notes``, ``completion``, ...) and compute nothing that the result does
not already hold. Plotting is imported only inside the methods that draw (DESIGN rule 1).
"""

from __future__ import annotations

import html
import math
import platform
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from .. import verdicts as _verdicts
from .._version import __version__
from ..hardware import capabilities
from ..viz.text import said_once

_TEXT_COLUMNS = ("variant", "status", "precision_used", "micro_batch", "grad_accum", "method", "optimizer",
                 "weights_dtype", "steps", "order", "wall_s", "tokens_per_s", "speedup", "mfu",
                 "peak_vram_gib", "peak_host_rss_gib", "peak_host_tensors_gib", "est_weights_gib",
                 "est_master_weights_gib", "est_gradients_gib", "est_optimizer_gib", "est_total_gib", "final_loss",
                 "eval_loss", "eval_perplexity", "eval_accuracy", "reward_margin", "reward_accuracy",
                 "max_abs_loss_diff", "skipped_steps", "nonfinite_steps", "min_scale", "lost_updates",
                 "logprob_mismatch", "sampler_mismatch", "fair")
# Columns the text view shows only where the variants differ in them (a setting they all share says nothing).
_TEXT_IF_DIFFERENT = ("micro_batch", "grad_accum", "method", "optimizer", "weights_dtype", "est_weights_gib",
                      "est_master_weights_gib", "est_gradients_gib", "est_optimizer_gib", "est_total_gib")
MISSING = "—"   # the one marker for "no value" in the HTML views


def _fmt_scale(v: float) -> str:
    # A loss scale is a power of two: 65,536 reads at a glance, 6.554e+04 does not.
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"


def _fmt_diff(v: float) -> str:
    """A loss difference: fixed decimals when it is visible at 3 decimals, else 2 significant digits."""
    if v == 0:
        return "0"
    return f"{v:.3f}" if v >= 0.01 else f"{v:.1e}"


def _fmt_mismatch(v: float) -> str:
    """A log-prob mismatch in nats per token: 4 decimals, or 2 significant digits below 0.001 (fp16's 3e-05 is not
    fp32's 0)."""
    if v == 0:
        return "0"
    return f"{v:.4f}" if abs(v) >= 1e-3 else f"{v:.1e}"


def _present(table: pd.DataFrame, key: str) -> bool:
    """Whether a compact column of _COMPACT_IF_PRESENT has something to show in ``table``."""
    if key == "reward":   # a preference comparison's table has the column, NaN rewards and all
        return "reward_margin" in table.columns
    return key in table.columns and bool(table[key].notna().any())


def _cell(v, fmt) -> str:
    return fmt(v) if v is not None and not pd.isna(v) and math.isfinite(v) else MISSING


def _loss_cell(v) -> str:
    # A run's non-finite loss is a result ("nan"), not a missing value: never hide it.
    if v is None:
        return MISSING
    return f"{v:.4f}" if math.isfinite(v) else str(float(v))


def _fmt_gib(v: float) -> str:
    """GiB to 3 significant digits without an exponent (0.0832, 1.74, 12.3, 123)."""
    if v <= 0:
        return "0"
    decimals = min(6, max(0, 2 - math.floor(math.log10(v))))
    return f"{v:.{decimals}f}"


_FORMATS = {"wall_s": "{:.1f}", "wall_s_spread": "{:.1f}", "tokens_per_s": "{:,.0f}", "mfu": "{:.2%}",
            "tokens_per_s_spread": "{:,.0f}", "speedup": "{:.2f}x", "speedup_low": "{:.2f}x",
            "speedup_high": "{:.2f}x", "speedup_spread": "{:.2f}",
            "noise_floor": _verdicts.half_width_text, "peak_vram_gib": _fmt_gib,
            "peak_host_rss_gib": _fmt_gib, "peak_host_tensors_gib": _fmt_gib, "final_loss": "{:.4f}",
            "eval_loss": "{:.4f}", "eval_perplexity": "{:.1f}", "eval_accuracy": "{:.3f}",
            "max_abs_loss_diff": "{:.2e}", "max_rel_loss_diff": "{:.2e}", "min_scale": _fmt_scale,
            "lost_updates": "{:.1%}", "est_weights_gib": _fmt_gib, "est_master_weights_gib": _fmt_gib,
            "est_gradients_gib": _fmt_gib, "est_optimizer_gib": _fmt_gib, "est_activations_gib": _fmt_gib,
            "est_logits_gib": _fmt_gib, "est_total_gib": _fmt_gib, "reward_margin": "{:.4f}",
            "reward_accuracy": "{:.3f}", "logprob_mismatch": _fmt_mismatch, "sampler_mismatch": _fmt_mismatch}

# The compact view: its columns and their headers, split in two lines where a header is longer than the values
# under it, so that every column stays narrow and ten of them fit a 968 px notebook output.
_COMPACT_HEADERS = {"variant": ("Variant",), "precision": ("Precision",),
                    "tokens_per_s": ("Tokens/s", "(speed-up)"), "memory": ("Peak memory", "(GiB)"), "final_loss": ("Final", "loss"), "eval": ("Eval", "loss"),
                    "loss_diff": ("Max |Δ loss|", "vs reference"), "skipped": ("Skipped /", "non-finite"),
                    "min_scale": ("Min", "scale"), "fair": ("Fair",)}
# Shown after the precision only where the variants differ in them: which optimizer, and the dtype the trainable
# weights are stored in (fp32 with a master copy under autocast; bf16 under bf16-pure).
_COMPACT_IF_DIFFERENT = {"optimizer": ("Optimizer",), "weights_dtype": ("Weights",)}
# Shown where a variant has a value in them (a preference comparison): the last step's reward margin with its
# accuracy after the eval column, and the log-prob mismatch of the run's dtype after the loss difference.
_COMPACT_IF_PRESENT = {"eval": {"reward": ("Reward margin", "(accuracy)")},
                       "loss_diff": {"logprob_mismatch": ("Log-prob", "mismatch"),
                                     "sampler_mismatch": ("Sampler/trainer", "mismatch")}}
_MEMORY_NOTES = {
    "vram": "accelerator memory the run allocated (its peak)",
    "tensors": "what the run's own tensors took at their peak (the process's resident memory, which grows "
               "with every run in this kernel, is in the full table)",
    "rss": "resident memory of the whole process at its peak: it includes what earlier runs in this kernel "
           "left behind, so later variants look bigger",
}


class ComparisonViews:
    """The views of a ComparisonResult (a mixin: ComparisonResult holds the data, this draws and formats it)."""

    def figure(self, smoothing: float = 0.9):
        """Overlaid loss, grad norm, loss scale and memory per variant (and a preference objective's reward margin
        and accuracy), each variant's exact per-step loss difference to the reference (eval differences as markers)
        over the seed-noise band, and bars of throughput (with the repeats' range) and peak memory (a plotly
        Figure)."""
        from ..viz.figures import compare_figure

        not_run = {r.variant: r.notes for r in self.table.itertuples() if r.variant not in self.results}
        return compare_figure(
            {n: r.history for n, r in self.results.items()}, reference=self.reference,
            summaries=self.summaries(), eval_histories={n: r.eval_history for n, r in self.results.items()},
            infos={n: r.info for n, r in self.results.items()}, not_run=not_run, smoothing=smoothing,
            band=self.band, throughput_range=self._throughput_range())

    def difference_figure(self):
        """The difference panel alone: each variant's loss minus the reference's per step, eval differences
        as markers, over the seed-noise band (a small plotly Figure, shown by the Panel after a Compare)."""
        from ..viz.figures import difference_figure

        return difference_figure({n: r.history for n, r in self.results.items()}, reference=self.reference,
                                 eval_histories={n: r.eval_history for n, r in self.results.items()},
                                 band=self.band)


    def _speed(self, variant: str):
        """``variant``'s speed against the reference (verdicts.Speed, as its verdict judged it), or None."""
        v = self.verdicts.get(variant)
        return v.speed if v is not None else None

    def _eval_column(self) -> str:
        # Classification is judged by accuracy; a comparison with any causal LM keeps the loss.
        return ("eval_accuracy" if "eval_accuracy" in self.table.columns
                and "eval_perplexity" not in self.table.columns else "eval_loss")

    @staticmethod
    def _memory(r) -> tuple[float, str]:
        """The peak memory a row is compared on and where it comes from ("vram", "tensors" or "rss")."""
        if r.device == "cuda":
            return r.peak_vram_gib, "vram"
        if math.isfinite(r.peak_host_tensors_gib):
            return r.peak_host_tensors_gib, "tensors"
        return r.peak_host_rss_gib, "rss"

    def _compact_rows(self) -> list[tuple[str, str, dict[str, str]]]:
        """``(variant, status words, {compact column: display string})`` per row."""
        eval_col = self._eval_column()
        rows = []
        for r in self.table.itertuples(index=False):
            ran = r.variant in self.results
            s = self.results[r.variant].summary if ran else {}

            tps = _cell(r.tokens_per_s, lambda v: f"{v:,.0f}")
            if tps != MISSING and r.variant == self.reference:
                tps += " (ref)"
            elif tps != MISSING and self._speed(r.variant) is not None:
                # The repeats' range first, then their median: a spread wider than the value cannot hide in a ±.
                tps += f" ({_verdicts.speed_span(self._speed(r.variant))})"
            mem, _ = self._memory(r)
            diff = ("ref" if ran and r.variant == self.reference
                    else _cell(r.max_abs_loss_diff, _fmt_diff) if ran else MISSING)
            cells = {
                "variant": r.variant,
                "precision": str(r.precision_used),
                "optimizer": MISSING if pd.isna(r.optimizer) else str(r.optimizer),
                "weights_dtype": MISSING if pd.isna(r.weights_dtype) else str(r.weights_dtype),
                "tokens_per_s": tps,
                "memory": _cell(mem, _fmt_gib),
                "final_loss": _loss_cell(s.get("final_loss")),
                "eval": (_cell(getattr(r, eval_col), lambda v: f"{v:.1%}") if eval_col == "eval_accuracy"
                         else _loss_cell(s.get("eval_loss"))),
                "loss_diff": diff,
                "skipped": f"{int(r.skipped_steps)} / {int(r.nonfinite_steps)}" if ran else MISSING,
                "min_scale": _cell(r.min_scale, _fmt_scale),
                "fair": MISSING if pd.isna(r.fair) else ("✓" if r.fair else "✗"),
                "reward": self._reward_cell(r, self.results[r.variant]) if ran else MISSING,
                "logprob_mismatch": _cell(getattr(r, "logprob_mismatch", None), _fmt_mismatch),
                "sampler_mismatch": _cell(getattr(r, "sampler_mismatch", None), _fmt_mismatch),
            }
            rows.append((r.variant, self.ended(r.variant), cells))
        return rows

    @staticmethod
    def _reward_cell(r, result) -> str:
        """The last step's reward margin and, in brackets, its accuracy ("0.4123 (75%)"), as the table holds them;
        a preference run's non-finite margin as it is ("nan"), never hidden; "—" for a run without rewards."""
        objective = getattr(getattr(result, "config", None), "objective", None)
        margin, acc = getattr(r, "reward_margin", math.nan), getattr(r, "reward_accuracy", math.nan)
        if objective in (None, "lm") and pd.isna(margin):
            return MISSING
        text = f"{margin:.4f}" if math.isfinite(margin) else str(float(margin))
        return text + (f" ({acc:.0%})" if math.isfinite(acc) else f" ({float(acc)})")

    def _compact_headers(self) -> dict[str, tuple[str, ...]]:
        heads = {}
        for key, lines in _COMPACT_HEADERS.items():
            heads[key] = lines
            if key == "precision":
                heads.update({k: v for k, v in _COMPACT_IF_DIFFERENT.items()
                              if k in self.table.columns and self.table[k].nunique(dropna=True) > 1})
            heads.update({k: v for k, v in _COMPACT_IF_PRESENT.get(key, {}).items() if _present(self.table, k)})
        if self._eval_column() == "eval_accuracy":
            heads["eval"] = ("Eval", "accuracy")
        return heads

    def compact_table(self) -> pd.DataFrame:
        """The table a person reads at a glance: ten columns of display strings, human headers, "—" where
        there is no value (and the optimizer and the weights' dtype after the precision where the variants differ
        in them). The variant's cell says how a run that did not finish ended. Every column and
        the raw numbers stay in ``table``; the notes are in ``notes``."""
        heads = self._compact_headers()
        data = []
        for name, status, cells in self._compact_rows():
            cells = {**cells, "variant": f"{name} ({status})" if status else name}
            data.append({" ".join(lines): cells[k] for k, lines in heads.items()})
        return pd.DataFrame(data, columns=[" ".join(h) for h in heads.values()])

    def _compact_html(self) -> str:
        # Inline styles: they hold in a widget, in JupyterLab's sanitised output and in a saved file alike.
        # Cells never wrap, headers break only at their <br>: each column is as wide as its longest line.
        def style(key: str, head: bool = False) -> str:
            align = "left" if key == "variant" else "right"
            rule = "vertical-align:bottom;border-bottom:1px solid #888;" if head else ""
            return f"padding:2px 8px;white-space:nowrap;text-align:{align};{rule}"

        heads = self._compact_headers()
        head = "".join(f'<th style="{style(k, head=True)}">{"<br>".join(html.escape(x) for x in lines)}</th>'
                       for k, lines in heads.items())
        body = []
        for _variant, status, cells in self._compact_rows():
            tds = []
            for k in heads:
                text = html.escape(cells[k])
                if k == "variant":
                    text = f"<b>{text}</b>" + (f'<br><span style="color:#b45309;font-size:11px">'
                                               f"{html.escape(status)}</span>" if status else "")
                tds.append(f'<td style="{style(k)}">{text}</td>')
            body.append('<tr style="border-bottom:1px solid #e4e4e4">' + "".join(tds) + "</tr>")
        return ('<table class="nbt-compare-table" style="border-collapse:collapse;table-layout:auto;width:auto;'
                'font-size:12px;margin:2px 0">'
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")

    def _general_notes(self) -> list[str]:
        """What holds for the whole table: the reference, what the memory column measures, repeats."""
        lines = []
        if self.results:
            if self.reference != self.requested_reference:
                why = f"the first variant that ran ({self.requested_reference!r} did not)"
            else:
                why = "the first variant" if self.reference == self.variants[0] else "as reference= asked"
            lines.append(f"speed-up and loss difference are relative to {self.reference!r}, {why}")
            sources = {self._memory(r)[1] for r in self.table.itertuples(index=False) if r.variant in self.results}
            lines += [f"peak memory: {_MEMORY_NOTES[src]}" for src in ("vram", "tensors", "rss") if src in sources]
        if self.repeats > 1:
            lines.append(f"tokens/s: median of {self.repeats} interleaved repeats, the order rotated each repeat "
                         f"(the table's order column); speed-up: the range of the per-repeat ratios to "
                         f"{self.reference!r}, then their median")
        lines += self._ratio_lines()
        lines += self._floor_lines()
        lines += self._seed_lines()
        if self.stopped:
            done = ", ".join(self.finished) or "none"
            lines.append(f"the comparison was {self.stopped}; finished: {done}")
        return lines

    def _ratio_lines(self) -> list[str]:
        """Per variant whose median per-repeat ratio (the speed-up shown) and the ratio of the two median tokens/s
        (the Tokens/s column) differ at the printed two decimals: which one the table shows, and why."""
        lines = []
        rows = self.table.set_index("variant")
        if self.reference not in rows.index:
            return lines
        ref_tps = rows.loc[self.reference, "tokens_per_s"]
        for name in self.variants:
            sp = self._speed(name)
            if name == self.reference or sp is None or sp.n < 2 or not ref_tps > 0:
                continue
            of_medians = rows.loc[name, "tokens_per_s"] / ref_tps
            if not math.isfinite(of_medians) or _verdicts._x(of_medians) == _verdicts._x(sp.ratio):
                continue
            lines.append(f"{name}: the speed-up shown ({_verdicts._x(sp.ratio)}x) is the median of its per-repeat "
                         f"ratios to {self.reference!r}, each against the run beside it in the same repeat, so that "
                         f"a repeat slower for every variant does not count; its median tokens/s over "
                         f"{self.reference!r}'s is {_verdicts._x(of_medians)}x, the medians coming from "
                         "different repeats")
        return lines

    def _shared_notes(self) -> tuple[list[str], dict[str, list[str]]]:
        """(notes said once for the whole comparison, variant -> its remaining notes): a note every variant that ran
        has (a GGUF model's conversion, chat examples cut) is said once, "all variants: …", not once per variant."""
        return said_once(self.notes, [n for n in self.notes if n in self.results])

    def _floor_lines(self) -> list[str]:
        """Where the speed's noise floor comes from (repeats only), and what happened to the A/A copy."""
        if self.repeats <= 1:
            return []
        ref, rate = self.reference, f"{_verdicts.FALSE_RANKING_RATE:.0%}"
        rule = (f"speed rule: the median of the per-repeat log-ratios against a robust spread, calibrated to rank "
                f"identical variants in at most {rate} of comparisons; each verdict's noise ± is that variant's own "
                f"half-width")
        if not math.isfinite(self.noise_floor):
            line = (f"noise floor unknown (fewer than {_verdicts.MIN_RANKED_REPEATS} whole repeats of the "
                    "reference): no speed difference is ranked")
        elif self.aa_timings:
            line = (f"noise floor {_verdicts.half_width_text(self.noise_floor)}: the rule's half-width for an "
                    f"identical copy of {ref!r} (run unrecorded in each of {len(self.aa_timings)} repeats), which "
                    "widens every variant's; " + rule)
        else:
            line = (f"noise floor {_verdicts.half_width_text(self.noise_floor)}: the rule's half-width for a "
                    f"variant as noisy as {ref!r}'s own repeats; " + rule)
        if self.noise_floor > _verdicts.NOISE_SHOWN:
            line += "; the repeats vary too much here to rank any speed difference"
        return [line] + [f"A/A: {n}" for n in self.aa_notes]

    def _seed_lines(self) -> list[str]:
        """The extra seed runs and what they cost, for the notes under the table."""
        if not self.seeds:
            return []
        if not self.seed_results and not self.seed_notes:
            return [f"noise band: seeds {', '.join(map(str, self.seeds))} asked, but the reference's own seed "
                    f"({self.reference_seed}) is the only one: no extra run"
                    if self.reference_seed is not None else "noise band: no seed run (the reference did not run)"]
        lines = []
        if self.seed_results:
            total = sum(self.seed_wall_s.values())
            each = ", ".join(f"{s}: {t:.1f} s" for s, t in self.seed_wall_s.items())
            plural = "s" if len(self.seed_results) > 1 else ""
            null = getattr(self, "null", "init")
            lines.append(f"noise band ({_verdicts.NULL_NAMES.get(null, 'seed noise')}: "
                         f"{_verdicts.null_words(null, getattr(self, 'rounding', None))}): {self.reference!r} again "
                         f"under seed{plural} {', '.join(map(str, self.seed_results))} (seed {self.reference_seed} is "
                         f"its own run); seed runs {each}, {total:.1f} s in all")
        return lines + [f"noise band: {n}" for n in self.seed_notes]

    def _verdicts_html(self) -> str:
        """One line per variant, above the table: its verdict, the variant's name in bold."""
        items = []
        for name, v in self.verdicts.items():
            flagged = (v.within_noise is False or v.nonfinite_steps or v.skipped_steps or not v.ran
                       or bool(v.lost_updates_text)
                       or any(j.within_noise is False for j in getattr(v, "rewards", {}).values()))
            color = "#b45309" if flagged else "#222"
            rest = v.text[len(name) + 2:]
            items.append(f'<li style="color:{color}"><b>{html.escape(name)}</b>: {html.escape(rest)}</li>')
        return ('<ul class="nbt-verdicts" style="font-size:13px;margin:4px 0 6px 0;padding-left:18px">'
                + "".join(items) + "</ul>")

    def _notes_html(self) -> str:
        # A note its variant's verdict already says (the lost-update sentence) is not said again under the table.
        said = {name: getattr(v, "lost_updates_text", None) for name, v in self.verdicts.items()}
        shared, rest = self._shared_notes()
        per_variant = "".join(f"<li>{html.escape(n)}</li>" for n in shared) + "".join(
            f"<li><b>{html.escape(name)}</b><ul style='margin:0;padding-left:18px'>"
            + "".join(f"<li>{html.escape(n)}</li>" for n in kept) + "</ul></li>"
            for name, kept in ((name, [n for n in notes if n != said.get(name)]) for name, notes in rest.items())
            if kept)
        general = "".join(f"<li>{html.escape(n)}</li>" for n in self._general_notes())
        verdict = html.escape(self._fairness_line())
        color = "#2e7d32" if self.fair else "#c62828"
        return ('<div class="nbt-compare-notes" style="font-size:12px;color:#444;max-width:100%">'
                + (f"<ul style='margin:4px 0;padding-left:18px'>{per_variant}</ul>" if per_variant else "")
                + (f"<ul style='margin:4px 0;padding-left:18px;color:#666'>{general}</ul>" if general else "")
                + f'<p class="nbt-compare-verdict" style="margin:4px 0;color:{color}">{verdict}</p></div>')

    def _samples_html(self) -> str:
        """Each variant's answers side by side (prompt rows x variant columns, the last step they all sampled);
        "" without sample prompts."""
        table = self.samples_table()
        if not len(table.index):
            return ""
        from ..viz.text import samples_html   # pure HTML (no plotly); viz/ sits above, so imported when asked

        return samples_html(table, title="answers side by side")

    def summary_html(self, details: bool = True) -> str:
        """The verdict line of each variant, the compact table, the sample answers side by side (with sample
        prompts), the notes under it (a list per variant), the fairness verdict and, with
        ``details``, every column of ``table`` behind a "details" toggle: an HTML fragment for a notebook
        output or a widget."""
        parts = [self._verdicts_html(),
                 f'<div class="nbt-compare" style="max-width:100%;overflow-x:auto">{self._compact_html()}</div>',
                 self._samples_html(), self._notes_html()]
        if details:
            parts.append(f'<details class="nbt-compare-details"><summary style="cursor:pointer;font-size:12px">'
                         f"details: all {len(self.table.columns)} columns</summary>"
                         f'<div style="overflow-x:auto">{self._table_html()}</div></details>')
        return "<div>" + "".join(parts) + "</div>"

    # -- text and HTML ------------------------------------------------------------------------------------
    def format_table(self) -> str:
        """The table as plain text for a terminal: the verdict lines above it, the notes and the fairness
        verdict below it."""
        # Leave out what says nothing here: settings every variant shares, a status every run reached.
        cols = [c for c in _TEXT_COLUMNS if c in self.table.columns
                and not (c in _TEXT_IF_DIFFERENT and self.table[c].nunique() <= 1)
                and not (c == "status" and all(v == "finished" for v in self.completion.values()))
                and not (c == "order" and self.repeats <= 1)]
        lines = [v.text for v in self.verdicts.values()]
        lines += ["", self._formatted(cols).to_string(index=False), ""]
        if self.repeats > 1:
            lines.append(f"tokens_per_s and wall_s: medians of {self.repeats} interleaved repeats, the order "
                         "rotated each repeat (order: the variant's position in each); speedup: the range of the "
                         "per-repeat ratios, then their median (spreads in .table)")
        lines += self._ratio_lines()
        lines += self._floor_lines()
        lines += self._seed_lines()
        shared, rest = self._shared_notes()
        lines += shared
        lines += [f"{name}: {'; '.join(notes)}" for name, notes in rest.items() if notes]
        lines.append(self._fairness_line())
        return "\n".join(lines)

    def _formatted(self, cols: Sequence[str], missing: str = "-") -> pd.DataFrame:
        """``cols`` of the table as display strings (``missing`` where there is no value); empty columns dropped."""
        out = {}
        for c in cols:
            values = self.table[c]
            if values.isna().all():
                continue
            f = _FORMATS.get(c, "{:.6g}" if values.dtype.kind == "f" else "{}")
            out[c] = [missing if pd.isna(v) else f(v) if callable(f) else f.format(v) for v in values]
            if c == "speedup":   # the range and the median, as the compact table and the verdicts show it
                spans = [self._speed(n) for n in self.table["variant"]]
                out[c] = [_verdicts.speed_span(sp) if sp is not None else x for sp, x in zip(spans, out[c])]
        return pd.DataFrame(out)

    def _fairness_line(self) -> str:
        ran = self.table[self.table["init_hash"].notna()]
        if ran.empty:
            return "no variant ran"
        if self.fair:
            return (f"fair: every variant started from the same weights and saw the same batches as "
                    f"{self.reference!r} (init {ran.init_hash.iloc[0]}, data {ran.data_hash.iloc[0]}), "
                    "or differs only by design")
        return "NOT FAIR: " + " | ".join(self.warnings)

    def _table_html(self) -> str:
        """Every column of ``table``, formatted, as an HTML table (a note every variant shares is in the notes above
        it, "all variants: …", not in each row)."""
        shown = self._formatted(list(self.table.columns), missing=MISSING)
        if "notes" in shown.columns:
            _, rest = self._shared_notes()
            shown["notes"] = ["; ".join(rest.get(n, [])) for n in self.table["variant"]]
        return shown.to_html(
            index=False, escape=True, classes=["nbtrain-compare", "nbt-compare-full"])

    def _repr_html_(self) -> str:
        return self.summary_html(details=True)

    def __repr__(self) -> str:
        stopped = f", stopped={self.stopped!r}" if self.stopped else ""
        return (f"ComparisonResult(variants={self.variants}, reference={self.reference!r}, fair={self.fair}"
                f"{stopped})")

    def to_html(self, path, title: str = "nbtrain comparison") -> Path:
        """Write one self-contained HTML report (plotly.js inlined, opens offline): the compact table and its
        notes, the sample answers side by side, figures, every column of the table, every sample answer, config and
        environment."""
        path = Path(path)
        fig = self.figure()
        fig_html = fig.to_html(full_html=False, include_plotlyjs=True, include_mathjax=False,
                               config={"displaylogo": False})
        overrides = "\n".join(f"{name}: {ov}" for name, ov in self.overrides.items())
        env_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                           for k, v in environment().items())
        errors = "".join(f"<h3>{html.escape(n)}</h3><pre>{html.escape(t)}</pre>"
                         for n, t in self.errors.items())
        samples = self.samples
        all_samples = ("<h2>Sample answers</h2><p>Every variant's greedy answer to each sample prompt at each "
                       "sampled step (their time is not in tokens/s).</p><div style='overflow-x:auto'>"
                       + samples[["variant", "step", "prompt", "answer", "new_tokens"]].to_html(
                           index=False, escape=True, classes=["nbt-samples-all"]) + "</div>"
                       if len(samples) else "")
        doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
.nbt-compare-full th, .nbt-compare-full td, .env th, .env td {{ border: 1px solid #ccc; padding: 3px 6px;
  text-align: right; }}
.nbt-compare-full td:last-child {{ text-align: left; min-width: 20em; }}
pre {{ background: #f6f6f6; padding: .6em; overflow-x: auto; }}
.verdict {{ font-weight: bold; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="verdict">{html.escape(self._fairness_line())}</p>
<h2>Results</h2>
{self.summary_html(details=False)}
<h2>Figures</h2>
{fig_html}
<h2>All columns</h2>
<div style="overflow-x:auto">{self._table_html()}</div>
{all_samples}
<h2>Configuration</h2>
<p>Base config (every variant is this with its overrides; the first, {html.escape(repr(self.reference))},
is the reference):</p>
<pre>{html.escape(self.config.to_yaml())}</pre>
<p>Variants:</p>
<pre>{html.escape(overrides)}</pre>
<h2>Environment</h2>
<table class="env">{env_rows}</table>
{"<h2>Errors</h2>" + errors if errors else ""}
</body></html>
"""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(doc, encoding="utf-8")
        return path



def environment() -> dict[str, str]:
    """Library versions and the device, for a report that says where its numbers come from."""
    from importlib import metadata

    env = {"python": sys.version.split()[0], "platform": platform.platform(), "nbtrain": __version__}
    for lib in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "numpy", "pandas", "plotly"):
        try:
            env[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            env[lib] = "not installed"
    caps = capabilities()
    env.update(device=caps.device, device_name=caps.name, device_memory_gib=f"{caps.total_memory_gib:.1f}",
               torch_threads=str(torch.get_num_threads()))
    if caps.device == "cuda":
        env["cuda"] = str(torch.version.cuda)
        env["compute_capability"] = ".".join(map(str, caps.compute_capability or ()))
    return env
