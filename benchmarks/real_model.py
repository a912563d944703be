"""Speed on a real model (issue 37.1): nbtrain, a bare torch.amp loop and transformers.Trainer (+ PEFT for LoRA) on
SmolLM2-135M-Instruct (``model="smollm2-135m-instruct"``), on the CPU (or CUDA where there is one).

The three arms are gpu_suite's (``run_bare``, ``run_nbtrain``, ``run_trainer``): the same model builder, the same
packed ``builtin:python-docs`` batches in the same order (seq 256), the same micro-batch, steps and optimizer
settings, no eval, no saving, logging every step. Rows: full and LoRA, each in fp32 and bf16. Each repeat runs the
three arms of a row back to back in an order that rotates from repeat to repeat (bare nbtrain trainer, nbtrain
trainer bare, ...), after one untimed warm pass of the first row. An arm's figure is its median window tokens/s
after ``--warmup`` steps; per repeat the paired ratios nbtrain/bare and nbtrain/Trainer, reported with their range and
judged by nbtrain's speed rule (``nbtrain.verdicts.speed``). MFU: summary["mfu"]'s arithmetic (engine.flops:
the model's own FLOPs per token; capabilities().peak_tflops).

    python benchmarks/real_model.py                          # 4 repeats (~10 min on 2 CPU cores)
    python benchmarks/real_model.py --repeats 1 --rows lora:bf16 --out /tmp/dry
Writes real_model_<device>.json and .md under --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_suite as gs  # noqa: E402

import nbtrain as nbt  # noqa: E402
from nbtrain import verdicts  # noqa: E402
from nbtrain.engine.flops import mfu, token_flops  # noqa: E402
from nbtrain.models import build_model, load_tokenizer  # noqa: E402
from nbtrain.precision import PRECISION_TABLE, global_torch_state  # noqa: E402

ROWS = [("full", "fp32"), ("full", "bf16"), ("lora", "fp32"), ("lora", "bf16")]


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except Exception:   # noqa: BLE001 - not installed, or it does not import with this transformers
        return False
    return True


# TRL's SFTTrainer as a fourth arm where trl imports (pip install trl; it is not a dependency of nbtrain)
ARMS = ("bare", "nbtrain", "trainer") + (("sft",) if _has_trl() else ())


def base_config(seq_len: int, batch: int) -> nbt.TrainConfig:
    return nbt.TrainConfig(model="smollm2-135m-instruct", data="builtin:python-docs", max_seq_len=seq_len,
                           micro_batch_size=batch, grad_accum_steps=1, packing=True, eval_fraction=0.0, max_steps=1,
                           lr=3e-4, scheduler="cosine", warmup_steps=0, max_grad_norm=1.0, lora_r=16, lora_alpha=32,
                           lora_dropout=0.0, lora_targets="all-linear", seed=0, log_every=1)


def one(arm: str, cfg: nbt.TrainConfig, plan, warmup: int, windows: int, per_window: int, device: str,
        tmp: Path) -> dict:
    """One timed run of ``arm`` on ``cfg``: tokens/s (median window) and final loss."""
    row = gs.Row(name=f"{arm}:{cfg.method}:{cfg.precision}", impl=arm, precision=cfg.precision, method=cfg.method)
    total = warmup + windows * per_window
    win = gs.Windows(warmup, windows, per_window, plan.tokens[:total], device)
    spec = PRECISION_TABLE[cfg.precision]
    gs._free(device)
    with global_torch_state(spec):
        runner = {"bare": gs.run_bare, "nbtrain": gs.run_nbtrain}.get(arm)
        got = (runner(cfg, row, win, device) if runner else
               gs.run_trainer(cfg, row, win, device, tmp, sft=arm == "sft"))
    got.update(win.summary())
    gs._free(device)
    return got


def flops_per_token(cfg: nbt.TrainConfig) -> float:
    tok = load_tokenizer(cfg)
    model = build_model(cfg, tok, None, cfg.precision, "cpu")
    return token_flops(model, cfg.max_seq_len, cfg.gradient_checkpointing).model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--rows", default=None, help="comma-separated method:precision, e.g. lora:bf16,full:fp32")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--per-window", type=int, default=2)
    ap.add_argument("--arms", default=None, help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--chunked-loss", action="store_true",
                    help="nbtrain's arm with chunked_loss=True (the fused head + loss: no vocab-wide logits)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    arms = tuple(args.arms.split(",")) if args.arms else ARMS
    if "nbtrain" not in arms or any(a not in ARMS for a in arms):
        ap.error(f"--arms: must include nbtrain and name only {', '.join(ARMS)}; got {args.arms!r}")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:   # noqa: BLE001
        pass
    device = "cuda" if torch.cuda.is_available() else "cpu"
    caps = nbt.capabilities(device)
    rows = ROWS if not args.rows else [tuple(r.split(":")) for r in args.rows.split(",")]
    base = base_config(args.seq_len, args.batch)
    tok = load_tokenizer(base)
    total = args.warmup + args.windows * args.per_window
    plan = gs.plan_data(base.replace(max_steps=total), tok, total)
    tmp = Path(tempfile.mkdtemp(prefix="nbtrain-real-"))
    t0 = time.perf_counter()
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
            "machine": caps.name, "threads": torch.get_num_threads(), "peak_tflops": caps.peak_tflops,
            "model": base.model, "seq_len": args.seq_len, "batch": args.batch, "warmup": args.warmup,
            "windows": args.windows, "per_window": args.per_window, "repeats": args.repeats,
            "versions": gs._versions()}
    first = base.replace(method=rows[0][0], precision=rows[0][1], max_steps=total)
    one("nbtrain", first, plan, args.warmup, args.windows, args.per_window, device, tmp)   # warm pass, discarded
    out_rows = []
    for method, precision in rows:
        cfg = base.replace(method=method, precision=precision, max_steps=total)
        runs: dict[str, list[float]] = {a: [] for a in arms}
        losses: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.repeats):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            for arm in order:
                arm_cfg = cfg.replace(chunked_loss=True) if arm == "nbtrain" and args.chunked_loss else cfg
                got = one(arm, arm_cfg, plan, args.warmup, args.windows, args.per_window, device, tmp)
                runs[arm].append(got["tokens_per_s"])
                losses[arm].append(got["final_loss"])
                print(f"[real] {method}:{precision} repeat {r + 1} {arm}: {got['tokens_per_s']:,.0f} tok/s, "
                      f"loss {got['final_loss']:.4f}", flush=True)
        pairs_bare = [n / b for n, b in zip(runs["nbtrain"], runs.get("bare", []))]
        pairs_trainer = [n / t for n, t in zip(runs["nbtrain"], runs.get("trainer", []))]
        pairs_sft = [n / t for n, t in zip(runs["nbtrain"], runs.get("sft", []))]
        fpt = flops_per_token(cfg)
        tps = statistics.median(runs["nbtrain"])
        out_rows.append({
            "method": method, "precision": precision,
            **({"vs_bare": statistics.median(pairs_bare), "pairs_bare": [round(x, 4) for x in pairs_bare],
                "verdict_bare": verdicts.speed(runs["nbtrain"], runs["bare"]).state} if pairs_bare else {}),
            **({"vs_trainer": statistics.median(pairs_trainer),
                "pairs_trainer": [round(x, 4) for x in pairs_trainer],
                "verdict_trainer": verdicts.speed(runs["nbtrain"], runs["trainer"]).state} if pairs_trainer else {}),
            **({"vs_sft_trainer": statistics.median(pairs_sft), "pairs_sft_trainer": [round(x, 4) for x in pairs_sft],
                "verdict_sft_trainer": verdicts.speed(runs["nbtrain"], runs["sft"]).state} if pairs_sft else {}),
            "tokens_per_s": tps, "tokens_per_s_by_arm": {a: [round(x, 1) for x in v] for a, v in runs.items()},
            "final_loss_by_arm": {a: [round(x, 4) for x in v] for a, v in losses.items()},
            "model_flops_per_token": fpt, "mfu": mfu(fpt, tps, caps.peak_tflops, precision),
        })
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    meta["arms"], meta["nbtrain_chunked_loss"] = list(arms), args.chunked_loss
    res = {"machine": caps.name, "meta": meta, "rows": out_rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"real_model_{device}" + ("_chunked" if args.chunked_loss else "") + \
        ("" if arms == ARMS else "_" + "-".join(a for a in arms if a != "nbtrain"))
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2, default=str))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return res


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# SmolLM2-135M-Instruct: nbtrain vs a bare loop vs transformers.Trainer ({m['device']}, {m['date']})",
             "", f"{res['machine']}, {m['threads']} threads; packed builtin:python-docs, {m['batch']} x {m['seq_len']} "
             f"tokens per step, {m['warmup']} warm-up + {m['windows']} x {m['per_window']} timed steps per run, "
             f"{m['repeats']} repeats in rotating order; ratios are the median of the per-repeat pairs [range].", "",
             "| method | precision | nbtrain tok/s | vs bare | vs Trainer | speed rule (bare / Trainer) | MFU |",
             "|---|---|---|---|---|---|---|"]
    sft = [r for r in res["rows"] if "vs_sft_trainer" in r]
    for r in res["rows"]:
        if "vs_bare" not in r or "vs_trainer" not in r:
            continue
        lines.append(f"| {r['method']} | {r['precision']} | {r['tokens_per_s']:,.0f} | {r['vs_bare']:.3f} "
                     f"[{min(r['pairs_bare']):.3f}-{max(r['pairs_bare']):.3f}] | {r['vs_trainer']:.3f} "
                     f"[{min(r['pairs_trainer']):.3f}-{max(r['pairs_trainer']):.3f}] | {r['verdict_bare']} / "
                     f"{r['verdict_trainer']} | {100 * r['mfu']:.2f}% |" if r["mfu"] is not None else
                     f"| {r['method']} | {r['precision']} | {r['tokens_per_s']:,.0f} | {r['vs_bare']:.3f} | "
                     f"{r['vs_trainer']:.3f} | {r['verdict_bare']} / {r['verdict_trainer']} | - |")
    if sft:
        how = " (nbtrain with chunked_loss=True)" if m.get("nbtrain_chunked_loss") else ""
        lines += ["", "TRL's SFTTrainer (trl " + str(m["versions"].get("trl", "?")) + f") on the same batches{how}:", "",
                  "| method | precision | nbtrain tok/s | vs SFTTrainer | speed rule |", "|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['precision']} | {r['tokens_per_s']:,.0f} | {r['vs_sft_trainer']:.3f} "
                  f"[{min(r['pairs_sft_trainer']):.3f}-{max(r['pairs_sft_trainer']):.3f}] | "
                  f"{r['verdict_sft_trainer']} |" for r in sft]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
