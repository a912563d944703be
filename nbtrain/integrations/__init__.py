"""Bridges to other tools. Submodules load on first use (``nbtrain.integrations.hf``,
``nbt.integrations.trackers``), so that ``import nbtrain`` never pulls in their dependencies."""

_SUBMODULES = ("exports", "hf", "trackers")


def __getattr__(name: str):
    # nbt.integrations.trackers.TensorBoardCallback(...) without an explicit import of the submodule
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
