"""GRPO learns on SmolLM2-135M-Instruct with LoRA on the CPU: a reward's mean rises beyond the seed band.

The run: ``builtin:prompts`` (sums of two numbers, "Answer with the number only"), reward ``length:8`` (1 at 8
completion tokens, 0 at none or 16: "7 + 12 = 19" and its stop token is 9), G completions per prompt, temperature 1,
the same config under several seeds (other initial adapters, prompt order and draws). The seed band is the spread
of the seeds' early reward (the mean over the first ``--window`` steps: the policy before it has learned much);
the claim holds when every seed's late reward (the last ``--window`` steps) lies above that whole band.

    python benchmarks/grpo_learns.py [--steps 20] [--seeds 0,1,2] [--group 4] [--prompts-per-step 2]
                                     [--tokens 24] [--precision auto] [--out benchmarks/results]
"""

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import nbtrain as nbt


def config(args, seed: int) -> nbt.TrainConfig:
    return nbt.TrainConfig(
        objective="grpo", reward=args.reward, data="builtin:prompts", model="smollm2-135m-instruct",
        method="lora", lora_dropout=0.0, precision=args.precision, seed=seed, max_steps=args.steps,
        micro_batch_size=args.group * args.prompts_per_step, grad_accum_steps=1, num_generations=args.group,
        max_new_tokens=args.tokens, temperature=1.0, lr=args.lr, scheduler="constant", eval_fraction=0.0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--reward", default="length:8")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        t0 = time.perf_counter()
        r = nbt.train(config(args, seed))
        wall = time.perf_counter() - t0
        h = r.history
        w = args.window
        runs.append({"seed": seed, "wall_s": wall, "steps": len(h), "precision": r.summary.precision_used,
                     "reward_mean": [round(v, 4) for v in h.reward_mean], "early": float(h.reward_mean[:w].mean()),
                     "late": float(h.reward_mean[-w:].mean()),
                     "completion_len_mean": [round(v, 2) for v in h.completion_len_mean],
                     "completion_tokens": int(r.rollouts.completion_tokens.sum()),
                     "rollout_s": r.summary.rollout_s, "rollout_tokens_per_s": r.summary.rollout_tokens_per_s,
                     "update_tokens_per_s": r.summary.update_tokens_per_s,
                     "first_completions": list(r.rollouts.completion[:4]),
                     "last_completions": list(r.rollouts.completion[-4:])})
        print(f"seed {seed}: reward {runs[-1]['early']:.3f} -> {runs[-1]['late']:.3f}, {wall:.0f} s", flush=True)
    early, late = [r["early"] for r in runs], [r["late"] for r in runs]
    out = {"date": dt.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "python": sys.version.split()[0], "config": {k: v for k, v in vars(args).items() if k != "out"},
           "completions_per_step": args.group * args.prompts_per_step, "runs": runs,
           "seed_band_early": [min(early), max(early)], "late_min": min(late),
           "beyond_seed_band": min(late) > max(early), "mean_wall_s": statistics.fmean(r["wall_s"] for r in runs)}
    print(f"early band {min(early):.3f}-{max(early):.3f}; late {min(late):.3f}-{max(late):.3f}; "
          f"beyond the band: {out['beyond_seed_band']}")
    path = Path(args.out) / "grpo_learns_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
