"""Figures and the live dashboard. Imports plotly; the core never imports this package at import time."""

from .dashboard import LiveDashboard, detect_mode, static_bundle, status_line, summary_text
from .figures import (
    PANELS,
    add_run_traces,
    columns,
    compare_figure,
    find_trace,
    find_traces,
    make_run_layout,
    run_figure,
    runs_figure,
    smooth,
    trace_specs,
)

__all__ = [
    "LiveDashboard", "detect_mode", "static_bundle", "status_line", "summary_text", "PANELS",
    "add_run_traces", "columns", "compare_figure", "find_trace", "find_traces", "make_run_layout",
    "run_figure", "runs_figure", "smooth", "trace_specs",
]
