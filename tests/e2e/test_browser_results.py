"""Real-browser tests of what a comparison shows (issue 18), in JupyterLab driven by Chromium.

One notebook, written for the test into the server's folder, is run with Run All; then the browser clicks:

* **Compare** in a Panel: the compact comparison table must fit a 968 px output without a sideways scroll.
* a comparison of fp16 (GradScaler) and fp32 (none) drawn live by a LiveDashboard and then as the final
  figure: the loss-scale axis must label 65,536 (2^16), and no console error may come from the live figure
  (it used to log "Error setting state … gd.data must be an array").
* **Compare** then **Stop** in a second Panel: the status must name the variant that was cut and the ones
  that never ran.

Screenshots of the three states go to test-artifacts/; with ``NBTRAIN_SCREENSHOTS=docs/screenshots`` they are
also written there, which is where the README's pictures come from.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

import nbformat
import pytest

from .test_browser import (ARTIFACTS, BROWSER_ARGS, CHROMIUM, KNOWN_UPSTREAM_ERRORS, ROOT, JupyterServer,
                           _missing, _run_all, _wait_for_kernel, _wait_until_ran, kernel_stacks_on_failure)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]

NOTEBOOK = "results.ipynb"
OUTPUT_WIDTH_PX = 968          # the width of a notebook output in a default JupyterLab window (issue 18)
RUN_ALL_TIMEOUT_S = 400
CELLS = [
    """import time

import nbtrain as nbt

cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=64, max_seq_len=32, micro_batch_size=4,
                      eval_fraction=0.0, max_steps=6, precision="fp32")""",
    # 1: a Panel whose Compare the browser clicks
    """table_panel = nbt.Panel(config=cfg)
for p, box in table_panel.compare_choices.items():
    box.value = p in ("fp32", "fp16", "bf16") and not box.disabled
table_panel""",
    # 2: fp16 with a GradScaler beside fp32 without one, drawn live (the path that logged gd.data errors)
    """scales = nbt.compare(cfg.replace(max_steps=5), precisions=("fp16", "fp32"), callbacks=[nbt.LiveDashboard()],
                     warmup=False)""",
    # 3: the final figure of it
    """scale_figure = scales.figure()
scale_figure""",
    # 4: a Panel whose Compare the browser stops
    """stop_panel = nbt.Panel(config=cfg.replace(max_steps=400))
for p, box in stop_panel.compare_choices.items():
    box.value = p in ("fp32", "fp16", "bf16") and not box.disabled
stop_panel""",
]

# The y axis of the loss-scale panel: the trace whose meta says panel "scale" names its axis.
_SCALE_TICKS = """
gd => {
  const t = (gd._fullData || []).find(t => (t.meta || {}).panel === 'scale');
  if (!t) return null;
  const axis = 'y' + (t.yaxis === 'y' ? '' : t.yaxis.slice(1));
  return [...gd.querySelectorAll('g.' + axis + 'tick text')].map(e => e.textContent);
}
"""


def _write_notebook(folder: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / NOTEBOOK)


def _shot(locator, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"e2e-{name}.png"
    locator.screenshot(path=str(path))
    extra = os.environ.get("NBTRAIN_SCREENSHOTS")
    if extra:
        out = ROOT / extra
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.png").write_bytes(path.read_bytes())


@pytest.fixture
def lab(tmp_path):
    srv = JupyterServer("lab", tmp_path)
    _write_notebook(srv.root)
    srv.start()
    yield srv
    srv.stop()


def test_comparison_results_in_browser(lab):
    from playwright.sync_api import expect, sync_playwright

    url = f"{lab.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{NOTEBOOK}?reset&token={lab.token}"
    problems: list[str] = []
    with sync_playwright() as p, kernel_stacks_on_failure(lab):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(url)
            nb = page.locator(".jp-NotebookPanel:visible")
            expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
            _wait_for_kernel(lab)
            _run_all(page)
            prompts = nb.locator(".jp-CodeCell .jp-InputPrompt")
            expect(prompts).to_have_count(len(CELLS))
            _wait_until_ran(nb, RUN_ALL_TIMEOUT_S, lab)
            cells = nb.locator(".jp-CodeCell")

            def button(cell, label):
                return cell.locator("button.widget-button", has_text=re.compile(rf"^\s*{label}\s*$"))

            # -- 1. the comparison table in a 968 px output --------------------------------------------------
            panel = cells.nth(1)
            panel.scroll_into_view_if_needed()
            output = panel.locator(".jp-OutputArea-output").first
            output.evaluate(f"el => {{ el.style.width = '{OUTPUT_WIDTH_PX}px'; el.style.maxWidth = "
                            f"'{OUTPUT_WIDTH_PX}px'; el.style.flex = '0 0 {OUTPUT_WIDTH_PX}px'; }}")
            button(panel, "Compare precisions").click()
            status = panel.get_by_text(re.compile(r"^\s*done — ")).last
            expect(status).to_be_visible(timeout=240_000)
            table = panel.locator("table.nbt-compare-table")
            expect(table).to_be_visible(timeout=30_000)
            table.scroll_into_view_if_needed()
            widths = output.evaluate("""el => {
                const t = el.querySelector('table.nbt-compare-table');
                // the full table behind the "details" toggle may scroll when opened: it is the wide one on purpose
                const over = [...el.querySelectorAll('*')].filter(e => e.scrollWidth > e.clientWidth + 1
                    && getComputedStyle(e).overflowX !== 'visible' && !e.closest('.nbt-compare-details'));
                return {output: el.clientWidth, table: t.getBoundingClientRect().width,
                        right: t.getBoundingClientRect().right - el.getBoundingClientRect().left,
                        scrolling: over.map(e => e.tagName + '.' + e.className + ' in ' + (e.parentElement || {}).className + ' '
                                 + e.scrollWidth + '>' + e.clientWidth + ' ' + e.outerHTML.slice(0, 300))};
            }""")
            assert widths["output"] <= OUTPUT_WIDTH_PX, widths
            assert widths["table"] <= widths["output"] and widths["right"] <= widths["output"] + 1, widths
            assert not widths["scrolling"], f"something scrolls sideways in the 968 px output: {widths}"
            rows = table.locator("tbody tr")
            expect(rows).to_have_count(3)
            body = table.inner_text()
            assert "<NA>" not in body and "e+0" not in body, body
            _shot(output, "compare-table")

            # -- 2. the loss-scale axis, fp16 beside a run without a scaler ----------------------------------
            fig_cell = cells.nth(3)
            fig_cell.scroll_into_view_if_needed()
            plot = fig_cell.locator(".js-plotly-plot").first
            expect(plot).to_be_visible(timeout=60_000)
            ticks = plot.evaluate(_SCALE_TICKS)
            assert ticks and "65,536" in ticks, f"loss-scale tick labels: {ticks}"
            assert not any(re.fullmatch(r"\d", t) for t in ticks), f"crowded minor tick labels: {ticks}"
            _shot(fig_cell.locator(".jp-OutputArea-output").first, "scale-panel")
            live = cells.nth(2).locator(".js-plotly-plot").first
            if live.count():
                live_ticks = live.evaluate(_SCALE_TICKS)
                assert live_ticks and "65,536" in live_ticks, f"live loss-scale tick labels: {live_ticks}"

            # -- 3. Stop during a comparison stops the comparison -------------------------------------------
            stopper = cells.nth(4)
            stopper.scroll_into_view_if_needed()
            button(stopper, "Compare precisions").click()
            stop = button(stopper, "Stop")
            expect(stop).to_be_enabled(timeout=30_000)
            # a few steps of the first variant, then Stop
            expect(stopper.locator(".js-plotly-plot").first).to_be_visible(timeout=120_000)
            time.sleep(3)
            stop.click()
            stopped = stopper.get_by_text(re.compile(r"^\s*stopped — ")).last   # the status line, innermost
            expect(stopped).to_be_visible(timeout=180_000)
            line = stopped.inner_text()
            assert "cut" in line and "not run" in line, line
            assert "ETA" not in stopper.locator(".jp-OutputArea-output").first.inner_text()
            _shot(stopper.locator(".jp-OutputArea-output").first, "compare-stopped")
        finally:
            browser.close()
    known = [(m, why) for m in problems for app, pattern, why in KNOWN_UPSTREAM_ERRORS
             if app == "lab" and pattern.match(m)]
    errors = [m for m in problems if m not in {k for k, _ in known}]
    assert not errors, "browser console errors:\n" + "\n".join(errors)
