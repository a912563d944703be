"""compare(): one training per variant in this process, fair by construction, and ComparisonResult.

Three parts, one job each: ``run.py`` runs the variants (order, the live pass, repeats, seeds, stop, the fairness
check), ``result.py`` holds what they found (table, differences, band, noise floor, verdicts), ``render.py``
shows it (compact table, notes, HTML summary and report, text table, figures, environment()).

Plotting, widgets and IPython are imported only inside the methods that draw (DESIGN rule 1).
"""

from .render import MISSING, ComparisonViews, environment
from .result import ComparisonResult, loss_difference
from .run import (DATA_FIELDS, INIT_FIELDS, INPUT_FIELDS, UNPAIRING_FIELDS, ComparisonWarning, compare)

__all__ = ["compare", "ComparisonResult", "ComparisonWarning", "ComparisonViews", "loss_difference", "environment",
           "INIT_FIELDS", "DATA_FIELDS", "UNPAIRING_FIELDS", "INPUT_FIELDS", "MISSING"]
