"""Real-browser tests: 01_quickstart in JupyterLab and in Notebook 7, and Run All of 08_instruction_tuning (the real
SmolLM2 model) in JupyterLab, driven by Chromium through playwright.

Each test starts its own Jupyter server on 127.0.0.1 with a temporary config, runtime, settings and
workspace directory and a copy of the notebook (the browser saves what it runs; the repo's notebooks
stay stripped). It runs all cells, clicks Train in the panel, waits until the four live plots (loss, grad
norm, loss scale, memory) have points in the rendered plotly DOM, clicks Stop, waits for the status to say
stopped, checks the browser console for errors, and saves a screenshot to test-artifacts/. The notebook's first
cell records the kernel's errors outside the cells (tests/e2e/kernel_errors.py): in the end the recorder (and, in
JupyterLab, the log console) must hold the deliberate canary and nothing else. The server is
stopped by its PID (after its kernels are shut down through the REST API). The REST polling retries what a
starting server answers now and then (a 5xx, a connection refused or reset) until its deadline, and fails at
once on anything else (``_transient``; tested without a browser in test_browser_polling.py).

Needs Debian's chromium at /usr/bin/chromium and the playwright Python package (``make setup`` installs
both; ``playwright install`` is never used). Without them the tests skip and say which one is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ..helpers import START_ATTEMPTS, free_port, port_in_use

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "01_quickstart.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"]
PANELS = {"loss", "grad_norm", "scale", "memory"}
RUN_ALL_TIMEOUT_S = 300     # the whole notebook, in a real kernel, on 2 busy cores
POINTS_TIMEOUT_S = 180      # from the Train click to points in all four plots
# Browser errors that come from the frontend itself, not from nbtrain, each with its upstream report. Only
# these exact messages, and only in the app named, are let through; every other console error fails the test.
KNOWN_UPSTREAM_ERRORS = [
    ("notebook", re.compile(r"^page error: Cannot read properties of undefined \(reading 'schema'\)$"),
     "jupyter/notebook#7862: Notebook 7's shortcut settings transform races the settings registry at start-up"),
]
# User settings for both frontends: render every cell (no windowing, so every prompt can be read) and
# do not ask about fetching news (the test is offline).
SETTINGS = {"@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
            "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"}}


def _missing() -> str | None:
    if not Path(CHROMIUM).is_file():
        return (f"Debian's chromium is not installed at {CHROMIUM} (apt-get install chromium; "
                "`make setup` does it)")
    for module, pip_name in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"), ("notebook", "notebook")):
        if importlib.util.find_spec(module) is None:
            return f"the {pip_name} Python package is not installed (it is in the dev extra: pip install -e '.[dev]')"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_missing() is not None, reason=_missing() or "")]


# What a Jupyter server answers now and then while it starts a kernel or itself: a 5xx (GET /api/kernels has
# answered 500 about one fresh run in seven while the kernel started), or a connection refused (not listening
# yet) or reset (http.client's RemoteDisconnected is a ConnectionResetError). The polling helpers retry these
# until their deadline; any other error (a 4xx such as a wrong token, a timeout, bad JSON) fails at once.
TRANSIENT_CONNECTION_ERRORS = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError)
RETRY_PAUSE_S = 0.5


def _transient(e: BaseException) -> bool:
    """Whether a REST call's error is the server still starting (retry it) rather than a real failure."""
    if isinstance(e, urllib.error.HTTPError):
        return 500 <= e.code < 600
    if isinstance(e, urllib.error.URLError):
        return isinstance(e.reason, TRANSIENT_CONNECTION_ERRORS)
    return isinstance(e, TRANSIENT_CONNECTION_ERRORS)


class JupyterServer:
    """``jupyter lab`` or ``jupyter notebook`` on 127.0.0.1, everything it writes under ``tmp``."""

    def __init__(self, app: str, tmp: Path, notebook: str = NOTEBOOK):
        self.app, self.tmp, self.notebook = app, tmp, notebook
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.root = tmp / "work"
        self.root.mkdir()
        shutil.copy(ROOT / "notebooks" / notebook, self.root / notebook)
        dirs = {name: tmp / name for name in ("config", "data", "runtime", "ipython", "settings", "workspaces")}
        for d in dirs.values():
            d.mkdir()
        config = {
            "ServerApp": {"ip": "127.0.0.1", "port": self.port, "port_retries": 0, "open_browser": False,
                          "root_dir": str(self.root), "allow_root": True},   # allow_root: CI containers run as root
            "IdentityProvider": {"token": self.token},
            # offline: no announcements, no update check, no PyPI extension manager
            "LabApp": {"news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
                       "extension_manager": "readonly"},
        }
        self._config, self._config_file = config, dirs["config"] / "jupyter_server_config.json"
        self._config_file.write_text(json.dumps(config, indent=1))
        for plugin, values in SETTINGS.items():
            f = dirs["settings"] / f"{plugin}.jupyterlab-settings"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(values))
        self.env = {**os.environ, "JUPYTER_CONFIG_DIR": str(dirs["config"]), "JUPYTER_DATA_DIR": str(dirs["data"]),
                    "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]), "IPYTHONDIR": str(dirs["ipython"]),
                    "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
                    "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        self.env.pop("JPY_SESSION_NAME", None)
        # Every kernel of this server dumps its Python stacks (all threads) into stacks.txt on SIGUSR1: what a
        # test that timed out waiting for a cell shows (kernel_stacks()).
        self.stacks = tmp / "stacks.txt"
        startup = dirs["ipython"] / "profile_default" / "startup"
        startup.mkdir(parents=True)
        (startup / "00-stacks.py").write_text(
            "import faulthandler, signal\n"
            f"faulthandler.register(signal.SIGUSR1, file=open({str(self.stacks)!r}, 'a'), all_threads=True)\n")
        self.log = tmp / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> None:
        """Start the server and wait until it answers; a port taken by another process between choosing and
        binding it is the one failure retried (with a new port), up to START_ATTEMPTS times."""
        for attempt in range(START_ATTEMPTS):
            try:
                return self._start(timeout)
            except RuntimeError as e:
                if not port_in_use(str(e)) or attempt == START_ATTEMPTS - 1:
                    raise
                self.port = free_port()
                self.base = f"http://127.0.0.1:{self.port}"
                self._config["ServerApp"]["port"] = self.port
                self._config_file.write_text(json.dumps(self._config, indent=1))

    def _start(self, timeout: float) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyter", self.app], env=self.env, cwd=self.root,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter {self.app} exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                self.api("GET", "/api/status")
                return
            except Exception as e:
                if not _transient(e):
                    raise RuntimeError(f"jupyter {self.app}: GET /api/status failed ({e!r}):\n"
                                       f"{self.log.read_text()}") from e
                time.sleep(RETRY_PAUSE_S)
        self.proc.kill()
        raise RuntimeError(f"jupyter {self.app} did not answer in {timeout} s:\n{self.log.read_text()[-4000:]}")

    def api(self, method: str, path: str):
        req = urllib.request.Request(f"{self.base}{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def poll_api(self, method: str, path: str, deadline: float):
        """``api()``, retrying transient errors (:func:`_transient`) until ``deadline`` (``time.monotonic()``);
        the last one is raised once it has passed. Any other error is raised at once."""
        while True:
            try:
                return self.api(method, path)
            except Exception as e:
                if not _transient(e):
                    raise
                if time.monotonic() >= deadline:
                    e.add_note(f"{method} {path}: still failing at the deadline, after retries of transient errors")
                    raise
                time.sleep(RETRY_PAUSE_S)

    def kernel_stacks(self) -> str:
        """The Python stacks of this server's kernels now (SIGUSR1 to each; see __init__), with the tail of the
        server's log: what a timed-out wait reports."""
        import psutil

        if self.proc is None:
            return ""
        try:
            kernels = [c for c in psutil.Process(self.proc.pid).children(recursive=True)
                       if "ipykernel" in " ".join(c.cmdline())]
        except psutil.Error:
            kernels = []
        for k in kernels:
            try:
                k.send_signal(signal.SIGUSR1)
            except psutil.Error:
                pass
        time.sleep(3)
        stacks = self.stacks.read_text(errors="replace") if self.stacks.is_file() else "(none dumped)"
        log = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return (f"--- {len(kernels)} kernel(s): Python stacks ---\n{stacks[-6000:]}\n"
                f"--- jupyter {self.app} log tail ---\n{log[-3000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:   # kernels first, so that none outlives the server
            deadline = time.monotonic() + 10
            for k in self.poll_api("GET", "/api/kernels", deadline) or []:
                self.poll_api("DELETE", f"/api/kernels/{k['id']}", deadline)
        except Exception:
            pass
        self.proc.terminate()          # SIGTERM to the server's own PID
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# Notebook 7 runs the quickstart only up to the cell that shows the Panel: what it adds over JupyterLab is the
# Panel's clicks in that frontend (the whole notebook runs in JupyterLab here and headless in test_notebooks).
def _through_the_panel(cells: list) -> list:
    panel = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and "nbt.Panel(" in "".join(c["source"]))
    return cells[:panel + 1]


def _with_checks(nb: dict, name: str) -> dict:
    import nbformat

    from ..test_notebooks import with_checks

    return with_checks(nbformat.from_dict(nb), ROOT / "notebooks" / name)


# Notebook 7 runs in make test-course (the course's second frontend); make test keeps JupyterLab, where the Panel
# tests also run
@pytest.fixture(params=["lab", pytest.param("notebook", marks=pytest.mark.course)], ids=["jupyterlab", "notebook7"])
def server(request, tmp_path):
    from .kernel_errors import RECORD_FILE, recorder_cell

    srv = JupyterServer(request.param, tmp_path)
    nb = json.loads((srv.root / NOTEBOOK).read_text())
    if request.param == "notebook":
        nb["cells"] = _through_the_panel(nb["cells"])
    else:   # Run All runs the notebook's library checks too (tests/notebook_checks), as the headless run would
        nb = _with_checks(nb, NOTEBOOK)
    # first, the recorder of the kernel's errors outside the cells (tests/e2e/kernel_errors.py)
    nb["cells"].insert(0, {"cell_type": "code", "id": "e2e-kernel-errors", "metadata": {}, "outputs": [],
                           "execution_count": None, "source": recorder_cell(srv.root / RECORD_FILE)})
    (srv.root / NOTEBOOK).write_text(json.dumps(nb))
    srv.start()
    yield srv
    srv.stop()
    assert srv.proc.poll() is not None


# JS run in the page: for the dashboard's plotly graph div, the points drawn in the rendered SVG for the main
# trace of each of the four panels (found by the trace's ``meta``, drawn in the ``g.trace<uid>`` group):
# its markers, or the vertices of its line, whichever is more.
_POINTS_PER_PANEL = """
gd => {
  const main = {loss: ['loss'], grad_norm: ['grad_norm'], scale: ['scale'], memory: ['host_rss', 'vram_allocated']};
  const out = {};
  for (const t of gd._fullData || []) {
    const meta = t.meta || {};
    if (!(main[meta.panel] || []).includes(meta.kind)) continue;
    const g = gd.querySelector('.scatterlayer .trace' + t.uid);
    let n = 0;
    if (g) {
      const vertices = [...g.querySelectorAll('path.js-line')]
        .map(p => ((p.getAttribute('d') || '').match(/[ML]/g) || []).length).reduce((a, b) => a + b, 0);
      n = Math.max(g.querySelectorAll('path.point').length, vertices);
    }
    out[meta.panel] = Math.max(out[meta.panel] || 0, n);
  }
  return out;
}
"""


@contextlib.contextmanager
def kernel_stacks_on_failure(server: JupyterServer):
    """A failure inside (a playwright wait that timed out, an assertion) carries the server's kernels' stacks and
    the tail of its log."""
    try:
        yield
    except Exception as e:
        e.add_note(server.kernel_stacks())
        raise


def _wait_for_kernel(server: JupyterServer, timeout: float = 120) -> None:
    """Until the page's kernel is started, idle, and connected to the browser by its websocket."""
    deadline = time.monotonic() + timeout
    while True:
        kernels = server.poll_api("GET", "/api/kernels", deadline) or []
        if any(k["execution_state"] == "idle" and k.get("connections", 0) > 0 for k in kernels):
            return
        assert time.monotonic() < deadline, f"no connected idle kernel after {timeout} s: {kernels}"
        time.sleep(0.5)


def _run_all(page, timeout: float = 60) -> None:
    """Run > Run All Cells through the menu bar (the same in JupyterLab and Notebook 7), once it is enabled."""
    deadline = time.monotonic() + timeout
    while True:
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        item = page.get_by_role("menuitem", name="Run All Cells", exact=True)
        item.wait_for()
        if "lm-mod-disabled" not in (item.get_attribute("class") or ""):
            item.click()
            return
        page.keyboard.press("Escape")   # not ready yet (the notebook's session is still starting)
        assert time.monotonic() < deadline, f"Run All Cells stayed disabled for {timeout} s"
        time.sleep(1)


class FrontendStall(AssertionError):
    """Every kernel has been idle for STALL_IDLE_S while the page still shows a cell running: the kernel finished,
    the frontend never took in the end of the run (seen now and then on 2 busy cores: issues 35 and 36, with an idle
    kernel, no browser console error and nothing in the kernel's error record). ``one_retry_on_stall`` runs the
    test once more from a restarted kernel and a new page; a second stall fails."""


STALL_IDLE_S = 60


def _kernels_idle_s(server: "JupyterServer") -> float | None:
    """Seconds since the last activity of this server's kernels when all are idle; None while any is busy (or the
    server cannot say)."""
    import datetime as dt

    try:
        kernels = server.api("GET", "/api/kernels") or []
    except Exception:   # noqa: BLE001 - no answer: no judgement
        return None
    if not kernels or any(k.get("execution_state") != "idle" for k in kernels):
        return None
    last = max(dt.datetime.fromisoformat(k["last_activity"].replace("Z", "+00:00")) for k in kernels)
    return (dt.datetime.now(dt.timezone.utc) - last).total_seconds()


# What a widget output shows while the frontend has not drawn its view (@jupyter-widgets/jupyterlab-manager): the
# model's state never arrived, or arrived after the output asked for it.
_WIDGET_NOT_DRAWN = ("Loading widget...", "Error displaying widget")


def widget_shown(cell, locator, what: str, timeout_s: float = 60) -> None:
    """Until ``locator`` (a control of the widget that ``cell`` displays) is visible. When it never is, the failure
    says what the cell's output shows; an output where the frontend drew no widget view at all (only
    _WIDGET_NOT_DRAWN's placeholders, or nothing) after Run All ended is a FrontendStall, like a cell the page
    never saw end (once, on 2 busy cores: the Panel's output stayed without its buttons for 30 s)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        locator.wait_for(state="visible", timeout=timeout_s * 1000)
        return
    except PlaywrightTimeout:
        pass
    out = cell.locator(".jp-OutputArea-output")
    texts = [t.strip() for t in out.all_inner_texts()]
    views = cell.locator(".jp-OutputArea-output .widget-button, .jp-OutputArea-output .widget-box").count()
    said = (f"{what} not visible in {timeout_s:.0f} s; the cell's {len(texts)} output(s) show {texts!r:.1500} "
            f"({views} widget view element(s) drawn)")
    if views == 0 and all(not t or any(t.startswith(p) for p in _WIDGET_NOT_DRAWN) for t in texts):
        raise FrontendStall(said)
    raise AssertionError(said)


def one_retry_on_stall(server: "JupyterServer", body) -> None:
    """``body()``, and once more after a FrontendStall, from a restarted kernel (the kernel-error record removed:
    Run All writes it afresh); any other failure, or a second stall, fails the test."""
    from .kernel_errors import RECORD_FILE

    try:
        body()
        return
    except FrontendStall as e:
        print(f"frontend stall, the test runs once more from a restarted kernel: {str(e).splitlines()[0]}")
    for k in server.api("GET", "/api/kernels") or []:
        server.api("POST", f"/api/kernels/{k['id']}/restart")
    (server.root / RECORD_FILE).unlink(missing_ok=True)
    body()


def _wait_until_ran(nb, timeout: float, server: "JupyterServer | None" = None) -> None:
    """Until every code cell of notebook panel ``nb`` shows an execution count and none a "*"; a traceback
    on the way fails at once. On the timeout the failure carries the kernels' stacks (``server``); a page that
    still shows a cell running after the kernel has been idle for STALL_IDLE_S raises FrontendStall."""
    prompts = nb.locator(".jp-CodeCell .jp-InputPrompt")
    deadline = time.monotonic() + timeout
    while True:
        texts = prompts.all_inner_texts()
        if all(any(ch.isdigit() for ch in t) for t in texts) and not any("*" in t for t in texts):
            return
        assert "Traceback (most recent call last)" not in nb.inner_text(), nb.inner_text()[-3000:]
        idle = _kernels_idle_s(server) if server is not None and any("*" in t for t in texts) else None
        if idle is not None and idle > STALL_IDLE_S:
            raise FrontendStall(f"the kernel has been idle for {idle:.0f} s, the page still shows {texts}\n"
                                + server.kernel_stacks())
        if time.monotonic() >= deadline:
            raise AssertionError(f"Run All did not finish in {timeout} s: {texts}\n"
                                 + (server.kernel_stacks() if server is not None else ""))
        time.sleep(1)


def _assert_no_stderr_box(nb) -> None:
    """A tutorial shows no red stderr box (what test_notebooks checks headless of the notebooks run only there)."""
    stderr = nb.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
    assert stderr.count() == 0, stderr.all_inner_texts()[:3]
    assert nb.locator('[data-mime-type="application/vnd.jupyter.stdout"]').count() > 0   # the selector reads outputs


def test_quickstart_panel_in_browser(server):
    one_retry_on_stall(server, lambda: _quickstart_panel(server))


def _quickstart_panel(server):
    from playwright.sync_api import expect, sync_playwright

    from .kernel_errors import RECORD_FILE, assert_only_canary, fire_canary, log_console_entries

    ARTIFACTS.mkdir(exist_ok=True)
    name = "jupyterlab" if server.app == "lab" else "notebook7"
    if server.app == "lab":
        url = f"{server.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{NOTEBOOK}?reset&token={server.token}"
    else:
        url = f"{server.base}/notebooks/{NOTEBOOK}?token={server.token}"
    problems: list[str] = []
    with sync_playwright() as p, kernel_stacks_on_failure(server):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(url)
            nb = page.locator(".jp-NotebookPanel:visible")
            expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
            _wait_for_kernel(server)

            _run_all(page)
            prompts = nb.locator(".jp-CodeCell .jp-InputPrompt")
            n_code = sum(c["cell_type"] == "code" for c in json.loads((server.root / NOTEBOOK).read_text())["cells"])
            expect(prompts).to_have_count(n_code)
            _wait_until_ran(nb, RUN_ALL_TIMEOUT_S, server)
            outputs = nb.locator(".jp-OutputArea").all_inner_texts()
            assert not any("Traceback (most recent call last)" in t for t in outputs), "\n".join(outputs)[-3000:]
            if server.app == "lab":   # the whole quickstart (Notebook 7 runs up to the Panel)
                _assert_no_stderr_box(nb)
            record = server.root / RECORD_FILE
            fire_canary(page, nb, record)

            def widget_button(label):
                return page.locator("button.widget-button", has_text=re.compile(rf"^\s*{label}\s*$"))

            cell = nb.locator(".jp-CodeCell").filter(has=widget_button("Train"))   # the cell showing the panel
            expect(cell).to_have_count(1)
            cell.scroll_into_view_if_needed()
            train, stop = cell.locator(widget_button("Train")), cell.locator(widget_button("Stop"))
            expect(train).to_be_enabled()
            # the run the notebook made itself (the whole quickstart only: Notebook 7 runs up to the Panel)
            old_plot = (cell.locator(".js-plotly-plot").first.element_handle()
                        if server.app == "lab" else None)

            train.click()
            expect(stop).to_be_enabled(timeout=30_000)
            if old_plot is not None:
                page.wait_for_function("el => !el.isConnected", arg=old_plot, timeout=30_000)   # a new dashboard
            plot = cell.locator(".js-plotly-plot").first
            expect(plot).to_be_visible(timeout=60_000)
            deadline = time.monotonic() + POINTS_TIMEOUT_S
            while True:
                counts = plot.evaluate(_POINTS_PER_PANEL)
                if set(counts) == PANELS and all(n >= 2 for n in counts.values()):
                    break
                assert time.monotonic() < deadline, f"the four plots did not get points: {counts}"
                time.sleep(0.5)

            status = cell.get_by_text("stopped (history kept)")
            expect(status).to_have_count(0)      # still running: the status is this run's, not the last one's
            stop.click()
            expect(status).to_be_visible(timeout=120_000)
            expect(train).to_be_enabled()
            counts = plot.evaluate(_POINTS_PER_PANEL)
            assert set(counts) == PANELS and all(n >= 2 for n in counts.values()), counts
            cell.scroll_into_view_if_needed()
            cell.locator(".jp-OutputArea").first.screenshot(path=str(ARTIFACTS / f"e2e-{name}-panel.png"))
            page.screenshot(path=str(ARTIFACTS / f"e2e-{name}-page.png"))
            # the kernel's errors outside the cells: the recorder's file, and JupyterLab's log console
            assert_only_canary(record, log_console_entries(page) if server.app == "lab" else None)
        finally:
            browser.close()
    known = [(m, why) for m in problems for app, pattern, why in KNOWN_UPSTREAM_ERRORS
             if app == server.app and pattern.match(m)]
    for m, why in known:
        print(f"known upstream browser error, let through: {m} ({why})")
    errors = [m for m in problems if m not in {k for k, _ in known}]
    assert not errors, "browser console errors:\n" + "\n".join(errors)


REAL_MODEL_NOTEBOOK = "08_instruction_tuning.ipynb"


@pytest.fixture
def lab_real_model(tmp_path):
    """JupyterLab with notebook 08 (instruction tuning on SmolLM2), the kernel-error recorder as its first cell."""
    from .kernel_errors import RECORD_FILE, recorder_cell

    srv = JupyterServer("lab", tmp_path, REAL_MODEL_NOTEBOOK)
    nb = _with_checks(json.loads((srv.root / REAL_MODEL_NOTEBOOK).read_text()), REAL_MODEL_NOTEBOOK)
    nb["cells"].insert(0, {"cell_type": "code", "id": "e2e-kernel-errors", "metadata": {}, "outputs": [],
                           "execution_count": None, "source": recorder_cell(srv.root / RECORD_FILE)})
    (srv.root / REAL_MODEL_NOTEBOOK).write_text(json.dumps(nb))
    srv.start()
    yield srv
    srv.stop()
    assert srv.proc.poll() is not None


@pytest.mark.course   # minutes of SmolLM2 under a browser: make test-course (08 runs alone from the wheel there too)
def test_real_model_notebook_runs_all_in_jupyterlab(lab_real_model, smollm2):
    """Run All of notebook 08 in JupyterLab: every cell runs (its own asserts on SmolLM2's answers included), no
    traceback, no browser console error, and nothing in the kernel's error record but the canary."""
    one_retry_on_stall(lab_real_model, lambda: _real_model_notebook(lab_real_model))


def _real_model_notebook(lab_real_model):
    from playwright.sync_api import expect, sync_playwright

    from .kernel_errors import RECORD_FILE, assert_only_canary, fire_canary, log_console_entries

    server = lab_real_model
    ARTIFACTS.mkdir(exist_ok=True)
    url = (f"{server.base}/lab/workspaces/e2e-{secrets.token_hex(4)}/tree/{REAL_MODEL_NOTEBOOK}?reset"
           f"&token={server.token}")
    problems: list[str] = []
    with sync_playwright() as p, kernel_stacks_on_failure(server):
        browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2200})
            page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(url)
            nb = page.locator(".jp-NotebookPanel:visible")
            expect(nb.locator(".jp-Cell").first).to_be_visible(timeout=120_000)
            _wait_for_kernel(server)
            _run_all(page)
            cells = json.loads((server.root / REAL_MODEL_NOTEBOOK).read_text())["cells"]
            expect(nb.locator(".jp-CodeCell .jp-InputPrompt")).to_have_count(
                sum(c["cell_type"] == "code" for c in cells))
            _wait_until_ran(nb, RUN_ALL_TIMEOUT_S, server)
            outputs = nb.locator(".jp-OutputArea").all_inner_texts()
            text = "\n".join(outputs)
            assert "Traceback (most recent call last)" not in text, text[-3000:]
            _assert_no_stderr_box(nb)
            record = server.root / RECORD_FILE
            fire_canary(page, nb, record)
            page.screenshot(path=str(ARTIFACTS / "e2e-real-model-notebook.png"))
            assert_only_canary(record, log_console_entries(page))
        finally:
            browser.close()
    assert not problems, "browser console errors:\n" + "\n".join(problems)
