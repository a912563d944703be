"""The kernel's own errors in a browser test (issue 35): what ipywidgets' comm handlers, a background thread or a
logger report goes to JupyterLab's log console, never to a cell or to the browser console.

Two independent checks, both proven live by a canary:

* :func:`recorder_cell`, the test notebook's first cell, wraps ``get_ipython().showtraceback`` (what ipywidgets'
  ``_show_traceback`` calls when a widget's ``set_state`` raises, as plotly's trace-delta handler did), adds a
  handler for ERROR records to the root logger and to the kernel's own (comm logs "Exception in comm_msg"), and
  chains ``threading.excepthook`` and ``sys.unraisablehook``; each writes the formatted error to a file in the
  server's folder. It shows a tick box whose observer raises: :func:`fire_canary` ticks it in the browser, so the
  canary travels the very path of the plotly errors (comm message, ``set_state``, ``_show_traceback``).
* :func:`log_console_entries` opens View > Show Log Console and reads its entries.

:func:`assert_only_canary` fails when either holds anything but the one canary, and shows what they hold.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

RECORD_FILE = "kernel_errors.txt"
CANARY = "nbtrain-e2e-canary: deliberate error in a widget callback"
CANARY_LABEL = "kernel-error canary"
SEPARATOR = "\n=====nbtrain-e2e-recorded=====\n"


def recorder_cell(path: Path) -> str:
    """The source of the cell that records the kernel's errors into ``path`` and shows the canary's tick box."""
    return f'''# The browser test's recorder of errors the kernel reports outside any cell (tests/e2e/kernel_errors.py).
import logging, sys, threading, traceback
import ipywidgets
from IPython import get_ipython
from IPython.display import display

_E2E_SEPARATOR = {SEPARATOR!r}
def _e2e_record(kind, text):
    with open({str(path)!r}, "a") as f:
        f.write(f"[{{kind}}] {{text}}" + _E2E_SEPARATOR)

_e2e_ip = get_ipython()
_e2e_showtraceback = _e2e_ip.showtraceback
def _e2e_recorded_showtraceback(exc_tuple=None, *args, **kwargs):
    etype, value, tb = exc_tuple if exc_tuple is not None else sys.exc_info()
    _e2e_record("showtraceback", "".join(traceback.format_exception(etype, value, tb)))
    return _e2e_showtraceback(exc_tuple, *args, **kwargs)
_e2e_ip.showtraceback = _e2e_recorded_showtraceback

class _E2eErrors(logging.Handler):
    def emit(self, record):
        _e2e_record("log " + record.name, logging.Formatter().format(record))
_e2e_handler = _E2eErrors(logging.ERROR)
for _e2e_logger in {{logging.getLogger(), getattr(getattr(_e2e_ip, "kernel", None), "log", logging.getLogger())}}:
    _e2e_logger.addHandler(_e2e_handler)

_e2e_threading_hook = threading.excepthook
def _e2e_thread_error(a):
    _e2e_record(f"thread {{getattr(a.thread, 'name', '?')}}",
                "".join(traceback.format_exception(a.exc_type, a.exc_value, a.exc_traceback)))
    _e2e_threading_hook(a)
threading.excepthook = _e2e_thread_error

_e2e_unraisable_hook = sys.unraisablehook
def _e2e_unraisable(u):
    _e2e_record("unraisable", f"{{u.err_msg or 'unraisable'}}: {{u.object!r}}\\n"
                + "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))
    _e2e_unraisable_hook(u)
sys.unraisablehook = _e2e_unraisable

_e2e_canary = ipywidgets.Checkbox(description={CANARY_LABEL!r}, indent=False)
def _e2e_canary_raises(change):
    raise RuntimeError({CANARY!r})
_e2e_canary.observe(_e2e_canary_raises, "value")
display(_e2e_canary)'''


def recorded(path: Path) -> list[str]:
    """The errors the recorder wrote, one string each."""
    if not path.is_file():
        return []
    return [e.strip() for e in path.read_text(errors="replace").split(SEPARATOR) if e.strip()]


def fire_canary(page, nb, path: Path, timeout: float = 60) -> None:
    """Tick the canary's box in notebook panel ``nb`` and wait until the recorder has written its error."""
    box = nb.locator(".widget-checkbox", has_text=CANARY_LABEL).locator("input[type=checkbox]")
    box.scroll_into_view_if_needed()
    box.check()
    deadline = time.monotonic() + timeout
    while not any(CANARY in e for e in recorded(path)):
        assert time.monotonic() < deadline, (f"the canary's error did not reach the recorder in {timeout} s: "
                                             f"{recorded(path)}")
        time.sleep(0.5)


def log_console_entries(page, timeout: float = 30) -> tuple[str, list[str]]:
    """Open JupyterLab's log console for the current notebook; its status-bar count (as shown before opening it)
    and the text of each of its entries (the default level, warning and above)."""
    badge = page.locator(".jp-StatusBar-Widget .jp-LogConsoleStatusItem, .jp-LogConsoleStatusItem").first
    count = badge.inner_text().strip() if badge.count() else "(no badge)"
    page.locator(".lm-MenuBar-itemLabel", has_text="View").first.click()
    page.get_by_role("menuitem", name=re.compile("Log Console")).first.click()
    panel = page.locator(".jp-LogConsolePanel")
    panel.wait_for(timeout=timeout * 1000)
    deadline = time.monotonic() + timeout
    entries = panel.locator(".jp-OutputArea-child")
    while entries.count() == 0 and time.monotonic() < deadline:   # it renders its logger's messages on opening
        time.sleep(0.5)
    return count, [t.strip() for t in entries.all_inner_texts()]


def assert_only_canary(path: Path, console: tuple[str, list[str]] | None = None) -> None:
    """The recorder's file holds the canary and nothing else; so does the log console (``console``: what
    :func:`log_console_entries` read), when given."""
    errors = recorded(path)
    others = [e for e in errors if CANARY not in e]
    assert len(errors) == 1 and not others, (
        f"the kernel reported {len(others)} error(s) outside the cells besides the canary "
        f"({len(errors)} recorded in {path}):\n\n" + "\n\n".join(others or errors)[-12000:])
    if console is not None:
        count, entries = console
        strays = [e for e in entries if CANARY not in e]
        assert len(entries) == 1 and not strays, (
            f"JupyterLab's log console (status-bar count {count}) holds {len(entries)} entries, "
            f"{len(strays)} besides the canary:\n\n" + "\n\n".join(strays or entries or ["(none)"])[-12000:])
