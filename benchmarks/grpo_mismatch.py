"""The sampler/trainer mismatch on SmolLM2-135M-Instruct (issue 47.2), measured with nbtrain's rollout path: each
precision samples G completions per prompt with the KV cache (temperature 1) and scores the same tokens in one
teacher-forced forward under the same precision (eval mode: dropout off). Per precision: the mean and max
|log p_sampler - log p_trainer| per completion token, k3 KL(sampler || trainer), and both against an fp32
teacher-forced pass.

    python benchmarks/grpo_mismatch.py [--prompts 4] [--group 4] [--tokens 24] [--out benchmarks/results]
"""

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import torch

import nbtrain as nbt
from nbtrain.engine.grpo import mismatch
from nbtrain.engine.rollout import sample_group, teacher_forced_logp
from nbtrain.models import build_model, load_tokenizer
from nbtrain.precision import PRECISION_TABLE

PROMPTS = ["Write a haiku about the sea.", "What is a Python list?", "Name three prime numbers.",
           "Explain recursion in one sentence.", "Give a synonym for happy.", "What does HTTP stand for?"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    cfg = nbt.TrainConfig(model="smollm2-135m-instruct", precision="fp32")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "fp32", "cpu")
    model.eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in PROMPTS[:args.prompts]]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    rows = []
    for name in args.precisions.split(","):
        spec = PRECISION_TABLE[name]
        t0 = time.perf_counter()
        s_all, t_all, f_all, m_all = [], [], [], []
        for k, ids in enumerate(prompts):
            r = sample_group(model, list(ids), args.group, args.tokens, spec=spec,
                             generator=torch.Generator().manual_seed(k))
            with torch.no_grad():
                trainer = teacher_forced_logp(model, r, spec=spec)
                fp32 = teacher_forced_logp(model, r)
            s_all.append(r.sampler_logp), t_all.append(trainer), f_all.append(fp32), m_all.append(r.mask)
        s, t, f, m = (torch.cat(x) for x in (s_all, t_all, f_all, m_all))
        mm = mismatch(s, t, m)
        rows.append({"precision": name, **vars(mm), "sampler_fp32_gap": mismatch(s, f, m).mismatch_mean,
                     "trainer_fp32_gap": mismatch(t, f, m).mismatch_mean, "tokens": int(m.sum()),
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{name}: mismatch {mm.mismatch_mean:.5f} nats/token (max {mm.mismatch_max:.4f}), k3 KL "
              f"{mm.mismatch_kl:.2e}; sampler vs fp32 {rows[-1]['sampler_fp32_gap']:.5f}, trainer vs fp32 "
              f"{rows[-1]['trainer_fp32_gap']:.5f}; {rows[-1]['tokens']} tokens, {rows[-1]['seconds']} s", flush=True)
    by = {r["precision"]: r for r in rows}
    if "bf16" in by and "fp16" in by and by["fp16"]["mismatch_mean"] > 0:
        print(f"bf16 / fp16: {by['bf16']['mismatch_mean'] / by['fp16']['mismatch_mean']:.1f}x")
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": "cpu",
           "threads": torch.get_num_threads(), "prompts": args.prompts, "group": args.group,
           "max_new_tokens": args.tokens, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "grpo_mismatch_cpu.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
