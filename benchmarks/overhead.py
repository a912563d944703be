"""nbtrain's loop vs a bare torch.amp loop on the same tiny model and the same batches (CPU).

Interleaved: each repeat runs the bare loop and nbtrain back to back, in alternating order, so drift in the
machine and any first-or-second advantage hit both. Each run's figure is its median per-step throughput after
warm-up; the result is the median over the repeats of the paired ratio nbtrain / bare, with the pairs' range as
its noise; target >= 0.97x.

    python benchmarks/overhead.py [--steps 40] [--repeats 3] [--precisions fp32,bf16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain.data import iter_steps, load_data
from nbtrain.engine.optimizers import adamw_fused
from nbtrain.hardware import resolve_precision
from nbtrain.precision import PRECISION_TABLE
from nbtrain.models import build_model, load_tokenizer

WARMUP = 5


def bench_config(precision: str, steps: int) -> nbt.TrainConfig:
    return nbt.TrainConfig(model="tiny", data="builtin:python-docs", max_seq_len=128, micro_batch_size=8,
                           grad_accum_steps=1, max_steps=steps, precision=precision, eval_fraction=0.0,
                           subset=2000, lr=3e-4)


def bare_loop(cfg: nbt.TrainConfig, steps: int) -> list[float]:
    """The loop a person would write by hand with torch.amp; returns per-step tokens/s."""
    spec = PRECISION_TABLE[resolve_precision(cfg.precision)]
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tok, None, spec.name, "cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    # the same AdamW kernel as nbtrain (fused on the CPU too), so the ratio measures the loop, not the optimizer
    opt = torch.optim.AdamW(params, lr=cfg.lr, fused=adamw_fused(params, "cpu"))
    scaler = torch.amp.GradScaler("cpu", enabled=spec.scaler)
    batches = iter_steps(data.train, cfg.micro_batch_size, 1, cfg.seed, data.pad_token_id, data.task)
    out = []
    t_prev = time.perf_counter()
    for _ in range(steps):
        _, (mb,) = next(batches)
        with torch.autocast("cpu", dtype=spec.autocast_dtype or torch.float32,
                            enabled=spec.autocast_dtype is not None):
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        # The same loss maths as nbtrain (labels shifted, logits not sliced), so the ratio measures the loop.
        targets = F.pad(mb.labels[:, 1:], (0, 1), value=-100)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        loss.item()
        now = time.perf_counter()
        out.append(mb.n_tokens / (now - t_prev))
        t_prev = now
    return out


def nbtrain_loop(cfg: nbt.TrainConfig, callbacks=None) -> list[float]:
    r = nbt.train(cfg, callbacks=callbacks)
    return list(r.history["tokens_per_s"])


def traced_every_step(cfg: nbt.TrainConfig) -> list[float]:
    """nbtrain with the CPU run-tensor tracer on every step (as before issue 25 sampled it)."""
    from nbtrain.engine.telemetry import RunTensorBytes

    saved = RunTensorBytes.MEASURE_EVERY
    RunTensorBytes.MEASURE_EVERY = 1
    try:
        return nbtrain_loop(cfg)
    finally:
        RunTensorBytes.MEASURE_EVERY = saved


def run(steps: int = 40, repeats: int = 3, precisions=("fp32", "bf16"), extra=None,
        every_step: bool = False, aa: bool = False) -> dict:
    """Measure every precision, interleaved; ``extra`` maps a name to callbacks for more nbtrain rows;
    ``every_step`` adds a row with the run-tensor tracer on every step; ``aa`` runs the bare loop a second time in
    each repeat (after the pair), so the bare-vs-bare ratio shows the spread the nbtrain-vs-bare ratio has when
    the two sides are the same code."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # Untimed first runs of both loops: the process's one-time costs (lazy imports, kernels, allocator pools)
    # would otherwise land on whichever loop runs first (a first pair measured 18x on 2 cores).
    for p in precisions:
        warm = bench_config(p, WARMUP + 1)
        bare_loop(warm, WARMUP + 1)
        nbtrain_loop(warm)
    rows = []
    for p in precisions:
        cfg = bench_config(p, steps)
        samples: dict[str, list[float]] = {"bare": [], "nbtrain": []}
        for name in (extra or {}):
            samples[name] = []
        if every_step:
            samples["traced_every_step"] = []
        if aa:
            samples["bare_again"] = []
        for r in range(repeats):
            # Alternate the order (ABBA...) so whatever favours the first or second run cancels out.
            pair = [("bare", lambda c=cfg: bare_loop(c, steps)), ("nbtrain", lambda c=cfg: nbtrain_loop(c))]
            for name, fn in (pair if r % 2 == 0 else pair[::-1]):
                samples[name].append(statistics.median(fn()[WARMUP:]))
            for name, make_cbs in (extra or {}).items():
                samples[name].append(statistics.median(nbtrain_loop(cfg, make_cbs())[WARMUP:]))
            if every_step:
                samples["traced_every_step"].append(statistics.median(traced_every_step(cfg)[WARMUP:]))
            if aa:
                samples["bare_again"].append(statistics.median(bare_loop(cfg, steps)[WARMUP:]))
        med = {k: statistics.median(v) for k, v in samples.items()}
        # Each repeat is one interleaved pair: its ratio is free of the drift between repeats; the median of the
        # pairs is the figure, their range its noise.
        pairs = [n / b for n, b in zip(samples["nbtrain"], samples["bare"])]
        row = {"precision": p, **{f"{k}_tokens_per_s": round(v, 1) for k, v in med.items()},
               "ratio_nbtrain_vs_bare": round(statistics.median(pairs), 4),
               "pair_ratios": [round(x, 4) for x in pairs],
               "pair_ratio_range": [round(min(pairs), 4), round(max(pairs), 4)],
               "ratio_of_medians": round(med["nbtrain"] / med["bare"], 4)}
        for name in (extra or {}):
            row[f"ratio_{name}_vs_nbtrain"] = round(med[name] / med["nbtrain"], 4)
        if every_step:
            traced = [t / b for t, b in zip(samples["traced_every_step"], samples["bare"])]
            row["ratio_traced_every_step_vs_bare"] = round(statistics.median(traced), 4)
            row["traced_every_step_pair_ratio_range"] = [round(min(traced), 4), round(max(traced), 4)]
        if aa:
            same = [a / b for a, b in zip(samples["bare_again"], samples["bare"])]
            row["ratio_bare_again_vs_bare"] = round(statistics.median(same), 4)
            row["bare_again_pair_ratios"] = [round(x, 4) for x in same]
        rows.append(row)
    return {
        "date": dt.date.today().isoformat(), "device": "cpu", "cpu": nbt.capabilities("cpu").name,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "steps": steps, "repeats": repeats, "warmup_steps_excluded": WARMUP, "rows": rows,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--every-step-tracer", action="store_true",
                    help="add a row with the CPU run-tensor tracer on every step, for what sampling it saves")
    ap.add_argument("--aa", action="store_true",
                    help="run the bare loop twice per repeat: the bare-vs-bare ratio is the harness's own spread")
    args = ap.parse_args(argv)
    res = run(args.steps, args.repeats, tuple(args.precisions.split(",")), every_step=args.every_step_tracer,
              aa=args.aa)
    for r in res["rows"]:
        print(f"{r['precision']}: bare {r['bare_tokens_per_s']:,.0f} tok/s, nbtrain "
              f"{r['nbtrain_tokens_per_s']:,.0f} tok/s, ratio {r['ratio_nbtrain_vs_bare']:.3f} (median of "
              f"{len(r['pair_ratios'])} pairs, range {r['pair_ratio_range'][0]:.3f}-{r['pair_ratio_range'][1]:.3f}; "
              "target >= 0.97)" + (f"; tracer on every step {r['ratio_traced_every_step_vs_bare']:.3f}"
                                   if "ratio_traced_every_step_vs_bare" in r else "")
              + (f"; bare vs bare {r['ratio_bare_again_vs_bare']:.3f} (pairs "
                 f"{min(r['bare_again_pair_ratios']):.3f}-{max(r['bare_again_pair_ratios']):.3f})"
                 if "ratio_bare_again_vs_bare" in r else ""))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "overhead_cpu.json").write_text(json.dumps(res, indent=2))
        print(f"wrote {out / 'overhead_cpu.json'}")
    return res


if __name__ == "__main__":
    main()
