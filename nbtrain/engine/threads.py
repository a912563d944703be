"""Background threads that are safe as the first thing a process does, and that end before it does.

Two traps this module closes:

* **Half-built imports.** ``transformers/__init__.py`` replaces itself in ``sys.modules`` at its end. When the
  first ``import transformers`` of a process runs on a background thread, another thread's
  ``from transformers import X`` that waited on the module lock can continue with the half-built module and
  fail (``cannot import name ...``). ``complete_imports`` does every heavy import a run needs on the calling
  thread, before any nbtrain thread starts.
* **Threads killed at exit.** A daemon thread still inside torch when the interpreter finalises can abort the
  process (``terminate called without an active exception``). ``spawn`` registers each thread with a way to
  stop it; at exit every live one is asked to stop and is joined.
"""

from __future__ import annotations

import atexit
import importlib
import threading
from typing import Callable, Optional

from .._logs import deferred_bitsandbytes, import_bitsandbytes

_done: set[str] = set()
_import_lock = threading.Lock()

# Attributes of transformers that nbtrain resolves; resolving them imports their submodules here, not later.
_TRANSFORMERS_NAMES = ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "AutoModelForCausalLM",
                       "AutoModelForSequenceClassification", "PreTrainedModel")
_NBTRAIN_MODULES = ("nbtrain.data", "nbtrain.models", "nbtrain.models.lean", "nbtrain.memory",
                    "nbtrain.engine.loop")


def _import(name: str) -> None:
    if name not in _done:
        importlib.import_module(name)
        _done.add(name)


def complete_imports(cfg=None) -> None:
    """Finish, on this thread, the imports a run of ``cfg`` needs (all runs' when ``cfg`` is None).

    Cheap after the first call. Optional packages that are missing are left for the run to report.
    """
    with _import_lock:
        if "transformers:names" not in _done:
            import transformers

            for name in _TRANSFORMERS_NAMES:
                getattr(transformers, name, None)
            _done.add("transformers:names")
        for name in _NBTRAIN_MODULES:
            _import(name)
        optional = []
        if cfg is not None:
            if getattr(cfg, "method", "full") in ("lora", "qlora"):
                optional.append("peft")
            if getattr(cfg, "method", "full") == "qlora" or "8bit" in str(getattr(cfg, "optimizer", "")):
                optional.append("bitsandbytes")
            if not str(getattr(cfg, "data", "builtin:")).startswith("builtin:"):
                optional.append("datasets")
            # report_to's tracker packages (a missing one is reported by prepare(), with its pip command)
            optional += [{"tensorboard": "torch.utils.tensorboard"}.get(t, t) for t in getattr(cfg, "report_to", ())]
        for name in optional:
            try:
                if name == "bitsandbytes":   # loaded the way a run loads it: no Hub kernel lookup
                    import_bitsandbytes()
                else:
                    with deferred_bitsandbytes():   # peft's own import of it stays unrun until used
                        _import(name)
            except ImportError:
                pass


_live: dict[threading.Thread, Optional[Callable[[], None]]] = {}
_live_lock = threading.Lock()
EXIT_JOIN_S = 60.0   # how long interpreter exit waits for each thread after asking it to stop


def spawn(target: Callable[[], None], name: str, stop: Optional[Callable[[], None]] = None,
          cfg=None) -> threading.Thread:
    """Start ``target`` in a daemon thread after ``complete_imports(cfg)``; at exit, ``stop()`` it and join it."""
    complete_imports(cfg)

    def body():
        try:
            target()
        finally:
            with _live_lock:
                _live.pop(threading.current_thread(), None)

    thread = threading.Thread(target=body, name=name, daemon=True)
    with _live_lock:
        _live[thread] = stop
    thread.start()
    return thread


def track(thread: threading.Thread, stop: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Have interpreter exit stop (``stop()``) and join a thread started elsewhere, e.g. a ``threading.Timer``."""
    with _live_lock:
        for t in [t for t in _live if not t.is_alive() and t is not thread]:
            _live.pop(t, None)
        _live[thread] = stop
    return thread


@atexit.register
def _stop_and_join_all() -> None:
    with _live_lock:
        live = list(_live.items())
    for _, stop in live:
        if stop is not None:
            try:
                stop()
            except Exception:
                pass
    for thread, _ in live:
        if thread is not threading.current_thread():
            thread.join(EXIT_JOIN_S)
