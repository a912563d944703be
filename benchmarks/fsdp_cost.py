"""What FSDP2 costs on this machine (CPU, gloo): the same config as 1 plain process, 2 processes DDP, 2 processes
FSDP, and 1 process FSDP (torchrun --nproc_per_node 1: FSDP's own cost with no second rank).

Every variant sees the same global batches (2 ranks x micro 4 = 1 process x micro 8), so their losses must agree;
the run checks that (max relative difference per step, target 1e-5) and records it. Each variant runs as its own
``nbtrain train`` process(es), with OMP_NUM_THREADS=1 per process (2 ranks on 2 cores). Order rotates over the
repeats (ABCD, BCDA, ...) so machine drift reaches every variant alike. A run's figure is its median step time
after ``--warmup`` steps; the ratios FSDP/DDP (2 ranks) and FSDP-1-rank/plain are taken inside each repeat (a
pair run minutes apart would carry the drift between them) and reported as the median of the repeats with their
min-max as the noise. The machine's load average before and after is in the result: others' processes share the
cores.

    python benchmarks/fsdp_cost.py [--repeats 3] [--steps N] [--at-commit HEAD] [--out benchmarks/results]
    python benchmarks/fsdp_cost.py --quick --out /tmp/x      # a few steps, 1 repeat: the code path, for tests

Without ``--steps`` an untimed calibration pass (each variant once, discarded) picks the step count so the slowest
variant's timed part lasts about ``--target-s`` seconds (at least 30 timed steps).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(_REPO))

LOSS_RTOL = 1e-5


@dataclass(frozen=True)
class Variant:
    name: str
    nproc: int          # 0: plain `python -m nbtrain`, no launcher
    micro: int          # per rank; nproc x micro is the global batch (8) in every variant
    sharding: str


VARIANTS = (Variant("plain", 0, 8, "none"), Variant("ddp_2", 2, 4, "none"),
            Variant("fsdp_2", 2, 4, "fsdp"), Variant("fsdp_1", 1, 8, "fsdp"))


def base_config(steps: int, seq_len: int, subset: Optional[int]) -> dict:
    """The config every variant shares (micro_batch_size and sharding are the variant's)."""
    return dict(model="tiny", data="builtin:python-docs", max_seq_len=seq_len, subset=subset, max_steps=steps,
                eval_fraction=0.0, precision="fp32", lr=3e-4, seed=0, log_every=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(v: Variant, cfg: dict, work: Path, env: dict, timeout_s: float) -> dict:
    """One run of a variant: its per-step losses, tokens and step times from rank 0's history.csv."""
    import nbtrain as nbt
    import pandas as pd

    d = Path(tempfile.mkdtemp(prefix=f"{v.name}-", dir=work))
    nbt.TrainConfig(**cfg, micro_batch_size=v.micro, sharding=v.sharding).to_yaml(d / "c.yaml")
    cmd = [sys.executable]
    if v.nproc:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(v.nproc), "--master_addr", "127.0.0.1",
                "--master_port", str(_free_port())]
    cmd += ["-m", "nbtrain", "train", str(d / "c.yaml"), "--output-dir", str(d / "out")]
    t0 = time.perf_counter()
    # cwd=d: `python -m` puts the cwd first on sys.path, so the repo's working tree cannot shadow PYTHONPATH
    proc = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{v.name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    h = pd.read_csv(d / "out" / "history.csv")
    s = json.loads((d / "out" / "summary.json").read_text())
    shutil.rmtree(d, ignore_errors=True)
    return {"variant": v.name, "wall_s": round(wall, 2), "world_size": s.get("world_size"),
            "sharded": any("FSDP" in n for n in s.get("notes") or []),
            "step_time_s": [round(x, 6) for x in h["step_time_s"]], "loss": list(map(float, h["loss"])),
            "tokens": list(map(int, h["tokens"]))}


def steady(r: dict, warmup: int) -> float:
    """The run's median step time after warm-up."""
    return statistics.median(r["step_time_s"][warmup:])


def loss_agreement(runs: list[dict]) -> dict:
    """Max relative loss difference of every run against the first plain run, step by step."""
    ref = next(r for r in runs if r["variant"] == "plain")
    worst: dict[str, float] = {}
    same_tokens = True
    for r in runs:
        if len(r["loss"]) != len(ref["loss"]):
            worst[r["variant"]] = math.inf
            continue
        d = max(abs(a - b) / abs(b) for a, b in zip(r["loss"], ref["loss"]))
        worst[r["variant"]] = max(worst.get(r["variant"], 0.0), d)
        same_tokens &= r["tokens"] == ref["tokens"]
    return {"max_rel_diff_vs_plain": {k: float(f"{v:.3g}") for k, v in worst.items()}, "rtol": LOSS_RTOL,
            "same_tokens": same_tokens, "pass": same_tokens and all(v <= LOSS_RTOL for v in worst.values())}


def _spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4),
            "per_repeat": [round(x, 4) for x in xs]}


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", str(_REPO), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:   # noqa: BLE001
        return None


def snapshot(rev: str, work: Path) -> Path:
    """``rev``'s nbtrain/ exported to ``work`` (others' uncommitted edits in the working tree stay out)."""
    dest = work / "src"
    dest.mkdir()
    arch = subprocess.run(["git", "-C", str(_REPO), "archive", rev, "nbtrain"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)
    return dest


def run(repeats: int = 3, steps: Optional[int] = None, warmup: int = 5, seq_len: int = 64,
        subset: Optional[int] = None, target_s: float = 10.0, threads: int = 1, at_commit: Optional[str] = None,
        timeout_s: float = 900.0, verbose: bool = True) -> dict:
    import torch

    import nbtrain as nbt

    work = Path(tempfile.mkdtemp(prefix="nbtrain-fsdp-cost-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    source = {"nbtrain": str(Path(nbt.__file__).parent), "git_commit": _git("rev-parse", "--short", "HEAD"),
              "working_tree_dirty": bool(_git("status", "--porcelain", "--", "nbtrain"))}
    if at_commit:
        src = snapshot(at_commit, work)
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        source = {"nbtrain": str(src / "nbtrain"), "git_commit": _git("rev-parse", "--short", at_commit),
                  "working_tree_dirty": False, "at_commit": at_commit}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    calibration = None
    if steps is None:
        # untimed: each variant once, to size the timed runs (the slowest one ~target_s after warm-up)
        n = warmup + 10
        cal = [run_variant(v, base_config(n, seq_len, subset), work, env, timeout_s) for v in VARIANTS]
        slowest = max(steady(r, warmup) for r in cal)
        steps = warmup + max(30, math.ceil(target_s / slowest))
        calibration = {"steps": n, "steady_step_time_s": {r["variant"]: round(steady(r, warmup), 5) for r in cal},
                       "chosen_steps": steps}
        if verbose:
            print(f"[fsdp_cost] calibration {calibration['steady_step_time_s']} -> {steps} steps", flush=True)
    cfg = base_config(steps, seq_len, subset)
    runs: list[dict] = []
    per_repeat: list[dict[str, float]] = []
    for rep in range(repeats):
        order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]   # ABCD, BCDA, CDAB, ...
        got: dict[str, float] = {}
        for v in order:
            r = run_variant(v, cfg, work, env, timeout_s)
            r["repeat"] = rep
            r["steady_step_time_s"] = round(steady(r, warmup), 6)
            got[v.name] = r["steady_step_time_s"]
            runs.append(r)
            if verbose:
                print(f"[fsdp_cost] repeat {rep} {v.name}: {r['steady_step_time_s'] * 1e3:.1f} ms/step "
                      f"(world {r['world_size']}, sharded {r['sharded']}, final loss {r['loss'][-1]:.6f}, "
                      f"wall {r['wall_s']} s)", flush=True)
        per_repeat.append(got)
    load_after = os.getloadavg()
    shutil.rmtree(work, ignore_errors=True)
    ratios = {
        # > 1: FSDP's step is slower
        "fsdp_2_vs_ddp_2": _spread([g["fsdp_2"] / g["ddp_2"] for g in per_repeat]),
        "fsdp_1_vs_plain": _spread([g["fsdp_1"] / g["plain"] for g in per_repeat]),
        "ddp_2_vs_plain": _spread([g["ddp_2"] / g["plain"] for g in per_repeat]),   # context: what 2 ranks buy
    }
    checks = {"losses": loss_agreement(runs),
              "sharded_as_asked": all(r["sharded"] == (r["variant"].startswith("fsdp")) for r in runs),
              "world_sizes": {r["variant"]: r["world_size"] for r in runs}}
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": "cpu",
        "device_name": nbt.capabilities("cpu").name, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(), "backend": "gloo", "source": source,
        "config": {**cfg, "micro_batch_size": {v.name: v.micro for v in VARIANTS},
                   "processes": {v.name: max(1, v.nproc) for v in VARIANTS},
                   "sharding": {v.name: v.sharding for v in VARIANTS}, "reshard_after_forward": True},
        "threads_per_process": threads, "repeats": repeats, "warmup_steps_excluded": warmup,
        "figure": "median step_time_s of rank 0 after warm-up; ratios per repeat, median and min-max over repeats",
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in load_after],
        "wall_s": round(time.perf_counter() - t0, 1), "calibration": calibration,
        "steady_step_time_s": {v.name: [g[v.name] for g in per_repeat] for v in VARIANTS},
        "ratios": ratios, "checks": checks, "runs": runs,
    }


def summary_text(res: dict) -> str:
    r = res["ratios"]
    lines = [f"FSDP cost on {res['device_name']} ({res['date']}, torch {res['torch']}, {res['repeats']} repeats, "
             f"{res['config']['max_steps']} steps, first {res['warmup_steps_excluded']} excluded; load "
             f"{res['loadavg_before'][0]} -> {res['loadavg_after'][0]})"]
    for k, label in (("fsdp_2_vs_ddp_2", "FSDP / DDP, 2 ranks"), ("fsdp_1_vs_plain", "FSDP 1 rank / plain"),
                     ("ddp_2_vs_plain", "DDP 2 ranks / plain")):
        lines.append(f"  step time {label}: {r[k]['median']:.3f}x (min-max {r[k]['min']:.3f}-{r[k]['max']:.3f})")
    c = res["checks"]["losses"]
    lines.append(f"  losses agree within {c['rtol']:g}: {c['pass']} {c['max_rel_diff_vs_plain']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: calibrated to --target-s)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of its figure")
    ap.add_argument("--target-s", type=float, default=10.0)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--subset", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    ap.add_argument("--at-commit", default=None, help="run the workers on this commit's nbtrain/ (git archive)")
    ap.add_argument("--quick", action="store_true", help="6 steps, 2 excluded, 1 repeat, 64 documents: the code path")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--stem", default=None, help="file name (default fsdp_cost_cpu_<date>)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats, args.subset = args.steps or 6, 2, 1, args.subset or 64
    res = run(args.repeats, args.steps, args.warmup, args.seq_len, args.subset, args.target_s, args.threads,
              args.at_commit)
    print(summary_text(res))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{args.stem or 'fsdp_cost_cpu_' + res['date'][:10]}.json"
        path.write_text(json.dumps(res, indent=2))
        res["path"] = str(path)
        print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
