"""Real-browser test of a live figure at its first point, and of a comparison's comm messages (issue 46), in
JupyterLab at 1440x900 driven by Chromium.

One notebook, written for the test into the server's folder, runs with Run All:

* a comparison drawn live by a LiveDashboard in one cell (notebook 04's path): each run draws on a new widget, and
  the last one used to be closed while plotly.js's answers to it still waited in the busy kernel's queue. Those
  answers then reached a comm the kernel no longer knew: "No such comm" in the log console, every run. The
  notebook records the kernel's "Comm" warnings into a file; it and the log console must hold none.
* a bf16 run (no GradScaler: the figure says so in the loss-scale panel) held at its first step until the browser
  has looked: the figure is its output's width, every tick label is short ("3.57", not "3.573132753372192383"),
  and no annotation or title overprints another, an axis title or a tick label.

The first cell records the kernel's errors outside the cells (tests/e2e/kernel_errors.py): only the canary may be
there at the end. A screenshot of the first point goes to test-artifacts/e2e-first-point.png.
"""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path

import nbformat
import pytest

from .kernel_errors import RECORD_FILE, assert_only_canary, fire_canary, log_console_entries, recorder_cell
from .test_browser import (ARTIFACTS, BROWSER_ARGS, CHROMIUM, KNOWN_UPSTREAM_ERRORS, JupyterServer, _missing,
                           _run_all, _wait_for_kernel, _wait_until_ran, kernel_stacks_on_failure, one_retry_on_stall)
from .test_browser_results import SCREEN, WIDTH_SLACK_PX, _kernel_errors_on_failure, _overlaps

# make test-course, not make test: under the suite's load on 2 cores the live figure has drawn no point for 180 s while
# the run went on (3 of 4 fresh runs on 2026-12-08, cause not found; see CHANGELOG), and CI must not be flaky. make
# test keeps JupyterLab's quickstart Panel in the browser.
pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]

NOTEBOOK = "first_point.ipynb"
COMM_FILE = "comm_warnings.txt"     # the kernel's "Comm" logger, warnings and above
RELEASE_FILE = "release"            # the held run goes on once this exists
RUN_ALL_TIMEOUT_S = 240
FIRST_POINT_TIMEOUT_S = 180
MAX_TICK_DIGITS = 5                 # significant digits a tick label may show ("65,536", "0.0123", "3.57")
GAP_PX = 2                          # texts closer than this touch


def _cells(folder: Path) -> list[str]:
    return [
        recorder_cell(folder / RECORD_FILE),
        # the comm manager's own warnings (not errors: the recorder above keeps errors only)
        f'''import logging
class _E2eCommWarnings(logging.Handler):
    def emit(self, record):
        with open({str(folder / COMM_FILE)!r}, "a") as f:
            f.write(logging.Formatter().format(record) + "\\n")
logging.getLogger("Comm").addHandler(_E2eCommWarnings(logging.WARNING))''',
        '''import os, time

import nbtrain as nbt

cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs", subset=32, max_seq_len=32, micro_batch_size=4,
                      eval_fraction=0.0, max_steps=4, precision="fp32")''',
        # notebook 04's path: several runs drawn live in one cell
        '''cmp = nbt.compare(cfg, precisions=("fp32", "fp16", "bf16"), warmup=False,
                  callbacks=[nbt.LiveDashboard()])''',
        # a run held at its first point until the browser has looked
        f'''class HoldAtFirstPoint:
    def on_step_end(self, record):
        deadline = time.monotonic() + {FIRST_POINT_TIMEOUT_S + 60}
        while record.step == 1 and not os.path.exists({RELEASE_FILE!r}) and time.monotonic() < deadline:
            time.sleep(0.1)

held = nbt.train(cfg.replace(precision="bf16", max_steps=3), callbacks=[nbt.LiveDashboard(), HoldAtFirstPoint()])''',
    ]


def _write_notebook(folder: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in _cells(folder)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / NOTEBOOK)


# The number of loss points the browser holds for the figure (its graph div's data).
_LOSS_POINTS = """
gd => { const t = (gd.data || []).find(t => (t.meta || {}).kind === 'loss'); return t && t.x ? t.x.length : 0; }
"""
# The figure against its output area; every tick label; every text box: annotations (panel titles, notes), the
# figure's title, axis titles and tick labels.
_FIRST_POINT = """
gd => {
  const box = el => { const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width, height: r.height}; };
  const out = gd.closest('.jp-OutputArea-output');
  const style = getComputedStyle(out);
  const texts = [];
  const add = (kind, el) => { const t = (el.textContent || '').trim(); const b = box(el);
    if (t && b.width > 0 && b.height > 0) texts.push({kind, text: t, ...b}); };
  gd.querySelectorAll('g.annotation text').forEach(e => add('annotation', e));
  gd.querySelectorAll('text.gtitle').forEach(e => add('title', e));
  gd.querySelectorAll('g.infolayer text[class$="title"]:not(.gtitle)').forEach(e => add('axis title', e));
  gd.querySelectorAll('.xaxislayer-above text, .yaxislayer-above text').forEach(e => add('tick', e));
  return {plot: box(gd), svg: box(gd.querySelector('.main-svg')),
          content_width: out.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
          texts};
}
"""


def _digits(label: str) -> int:
    """Significant digits a tick label shows ("0.0123" -> 3, "65,536" -> 5, "3.573132753372192383" -> 19)."""
    return len(re.sub(r"[^0-9]", "", label).lstrip("0"))


def _touch(a: dict, b: dict) -> bool:
    grown = {k: a[k] + d for k, d in (("top", -GAP_PX), ("bottom", GAP_PX), ("left", -GAP_PX), ("right", GAP_PX))}
    return _overlaps(grown, b)


def first_point_problems(seen: dict) -> list[str]:
    """What is wrong with a figure at its first point (``seen``: what _FIRST_POINT measured), or nothing."""
    problems = [f"the figure's {part} is {seen[part]['width']:.0f} px wide in a {seen['content_width']:.0f} px "
                "output" for part in ("plot", "svg") if abs(seen[part]["width"] - seen["content_width"]) > WIDTH_SLACK_PX]
    ticks = [t["text"] for t in seen["texts"] if t["kind"] == "tick"]
    long = sorted({t for t in ticks if _digits(t) > MAX_TICK_DIGITS})
    if long:
        problems.append(f"tick labels with more than {MAX_TICK_DIGITS} significant digits: {long}")
    texts = seen["texts"]
    # a note or a title against every other text: two of them may not even touch, and neither may overlap an axis
    # title or a tick label (tick labels and axis titles among themselves are plotly's own layout)
    notes = ("annotation", "title")
    over = [(f"{a['kind']} {a['text']!r}", f"{b['kind']} {b['text']!r}") for i, a in enumerate(texts)
            for b in texts[i + 1:] if (a["kind"] in notes or b["kind"] in notes)
            and (_touch(a, b) if a["kind"] in notes and b["kind"] in notes else _overlaps(a, b))]
    if over:
        problems.append(f"texts drawn over (or touching) each other: {over}")
    return problems


@pytest.fixture
def lab(tmp_path):
    srv = JupyterServer("lab", tmp_path)
    _write_notebook(srv.root)
    srv.start()
    yield srv
    srv.stop()


def test_first_point_and_comms_in_browser(lab):
    one_retry_on_stall(lab, lambda: _first_point(lab))


def _first_point(lab):
    from playwright.sync_api import expect, sync_playwright

    (lab.root / RELEASE_FILE).unlink(missing_ok=True)
    (lab.root / COMM_FILE).unlink(missing_ok=True)
    url = f"{lab.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{NOTEBOOK}?reset&token={lab.token}"
    problems: list[str] = []
    record = lab.root / RECORD_FILE
    with sync_playwright() as p, kernel_stacks_on_failure(lab), _kernel_errors_on_failure(record):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport=SCREEN)
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(url)
            nb = page.locator(".jp-NotebookPanel:visible")
            expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
            _wait_for_kernel(lab)
            _run_all(page)
            cells = nb.locator(".jp-CodeCell")
            expect(cells).to_have_count(len(_cells(lab.root)))

            # -- the held run at its first point --------------------------------------------------------
            held = cells.last
            plot = held.locator(".js-plotly-plot").first
            deadline = time.monotonic() + FIRST_POINT_TIMEOUT_S
            while not (plot.count() and plot.evaluate(_LOSS_POINTS) >= 1):
                assert "Traceback (most recent call last)" not in nb.inner_text(), nb.inner_text()[-3000:]
                assert time.monotonic() < deadline, f"no first point in the held run's figure in " \
                                                    f"{FIRST_POINT_TIMEOUT_S} s"
                time.sleep(0.3)
            plot.scroll_into_view_if_needed()
            time.sleep(5)   # plotly.js lays out the point; the dashboard's late fits (0.5-4 s) reach the view
            seen = plot.evaluate(_FIRST_POINT)
            ARTIFACTS.mkdir(exist_ok=True)
            held.locator(".jp-OutputArea").first.screenshot(path=str(ARTIFACTS / "e2e-first-point.png"))
            (lab.root / RELEASE_FILE).write_text("go")
            at_first_point = first_point_problems(seen)

            _wait_until_ran(nb, RUN_ALL_TIMEOUT_S, lab)
            # the canary's comm message is read after every answer the figures got before it
            fire_canary(page, nb, record)
            console = log_console_entries(page)
            comm_file = lab.root / COMM_FILE
            comm_warnings = comm_file.read_text().splitlines() if comm_file.is_file() else []
            no_such = [e for e in console[1] if "No such comm" in e]
            assert not at_first_point, ("at the first point (test-artifacts/e2e-first-point.png):\n"
                                        + "\n".join(f"- {p}" for p in at_first_point))
            assert not comm_warnings and not no_such, (
                f"the kernel's comm warnings: {len(comm_warnings)} recorded, {len(no_such)} in the log console:\n"
                + "\n".join((comm_warnings + no_such)[:20]))
            assert_only_canary(record)
        finally:
            browser.close()
    known = {m for m in problems for app, pattern, _ in KNOWN_UPSTREAM_ERRORS if app == "lab" and pattern.match(m)}
    errors = [m for m in problems if m not in known]
    assert not errors, "browser console errors:\n" + "\n".join(errors)
