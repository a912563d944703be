"""Issue 46 item 1: progress from the first second. Every phase of a Train and of a Compare says what it is doing and
how far along it is (loading, the recorded pass drawn live and untimed, each variant's timed repeats k of n, the
end-of-run eval), the
time left once a step is timed, Stop names the eval still to come, and the last press's figure is marked as the
previous run's at once. Driven from code through the Panel's buttons; each status is recorded as it changes."""

import html
import re
import time

import pytest

pytest.importorskip("ipywidgets")

from nbtrain.ui import runner as runner_mod  # noqa: E402 (after the importorskip)
from nbtrain.ui.panel import Panel  # noqa: E402

from .test_ui import TIMEOUT, small  # noqa: E402


def text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def record_statuses(panel) -> list[str]:
    seen = []
    panel.status.observe(lambda ch: seen.append(text(ch["new"])), names="value")
    return seen


def first(seen: list[str], pattern: str) -> int:
    """Index of the first status matching ``pattern`` (fails with the whole sequence when none does)."""
    for i, s in enumerate(seen):
        if re.search(pattern, s):
            return i
    raise AssertionError(f"no status matches {pattern!r} in:\n" + "\n".join(seen))


@pytest.fixture
def every_step(monkeypatch):
    # every step line shown (the cap on lines per second reads the clock): the sequence does not depend on speed
    monkeypatch.setattr(runner_mod.StatusCallback, "MIN_INTERVAL", 0.0)


def test_a_compare_says_every_phase_in_order(every_step):
    panel = Panel(small(max_steps=3, eval_fraction=0.2), debounce_s=0)
    for p, box in panel.compare_choices.items():
        box.value = p in ("fp32", "bf16")
    panel.repeats_control.value = 3
    seen = record_statuses(panel)
    panel.compare_button.click()
    assert panel.wait(TIMEOUT) is not None, seen
    order = [
        r"^comparing fp32, bf16 × 3 repeats: starting…",
        # the recorded pass, drawn live, first: it says it is not timed
        r"^fp32 \(1 of 2\), drawn live \(untimed\): loading data and model…",
        r"^running fp32 \(1 of 2\), drawn live \(untimed\): step 0/3 \(cpu · fp32\)",
        r"^running fp32 \(1 of 2\), drawn live \(untimed\): step 1/3 · loss [\d.]+ · about \S+ (s|min) left",
        r"^running fp32 \(1 of 2\), drawn live \(untimed\): step 3/3 done · end-of-run eval on \d+ held-out",
        r"^bf16 \(2 of 2\), drawn live \(untimed\): loading data and model…",
        r"^running bf16 \(2 of 2\), drawn live \(untimed\): step 3/3 done · end-of-run eval",
        # then the timed repeats, rotated
        r"^fp32 \(1 of 2\), timed repeat 1 of 3: loading data and model…",
        r"^running fp32 \(1 of 2\), timed repeat 1 of 3: step 1/3 · about \S+ (s|min) left",
        r"^running bf16 \(2 of 2\), timed repeat 1 of 3: step 3/3 done · end-of-run eval",
        r"^bf16 \(1 of 2\), timed repeat 2 of 3: loading data and model…",   # rotated: bf16 first in repeat 2
        r"^running fp32 \(2 of 2\), timed repeat 2 of 3: step 3/3 done · end-of-run eval",
        r"^running bf16 \(2 of 2\), timed repeat 3 of 3: step 3/3 done · end-of-run eval",
    ]
    at = [first(seen, p) for p in order]
    assert at == sorted(at), "\n".join(seen)
    assert re.search(r"compared|done|slower|faster|fp32", seen[-1]), seen[-1]   # the comparison's own line last
    # nothing was left without a phase: every line while it ran names what runs, or the comparison's start
    running = seen[:first(seen, r"^running bf16 \(2 of 2\), timed repeat 3 of 3: step 3/3 done")]
    assert all(re.match(r"(comparing|running |fp32|bf16)", s) for s in running), running


def test_the_time_left_counts_the_runs_to_come(every_step):
    # the estimate is steps to go x the run's median step time: injected here, no clock read
    job = runner_mod.Job("compare")
    job.steps, job.repeats, job.extra_seeds = 10, 3, (1,)
    cb = runner_mod.StatusCallback(runner_mod.Runner.__new__(runner_mod.Runner), job)
    said = []
    cb.runner.set_status = lambda t, c: said.append(t)
    cb.on_phase(dict(phase="run", variant="fp16", k=2, n=3, repeat=2, repeats=3, event="load"))
    cb.on_phase(dict(phase="run", variant="fp16", k=2, n=3, repeat=2, repeats=3, event="start", total=10,
                     eval_examples=0))
    assert "left" not in said[-1]                      # no step timed yet: no estimate
    cb.on_phase(dict(phase="run", variant="fp16", k=2, n=3, repeat=2, repeats=3, event="step", step=4, total=10,
                     step_time_s=0.5))
    # this run 6 steps, 1 more variant of this repeat, 3 of the last repeat, 1 seed run: 6 + 5 x 10 = 56 x 0.5 s
    assert said[-1] == "running fp16 (2 of 3), timed repeat 2 of 3: step 4/10 · about 28 s left"
    # the live pass before the timed repeats: its own steps, the 2 variants after it, then 3 x 3 timed, 1 seed
    cb.on_phase(dict(phase="live", variant="fp32", k=1, n=3, event="load"))
    cb.on_phase(dict(phase="live", variant="fp32", k=1, n=3, event="start", total=10, eval_examples=0))
    cb.on_phase(dict(phase="live", variant="fp32", k=1, n=3, event="step", step=9, total=10, step_time_s=0.1))
    assert said[-1] == "running fp32 (1 of 3), drawn live (untimed): step 9/10 · about 12 s left"
    # 1 step of its own, then (2 variants + 3 x 3 timed + 1 seed run) x 10 steps: 121 x 0.1 s
    assert runner_mod.time_left_words(150) == "about 2 min left"


def test_a_train_says_loading_steps_time_left_and_the_eval_and_stop_names_the_eval(every_step):
    panel = Panel(small(max_steps=400, eval_fraction=0.2), debounce_s=0)
    seen = record_statuses(panel)
    panel.train_button.click()
    assert seen[0] == "starting: loading data and model…"
    end = time.monotonic() + TIMEOUT
    while not any(re.search(r"step [3-9]/400", s) for s in seen) and time.monotonic() < end:
        time.sleep(0.05)
    panel.stop_button.click()
    assert text(panel.status.value) == ("stopping after the current step, then the end-of-run eval on the "
                                        "held-out examples…")
    assert panel.wait(TIMEOUT) is not None, seen
    assert re.search(r"^running: step 0/400 \(cpu · fp32\)", seen[1]), seen
    assert any(re.search(r"^running: step \d+/400 · loss [\d.]+ · about \S+ (s|min) left$", s) for s in seen), seen
    assert "stopped" in seen[-1], seen


def test_the_previous_figure_is_marked_as_soon_as_a_new_run_starts():
    panel = Panel(small(max_steps=2), debounce_s=0)
    panel.train_button.click()
    assert panel.wait(TIMEOUT) is not None
    assert panel.runner.previous.layout.display == "none"
    old = panel.dashboard_area.children
    job = panel.runner.begin("train", panel.config)            # a new press, before its first step
    assert panel.dashboard_area.children == old                 # kept on screen ...
    assert panel.runner.previous.layout.display != "none"       # ... and said to be the last run's, above it
    assert "previous run's results and figure" in text(panel.runner.previous.value)
    assert panel.runner.board.children[0] is panel.runner.previous
    panel.runner.reveal(job)                                     # its first step: the new figure, no mark
    assert panel.runner.previous.layout.display == "none"
    panel.runner.finish(job, error=RuntimeError("x"))
