"""Callback protocol, StopTraining, and the dispatcher that names a failing callback."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


class StopTraining(Exception):
    """Raise from a callback to end the run cleanly after the current step."""


class CallbackError(RuntimeError):
    """A callback raised; the message names the callback and the event.

    The run still ends as usual (history, model, outputs, ``on_run_end``); ``.result`` is its TrainResult.
    """

    result = None


@runtime_checkable
class Callback(Protocol):
    """Implement any subset of these; every method is optional. Callbacks observe, never change."""

    def on_run_start(self, info: Any) -> None: ...
    def on_step_end(self, record: Any) -> None: ...
    def on_eval(self, record: Any) -> None: ...
    def on_sample(self, record: Any) -> None: ...   # a sample prompt's answer at a step (SampleRecord)
    def on_run_end(self, result: Any) -> None: ...


class CallbackList:
    """Calls each callback's handler for an event, if it has one."""

    def __init__(self, callbacks=None):
        self.callbacks = list(callbacks or [])

    def fire(self, event: str, payload: Any) -> None:
        """Run ``event`` on every callback. StopTraining propagates; other errors are wrapped."""
        for cb in self.callbacks:
            self._call(cb, event, payload)

    def fire_all(self, event: str, payload: Any) -> list[CallbackError]:
        """Run ``event`` on every callback, even after one fails; returns the wrapped errors."""
        errors = []
        for cb in self.callbacks:
            try:
                self._call(cb, event, payload)
            except StopTraining:
                pass
            except CallbackError as e:
                errors.append(e)
        return errors

    @staticmethod
    def _call(cb, event: str, payload: Any) -> None:
        fn = getattr(cb, event, None)
        if fn is None:
            return
        try:
            fn(payload)
        except StopTraining:
            raise
        except Exception as e:
            raise CallbackError(f"callback {type(cb).__name__}.{event} raised "
                                f"{type(e).__name__}: {e}") from e
