"""Real-browser Run All of the tutorials that the other browser tests do not open (07 image classification, 08
instruction tuning), in JupyterLab driven by Chromium: every cell runs, no traceback, no stderr box, no browser console error.
"""

from __future__ import annotations

import json
import secrets
import shutil

import pytest

from .test_browser import (ARTIFACTS, BROWSER_ARGS, CHROMIUM, KNOWN_UPSTREAM_ERRORS, ROOT, JupyterServer,
                           _missing, _run_all, _wait_for_kernel, _wait_until_ran)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]

RUN_ALL_TIMEOUT_S = 500


@pytest.mark.parametrize("notebook", ["07_image_classification.ipynb", "08_instruction_tuning.ipynb"])
def test_tutorial_runs_all_in_jupyterlab(tmp_path, notebook):
    from playwright.sync_api import expect, sync_playwright

    srv = JupyterServer("lab", tmp_path)
    shutil.copy(ROOT / "notebooks" / notebook, srv.root / notebook)
    srv.start()
    problems: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 2200})
                page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}")
                        if m.type == "error" else None)
                page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
                page.goto(f"{srv.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{notebook}"
                          f"?reset&token={srv.token}")
                nb = page.locator(".jp-NotebookPanel:visible")
                expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
                _wait_for_kernel(srv)
                _run_all(page)
                n_code = sum(c["cell_type"] == "code"
                             for c in json.loads((ROOT / "notebooks" / notebook).read_text())["cells"])
                prompts = nb.locator(".jp-CodeCell .jp-InputPrompt")
                expect(prompts).to_have_count(n_code)
                _wait_until_ran(nb, RUN_ALL_TIMEOUT_S)
                outputs = "\n".join(nb.locator(".jp-OutputArea").all_inner_texts())
                assert "Traceback (most recent call last)" not in outputs and "AssertionError" not in outputs, \
                    outputs[-3000:]
                assert nb.locator("[data-mime-type='application/vnd.jupyter.stderr']").count() == 0, \
                    "a red stderr box in the tutorial"
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / f"e2e-{notebook.removesuffix('.ipynb')}.png"), full_page=True)
            finally:
                browser.close()
    finally:
        srv.stop()
    known = {m for m in problems for app, pattern, _ in KNOWN_UPSTREAM_ERRORS if app == "lab" and pattern.match(m)}
    errors = [m for m in problems if m not in known]
    assert not errors, "browser console errors:\n" + "\n".join(errors)
