"""The output layer and loss alone: plain vs chunked (recompute) vs chunked (fused), time and peak memory.

Each variant computes sum-of-cross-entropies of ``h @ W.T`` against targets and its backward (gradients of the
hidden states and of W), the way the training loop does: under autocast for bf16, fp32 loss. Same tensors for
all three, interleaved repeats (A B C, C B A, ...), the device synchronised at the edges of each repeat only.

- plain: ``F.cross_entropy(head(h).float(), y)`` -- the full ``tokens x vocab`` logits, their fp32 copy, and
  the fp32 gradient;
- recompute: ``head_loss_sum(..., fused=False)`` -- chunks under activation checkpointing (one more head
  forward in backward);
- fused: ``head_loss_sum(..., fused=True)`` -- the chunk's gradients made in the forward, the head's matmuls
  once each (nbtrain's default for a plain ``nn.Linear`` head);
- fused_compiled (bf16 only): the same with the chunk's softmax gradient through torch.compile (what
  ``compile=True`` uses); its compilation happens in the warm-up.

Peak memory: on CUDA ``max_memory_allocated`` above what was allocated before the variant ran; on the CPU the
peak of live tensor storages traced per op (a separate, untimed pass).

    python benchmarks/chunked_loss.py                 # CUDA: Qwen2.5-0.5B's head, 8 x 1023 targets
    python benchmarks/chunked_loss.py --cpu           # a CPU-sized head (1,024 x 128 -> 32,000)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import meta, write  # noqa: E402
from nbtrain.engine.losses import head_loss_sum  # noqa: E402
from nbtrain.engine.telemetry import LiveTensorBytes  # noqa: E402

SHAPES = {"cuda": dict(tokens=8 * 1023, hidden=896, vocab=151936, chunk=1024),
          "cpu": dict(tokens=1024, hidden=128, vocab=32000, chunk=256)}
VARIANTS = ("plain", "recompute", "fused", "fused_compiled")


def _loss(variant: str, head, h, y, chunk: int):
    if variant == "plain":
        return F.cross_entropy(head(h).float(), y, reduction="sum")
    return head_loss_sum(head, h, y, chunk, fused=variant != "recompute", compiled=variant == "fused_compiled")


def _step(variant, head, h, y, chunk, amp) -> torch.Tensor:
    head.weight.grad = None
    h.grad = None
    with torch.autocast(**amp):
        loss = _loss(variant, head, h, y, chunk)
    (loss / y.numel()).backward()
    return loss.detach()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _cpu_peak(variant, head, h, y, chunk, amp) -> int:
    with LiveTensorBytes({t.untyped_storage()._cdata for t in (head.weight, h, y)}) as tr:
        _step(variant, head, h, y, chunk, amp)
    return tr.peak


def run(device: str, precision: str, shape: dict, repeats: int, warmup: int = 2, compiled: bool = True) -> dict:
    torch.manual_seed(0)
    n, hid, vocab, chunk = shape["tokens"], shape["hidden"], shape["vocab"], shape["chunk"]
    head = torch.nn.Linear(hid, vocab, bias=False, device=device)
    with torch.no_grad():
        head.weight.normal_(0, 0.02)
    h = torch.randn(n, hid, device=device, requires_grad=True)
    y = torch.randint(0, vocab, (n,), device=device)
    amp = dict(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")
    # fp32 has no compiled chunk path
    variants = VARIANTS if precision == "bf16" and compiled else VARIANTS[:3]
    times = {v: [] for v in variants}
    losses, grads, peaks = {}, {}, {}
    for v in variants:
        for _ in range(warmup):
            _step(v, head, h, y, chunk, amp)
    for rep in range(repeats):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            _sync(device)
            t0 = time.perf_counter()
            loss = _step(v, head, h, y, chunk, amp)
            _sync(device)
            times[v].append(time.perf_counter() - t0)
            losses[v] = loss.item()
            grads[v] = (h.grad.clone(), head.weight.grad.clone())
    for v in variants:
        if device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(v, head, h, y, chunk, amp)
            _sync(device)
            peaks[v] = torch.cuda.max_memory_allocated() - base
        else:
            # a compiled function's buffers are not seen op by op (under a dispatch mode it does not even run
            # its fused kernels): no CPU peak for it
            peaks[v] = None if v == "fused_compiled" else _cpu_peak(v, head, h, y, chunk, amp)
    rows = []
    for v in variants:
        t = statistics.median(times[v])
        gh, gw = grads[v]
        rh, rw = grads["plain"]
        rows.append({"variant": v, "time_ms": round(1e3 * t, 3), "tokens_per_s": round(n / t, 1),
                     "speed_vs_plain": round(statistics.median(times["plain"]) / t, 4),
                     "peak_gib": None if peaks[v] is None else round(peaks[v] / 2**30, 4),
                     "peak_vs_plain": None if peaks[v] is None else round(peaks[v] / peaks["plain"], 4),
                     "loss_rel_diff": abs(losses[v] - losses["plain"]) / abs(losses["plain"]),
                     "grad_h_rel_diff": float((gh - rh).abs().max() / rh.abs().max()),
                     "grad_w_rel_diff": float((gw - rw).abs().max() / rw.abs().max())})
    return {"precision": precision, "rows": rows}


def _f(x, fmt: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, fmt) + suffix


def markdown(res: dict) -> str:
    m = res["meta"]
    s = m["shape"]
    out = [f"# Output layer + loss: plain vs chunked — {m['device_name']}", "",
           f"{m['date']} · {s['tokens']} targets x hidden {s['hidden']} -> vocab {s['vocab']}, chunk {s['chunk']} "
           f"tokens · median of {m['repeats']} interleaved repeats · torch {m['torch']}", "",
           "| precision | variant | ms | vs plain (speed) | peak GiB | vs plain (memory) | loss rel. diff "
           "| grad rel. diff (h, W) |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for p in res["precisions"]:
        for r in p["rows"]:
            out.append(f"| {p['precision']} | {r['variant']} | {r['time_ms']:.1f} | {r['speed_vs_plain']:.2f}x "
                       f"| {_f(r['peak_gib'], '.3f')} | {_f(r['peak_vs_plain'], '.2f', 'x')} | {r['loss_rel_diff']:.1e} "
                       f"| {r['grad_h_rel_diff']:.1e}, {r['grad_w_rel_diff']:.1e} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with the CPU-sized head")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=None, help="default: 10 on CUDA, 5 on the CPU")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--no-compiled", action="store_true",
                    help="leave out fused_compiled (torch.compile's first compilation takes ~30 s on a CPU)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    shape = dict(SHAPES[device])
    shape.update({k: v for k, v in (("tokens", args.tokens), ("vocab", args.vocab)) if v})
    repeats = args.repeats or (10 if device == "cuda" else 5)
    res = {"meta": meta(device, shape, repeats),
           "precisions": [run(device, p, shape, repeats, compiled=not args.no_compiled)
                          for p in args.precisions.split(",")]}
    write(args.out, f"chunked_loss_{device}", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
