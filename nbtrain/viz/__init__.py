"""Figures and the live dashboard. Imports plotly; the core never imports this package at import time.

Names are resolved lazily from their modules, so ``nbtrain.viz.progress`` (the command line's bar) loads
without plotly.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "LiveDashboard": "dashboard", "detect_mode": "dashboard",
    "static_bundle": "views",
    "status_line": "text", "summary_text": "text", "grpo_text": "text", "notes_html": "text", "notes_text": "text",
    "figure_title": "text", "samples_html": "text", "samples_text": "text",
    "ProgressBar": "progress",
    "Tracker": "tracker",
    **{name: "figures" for name in (
        "PANELS", "REWARD_PANELS", "GRPO_PANELS", "add_run_traces", "columns", "compare_figure", "find_trace",
        "find_traces", "has_rewards", "has_grpo", "iter_runs",
        "make_run_layout", "run_figure", "runs_figure", "scale_axis", "set_title", "smooth", "trace_specs")},
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'nbtrain.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
