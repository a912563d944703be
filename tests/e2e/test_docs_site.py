"""`make docs`: the site builds offline (pages, the API reference from the docstrings, a notebook executed with
its figure) and opens in Chromium with no console error, from disk, with the network off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .test_browser import BROWSER_ARGS, CHROMIUM, ROOT, _missing

# A short notebook that draws a plotly figure (the static one a headless LiveDashboard leaves)
NOTEBOOK = "A1_hf_trainer_dashboard"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "tools/build_docs.py", "--only", NOTEBOOK, "--site", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert json.loads(p.stdout.strip().splitlines()[-1])["notebooks"] == [NOTEBOOK]
    return out


def _open(page, url: str) -> list[str]:
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    page.goto(url, wait_until="load")
    page.wait_for_timeout(500)
    return errors


def test_the_site_opens_offline_with_its_api_and_a_live_figure(site):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        ctx = browser.new_context(offline=True, viewport={"width": 1280, "height": 900})
        try:
            page = ctx.new_page()
            errors = _open(page, (site / "index.html").as_uri())
            assert "nbtrain" in page.title()
            assert page.locator("a[href$='precision.html']").count() > 0
            assert not errors, errors

            page = ctx.new_page()
            errors = _open(page, (site / "api.html").as_uri())
            # generated from the docstrings: the config's class and train()'s signature are there
            assert page.locator("h3#nbtrain\\.TrainConfig, [id='nbtrain.TrainConfig']").count() > 0
            assert page.get_by_text("Train").count() > 0 and page.locator("[id='nbtrain.train']").count() > 0
            assert not errors, errors

            page = ctx.new_page()
            errors = _open(page, (site / "notebooks" / f"{NOTEBOOK}.html").as_uri())
            plot = page.locator(".js-plotly-plot").first
            plot.wait_for(timeout=20_000)   # drawn by plotly.js from the site, with the network off
            assert plot.locator(".main-svg").count() > 0
            assert not errors, errors
        finally:
            browser.close()
