"""nbtrain's own loop at two commits, side by side in one run (CPU): did a change cost the loop anything?

``overhead.py`` compares nbtrain with a bare loop; when its figure moves between two sessions, the machine may
have moved instead. This runs the same training (overhead.py's tiny config) from two checkouts of the repository,
interleaved (ABBA...), each run in a fresh process with only that checkout on its path, and reports the median
of the paired throughput ratios new / old with the pairs' range as the noise. ``--aa`` makes both sides the new
commit, for the harness's own spread. ``--objective dpo`` runs the DPO loop instead (LoRA on tiny, the built-in
preference pairs; the reference is the model with its adapters off).

    python benchmarks/loop_ab.py --old 12abd46 [--new HEAD] [--repeats 6] [--precisions fp32,bf16] [--aa]
                                 [--objective lm|dpo]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What each process runs: an untimed warm-up run (lazy imports, kernels, allocator pools), then the timed one; it
# prints the median per-step tokens/s after overhead.py's warm-up steps.
_CHILD = """
import json, statistics, sys
import nbtrain as nbt
assert nbt.__file__.startswith(sys.argv[1]), (nbt.__file__, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/benchmarks")
from overhead import WARMUP, bench_config, nbtrain_loop
p, steps, objective = sys.argv[2], int(sys.argv[3]), sys.argv[4]


def config(n):
    if objective == "dpo":
        return nbt.TrainConfig(model="tiny", data="builtin:python-docs-pref", objective="dpo", method="lora",
                               max_seq_len=128, micro_batch_size=4, max_steps=n, precision=p, eval_fraction=0.0,
                               lr=3e-4)
    return bench_config(p, n)


nbtrain_loop(config(WARMUP + 1))
print(json.dumps(statistics.median(nbtrain_loop(config(steps))[WARMUP:])))
"""


def _checkout(rev: str, into: Path) -> Path:
    """``rev``'s files in ``into`` (git archive: no worktree bookkeeping left behind)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _one(tree: Path, precision: str, steps: int, objective: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "NBTRAIN_DASHBOARD": "text"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tree), precision, str(steps), objective], env=env,
                         cwd=tree,
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def run(old: str, new: str = "HEAD", repeats: int = 6, steps: int = 40, precisions=("fp32", "bf16"),
        aa: bool = False, objective: str = "lm") -> dict:
    """Interleaved runs of both commits; per precision the paired ratios new / old."""
    revs = {name: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", r], check=True,
                                 capture_output=True, text=True).stdout.strip()
            for name, r in (("old", new if aa else old), ("new", new))}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: _checkout(rev, Path(tmp) / name) for name, rev in revs.items()}
        for p in precisions:
            got: dict[str, list[float]] = {"old": [], "new": []}
            for r in range(repeats):
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    got[name].append(_one(trees[name], p, steps, objective))
            pairs = [n / o for n, o in zip(got["new"], got["old"])]
            rows.append({"precision": p, "old_tokens_per_s": [round(x, 1) for x in got["old"]],
                         "new_tokens_per_s": [round(x, 1) for x in got["new"]],
                         "ratio_new_vs_old": round(statistics.median(pairs), 4),
                         "pair_ratios": [round(x, 4) for x in pairs],
                         "pair_ratio_range": [round(min(pairs), 4), round(max(pairs), 4)]})
    return {"old": revs["old"], "new": revs["new"], "aa": aa, "objective": objective, "steps": steps,
            "repeats": repeats, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--old", required=True, help="the commit before the change")
    ap.add_argument("--new", default="HEAD")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--aa", action="store_true", help="both sides the new commit: the harness's own spread")
    ap.add_argument("--objective", choices=("lm", "dpo"), default="lm")
    ap.add_argument("--out", default="", help="a JSON file to write")
    args = ap.parse_args(argv)
    res = run(args.old, args.new, args.repeats, args.steps, tuple(args.precisions.split(",")), args.aa,
              args.objective)
    for r in res["rows"]:
        print(f"{res['objective']} {r['precision']}: {res['new']} / {res['old']} = {r['ratio_new_vs_old']:.3f} (median of "
              f"{len(r['pair_ratios'])} pairs, range {r['pair_ratio_range'][0]:.3f}-{r['pair_ratio_range'][1]:.3f})")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
