"""Exercises for the course notebooks: "predict, then run".

A learner writes a guess in one cell (``guess = ...`` until they do); the next cell computes the answer from the
run and calls :func:`check`, which says whether the guess was right and why. It never raises: a notebook with no
guess written still runs to its end ("Run All"), and shows the answer with its explanation.
"""

from __future__ import annotations

import math
from numbers import Number
from typing import Any, Optional

__all__ = ["check", "matches"]


def matches(guess: Any, answer: Any, tolerance: float = 0.0) -> bool:
    """Whether ``guess`` is the ``answer``: numbers within ``tolerance`` (relative, 0.1 = 10%), text ignoring case
    and surrounding spaces, sequences item by item, anything else by ``==``."""
    if isinstance(guess, bool) or isinstance(answer, bool):
        return isinstance(guess, bool) and isinstance(answer, bool) and guess == answer
    if isinstance(guess, Number) and isinstance(answer, Number):
        g, a = float(guess), float(answer)
        if math.isnan(a) or math.isnan(g):
            return math.isnan(a) and math.isnan(g)
        return g == a or abs(g - a) <= tolerance * max(abs(a), abs(g))
    if isinstance(guess, str) and isinstance(answer, str):
        return guess.strip().lower() == answer.strip().lower()
    if isinstance(guess, (list, tuple)) and isinstance(answer, (list, tuple)):
        return len(guess) == len(answer) and all(matches(g, a, tolerance) for g, a in zip(guess, answer))
    try:
        return bool(guess == answer)
    except Exception:   # e.g. comparing arrays: not a verdict a learner can use
        return False


def check(guess: Any, answer: Any, why: str = "", *, tolerance: float = 0.0) -> Optional[bool]:
    """Say whether the learner's ``guess`` matches ``answer`` (see :func:`matches`) and explain ``why``.

    ``guess`` is ``...`` (Ellipsis) until the learner writes one: then the answer is shown with its explanation
    and the result is None. Returns True or False otherwise. Prints; never raises."""
    shown = f"{answer:.4g}" if isinstance(answer, float) else repr(answer) if isinstance(answer, str) else f"{answer}"
    if guess is Ellipsis:
        verdict, result = f"No guess yet (write one in the cell above and run both again). The answer: {shown}.", None
    elif matches(guess, answer, tolerance):
        verdict, result = f"Right: {shown}.", True
    else:
        mine = f"{guess:.4g}" if isinstance(guess, float) else repr(guess) if isinstance(guess, str) else f"{guess}"
        verdict, result = f"Not quite: you guessed {mine}; the answer is {shown}.", False
    print(verdict + (f"\nWhy: {why}" if why else ""))
    return result

