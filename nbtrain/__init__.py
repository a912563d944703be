"""nbtrain: fine-tune transformers in a notebook and see what precision, accumulation and LoRA do.

The UI pieces (``Panel``, ``LiveDashboard``) are resolved lazily so that ``import nbtrain`` never loads
ipywidgets, plotly or IPython (DESIGN rule 1).
"""

from . import _logs  # noqa: F401  (first: it quiets library log lines before anything below imports them)

# transformers replaces itself in sys.modules at the end of its import; completed here, on the thread that
# imports nbtrain, so that a later first use from a background thread (a run, a comparison in the user's own
# thread) cannot hand another thread a half-built module.
import transformers as _transformers  # noqa: F401

from .config import ConfigError, TrainConfig
from .engine import (CallbackError, CheckpointError, EvalRecord, Finding, Run, RunInfo, SampleRecord, StepRecord,
                     StopTraining, TrainResult, scan_fp16_overflow, start, train)
from .compare import ComparisonResult, compare
from .hardware import Capabilities, capabilities

from ._version import __version__  # noqa: F401  (nbtrain.__version__)

_LAZY = {
    "LiveDashboard": ("nbtrain.viz.dashboard", "LiveDashboard"),
    "Panel": ("nbtrain.ui.panel", "Panel"),
    "estimate_memory": ("nbtrain.memory", "estimate_memory"),
    "launch": ("nbtrain.engine.launch", "launch"),
    "MemoryEstimate": ("nbtrain.memory", "MemoryEstimate"),
}

__all__ = ["TrainConfig", "ConfigError", "train", "start", "Run", "TrainResult", "StepRecord", "EvalRecord",
           "SampleRecord", "RunInfo", "StopTraining", "CallbackError", "CheckpointError", "Finding", "scan_fp16_overflow", "capabilities", "Capabilities", "compare", "ComparisonResult", *_LAZY]


def __getattr__(name: str):
    if name == "integrations":   # nbt.integrations.trackers.TensorBoardCallback(...): the subpackage, on first use
        import importlib

        return importlib.import_module("nbtrain.integrations")
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(mod), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
