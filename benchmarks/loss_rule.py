"""How often does the loss rule (nbtrain.verdicts.loss_test) call a variant "beyond noise" when it is not, and how
often does it find a real difference?

Two parts, each fed to the real function:

* **simulated**: per comparison, the reference and k reruns and one A/A draw, each a per-step loss difference
  from the reference made of a run offset (normal, or Student t with 3 degrees of freedom: heavy tails) plus
  AR(1) step noise. Reports the rule's A/A false-call rate by k, beside the old rule's (any step outside the
  max-of-k band), and its power against a shifted run.
* **real**: trials of the tiny preset (fp32, 40 steps, micro-batch 8, 64 tokens). Each trial is one compare()
  with ``seeds=`` of three (the reference and 2 reruns with other initial weights, the same batches: the default
  band) and two variants: an A/A draw made exactly as the band's runs are (another ``seed``, the same
  ``data_seed``), and lr x 1.5. Reports the A/A false-call rate and the power, each with a 95% Wilson interval.

    python benchmarks/loss_rule.py [--trials 24] [--comparisons 20000] [--out benchmarks/results]

tests/test_loss_rule.py checks the rule's bookkeeping on fixed inputs; the rates are measured here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import time

import numpy as np
import pandas as pd

from nbtrain import verdicts


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``hits`` / ``n``."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


# ----------------------------------------------------------------------------------------------------------------
# simulated
# ----------------------------------------------------------------------------------------------------------------
def _runs(rng: np.random.Generator, n_runs: int, steps: int, heavy: bool, shift: float = 0.0) -> np.ndarray:
    """``n_runs`` loss series (steps), each an offset plus AR(1) noise (phi 0.8, step sd 0.5 of the offset's)."""
    offset = rng.standard_t(3, n_runs) / math.sqrt(3.0) if heavy else rng.normal(size=n_runs)
    noise = np.zeros((n_runs, steps))
    e = rng.normal(scale=0.5, size=(n_runs, steps))
    for t in range(steps):
        noise[:, t] = (0.8 * noise[:, t - 1] if t else 0.0) + e[:, t]
    return offset[:, None] + noise + shift


def simulate(rng: np.random.Generator, comparisons: int, reruns: int, steps: int = 40, heavy: bool = False,
             shift: float = 0.0) -> dict:
    """Shares of comparisons called beyond noise: by the rule and by the old max-of-k rule."""
    idx = pd.Index(range(1, steps + 1), name="step")
    rule = old = 0
    for _ in range(comparisons):
        loss = _runs(rng, reruns + 2, steps, heavy)          # the reference, its reruns, the variant
        loss[-1] += shift
        ref = loss[0]
        runs = pd.DataFrame({s: loss[1 + s] - ref for s in range(reruns)}, index=idx)
        band = verdicts.SeedBand(0, tuple(range(reruns)), runs, runs.abs().max(axis=1).rename("width"))
        diff = pd.Series(loss[-1] - ref, index=idx)
        test = verdicts.loss_test(diff, band)
        rule += bool(test.beyond)
        old += bool((~band.contains(diff)).any())
    return {"rule": rule / comparisons, "old_rule": old / comparisons}


def simulated(comparisons: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for reruns in (1, 2, 4):
        for heavy in (False, True):
            aa = simulate(rng, comparisons, reruns, heavy=heavy)
            power = simulate(rng, comparisons, reruns, heavy=heavy, shift=4.0)
            rows.append({"reruns": reruns, "offsets": "t3" if heavy else "normal",
                         "aa_rule": round(aa["rule"], 4), "aa_old_rule": round(aa["old_rule"], 4),
                         "power_shift_4sd": round(power["rule"], 4)})
            print(rows[-1], flush=True)
    return rows


# ----------------------------------------------------------------------------------------------------------------
# real draws of tiny
# ----------------------------------------------------------------------------------------------------------------
def real(trials: int, steps: int = 40, first_seed: int = 1000) -> dict:
    import nbtrain as nbt

    base = nbt.TrainConfig.example("tiny").replace(precision="fp32", max_steps=steps, micro_batch_size=8,
                                                   max_seq_len=64)
    rows = []
    start = time.perf_counter()
    for i in range(trials):
        seed = first_seed + 10 * i
        cfg = base.replace(seed=seed, data_seed=seed)
        variants = {"fp32": {}, "A/A": {"seed": seed + 3, "data_seed": seed}, "lr x1.5": {"lr": base.lr * 1.5}}
        cmp = nbt.compare(cfg, variants=variants, seeds=(seed, seed + 1, seed + 2), warmup=False)
        aa, lr = cmp.verdicts["A/A"], cmp.verdicts["lr x1.5"]
        rows.append({"trial": i, "seed": seed,
                     "aa_beyond": not aa.within_noise, "aa_old_rule": bool(aa.outside),
                     "aa_mean": aa.test.mean_diff, "aa_limit": aa.test.limit, "aa_center": aa.test.center,
                     "lr_beyond": not lr.within_noise, "lr_mean": lr.test.mean_diff,
                     "null_means": list(aa.test.null_means)})
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "null_means"},
              flush=True)
    n = len(rows)
    aa_hits = sum(r["aa_beyond"] for r in rows)
    old_hits = sum(r["aa_old_rule"] for r in rows)
    lr_hits = sum(r["lr_beyond"] for r in rows)
    return {"trials": n, "steps": steps, "config": {k: v for k, v in cfg.to_dict().items()
                                                    if k in ("model", "data", "subset", "max_seq_len",
                                                             "micro_batch_size", "lr", "precision")},
            "seeds_per_band": 3, "wall_s": round(time.perf_counter() - start, 1),
            "aa_rate": aa_hits / n, "aa_ci95": wilson(aa_hits, n),
            "aa_old_rule_rate": old_hits / n, "aa_old_rule_ci95": wilson(old_hits, n),
            "power_lr_x1.5": lr_hits / n, "power_ci95": wilson(lr_hits, n), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# The loss rule: its false-call rate and power ({res['date']})", ""]
    if res.get("simulated"):
        lines += [f"## Simulated ({res['comparisons']:,} comparisons per cell, 40 steps, AR(1) step noise)", "",
                  "| reruns | run offsets | A/A called beyond (rule) | A/A (old: any step outside max-of-k) | "
                  "power, shift of 4 offset sd |", "|---|---|---|---|---|"]
        for r in res["simulated"]:
            lines.append(f"| {r['reruns']} | {r['offsets']} | {r['aa_rule']:.1%} | {r['aa_old_rule']:.1%} | "
                         f"{r['power_shift_4sd']:.1%} |")
        lines.append("")
    if res.get("real"):
        r = res["real"]
        lo, hi = r["aa_ci95"]
        plo, phi = r["power_ci95"]
        olo, ohi = r["aa_old_rule_ci95"]
        lines += [f"## Real draws: tiny, fp32, {r['steps']} steps, 3 seeds per band ({r['trials']} trials, "
                  f"{r['wall_s']:.0f} s on {res['device']})", "",
                  "| what | called beyond noise | 95% interval |", "|---|---|---|",
                  f"| A/A (another seed, the same data_seed) | {r['aa_rate']:.1%} | {lo:.1%}-{hi:.1%} |",
                  f"| A/A under the old rule (any step outside max-of-k) | {r['aa_old_rule_rate']:.1%} | "
                  f"{olo:.1%}-{ohi:.1%} |",
                  f"| lr x 1.5 (power) | {r['power_lr_x1.5']:.1%} | {plo:.1%}-{phi:.1%} |", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=24, help="real A/A + power trials of tiny (0: none)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--comparisons", type=int, default=20000, help="simulated comparisons per cell (0: none)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from nbtrain.hardware import capabilities

    res = {"date": dt.date.today().isoformat(), "device": capabilities("cpu").name, "alpha": verdicts.LOSS_ALPHA,
           "comparisons": args.comparisons}
    if args.comparisons:
        res["simulated"] = simulated(args.comparisons)
    if args.trials:
        res["real"] = real(args.trials, args.steps)
    md = markdown(res)
    print(md)
    if args.out:
        import json
        from pathlib import Path

        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "loss_rule.json").write_text(json.dumps(res, indent=2))
        (d / "loss_rule.md").write_text(md)
    return res


if __name__ == "__main__":
    main()
