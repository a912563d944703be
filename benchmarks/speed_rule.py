"""How often does the speed rule (nbtrain.verdicts.speed) rank identical variants, and how often does it find a
real difference? Simulated timings, fed to the real function: per comparison a jitter sigma and a share of
disturbed runs are drawn, every run's throughput is log-normal around its true value, a disturbed run is slowed
1.2-2.5x, and each repeat shares a small drift between its two runs (what pairing by repeat cancels).

    python benchmarks/speed_rule.py [--comparisons 20000] [--out benchmarks/results]

tests/test_speed_rule.py runs the same scenarios with fewer comparisons and asserts the issue's bounds.
"""

from __future__ import annotations

import argparse
import math
from typing import Optional, Sequence

import numpy as np

from nbtrain import verdicts

# name -> (jitter sigma range, disturbed share range): the A/A conditions and its two power conditions
SCENARIOS = {
    "quiet": ((0.02, 0.05), (0.0, 0.0)),
    "disturbed 8%": ((0.02, 0.05), (0.08, 0.08)),
    "disturbed 5-20%": ((0.02, 0.05), (0.05, 0.20)),
    "disturbed 20%": ((0.02, 0.05), (0.20, 0.20)),
}
DRIFT = 0.01          # a round's shared slow-down (log sd): pairing by repeat removes it
SLOWED = (1.2, 2.5)   # how much a disturbed run is slowed


def simulate(rng: np.random.Generator, comparisons: int, repeats: int, ratio: float,
             jitter: Sequence[float], disturbed: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(variant, reference) tokens/s, each of shape (comparisons, repeats); the variant truly ``ratio`` x."""
    shape = (comparisons, repeats)
    sigma = rng.uniform(*jitter, (comparisons, 1))
    share = rng.uniform(*disturbed, (comparisons, 1))
    drift = rng.normal(0.0, DRIFT, shape)

    def arm(true: float) -> np.ndarray:
        logs = math.log(true) + drift + sigma * rng.normal(size=shape)
        slowed = rng.random(shape) < share
        return np.exp(logs - slowed * np.log(rng.uniform(*SLOWED, shape)))

    return arm(100.0 * ratio), arm(100.0)


def ranked_share(rng: np.random.Generator, comparisons: int, repeats: int, ratio: float, scenario: str,
                 right_way: Optional[bool] = None) -> float:
    """The share of simulated comparisons the rule ranks (only those ranked the true way when ``right_way``)."""
    var, ref = simulate(rng, comparisons, repeats, ratio, *SCENARIOS[scenario])
    hits = 0
    for v, r in zip(var.tolist(), ref.tolist()):
        s = verdicts.speed(v, r)
        if s.measurable and (not right_way or (s.state == "faster") == (ratio > 1)):
            hits += 1
    return hits / comparisons


def run(comparisons: int, seed: int = 0, repeats=(3, 4, 5, 7, 10), ratios=(1.0, 1.1, 1.3, 1 / 1.3)) -> dict:
    rng = np.random.default_rng(seed)
    rows = []
    for n in repeats:
        for scenario in SCENARIOS:
            for ratio in ratios:
                share = ranked_share(rng, comparisons, n, ratio, scenario, right_way=ratio != 1.0)
                rows.append({"repeats": n, "scenario": scenario, "ratio": round(ratio, 4),
                             "ranked" if ratio == 1.0 else "found": round(share, 4)})
                print(rows[-1], flush=True)
    return {"comparisons_per_cell": comparisons, "seed": seed, "drift": DRIFT, "slowed": SLOWED,
            "scenarios": {k: {"jitter": v[0], "disturbed": v[1]} for k, v in SCENARIOS.items()},
            "k": verdicts.SPEED_K, "rows": rows}


def markdown(res: dict) -> str:
    ratios = sorted({r["ratio"] for r in res["rows"]}, key=lambda x: (abs(math.log(x)), x < 1))
    head = ["repeats", "scenario"] + [("A/A ranked" if r == 1.0 else f"{r:.2f}x found") for r in ratios]
    lines = [f"# The speed rule on simulated timings ({res['comparisons_per_cell']:,} comparisons per cell)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells: dict = {}
    for r in res["rows"]:
        cells.setdefault((r["repeats"], r["scenario"]), {})[r["ratio"]] = r.get("ranked", r.get("found"))
    for (n, sc), vals in cells.items():
        lines.append(f"| {n} | {sc} | " + " | ".join(f"{vals[x]:.1%}" for x in ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--comparisons", type=int, default=20000)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    res = run(args.comparisons)
    md = markdown(res)
    print(md)
    if args.out:
        import json
        from pathlib import Path
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "speed_rule_sim.json").write_text(json.dumps(res, indent=2))
        (d / "speed_rule_sim.md").write_text(md)
    return res


if __name__ == "__main__":
    main()
