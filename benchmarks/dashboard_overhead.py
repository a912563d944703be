"""What the LiveDashboard costs: the tiny model trained with the dashboard on vs off (target >= 0.98x).

Interleaved and alternating (off/on, then on/off, ...) so drift in the machine hits both. The figure
is throughput over all steps after warm-up, total input tokens / total step time, not a median:
the dashboard's cost lands on the few steps that redraw, and a median would hide exactly those.
The engine's step time includes the callbacks, so the dashboard's work is inside it.

Modes: ``widget`` updates a plotly FigureWidget (what a JupyterLab user gets; without a kernel no
comm messages are sent, so the frontend's share is not in the figure), ``html`` rebuilds the
figure's JSON/HTML for a display handle, ``text`` drives a tqdm bar. Widget and html run with
``display=False`` (nothing to show in a script); text prints its bar to stderr.

    python benchmarks/dashboard_overhead.py [--steps 40] [--repeats 3] [--modes widget,text]
                                            [--precision fp32] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
from pathlib import Path

import torch

import nbtrain as nbt
from nbtrain.hardware import resolve_precision
from nbtrain.viz.dashboard import LiveDashboard

WARMUP = 5


def bench_config(precision: str, steps: int) -> nbt.TrainConfig:
    return nbt.TrainConfig(model="tiny", data="builtin:python-docs", max_seq_len=128, micro_batch_size=8,
                           grad_accum_steps=1, max_steps=steps, precision=precision, eval_fraction=0.0,
                           subset=2000, lr=3e-4)


def throughput(result) -> float:
    """Input tokens per second over the steps after warm-up (a mean, so rare slow steps count)."""
    h = result.history.iloc[WARMUP:]
    return float((h.tokens_per_s * h.step_time_s).sum() / h.step_time_s.sum())


def _widgets_ok() -> bool:
    try:
        import anywidget  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def run(steps: int = 40, repeats: int = 3, modes=("widget", "text"), precision: str = "auto") -> dict:
    """Train ``repeats`` times without and with a dashboard in each mode; ratios of the median throughputs."""
    modes = tuple(m if m != "widget" or _widgets_ok() else "html" for m in modes)
    cfg = bench_config(precision, steps)
    samples: dict[str, list[float]] = {"off": [], **{m: [] for m in modes}}
    redraws: dict[str, list[float]] = {m: [] for m in modes}
    nbt.train(cfg)  # discarded: the first run in a process pays for kernel selection and caches
    for rep in range(repeats):
        order = ["off", *modes]
        if rep % 2:
            order.reverse()
        for name in order:
            if name == "off":
                samples["off"].append(throughput(nbt.train(cfg)))
                continue
            dash = LiveDashboard(mode=name, display=(name == "text"))
            r = nbt.train(cfg, callbacks=[dash])
            samples[name].append(throughput(r))
            redraws[name].append(dash.redraws / max(r.summary["wall_s"], 1e-9))
    med = {k: statistics.median(v) for k, v in samples.items()}
    rows = [{"mode": m, "off_tokens_per_s": round(med["off"], 1), "on_tokens_per_s": round(med[m], 1),
             "ratio_on_vs_off": round(med[m] / med["off"], 4),
             "redraws_per_s": round(statistics.median(redraws[m]), 2),
             "samples_off": [round(x, 1) for x in samples["off"]],
             "samples_on": [round(x, 1) for x in samples[m]]} for m in modes]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "date": dt.date.today().isoformat(), "device": device, "name": nbt.capabilities().name,
        "precision": resolve_precision(cfg.precision), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "steps": steps, "repeats": repeats,
        "warmup_steps_excluded": WARMUP, "target_ratio": 0.98, "rows": rows,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="widget,text")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    res = run(args.steps, args.repeats, tuple(args.modes.split(",")), args.precision)
    for r in res["rows"]:
        print(f"{res['device']} {res['precision']} {r['mode']}: off {r['off_tokens_per_s']:,.0f} tok/s, "
              f"on {r['on_tokens_per_s']:,.0f} tok/s, ratio {r['ratio_on_vs_off']:.3f} (target >= 0.98), "
              f"{r['redraws_per_s']} redraws/s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"dashboard_overhead_{res['device']}.json"
        path.write_text(json.dumps(res, indent=2))
        print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
