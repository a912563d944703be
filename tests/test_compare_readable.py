"""Issue 18: a comparison a person can read (compact table, notes below it, the full table behind a toggle),
a Stop that stops the whole comparison, and a Panel that says what finished, what was cut and what never ran."""

import html as htmllib
import math
import re
import threading
from html.parser import HTMLParser

import pytest

import nbtrain as nbt
from nbtrain.compare import compare
from nbtrain.config import ConfigError
from nbtrain.data import DataError
from nbtrain.engine import StopTraining

from .helpers import inject_inf

CHAR_PX = 7          # a generous width per character at the table's 12px font
CELL_PAD_PX = 16     # 8px padding either side
OUTPUT_PX = 900      # a 968 px notebook output, less its prompt margin and a scrollbar
MISSING = "—"        # the one marker for "no value"


def tiny_cfg(**kw):
    base = dict(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=16, micro_batch_size=4,
                max_steps=3, eval_fraction=0.25, precision="fp32", lr=1e-3)
    return nbt.TrainConfig(**{**base, **kw})


class StopAt:
    """Sets ``event`` at ``step`` of ``variant``, as the Panel's Stop button would from another thread."""

    def __init__(self, event, variant, step):
        self.event, self.variant, self.step = event, variant, step

    def on_step_end(self, rec):
        if rec.variant == self.variant and rec.step == self.step:
            self.event.set()


@pytest.fixture(scope="module")
def stopped_cmp():
    """fp32 runs to the end; fp16 overflows at its first step (skipped, scale halved) and is stopped at its
    second; bf16 never starts. Also returns the variants the engine was asked to run."""
    import nbtrain.engine.loop as loop

    stop = threading.Event()
    ran = []
    original = loop._run

    def spy(cfg, callbacks=None, **kw):
        ran.append(kw.get("variant"))
        return original(cfg, callbacks, **kw)

    with pytest.MonkeyPatch.context() as mp:
        inject_inf(mp, on_forward_calls={4})      # fp32 runs training forwards 1-3: 4 is fp16's first step
        mp.setattr(loop, "_run", spy)
        cmp = compare(tiny_cfg(), precisions=("fp32", "fp16", "bf16"), callbacks=[StopAt(stop, "fp16", 2)],
                      warmup=False, stop=stop)
    return cmp, ran


# -- Stop ends the comparison ------------------------------------------------------------------------
def test_stop_ends_the_comparison_and_says_what_finished_was_cut_and_never_ran(stopped_cmp):
    cmp, ran = stopped_cmp
    assert ran == ["fp32", "fp16"]                       # bf16 never started
    assert cmp.stopped == "stopped"
    assert cmp.completion == {"fp32": "finished", "fp16": "cut", "bf16": "not_run"}
    assert (cmp.finished, cmp.cut, cmp.not_run) == (["fp32"], ["fp16"], ["bf16"])
    assert cmp.steps("fp32") == 3 and cmp.steps("fp16") == 2 and cmp.steps("bf16") == 0
    assert [cmp.ended(n) for n in cmp.variants] == ["", "cut at step 2", "not run"]
    t = cmp.table.set_index("variant")
    assert t.loc["fp16", "status"] == "stopped" and t.loc["bf16", "status"] == "not_run"
    assert "not run: the comparison was stopped" in cmp.notes["bf16"]
    assert "stopped=" in repr(cmp)


def test_a_callbacks_stop_training_ends_its_own_variant_only():
    class StopFirst:
        def on_step_end(self, rec):
            if rec.variant == "fp32" and rec.step == 1:
                raise StopTraining

    stop = threading.Event()
    cmp = compare(tiny_cfg(max_steps=2, eval_fraction=0.0), precisions=("fp32", "bf16"), callbacks=[StopFirst()],
                  warmup=False, stop=stop)
    assert not stop.is_set() and cmp.stopped is None
    assert cmp.completion == {"fp32": "cut", "bf16": "finished"} and cmp.steps("bf16") == 2


# -- the compact table --------------------------------------------------------------------------------
def _mem(summary) -> float:
    # On a CPU the run's own tensors, when the engine measured them; else the process's RSS.
    if summary["device"] == "cuda":
        return summary["peak_vram_gib"]
    tensors = summary.get("peak_host_tensors_gib")
    return tensors if tensors is not None else summary["peak_host_rss_gib"]


def test_compact_table_has_ten_readable_columns(stopped_cmp):
    cmp, _ = stopped_cmp
    c = cmp.compact_table().set_index("Variant")
    assert len(c.columns) + 1 <= 10
    assert list(c.index) == ["fp32", "fp16 (cut at step 2)", "bf16 (not run)"]
    s32, s16 = cmp.results["fp32"].summary, cmp.results["fp16"].summary
    ref, fp16, bf16 = c.loc["fp32"], c.loc["fp16 (cut at step 2)"], c.loc["bf16 (not run)"]
    t = cmp.table.set_index("variant")

    assert ref["Tokens/s (speed-up)"] == f"{t.loc['fp32', 'tokens_per_s']:,.0f} (ref)"
    assert fp16["Tokens/s (speed-up)"] == (f"{t.loc['fp16', 'tokens_per_s']:,.0f} "
                                           f"({t.loc['fp16', 'speedup']:.2f}x, one timing)")
    assert ref["Final loss"] == f"{s32['final_loss']:.4f}" and ref["Eval loss"] == f"{s32['eval_loss']:.4f}"
    assert float(ref["Peak memory (GiB)"]) == pytest.approx(_mem(s32), rel=5e-3)
    assert float(fp16["Peak memory (GiB)"]) == pytest.approx(_mem(s16), rel=5e-3)
    assert ref["Max |Δ loss| vs reference"] == "ref"
    d = (cmp.results["fp16"].history.loss - cmp.results["fp32"].history.loss.iloc[:2]).abs()
    diff = max(x for x in d if math.isfinite(x))           # fp16's overflowed first step does not count
    assert float(fp16["Max |Δ loss| vs reference"]) == pytest.approx(diff, rel=0.05, abs=6e-4)
    assert ref["Skipped / non-finite"] == "0 / 0" and fp16["Skipped / non-finite"] == "1 / 1"
    scale = cmp.results["fp16"].history.scale.min()
    assert scale == 32768.0 and fp16["Min scale"] == "32,768"      # halved once from 65,536
    assert ref["Min scale"] == MISSING                               # no GradScaler in fp32
    assert ref["Fair"] == "✓" and ref["Precision"] == "fp32"
    assert (bf16.drop("Precision") == MISSING).all()
    for v in c.to_numpy().ravel().tolist() + list(c.index):
        assert "<NA>" not in v and "e+0" not in v and v not in ("nan", "None", "-"), v


class _Cells(HTMLParser):
    """The header and body cells of the first ``<table class=...cls...>``, each as its lines (split at <br>)."""

    def __init__(self, cls):
        super().__init__()
        self.cls, self.depth, self.rows, self.cell = cls, 0, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table" and self.cls in (dict(attrs).get("class") or "").split() and not self.rows:
            self.depth = 1
        elif self.depth and tag == "tr":
            self.rows.append([])
        elif self.depth and tag in ("th", "td"):
            self.cell = [""]
        elif self.cell is not None and tag == "br":
            self.cell.append("")

    def handle_endtag(self, tag):
        if self.depth and tag in ("th", "td") and self.cell is not None:
            self.rows[-1].append([x.strip() for x in self.cell])
            self.cell = None
        elif tag == "table" and self.depth:
            self.depth = 0

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[-1] += data


def cells_of(doc, cls):
    p = _Cells(cls)
    p.feed(doc)
    return p.rows


def estimated_width_px(rows) -> int:
    columns = list(zip(*rows))
    return sum(max(len(line) for cell in col for line in cell) * CHAR_PX + CELL_PAD_PX for col in columns)


def test_compact_html_fits_a_notebook_output_with_notes_below(stopped_cmp):
    cmp, _ = stopped_cmp
    doc = cmp._repr_html_()
    rows = cells_of(doc, "nbt-compare-table")
    assert len(rows) == 4 and all(len(r) == len(rows[0]) <= 10 for r in rows)
    assert estimated_width_px(rows) < OUTPUT_PX, rows
    compact = doc[doc.index("nbt-compare-table"):doc.index("</table>")]
    for bad in ("&lt;NA&gt;", "<NA>", "e+0", "nan"):
        assert bad not in compact, bad
    assert "notes" not in [cell[0].lower() for cell in rows[0]]       # notes are text below, not a column
    # The notes: below the table, one list per variant, then the fairness verdict.
    notes = doc[doc.index('class="nbt-compare-notes"'):]
    assert doc.index("nbt-compare-table") < doc.index("nbt-compare-notes")
    assert re.search(r"<b>bf16</b><ul[^>]*><li>not run: the comparison was stopped</li>", notes)
    assert "<b>fp16</b>" in notes and "skipped by the GradScaler" in notes
    assert htmllib.escape("started from the same weights and saw the same batches as 'fp32'") in notes
    # Every column of .table is one click away.
    details = doc[doc.index("<details"):]
    full = cells_of(details, "nbt-compare-full")
    shown = [c[0] for c in full[0]]
    assert {"init_hash", "data_hash", "wall_s", "notes", "status"} <= set(shown)
    assert all(c in shown for c in cmp.table.columns if cmp.table[c].notna().any())
    assert "&lt;NA&gt;" not in details and "32,768" in details          # min scale, not 3.277e+04


def test_panel_status_line_names_the_variants_cut_and_not_run(stopped_cmp):
    from nbtrain.ui import render

    cmp, _ = stopped_cmp
    line = htmllib.unescape(render.comparison_line(cmp))
    assert line == "stopped — finished: fp32; cut at step 2: fp16; not run: bf16"
    assert render.comparison_color(cmp) == render.AMBER


def test_report_has_the_compact_table_and_a_section_with_every_column(stopped_cmp, tmp_path):
    cmp, _ = stopped_cmp
    doc = (cmp.to_html(tmp_path / "r.html")).read_text(encoding="utf-8")
    results, everything = doc.index("<h2>Results</h2>"), doc.index("<h2>All columns</h2>")
    assert results < doc.index('class="nbt-compare-table"') < doc.index('class="nbt-compare-notes"') < everything
    assert 'nbt-compare-full' in doc[everything:]
    assert len(cells_of(doc, "nbt-compare-table")[0]) <= 10


# -- the Panel -----------------------------------------------------------------------------------------
ipywidgets = pytest.importorskip("ipywidgets")


def _texts(widget) -> list[str]:
    """The HTML of every widget under ``widget``."""
    out = [widget.value] if isinstance(widget, ipywidgets.HTML) else []
    for child in getattr(widget, "children", ()):
        out += _texts(child)
    return out


def test_panel_stop_during_compare_stops_it_and_names_what_never_ran():
    from nbtrain.ui import render
    from nbtrain.ui.panel import Panel

    from .test_ui import TIMEOUT, small, wait_for

    panel = Panel(small(max_steps=300), debounce_s=0)
    usable = [p for p in ("fp32", "bf16", "fp16") if not panel.compare_choices[p].disabled][:2]
    if len(usable) < 2:
        pytest.skip("needs two precisions this device can run")
    for p, box in panel.compare_choices.items():
        box.value = p in usable
    panel.compare_button.click()
    wait_for(lambda: len(panel.dashboard.records) >= 2, what="two steps of the first variant")
    panel.stop_button.click()
    cmp = panel.wait(TIMEOUT)
    first, second = usable
    assert cmp is not None and list(cmp.results) == [first]       # the second never started
    assert cmp.cut == [first] and cmp.not_run == [second]
    assert {r.variant for r in panel.dashboard.records} == {first}
    steps = cmp.steps(first)
    status = htmllib.unescape(panel.status.value)
    assert f"stopped — cut at step {steps}: {first}; not run: {second}" in status
    assert render.AMBER in panel.status.value and render.GREEN not in panel.status.value
    shown = " ".join(_texts(panel.runner.board))
    assert "ETA" not in shown and "/300" not in shown                # no stale live status line
    assert panel.comparison_table in panel.summary_area.children
    assert 'class="nbt-compare-table"' in panel.comparison_table.value
    assert "not run: the comparison was stopped" in panel.runner.table_notes.value   # the table's notes, under the figure
    assert not panel.train_button.disabled and panel.stop_button.disabled


def test_a_run_that_fails_before_any_step_leaves_no_empty_figure(tmp_path):
    from nbtrain.ui.panel import Panel

    from .test_ui import TIMEOUT, small

    data = tmp_path / "rows.csv"
    data.write_text("foo\nhello world\nanother line\n")
    panel = Panel(small(data=str(data), subset=None, max_steps=2), debounce_s=0)
    panel.train_button.click()
    assert panel.wait(TIMEOUT) is None and "error" in panel.status.value
    # its run never started: nothing of it is put on screen (no empty figure, no "waiting" line; issue 35: a failed
    # start leaves what the last run showed, here nothing)
    assert panel.dashboard_area.children == ()


def test_a_run_that_fails_after_some_steps_keeps_its_figure(monkeypatch):
    from nbtrain.ui.panel import Panel

    from .helpers import after_build
    from .test_ui import TIMEOUT, small

    calls = {"n": 0}

    def hook(module, inputs, output):
        calls["n"] += module.training
        if calls["n"] == 3:
            raise RuntimeError("boom at the third step")
        return output

    after_build(monkeypatch, lambda model: model.register_forward_hook(hook))
    panel = Panel(small(max_steps=5), debounce_s=0)
    panel.train_button.click()
    assert panel.wait(TIMEOUT) is None and "boom at the third step" in panel.status.value
    assert len(panel.dashboard.records) == 2
    assert panel.dashboard.figure in panel.dashboard_area.children
    assert "no steps ran" not in " ".join(_texts(panel.dashboard_area))


@pytest.mark.parametrize("error, field", [
    (DataError("data: unknown builtin dataset 'nope'; the builtins are python-docs"), "data"),
    (ConfigError("precision: 'bf16' cannot run on this cpu: no bf16", field="precision"), "precision"),
])
def test_the_error_box_names_the_field_once(error, field):
    from nbtrain.ui.panel import Panel

    from .test_ui import small

    panel = Panel(small(), debounce_s=0)
    panel.runner.finish(panel.runner.begin("train"), error=error)
    text = htmllib.unescape(re.sub(r"<[^>]+>", "", panel.form.field_errors[field].value))   # under the field
    label = panel.form.label(field)   # the line names the field by its label ("Data")
    assert f"{label}: " in text and f"{label}: {field}:" not in text and f"{label}: {label}:" not in text
    assert str(error).split(": ", 1)[1] in text
    assert panel.controls[field].layout.border

