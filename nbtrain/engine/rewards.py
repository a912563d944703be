"""GRPO's reward functions: built-in names and the user's callables, weighted, each failure named.

A reward function takes the prompts and their completions (one prompt per completion, repeated for a group) and
the data's other columns, each as a list aligned with the completions, and returns one float per completion:
``f(prompts, completions, **columns) -> list[float]``, as TRL's GRPOTrainer calls them. The built-ins:

- ``"length:N"``: closeness to N completion tokens, ``max(0, 1 - |n - N| / N)`` (1 at N, 0 at none or 2N);
- ``"format:REGEX"``: 1 where the completion matches REGEX (``re.search``: anchor it with ^ and $ to match all);
- ``"exact"``: 1 where the completion, stripped, equals the data's ``answer`` column, stripped;
- ``"contains"``: 1 where the completion contains the ``answer``, stripped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..config import REWARD_HELP as _HELP
from ..config import reward_kind

BUILTIN_REWARDS = ("length:N", "format:REGEX", "exact", "contains")


class RewardError(ValueError):
    """A reward that cannot be made, or that failed while scoring: the message names it."""


@dataclass(frozen=True)
class Reward:
    name: str
    fn: Callable[..., Sequence[float]]
    weight: float = 1.0


def parse_rewards(reward: Any, reward_weights: Sequence[float] | None = None) -> list[Reward]:
    """``reward`` (a name, a callable, or a list of them) as Rewards, with ``reward_weights`` (one per reward;
    default 1 each). Raises RewardError naming the field and what is allowed."""
    items = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    if not items or any(r is None for r in items):
        raise RewardError(f"reward: give one or more reward functions ({_HELP})")
    made = [_make(r) for r in items]
    names = [r.name for r in made]
    if len(set(names)) < len(names):
        raise RewardError(f"reward: each reward once, got {names}")
    if reward_weights is None:
        return made
    weights = list(reward_weights)
    if len(weights) != len(made):
        raise RewardError(f"reward_weights: one weight per reward ({len(made)}: {names}), got {len(weights)}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise RewardError(f"reward_weights: each weight is a finite number, got {w!r}")
    return [Reward(r.name, r.fn, float(w)) for r, w in zip(made, weights)]


def _make(spec: Any) -> Reward:
    if callable(spec):
        return Reward(getattr(spec, "__name__", type(spec).__name__), spec)
    try:
        kind, arg = reward_kind(spec)
    except ValueError as e:
        raise RewardError(f"reward: {e}") from None
    if kind == "length":
        return Reward(spec, _length(int(arg)))
    if kind == "format":
        return Reward(spec, _format(re.compile(arg)))
    if kind in ("exact", "contains"):
        return Reward(spec, _exact if kind == "exact" else _contains)
    module, _, qualname = spec.partition(":")
    return Reward(spec, _imported(module, qualname, spec))


def _imported(module: str, qualname: str, spec: str):
    """The function 'module:qualname' names (a reward saved in a YAML config, or given on the command line)."""
    import importlib

    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise RewardError(f"reward: {spec!r}: cannot import module {module!r} ({e})") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise RewardError(f"reward: {spec!r}: module {module!r} has no {qualname!r}")
    if not callable(obj):
        raise RewardError(f"reward: {spec!r} is not a function")
    return obj


def _length(n: int):
    def length(prompts, completions, completion_tokens=None, **_):
        if completion_tokens is None:
            raise KeyError("completion_tokens")
        return [max(0.0, 1.0 - abs(int(k) - n) / n) for k in completion_tokens]
    return length


def _format(pattern: re.Pattern):
    def fmt(prompts, completions, **_):
        return [1.0 if pattern.search(c) else 0.0 for c in completions]
    return fmt


def _answers(columns: Mapping[str, Any]) -> list[str]:
    answers = columns.get("answer")
    if answers is None:
        have = sorted(k for k in columns if k != "completion_tokens")
        raise RewardError(f"needs the data's 'answer' column; the data has {have}")
    return ["" if a is None else str(a).strip() for a in answers]


def _exact(prompts, completions, **columns):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, _answers(columns))]


def _contains(prompts, completions, **columns):
    return [1.0 if a and a in c else 0.0 for c, a in zip(completions, _answers(columns))]


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str],
          columns: Mapping[str, Sequence[Any]] | None = None) -> tuple[dict[str, list[float]], list[float]]:
    """Every reward of every completion, and their weighted sum: ``({name: values}, totals)``. A reward that
    raises, returns the wrong number of values or a value that is not a number raises RewardError naming it."""
    columns = dict(columns or {})
    n = len(completions)
    if len(prompts) != n:
        raise RewardError(f"reward: {len(prompts)} prompts for {n} completions")
    each: dict[str, list[float]] = {}
    for r in rewards:
        try:
            values = r.fn(list(prompts), list(completions), **columns)
        except RewardError as e:
            raise RewardError(f"reward {r.name!r}: {e}") from None
        except Exception as e:   # noqa: BLE001 - the user's function: its failure is named, the run stops with it
            raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e}") from e
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardError(f"reward {r.name!r}: returned {values!r:.80}, not a list of numbers") from None
        if len(values) != n:
            raise RewardError(f"reward {r.name!r}: returned {len(values)} values for {n} completions")
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            raise RewardError(f"reward {r.name!r}: returned {bad}, not a finite number")
        each[r.name] = values
    totals = [sum(r.weight * each[r.name][i] for r in rewards) for i in range(n)]
    return each, totals
