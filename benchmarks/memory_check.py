"""Predicted vs measured peak memory of a training step on a CUDA GPU: is ``estimate_memory`` honest?

The grid: full / LoRA / QLoRA x fp32 / bf16 x seq 256 / 1024 x gradient checkpointing off / on (24 rows), on a
random-init model shaped like Qwen2.5-0.5B (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864,
vocab 151936, tied embeddings; 494M parameters), micro batch 4. The model is drawn once, saved with the
``tiny`` preset's tokenizer to a temporary directory, and every row builds it from there with nbtrain's own
``build_model`` (so full / LoRA / QLoRA are exactly what ``nbtrain.train`` would run). Each row runs a few
optimizer steps of a plain torch.amp loop that does what nbtrain's loop does (autocast forward,
``loss_sum`` in fp32, backward, clipping, fused AdamW, ``zero_grad(set_to_none=True)``) on random token ids.

Measured per row: ``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` (the caching
allocator's segments) over the steps, and the memory outside PyTorch's allocator (CUDA context, cuBLAS/cuDNN
handles): device used (``mem_get_info``) minus reserved. Compared:

* estimated tensor peak (``MemoryEstimate.tensors_peak_gib``) vs max allocated;
* estimated total (``total_gib``: tensor peak + context + allocator slack) vs max reserved + outside memory.

The target is within 15% on every row. Writes ``memory_check_<device>.json`` and ``.md`` (date, GPU, versions,
one row per config) under ``--out`` (default benchmarks/results/) after every row, so a timeout loses
nothing. Without CUDA it prints why and exits 0.

    python benchmarks/memory_check.py                     # the 24-row grid (~3 min on an H200)
    python benchmarks/memory_check.py --methods lora --seqs 256 --precisions bf16   # a subset
    python benchmarks/memory_check.py --loss chunked --seqs 1024     # with nbtrain's chunked loss
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import itertools
import json
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
QWEN_05B_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                      hidden_act="silu", attention_dropout=0.0, use_cache=False)


def make_model_dir(root: str, layers: int | None = None) -> str:
    """A Qwen2.5-0.5B-shaped random-init model (seed 0) with the tiny preset's tokenizer, saved under root."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nbtrain.models.presets import preset_tokenizer

    shape = dict(QWEN_05B_SHAPE)
    if layers:
        shape["num_hidden_layers"] = layers
    tok = preset_tokenizer("tiny")
    config = Qwen2Config(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):   # drawing 494M numbers is seconds on the GPU, a minute on the CPU
        model = Qwen2ForCausalLM(config)
    model.to("cpu").save_pretrained(root)
    tok.save_pretrained(root)
    del model
    torch.cuda.empty_cache()
    return root


def run_row(cfg, steps: int) -> dict:
    """Build ``cfg``'s model with nbtrain and train ``steps`` optimizer steps; the memory it took."""
    import torch

    from nbtrain.data.batching import MicroBatch
    from nbtrain.engine.losses import micro_loss_sum
    from nbtrain.hardware import resolve_precision
    from nbtrain.precision import PRECISION_TABLE, global_torch_state
    from nbtrain.models import build_model, load_tokenizer

    precision = resolve_precision(cfg.precision)
    spec = PRECISION_TABLE[precision]
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, precision, "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    V = model.config.vocab_size
    B, T = cfg.micro_batch_size, cfg.max_seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)
    gc.collect()
    torch.cuda.empty_cache()               # what loading left cached is not the step's memory
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with global_torch_state(spec):
        model.train()
        for _ in range(steps):
            for _ in range(cfg.grad_accum_steps):
                ids = torch.randint(0, V, (B, T), device="cuda", generator=gen)
                mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids,
                                n_targets=B * (T - 1), n_tokens=B * T)
                # the loop's own forward and loss (what it keeps and frees is what is measured)
                loss = micro_loss_sum(model, mb, "causal-lm", spec, "cuda",
                                      cfg.loss_chunk_tokens if cfg.chunked_loss else None) / (B * (T - 1))
                loss.backward()
                del loss
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"allocated_gib": torch.cuda.max_memory_allocated() / GIB,
           "reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    free, total = torch.cuda.mem_get_info()
    out["outside_torch_gib"] = (total - free - torch.cuda.memory_reserved()) / GIB
    out["measured_total_gib"] = out["reserved_gib"] + out["outside_torch_gib"]
    out["wall_s"] = wall
    del model, opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return out


def versions() -> dict:
    import torch
    import transformers

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
         "transformers": transformers.__version__}
    for name in ("peft", "bitsandbytes"):
        try:
            v[name] = __import__(name).__version__
        except Exception as e:  # recorded, not fatal: the rows that need it carry the error
            v[name] = f"unavailable ({type(e).__name__})"
    return v


def write(out_dir: Path, meta: dict, rows: list[dict], tol: float) -> None:
    def flag(e: float) -> str:
        return f"{e:+.1%}" + ("" if abs(e) <= tol else " **")

    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"memory_check_{meta['device']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Memory estimate vs measured peak ({meta['gpu']})", "",
             f"{meta['date']}; {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; model "
             f"{meta['model']}; micro batch {meta['batch']}, {meta['steps']} steps per row. "
             "Tensors: estimated tensor peak vs `max_memory_allocated`. Total: estimated total vs "
             "`max_memory_reserved` + memory outside PyTorch (context). Error = estimate / measured - 1.", "",
             "| loss | method | precision | seq | ckpt | est tensors GiB | allocated GiB | err | est total GiB | "
             "reserved+ctx GiB | err | est peak at |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('loss', 'plain')} | {r['method']} | {r['precision']} | {r['seq']} | "
                         f"{r['ckpt']} | error: {r['error'][:80]} |||||||")
            continue
        lines.append(f"| {r.get('loss', 'plain')} | {r['method']} | {r['precision']} | {r['seq']} | {r['ckpt']} | "
                     f"{r['est_tensors_gib']:.2f} | {r['allocated_gib']:.2f} | {flag(r['err_tensors'])} | "
                     f"{r['est_total_gib']:.2f} | {r['measured_total_gib']:.2f} | {flag(r['err_total'])} | "
                     f"{r['est_phase']} |")
    done = [r for r in rows if "error" not in r]
    if done:
        worst_t = max(abs(r["err_tensors"]) for r in done)
        worst = max(abs(r["err_total"]) for r in done)
        lines += ["", f"Worst error: tensors {worst_t:.1%}, total {worst:.1%} (target {tol:.0%}); "
                  f"{sum(abs(r['err_total']) <= tol and abs(r['err_tensors']) <= tol for r in done)}/{len(done)} "
                  "rows within target."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="full,lora,qlora")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--seqs", default="256,1024")
    p.add_argument("--ckpt", default="off,on")
    p.add_argument("--loss", default="plain", help="plain, chunked (nbtrain's chunked_loss) or both: plain,chunked")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per row (>= 2: AdamW's state exists "
                                                         "from the second)")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers, for a quick try")
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("memory_check: no CUDA GPU on this machine; this benchmark measures GPU memory, skipped.")
        return 0
    warnings.filterwarnings("ignore")
    from nbtrain.config import TrainConfig
    from nbtrain.memory import estimate_memory

    props = torch.cuda.get_device_properties(0)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": props.name,
            "gpu_total_gib": round(props.total_memory / GIB, 2), "device": "cuda", "versions": versions(),
            "model": "Qwen2.5-0.5B shape, random init" + (f", {args.layers} layers" if args.layers else ""),
            "batch": args.batch, "steps": args.steps}
    print(json.dumps(meta))
    out_dir = Path(args.out)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nbtrain-memcheck-") as tmp:
        t0 = time.perf_counter()
        model_dir = make_model_dir(tmp, args.layers)
        print(f"model drawn and saved in {time.perf_counter() - t0:.1f}s", flush=True)
        grid = itertools.product(args.loss.split(","), args.methods.split(","), args.precisions.split(","),
                                 [int(s) for s in args.seqs.split(",")], [c == "on" for c in args.ckpt.split(",")])
        for loss, method, precision, seq, ckpt in grid:
            row = {"method": method, "precision": precision, "seq": seq, "ckpt": ckpt, "loss": loss}
            try:
                cfg = TrainConfig(model=model_dir, method=method, precision=precision, max_seq_len=seq,
                                  micro_batch_size=args.batch, gradient_checkpointing=ckpt, max_steps=args.steps,
                                  chunked_loss=loss == "chunked")
                est = estimate_memory(cfg, device="cuda")
                row.update(est_tensors_gib=est.tensors_peak_gib, est_total_gib=est.total_gib,
                           est_phase=est.peak_phase, est_weights_gib=est.weights_gib,
                           est_activations_gib=est.activations_gib, est_logits_gib=est.logits_gib)
                row.update(run_row(cfg, args.steps))
                row["err_tensors"] = row["est_tensors_gib"] / row["allocated_gib"] - 1
                row["err_total"] = row["est_total_gib"] / row["measured_total_gib"] - 1
                print(f"{loss:7} {method:5} {precision} seq {seq:5} ckpt {int(ckpt)}: tensors est {row['est_tensors_gib']:6.2f}"
                      f" meas {row['allocated_gib']:6.2f} ({row['err_tensors']:+.1%}) | total est "
                      f"{row['est_total_gib']:6.2f} meas {row['measured_total_gib']:6.2f} ({row['err_total']:+.1%})"
                      f" | outside torch {row['outside_torch_gib']:.2f} | {row['wall_s']:.1f}s", flush=True)
            except Exception as e:  # one broken row (bitsandbytes missing, OOM) must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{method} {precision} {seq} {ckpt}: {row['error']}\n{traceback.format_exc()}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            write(out_dir, meta, rows, args.tolerance)
    done = [r for r in rows if "error" not in r]
    bad = [r for r in done if abs(r["err_total"]) > args.tolerance or abs(r["err_tensors"]) > args.tolerance]
    print(f"{len(done) - len(bad)}/{len(rows)} rows within {args.tolerance:.0%}; wrote "
          f"{out_dir / 'memory_check_cuda.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
