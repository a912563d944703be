"""Real-browser test of where the answer is when a run ends (issue 46, item 3), JupyterLab in Chromium at 1440x900.

A Panel cell: **Train**, **Stop**, then **Compare** of two precisions. After Stop and after the Compare the settings
stay folded (a click on their title opens them), and the status line, the verdicts, the compact table and the
figure are in view, in that order, top to bottom: their bounding boxes are read from the page.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import nbformat
import pytest

from .test_browser import (_POINTS_PER_PANEL, ARTIFACTS, BROWSER_ARGS, CHROMIUM, JupyterServer, _missing, _run_all,
                           _wait_for_kernel, _wait_until_ran, kernel_stacks_on_failure, one_retry_on_stall,
                           widget_shown)
from .test_browser_results import _LAYOUT, _SCROLL_TO_STATUS, FOLDED_MAX_PX, SCREEN, _inside

# make test-course, not make test: under the suite's load on 2 cores the live figure has drawn no point for 180 s while
# the run went on (3 of 4 fresh runs on 2026-12-08, cause not found; see CHANGELOG), and CI must not be flaky. make
# test keeps JupyterLab's quickstart Panel in the browser.
pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]

NOTEBOOK = "layout.ipynb"
CELLS = [
    # a long Train the browser stops (a tiny step takes milliseconds: it must still run when the test looks),
    # then a Compare of two precisions over COMPARE_STEPS steps, typed into Max steps as a person would
    """import nbtrain as nbt

panel = nbt.Panel(config=nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=48, max_seq_len=32,
                                         micro_batch_size=4, eval_fraction=0.0, max_steps=20_000, precision="fp32"))
for p, box in panel.compare_choices.items():
    box.value = p in ("fp32", "bf16") and not box.disabled
panel""",
]
COMPARE_STEPS = 4
# the parts of the Panel after a run, top to bottom, as the page shows them
_PARTS = """
cell => {
  const box = el => { if (!el || !el.getClientRects().length) return null; const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, height: r.height}; };
  const q = s => cell.querySelector(s);
  return {status: box(q('.nbtrain-status')), verdicts: box(q('.nbtrain-verdicts')), table: box(q('.nbtrain-table')),
          figure: box(q('.nbtrain-dashboard .js-plotly-plot')), viewport: {width: innerWidth, height: innerHeight}};
}
"""
MIN_SHOWN_PX = 120   # of the figure, above the bottom of the screen: enough to see it is there


def _write_notebook(folder: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / NOTEBOOK)


@pytest.fixture
def lab(tmp_path):
    srv = JupyterServer("lab", tmp_path)
    _write_notebook(srv.root)
    srv.start()
    yield srv
    srv.stop()


def _problems(cell, parts: tuple[str, ...], when: str) -> list[str]:
    """What is wrong with where ``parts`` are: each in view (the status whole; the others from their top, the
    figure at least MIN_SHOWN_PX of it), inside the notebook's scroll area, in that order top to bottom; and the
    settings folded."""
    lay, at = cell.evaluate(_LAYOUT), cell.evaluate(_PARTS)
    screen = {"top": 0, "left": 0, "bottom": at["viewport"]["height"], "right": at["viewport"]["width"]}
    area = lay["scroller"] or screen
    view = {"top": max(screen["top"], area["top"]), "bottom": min(screen["bottom"], area["bottom"])}
    problems = []
    settings = lay["settings"]
    if settings is None or settings["height"] > FOLDED_MAX_PX or lay["settings_tabs_shown"]:
        problems.append(f"{when}: the settings are not folded: {settings}, {lay['settings_tabs_shown']} tab bar(s)")
    boxes = {k: at[k] for k in parts}
    missing = [k for k, b in boxes.items() if b is None]
    if missing:
        return problems + [f"{when}: not shown: {missing}"]
    if not _inside(boxes["status"], {**screen, **view}):
        problems.append(f"{when}: the status line is not all in view: {boxes['status']}, view {view}")
    for k in parts[1:]:
        room = MIN_SHOWN_PX if k == "figure" else 10
        if not (view["top"] - 1 <= boxes[k]["top"] <= view["bottom"] - room):
            problems.append(f"{when}: the {k} is not in view: its top at {boxes[k]['top']:.0f} px, the view "
                            f"{view['top']:.0f}-{view['bottom']:.0f} px")
    for a, b in zip(parts, parts[1:]):
        if boxes[a]["bottom"] > boxes[b]["top"] + 1:
            problems.append(f"{when}: the {a} ({boxes[a]['top']:.0f}-{boxes[a]['bottom']:.0f} px) is not above the "
                            f"{b} ({boxes[b]['top']:.0f}-{boxes[b]['bottom']:.0f} px)")
    return problems


def test_the_answer_is_in_view_after_stop_and_after_compare(lab):
    one_retry_on_stall(lab, lambda: _layout_after_runs(lab))


def _layout_after_runs(lab):
    from playwright.sync_api import expect, sync_playwright

    url = f"{lab.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{NOTEBOOK}?reset&token={lab.token}"
    problems: list[str] = []
    with sync_playwright() as p, kernel_stacks_on_failure(lab):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=SCREEN)
            page.goto(url)
            nb = page.locator(".jp-NotebookPanel:visible")
            expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
            _wait_for_kernel(lab)
            _run_all(page)
            _wait_until_ran(nb, 240, lab)
            cell = nb.locator(".jp-CodeCell").last

            def button(label):
                return cell.locator("button.widget-button", has_text=re.compile(rf"^\s*{label}\s*$"))

            train, stop = button("Train"), button("Stop")
            widget_shown(cell, train, "the Panel's Train button")
            cell.scroll_into_view_if_needed()
            train.click()
            expect(stop).to_be_enabled(timeout=30_000)
            plot = cell.locator(".nbtrain-dashboard .js-plotly-plot").first
            expect(plot).to_be_visible(timeout=120_000)
            deadline = time.monotonic() + 120
            while not any(n >= 2 for n in plot.evaluate(_POINTS_PER_PANEL).values()):
                assert time.monotonic() < deadline, "no points drawn in the live figure in 120 s"
                time.sleep(0.2)
            cell.evaluate(_SCROLL_TO_STATUS)   # where a person watching the run has it: status at the top
            time.sleep(0.3)
            stop.click()
            expect(cell.locator(".nbtrain-status").get_by_text(re.compile(r"stopped"))).to_be_visible(timeout=120_000)
            expect(train).to_be_enabled()
            time.sleep(0.5)
            problems += _problems(cell, ("status", "figure"), "after Stop")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "e2e-layout-after-stop.png"))

            # a click on the folded title opens the settings; Max steps typed there; a click folds them again
            title = cell.locator(".nbtrain-settings .jupyter-widget-Collapse-header").first
            title.click()
            cell.locator(".lm-TabBar-tab", has_text=re.compile(r"^\s*Training\s*$")).first.click()
            steps = cell.locator(".widget-text", has_text="Max steps").locator("input").first
            expect(steps).to_be_visible(timeout=10_000)
            steps.fill(str(COMPARE_STEPS))
            steps.press("Tab")
            title.click()
            expect(steps).to_be_hidden(timeout=10_000)
            button("Compare precisions").click()
            expect(stop).to_be_enabled(timeout=30_000)
            done = cell.locator(".nbtrain-status").get_by_text(re.compile(r"^\s*done — "))
            expect(done).to_be_visible(timeout=240_000)
            expect(cell.locator(".nbtrain-table")).to_be_visible(timeout=30_000)
            time.sleep(1)
            problems += _problems(cell, ("status", "verdicts", "table", "figure"), "after the Compare")
            page.screenshot(path=str(ARTIFACTS / "e2e-layout-after-compare.png"))
        finally:
            browser.close()
    # outside the block that adds the kernels' stacks to a failure: what is misplaced is the whole story here
    assert not problems, "at 1440x900 (screenshots: test-artifacts/e2e-layout-*.png):\n" + "\n".join(
        f"- {p}" for p in problems)
