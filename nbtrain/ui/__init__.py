"""Widget panels for notebooks: ``Panel`` (imports ipywidgets; ``import nbtrain`` does not load this).

``panel`` puts together ``form`` (the controls of every TrainConfig field, validation, errors), ``runner``
(Train / Stop / Compare in background threads, status) and ``render`` (the HTML they show); ``controls``
holds the widget kinds and the value codecs.
"""

from .panel import Panel

__all__ = ["Panel"]
