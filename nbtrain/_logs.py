"""Library log lines and import side effects that are about nbtrain's own use of a library, not for its users."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import sys
import threading

# torchao (precision="fp8") logs, at import, each of its CUDA kernel libraries it cannot load on a machine without
# them (a CPU, another CUDA), and torch logs that one of its enums registers itself the deprecated way. Its float8
# training needs neither kernel library (it falls back to torch's scaled matmul, or emulates it).
_QUIET = (("torchao", "Failed to load"), ("torch.utils._pytree", "register_constant"))

# bitsandbytes' CPU backend, on CPUs with AVX512-BF16, asks the Hub at import for an optional 4-bit kernel
# (kernels.get_kernel): online a download at import time, offline a warning in red in the first cell that trains.
# nbtrain imports it only for a run that needs it, with that lookup turned off (its own CPU kernel is used).
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_CPU_MESSAGE = "kernels-community"
_BNB_LOCK = threading.Lock()


class _DropMessage(logging.Filter):
    def __init__(self, needle: str):
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.needle not in record.getMessage()
        except Exception:  # a record whose arguments do not format is not ours to hide
            return True


def quiet_library_logs() -> None:
    """Drop the known, harmless import-time log lines of optional libraries (idempotent; imports nothing)."""
    for name, needle in _QUIET:
        log = logging.getLogger(name)   # configurable before the library is ever imported
        if not any(isinstance(f, _DropMessage) and f.needle == needle for f in log.filters):
            log.addFilter(_DropMessage(needle))


@contextlib.contextmanager
def _without_module(name: str):
    """``import name`` fails inside the block (ImportError), whether or not it was imported before."""
    had, saved = name in sys.modules, sys.modules.get(name)
    sys.modules[name] = None   # type: ignore[assignment]  (Python's own "import halted" marker)
    try:
        yield
    finally:
        if had:
            sys.modules[name] = saved   # type: ignore[assignment]
        else:
            sys.modules.pop(name, None)


class _QuietLoader(importlib.abc.Loader):
    """bitsandbytes' own loader, executing the module with the Hub kernel lookup off and its fallback note
    dropped (for that execution only)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        log = logging.getLogger(_BNB_CPU_LOGGER)
        note = _DropMessage(_BNB_CPU_MESSAGE)
        log.addFilter(note)
        try:
            with _without_module("kernels"):
                self.loader.exec_module(module)
        finally:
            log.removeFilter(note)


class _DeferBitsandbytes(importlib.abc.MetaPathFinder):
    """``import bitsandbytes`` gives a lazy module: it executes (through ``_QuietLoader``) when first used.
    peft imports it at its own import, and transformers.optimization imports peft: without this, every run
    paid bitsandbytes' import and its Hub lookup, QLoRA or not."""

    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes":
            return None
        for finder in sys.meta_path:
            if finder is self or isinstance(finder, _DeferBitsandbytes) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = importlib.util.LazyLoader(_QuietLoader(spec.loader))
        return spec


_DEFER = _DeferBitsandbytes()
_DEFER_DEPTH = 0


@contextlib.contextmanager
def deferred_bitsandbytes():
    """Inside the block, a first ``import bitsandbytes`` (peft's, at its own import) does not run the library:
    it runs when something uses it (a QLoRA model, an 8-bit optimizer), with its Hub kernel lookup off. nbtrain's
    runs, estimates and exports prepare inside it."""
    global _DEFER_DEPTH
    with _BNB_LOCK:
        if _DEFER_DEPTH == 0 and _DEFER not in sys.meta_path:
            sys.meta_path.insert(0, _DEFER)
        _DEFER_DEPTH += 1
    try:
        yield
    finally:
        with _BNB_LOCK:
            _DEFER_DEPTH -= 1
            if _DEFER_DEPTH == 0 and _DEFER in sys.meta_path:
                sys.meta_path.remove(_DEFER)


def defers_bitsandbytes(fn):
    """Decorator: ``fn`` runs inside :func:`deferred_bitsandbytes`."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with deferred_bitsandbytes():
            return fn(*args, **kwargs)
    return wrapper


def bitsandbytes_loaded() -> bool:
    """Whether bitsandbytes has run (a deferred import that nothing used yet has not)."""
    mod = sys.modules.get("bitsandbytes")
    return mod is not None and not isinstance(mod, importlib.util._LazyModule)


def import_bitsandbytes():
    """bitsandbytes, for a run that needs it (QLoRA, an 8-bit optimizer), loaded now on the calling thread with
    its CPU backend's Hub kernel lookup off. Raises what the import raises (not installed, a native library that
    does not load)."""
    with _BNB_LOCK:
        mod = sys.modules.get("bitsandbytes")
        if mod is None:
            with _defer_once():
                import bitsandbytes as mod
        _ = mod.__name__   # a deferred module runs here, on this thread, once
    return mod


@contextlib.contextmanager
def _defer_once():
    if _DEFER in sys.meta_path:
        yield
        return
    sys.meta_path.insert(0, _DEFER)
    try:
        yield
    finally:
        if _DEFER in sys.meta_path and _DEFER_DEPTH == 0:
            sys.meta_path.remove(_DEFER)


quiet_library_logs()   # on import: nbtrain/__init__ imports this module before anything below imports them
