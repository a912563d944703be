"""Real-browser tests of what a comparison shows (issue 18), in JupyterLab driven by Chromium.

One notebook, written for the test into the server's folder, is run with Run All; then the browser clicks:

* **Compare** in a Panel: the compact comparison table must fit a 968 px output without a sideways scroll.
* a comparison of fp16 (GradScaler) and fp32 (none) drawn live by a LiveDashboard and then as the final
  figure: the loss-scale axis must label 65,536 (2^16), and no console error may come from the live figure
  (it used to log "Error setting state … gd.data must be an array").
* **Compare** then **Stop** in a second Panel: the status must name the variant that was cut and the ones
  that never ran.
* a Panel session on one 1440×900 screen (issue 35): **Train**, **Stop**, then **Compare** of fp32, fp16, bf16 and
  bf16-pure. While the run goes, the status line and the live figure are both inside the viewport and the
  notebook's scroll area, the settings are folded (and stay folded once it ends), and the figure is the output's width
  from its first point; after the Compare its dashboard shows the verdicts, the compact table and the figure,
  top to bottom, no annotation or title overprints another and none appears twice.

The notebook's first cell records every error the kernel reports outside a cell (tests/e2e/kernel_errors.py):
at the end the recorder and JupyterLab's log console must hold the deliberate canary and nothing else.

Screenshots go to test-artifacts/; with ``NBTRAIN_SCREENSHOTS=docs/screenshots`` they are also written there,
which is where the README's pictures come from.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from pathlib import Path

import nbformat
import pytest

from .kernel_errors import (RECORD_FILE, assert_only_canary, fire_canary, log_console_entries, recorded,
                            recorder_cell)
from .test_browser import (_POINTS_PER_PANEL, ARTIFACTS, BROWSER_ARGS, CHROMIUM, KNOWN_UPSTREAM_ERRORS, PANELS, ROOT,
                           JupyterServer, _missing, _run_all, _wait_for_kernel, _wait_until_ran,
                           kernel_stacks_on_failure, one_retry_on_stall, widget_shown)

# make test-course, not make test: under the suite's load on 2 cores the live figure has drawn no point for 180 s while
# the run went on (3 of 4 fresh runs on 2026-12-08, cause not found; see CHANGELOG), and CI must not be flaky. make
# test keeps JupyterLab's quickstart Panel in the browser.
pytestmark = [pytest.mark.slow, pytest.mark.course, pytest.mark.timeout(900),
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
    # 5: the one-screen session: a long Train the browser stops, then a short Compare of four precisions
    # (20,000 steps: a tiny step takes milliseconds, and a loaded browser may draw the first points seconds late;
    # the run must still be going when the test looks, and Stop ends it)
    """session = nbt.Panel(config=cfg.replace(max_steps=20_000))
for p, box in session.compare_choices.items():
    box.value = p in ("fp32", "fp16", "bf16", "bf16-pure") and not box.disabled
session""",
]
SESSION_PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")   # as ticked in CELLS[5]
SESSION_COMPARE_STEPS = 8      # typed into the Panel's Max steps before Compare: four variants in well under a minute
SCREEN = {"width": 1440, "height": 900}
WIDTH_SLACK_PX = 12            # the live figure against its output's content width
FOLDED_MAX_PX = 60             # the folded settings: one accordion title bar

# Where things are on screen, for the session's Panel cell: the status line, the live figure (its graph div and
# the SVG drawn in it), the settings, the output area (content box) and the element that scrolls the notebook.
_LAYOUT = """
cell => {
  const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right, width: r.width, height: r.height}; };
  const q = s => cell.querySelector(s);
  const out = q('.jp-OutputArea-output');
  const style = out && getComputedStyle(out);
  let scroller = cell.parentElement;
  while (scroller && !(['auto', 'scroll'].includes(getComputedStyle(scroller).overflowY)
                       && scroller.scrollHeight > scroller.clientHeight)) scroller = scroller.parentElement;
  const plot = q('.nbtrain-dashboard .js-plotly-plot');
  const settings = q('.nbtrain-settings');
  const tabs = settings && [...settings.querySelectorAll('.lm-TabBar, .widget-tab, .jupyter-widget-Tab')]
    .filter(e => e.getClientRects().length > 0 && e.getBoundingClientRect().height > 0);
  return {
    viewport: {width: innerWidth, height: innerHeight},
    status: box(q('.nbtrain-status')), plot: box(plot), svg: box(plot && plot.querySelector('.main-svg')),
    settings: box(settings), settings_tabs_shown: tabs ? tabs.length : null,
    output: out && {...box(out), content_width: out.clientWidth - parseFloat(style.paddingLeft)
                                                 - parseFloat(style.paddingRight)},
    scroller: scroller && {...box(scroller), cls: scroller.className, scrollTop: scroller.scrollTop},
  };
}
"""
# Scroll the notebook so that the upper of the status line and the live figure is at the top of its scroll area.
_SCROLL_TO_STATUS = """
cell => {
  const els = [cell.querySelector('.nbtrain-status'), cell.querySelector('.nbtrain-dashboard .js-plotly-plot')];
  const top = Math.min(...els.map(e => e.getBoundingClientRect().top));
  let s = cell.parentElement;
  while (s && !(['auto', 'scroll'].includes(getComputedStyle(s).overflowY) && s.scrollHeight > s.clientHeight))
    s = s.parentElement;
  if (s) s.scrollTop += top - s.getBoundingClientRect().top - 4;
}
"""
# In the dashboard after a Compare: the top of the verdicts, the table and the first figure; every annotation and
# title drawn in its figures (text and box), to find overprints and repeats.
_AFTER_COMPARE = """
dash => {
  const box = el => { if (!el) return null; const r = el.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right}; };
  const texts = [];
  dash.querySelectorAll('.js-plotly-plot').forEach((gd, fig) => {
    gd.querySelectorAll('g.annotation, g.g-gtitle, text.gtitle').forEach(g => {
      const t = (g.textContent || '').trim();
      if (t) texts.push({fig, text: t, ...box(g)});
    });
  });
  // a sentence shown twice in the Panel: a list item or paragraph (outside the collapsed full table) whose text is
  // also inside another one that neither holds it nor is held by it
  const shown = [...dash.closest('.jp-OutputArea-output').querySelectorAll('li, p')]
    .filter(e => e.getClientRects().length > 0 && !e.closest('details:not([open])')
                 && (e.innerText || '').trim().length >= 40);
  const repeated = shown.filter(a => shown.some(b => a !== b && !a.contains(b) && !b.contains(a)
                                                     && b.innerText.includes(a.innerText.trim())))
    .map(e => e.innerText.trim());
  return {verdicts: box(dash.querySelector('.nbtrain-verdicts')), table: box(dash.querySelector('.nbtrain-table')),
          figure: box(dash.querySelector('.js-plotly-plot')), texts, repeated};
}
"""


def _inside(inner: dict, outer: dict, slack: float = 1.0) -> bool:
    return (inner["top"] >= outer["top"] - slack and inner["bottom"] <= outer["bottom"] + slack
            and inner["left"] >= outer["left"] - slack and inner["right"] <= outer["right"] + slack)


def _overlaps(a: dict, b: dict) -> bool:
    return min(a["right"], b["right"]) - max(a["left"], b["left"]) > 1 and \
        min(a["bottom"], b["bottom"]) - max(a["top"], b["top"]) > 1

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
    nb.cells = [nbformat.v4.new_code_cell(src) for src in [recorder_cell(folder / RECORD_FILE), *CELLS]]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / NOTEBOOK)


def _shot(locator, name: str, readme: bool = True) -> None:
    """A screenshot of ``locator`` (an element, or a page: the viewport) in test-artifacts/, and, for the README's
    pictures, in $NBTRAIN_SCREENSHOTS when set."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"e2e-{name}.png"
    locator.screenshot(path=str(path))
    extra = os.environ.get("NBTRAIN_SCREENSHOTS")
    if extra and readme:
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
    one_retry_on_stall(lab, lambda: _comparison_results(lab))


def _comparison_results(lab):
    from playwright.sync_api import expect, sync_playwright

    url = f"{lab.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{NOTEBOOK}?reset&token={lab.token}"
    problems: list[str] = []
    record = lab.root / RECORD_FILE
    with sync_playwright() as p, kernel_stacks_on_failure(lab), _kernel_errors_on_failure(record):
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
            expect(prompts).to_have_count(1 + len(CELLS))
            try:
                _wait_until_ran(nb, RUN_ALL_TIMEOUT_S, lab)
            except AssertionError as e:   # what the browser said on the way is the likeliest clue
                e.add_note("browser console errors:\n" + "\n".join(problems[-20:]))
                page.screenshot(path=str(ARTIFACTS / "e2e-results-run-all.png"), full_page=True)
                raise
            fire_canary(page, nb, record)
            cells = nb.locator(".jp-CodeCell")

            def cell_of(i):   # CELLS[i]; cell 0 is the recorder
                return cells.nth(1 + i)


            def button(cell, label):
                return cell.locator("button.widget-button", has_text=re.compile(rf"^\s*{label}\s*$"))

            # -- 1. the comparison table in a 968 px output --------------------------------------------------
            panel = cell_of(1)
            panel.scroll_into_view_if_needed()
            output = panel.locator(".jp-OutputArea-output").first
            output.evaluate(f"el => {{ el.style.width = '{OUTPUT_WIDTH_PX}px'; el.style.maxWidth = "
                            f"'{OUTPUT_WIDTH_PX}px'; el.style.flex = '0 0 {OUTPUT_WIDTH_PX}px'; }}")
            compare = button(panel, "Compare precisions")
            widget_shown(panel, compare, "the Panel's Compare button")
            compare.click()
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
            fig_cell = cell_of(3)
            fig_cell.scroll_into_view_if_needed()
            plot = fig_cell.locator(".js-plotly-plot").first
            expect(plot).to_be_visible(timeout=60_000)
            ticks = plot.evaluate(_SCALE_TICKS)
            assert ticks and "65,536" in ticks, f"loss-scale tick labels: {ticks}"
            assert not any(re.fullmatch(r"\d", t) for t in ticks), f"crowded minor tick labels: {ticks}"
            _shot(fig_cell.locator(".jp-OutputArea-output").first, "scale-panel")
            live = cell_of(2).locator(".js-plotly-plot").first
            if live.count():
                live_ticks = live.evaluate(_SCALE_TICKS)
                assert live_ticks and "65,536" in live_ticks, f"live loss-scale tick labels: {live_ticks}"

            # -- 3. Stop during a comparison stops the comparison -------------------------------------------
            stopper = cell_of(4)
            stopper.scroll_into_view_if_needed()
            compare = button(stopper, "Compare precisions")
            widget_shown(stopper, compare, "the second Panel's Compare button")
            compare.click()
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

            # -- 4. Train, Stop and Compare of four precisions on one 1440x900 screen ---------------------
            session = _panel_session(page, cell_of(5), button)
            what = ("the Panel session on a 1440x900 screen (screenshots: test-artifacts/e2e-panel-*.png):\n"
                    + "\n".join(f"- {p}" for p in session))

            console = log_console_entries(page)
            _shot(page, "log-console", readme=False)
            try:
                assert_only_canary(record, console)
            except AssertionError as e:
                if session:
                    e.add_note(what)
                raise
            assert not session, what
        finally:
            browser.close()
    known = [(m, why) for m in problems for app, pattern, why in KNOWN_UPSTREAM_ERRORS
             if app == "lab" and pattern.match(m)]
    errors = [m for m in problems if m not in {k for k, _ in known}]
    assert not errors, "browser console errors:\n" + "\n".join(errors)


@contextlib.contextmanager
def _kernel_errors_on_failure(record: Path):
    """A failure inside carries what the kernel's error recorder holds by then."""
    try:
        yield
    except Exception as e:
        errors = recorded(record)
        e.add_note(f"--- the kernel's error recorder: {len(errors)} entr{'y' if len(errors) == 1 else 'ies'} "
                   f"(the canary is one) ---\n" + "\n\n".join(errors)[-6000:])
        raise


def _layout(cell) -> dict:
    return cell.evaluate(_LAYOUT)


def _settings_problem(lay: dict, folded: bool, when: str) -> list[str]:
    """What is wrong with the settings' state (folded while a run goes, shown otherwise), or nothing."""
    settings = lay["settings"]
    if settings is None:
        return [f"{when}: no .nbtrain-settings in the Panel"]
    if folded and not (settings["height"] <= FOLDED_MAX_PX and lay["settings_tabs_shown"] == 0):
        return [f"{when}: the settings are not folded: {settings['height']:.0f} px tall (one title bar is at most "
                f"{FOLDED_MAX_PX}), {lay['settings_tabs_shown']} tab bar(s) shown"]
    if not folded and not (settings["height"] > FOLDED_MAX_PX and lay["settings_tabs_shown"]):
        return [f"{when}: the settings are not shown: {settings['height']:.0f} px tall, "
                f"{lay['settings_tabs_shown']} tab bar(s) shown"]
    return []


def _width_problem(lay: dict, when: str) -> list[str]:
    """The dashboard's figure (its graph div and the SVG plotly drew) against the output area's content width."""
    want = lay["output"]["content_width"]
    return [f"{when}: the figure's {part} is {lay[part]['width']:.0f} px wide, the output area {want:.0f} px"
            for part in ("plot", "svg") if abs(lay[part]["width"] - want) > WIDTH_SLACK_PX]


# Each figure's traces as the browser holds them: a trace with y values but no x (or fewer) is drawn at 0, 1, 2, ...
# instead of its steps (what plotly's trace deltas did to the clip line, the memory and the Δloss lines).
_TRACES_WITHOUT_X = """
dash => [...dash.querySelectorAll('.js-plotly-plot')].flatMap((gd, fig) => (gd.data || []).map(t => ({
    fig, name: JSON.stringify(t.meta || t.name || null), x: t.x ? t.x.length : 0, y: t.y ? t.y.length : 0}))
  .filter(t => t.y > 0 && t.x !== t.y))
"""


def _x_problems(dash, when: str) -> list[str]:
    bad = dash.evaluate(_TRACES_WITHOUT_X)
    return [f"{when}: {len(bad)} trace(s) in the browser have y values without as many x values (drawn at 0, 1, "
            f"2, … instead of their steps): "
            + "; ".join(f"figure {t['fig']} {t['name']}: {t['x']} x for {t['y']} y" for t in bad)] if bad else []


def _panel_session(page, cell, button) -> list[str]:
    """Train, Stop, Compare of SESSION_PRECISIONS in the session Panel at 1440x900 (issue 35, Must hold 2). The
    flow fails at once when it cannot go on; what the screen shows on the way is returned, every problem found
    (the screenshots are in test-artifacts/)."""
    from playwright.sync_api import expect

    problems: list[str] = []
    page.set_viewport_size(SCREEN)
    cell.scroll_into_view_if_needed()
    train, stop = button(cell, "Train"), button(cell, "Stop")
    widget_shown(cell, train, "the session Panel's Train button")
    expect(train).to_be_enabled()
    expect(cell.locator(".nbtrain-settings")).to_be_visible()
    problems += _settings_problem(_layout(cell), folded=False, when="before Train")

    train.click()
    expect(stop).to_be_enabled(timeout=30_000)
    plot = cell.locator(".nbtrain-dashboard .js-plotly-plot").first
    expect(plot).to_be_visible(timeout=120_000)
    deadline = time.monotonic() + 180
    while not any(n >= 1 for n in plot.evaluate(_POINTS_PER_PANEL).values()):   # the first point drawn
        # what the cell shows (the status line: the step reached, or an error) and whether Stop is still enabled
        assert time.monotonic() < deadline, (f"no point drawn in the live figure in 180 s; Stop enabled: "
                                             f"{stop.is_enabled()}; the cell shows:\n{cell.inner_text()[-2000:]}")
        time.sleep(0.2)
    problems += _width_problem(_layout(cell), "at the first point")
    drawn = PANELS - {"scale"}   # fp32 has no loss scale: that panel only says so
    while True:   # a few points in the other panels
        counts = plot.evaluate(_POINTS_PER_PANEL)
        if all(counts.get(k, 0) >= 2 for k in drawn):
            break
        assert time.monotonic() < deadline, f"the plots {sorted(drawn)} did not get points: {counts}"
        time.sleep(0.5)
    cell.evaluate(_SCROLL_TO_STATUS)
    time.sleep(0.5)   # the notebook re-lays out what scrolled into view
    lay = _layout(cell)
    expect(stop).to_be_enabled()   # still running
    screen = {"top": 0, "left": 0, "bottom": lay["viewport"]["height"], "right": lay["viewport"]["width"]}
    for part in ("status", "plot"):
        if lay[part] is None or not (_inside(lay[part], screen) and _inside(lay[part], lay["scroller"])):
            problems.append(f"during the run (status line scrolled to the top) the {part} is not all in view: status "
                            f"{lay['status']}, figure {lay['plot']}, viewport {lay['viewport']}, the notebook's "
                            f"scroll area {lay['scroller']}")
    problems += _width_problem(lay, "during the run")
    problems += _x_problems(cell.locator(".nbtrain-dashboard"), "during the run")
    problems += _settings_problem(lay, folded=True, when="during the run")
    _shot(page, "panel-running")

    stop.click()
    expect(cell.locator(".nbtrain-status").get_by_text("stopped (history kept)")).to_be_visible(timeout=120_000)
    expect(train).to_be_enabled()
    time.sleep(0.5)
    problems += _settings_problem(_layout(cell), folded=True, when="after Stop")   # issue 46: they stay folded

    # a short Compare: Max steps typed in the Training tab, as a person would (a click opens the folded settings)
    cell.locator(".nbtrain-settings .jupyter-widget-Collapse-header").first.click()
    cell.locator(".lm-TabBar-tab", has_text=re.compile(r"^\s*Training\s*$")).first.click()
    steps = cell.locator(".widget-text", has_text="Max steps").locator("input").first
    steps.fill(str(SESSION_COMPARE_STEPS))
    steps.press("Tab")
    button(cell, "Compare precisions").click()
    expect(stop).to_be_enabled(timeout=30_000)
    problems += _settings_problem(_layout(cell), folded=True, when="during the Compare")
    done = cell.locator(".nbtrain-status").get_by_text(re.compile(r"^\s*done — "))
    expect(done).to_be_visible(timeout=300_000)
    expect(train).to_be_enabled()
    time.sleep(1)
    lay = _layout(cell)
    problems += _settings_problem(lay, folded=True, when="after the Compare")
    problems += _width_problem(lay, "after the Compare")
    dash = cell.locator(".nbtrain-dashboard")
    expect(dash.locator(".nbtrain-table")).to_be_visible()
    table = dash.locator(".nbtrain-table").inner_text()
    problems += [f"after the Compare the table does not name {name}" for name in SESSION_PRECISIONS
                 if name not in table]
    dash.evaluate("d => d.scrollIntoView({block: 'start'})")
    time.sleep(0.5)
    after = dash.evaluate(_AFTER_COMPARE)
    order = [(k, after[k]) for k in ("verdicts", "table", "figure")]
    missing = [k for k, b in order if b is None]
    if missing:
        problems.append(f"after the Compare the dashboard has no {missing}")
    elif not (after["verdicts"]["bottom"] <= after["table"]["top"] + 1
              and after["table"]["bottom"] <= after["figure"]["top"] + 1):
        problems.append("after the Compare the dashboard is not verdicts, then table, then figure: "
                        + ", ".join(f"{k} {b['top']:.0f}-{b['bottom']:.0f} px" for k, b in order))
    texts = after["texts"]
    over = [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[i + 1:]
            if a["fig"] == b["fig"] and _overlaps(a, b)]
    if over:
        problems.append(f"after the Compare titles or annotations are drawn over each other: {over}")
    seen: dict[str, int] = {}
    for t in texts:
        seen[t["text"]] = seen.get(t["text"], 0) + 1
    twice = {t: n for t, n in seen.items() if n > 1}
    if twice:
        problems.append(f"after the Compare a title or note appears more than once in its figures: {twice}")
    if after["repeated"]:
        problems.append(f"after the Compare a note is shown twice in the Panel: {sorted(set(after['repeated']))}")
    problems += _x_problems(dash, "after the Compare")
    _shot(page, "panel-compared-screen", readme=False)
    page.set_viewport_size({"width": SCREEN["width"], "height": 2400})   # the whole dashboard in one picture
    time.sleep(1)
    _shot(dash, "panel-compared")
    page.set_viewport_size(SCREEN)
    return problems
