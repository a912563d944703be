"""Decoder layers alone: eager vs ``lean_layers`` (nbtrain.models.lean), time, peak memory and equality.

A Qwen2-style decoder stack (no output layer, so the layers are all there is) runs forward under autocast (bf16)
or plain (fp32) and backward from a fixed random projection of its last hidden state, the weights fp32 and
trainable as in a full fine-tune. The two variants are the same model object, lean layers applied and undone
between them; interleaved repeats (A B, B A, ...), the device synchronised at the edges of each repeat only.
Gradients are compared bit for bit.

Peak memory: on CUDA ``max_memory_allocated`` above what was allocated before the step; on the CPU the peak of
live tensor storages traced per op (a separate, untimed pass). Either way the weights are not counted.

    python benchmarks/lean_layers.py          # CUDA: Qwen2.5-0.5B's layer sizes, 4 layers, 8 x 1024 tokens
    python benchmarks/lean_layers.py --cpu    # a CPU-sized stack
    python benchmarks/lean_layers.py --cpu --shape cpu-qwen --compile   # Qwen2.5-0.5B's layers; + torch.compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import meta, write  # noqa: E402
from nbtrain.engine.prepare import compile_blocks, uncompile  # noqa: E402
from nbtrain.engine.telemetry import LiveTensorBytes  # noqa: E402
from nbtrain.models.lean import lean_layers  # noqa: E402

SHAPES = {"cuda": dict(batch=8, seq=1024, layers=4, hidden=896, intermediate=4864, heads=14, kv_heads=2),
          "cpu": dict(batch=2, seq=256, layers=2, hidden=256, intermediate=1408, heads=4, kv_heads=2),
          # Qwen2.5-0.5B's layer sizes at a CPU-sized token count (what is kept per token does not depend on it)
          "cpu-qwen": dict(batch=4, seq=256, layers=2, hidden=896, intermediate=4864, heads=14, kv_heads=2)}
VARIANTS = ("eager", "lean")


def _model(shape: dict, device: str):
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], vocab_size=512, attn_implementation="sdpa")
    return Qwen2Model(cfg).to(device).train()


def _step(model, ids, proj, amp) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast(**amp):
        h = model(input_ids=ids).last_hidden_state
    (h.float() * proj).sum().backward()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _kept_bytes(model, step) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``step()``'s forward (weights not
    counted): the activations, whoever keeps them -- eager ops, lean functions or a compiled graph."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def run(device: str, precision: str, shape: dict, repeats: int, warmup: int = 2, compiled: bool = False) -> dict:
    model = _model(shape, device)
    ids = torch.randint(0, 512, (shape["batch"], shape["seq"]), device=device)
    proj = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device) / shape["hidden"] ** 0.5
    amp = dict(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")
    variants = VARIANTS + (("compiled",) if compiled else ())
    lean = lean_layers(model)
    applied = lean.describe()
    lean.undo()
    blocks = compile_blocks(model) if compiled else []
    compiled_calls = [b._compiled_call_impl for b in blocks]
    uncompile(blocks)

    def use(v):
        nonlocal lean
        if lean.mlps and v != "lean":
            lean.undo()
        if v == "lean" and not lean.mlps:
            lean = lean_layers(model)
        for b, call in zip(blocks, compiled_calls):
            b._compiled_call_impl = call if v == "compiled" else None

    times = {v: [] for v in variants}
    grads, peaks, kept = {}, {}, {}
    warm_s = {}
    for v in variants:
        use(v)
        t0 = time.perf_counter()
        for _ in range(warmup):       # the compiled variant compiles here
            _step(model, ids, proj, amp)
        _sync(device)
        warm_s[v] = time.perf_counter() - t0
    for rep in range(repeats):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            use(v)
            _sync(device)
            t0 = time.perf_counter()
            _step(model, ids, proj, amp)
            _sync(device)
            times[v].append(time.perf_counter() - t0)
    for v in variants:
        use(v)
        model.zero_grad(set_to_none=True)
        kept[v] = _kept_bytes(model, lambda: _step(model, ids, proj, amp))
        if device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            _step(model, ids, proj, amp)
            _sync(device)
            peaks[v] = torch.cuda.max_memory_allocated() - base
        elif v == "compiled":   # compiled code allocates out of a dispatch mode's sight: no CPU peak for it
            peaks[v] = None
        else:
            keep = list(model.parameters()) + list(model.buffers()) + [ids, proj]
            with LiveTensorBytes({t.untyped_storage()._cdata for t in keep}) as tr:
                _step(model, ids, proj, amp)
            peaks[v] = tr.peak
        grads[v] = {n: p.grad.clone() for n, p in model.named_parameters()}
    use("eager")
    tokens = shape["batch"] * shape["seq"]
    rows = []
    for v in variants:
        t = statistics.median(times[v])
        ref = grads["eager"]
        rows.append({"variant": v, "time_ms": round(1e3 * t, 3), "tokens_per_s": round(tokens / t, 1),
                     "speed_vs_eager": round(statistics.median(times["eager"]) / t, 4),
                     "warmup_s": round(warm_s[v], 2),
                     "peak_gib": None if peaks[v] is None else round(peaks[v] / 2**30, 4),
                     "peak_vs_eager": None if peaks[v] is None else round(peaks[v] / peaks["eager"], 4),
                     # what the forward leaves for backward (the activations), per token and layer
                     "kept_bytes_per_token_layer": round(kept[v] / tokens / shape["layers"], 1),
                     "kept_vs_eager": round(kept[v] / kept["eager"], 4),
                     "grads_equal": all(torch.equal(g, ref[n]) for n, g in grads[v].items()),
                     "grad_rel_diff": max(float((g - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-30))
                                          for n, g in grads[v].items())})
    return {"precision": precision, "applied": applied, "rows": rows}


def markdown(res: dict) -> str:
    m, s = res["meta"], res["meta"]["shape"]
    out = [f"# Decoder layers: eager vs lean_layers — {m['device_name']}", "",
           f"{m['date']} · {s['layers']} Qwen2 layers (hidden {s['hidden']}, intermediate {s['intermediate']}, "
           f"{s['heads']}/{s['kv_heads']} heads) · {s['batch']} x {s['seq']} tokens · full fine-tune · median of "
           f"{m['repeats']} interleaved repeats · torch {m['torch']}", "",
           "peak: the step's, above the weights (n/a: compiled code on the CPU allocates out of the tracer's sight); "
           "kept: the storages autograd saves in the forward (its activations, weights' casts included); "
           "warm-up includes compilation", "",
           "| precision | variant | ms | vs eager (speed) | warm-up s | peak GiB | vs eager (peak) "
           "| kept bytes/token/layer | vs eager (kept) | gradients vs eager |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in res["precisions"]:
        for r in p["rows"]:
            same = "equal bit for bit" if r["grads_equal"] else f"max rel. diff {r['grad_rel_diff']:.1e}"
            peak = "n/a | n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.3f} | {r['peak_vs_eager']:.2f}x"
            out.append(f"| {p['precision']} | {r['variant']} | {r['time_ms']:.1f} | {r['speed_vs_eager']:.2f}x "
                       f"| {r['warmup_s']:.1f} | {peak} | {r['kept_bytes_per_token_layer']:,.0f} "
                       f"| {r['kept_vs_eager']:.2f}x | {same} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with the CPU-sized stack")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=None, help="default: 10 on CUDA, 5 on the CPU")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: the device's")
    ap.add_argument("--compile", action="store_true",
                    help="also the layers under torch.compile (compile=True's compile_blocks), lean not applied")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    shape = dict(SHAPES[args.shape or device])
    if args.seq:
        shape["seq"] = args.seq
    repeats = args.repeats or (10 if device == "cuda" else 5)
    res = {"meta": meta(device, shape, repeats),
           "precisions": [run(device, p, shape, repeats, compiled=args.compile) for p in args.precisions.split(",")]}
    write(args.out, f"lean_layers_{args.shape or device}", res, markdown(res))
    return res


if __name__ == "__main__":
    main()
