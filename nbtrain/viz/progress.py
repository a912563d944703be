"""The tqdm progress bar of the command line, also the text view of :class:`~nbtrain.viz.dashboard.LiveDashboard`.

Imports only ``sys`` at import time (tqdm when a run starts), so the CLI can load it without plotly.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Optional


class ProgressBar:
    """A tqdm bar with loss and tokens/s; ``log_every`` thins the postfix updates, never the records.

    ``total`` overrides the run's ``total_steps``; ``mininterval`` is tqdm's least time between redraws.
    A step that arrives before ``on_run_start`` opens the bar itself.
    """

    def __init__(self, log_every: int = 1, desc: str = "train", *, total: Optional[int] = None,
                 mininterval: float = 0.1):
        self.log_every = log_every
        self.desc = desc
        self.total = total
        self.mininterval = mininterval
        self.bar = None

    def on_run_start(self, info: Any):
        from tqdm.auto import tqdm

        variant = getattr(info, "variant", None)
        precision = getattr(info, "precision_used", None)
        label = self.desc if variant is None else f"{self.desc} {variant}"
        self.bar = tqdm(total=self.total or getattr(info, "total_steps", None),
                        desc=f"{label} [{precision}]" if precision else label, unit="step",
                        file=sys.stderr, dynamic_ncols=True, mininterval=self.mininterval)

    def on_step_end(self, rec):
        if self.bar is None:
            self.on_run_start(None)
        if rec.step % self.log_every == 0:
            flags = " SKIPPED" if rec.skipped else (" NONFINITE" if rec.nonfinite else "")
            tps = rec.tokens_per_s if rec.tokens_per_s is not None and math.isfinite(rec.tokens_per_s) else 0.0
            # GRPO's loss says little on its own (a surrogate of advantages): its reward is what climbs
            reward = getattr(rec, "reward_mean", None)
            more = f" reward={reward:.3g}" if reward is not None else ""
            # no redraw of its own: update() draws the new postfix with the step, at most once per mininterval
            self.bar.set_postfix_str(f"loss={rec.loss:.4f}{more} tok/s={tps:,.0f}{flags}", refresh=False)
        self.bar.update(1)

    def on_eval(self, rec):
        if self.bar is not None:
            self.bar.write(f"step {rec.step}: eval_loss={rec.eval_loss:.4f}")

    def write(self, text: str) -> None:
        """Print ``text`` above the bar (or plainly when no bar is open)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)   # the bar's stream: the lines stay above it
        else:
            print(text, file=sys.stderr, flush=True)

    def on_sample(self, rec):
        self.write(f"step {rec.step}: {rec.prompt!r} -> {rec.answer!r}")

    def on_run_end(self, result):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
