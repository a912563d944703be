"""Widget panels for notebooks: ``Panel`` (imports ipywidgets; ``import nbtrain`` does not load this)."""

from .panel import Panel

__all__ = ["Panel"]
