"""Callback protocol, StopTraining, and the dispatcher that names a failing callback."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class StopTraining(Exception):
    """Raise from a callback to end the run cleanly after the current step."""


class CallbackError(RuntimeError):
    """A callback raised; the message names the callback and the event."""


@runtime_checkable
class Callback(Protocol):
    """Implement any subset of these; every method is optional. Callbacks observe, never change."""

    def on_run_start(self, info: Any) -> None: ...
    def on_step_end(self, record: Any) -> None: ...
    def on_eval(self, record: Any) -> None: ...
    def on_run_end(self, result: Any) -> None: ...


class CallbackList:
    """Calls each callback's handler for an event, if it has one."""

    def __init__(self, callbacks=None):
        self.callbacks = list(callbacks or [])

    def fire(self, event: str, payload: Any) -> None:
        """Run ``event`` on every callback. StopTraining propagates; other errors are wrapped."""
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is None:
                continue
            try:
                fn(payload)
            except StopTraining:
                raise
            except Exception as e:
                raise CallbackError(f"callback {type(cb).__name__}.{event} raised "
                                    f"{type(e).__name__}: {e}") from e
