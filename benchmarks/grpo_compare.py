"""The GRPO precision A/B on SmolLM2-135M-Instruct with LoRA on the CPU, through ``compare()``: fp32, bf16 and fp16
(sampler and trainer in the same precision), and bf16 sampling with fp32 training (``sampler_precision``). Each
variant's verdict says its sampler/trainer mismatch (mean |delta log p| per completion token, with its band over the
rollout batches) against fp16's.

    python benchmarks/grpo_compare.py [--steps 6] [--group 4] [--prompts-per-step 2] [--tokens 24]
                                      [--out benchmarks/results]
"""

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import nbtrain as nbt

VARIANTS = {"fp32": dict(precision="fp32"), "bf16": dict(precision="bf16"), "fp16": dict(precision="fp16"),
            "bf16 sampling, fp32 training": dict(precision="fp32", sampler_precision="bf16")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeds", default="", help="extra seeds of the reference (fp32), e.g. 0,1")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    cfg = nbt.TrainConfig(objective="grpo", reward="length:8", data="builtin:prompts", model="smollm2-135m-instruct",
                          method="lora", lora_dropout=0.0, max_steps=args.steps, num_generations=args.group,
                          micro_batch_size=args.group * args.prompts_per_step, max_new_tokens=args.tokens,
                          lr=3e-4, scheduler="constant", eval_fraction=0.0)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    t0 = time.perf_counter()
    cmp = nbt.compare(cfg, variants=VARIANTS, seeds=seeds, warmup=False)
    wall = time.perf_counter() - t0
    rows = []
    for name, v in cmp.verdicts.items():
        j = cmp.mismatch.get(name)
        r = cmp.results[name]
        rows.append({"variant": name, "verdict": v.text, "mismatch_mean": j.mean if j else None,
                     "band": [j.low, j.high] if j else None, "batches": j.batches if j else None,
                     "partner": j.partner if j else None, "ratio": j.ratio if j else None,
                     "beyond_noise": j.beyond_noise if j else None,
                     "precision_used": r.summary.precision_used, "sampler_precision": r.summary.sampler_precision,
                     "reward_mean": list(r.history.reward_mean), "wall_s": r.summary.wall_s})
        print(v.text, flush=True)
    out = {"date": dt.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "python": sys.version.split()[0], "config": {k: v for k, v in vars(args).items() if k != "out"},
           "wall_s": wall, "variants": rows}
    path = Path(args.out) / "grpo_compare_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{wall:.0f} s; wrote {path}")
    return out


if __name__ == "__main__":
    main()
