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
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nbtrain.engine.telemetry import LiveTensorBytes  # noqa: E402
from nbtrain.hardware import capabilities  # noqa: E402
from nbtrain.models.lean import lean_layers  # noqa: E402

SHAPES = {"cuda": dict(batch=8, seq=1024, layers=4, hidden=896, intermediate=4864, heads=14, kv_heads=2),
          "cpu": dict(batch=2, seq=256, layers=2, hidden=256, intermediate=1408, heads=4, kv_heads=2)}
VARIANTS = ("eager", "lean")


def _model(shape: dict, device: str):
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], vocab_size=512, attn_implementation="sdpa")
    return Qwen2Model(cfg).to(device).train()


def _step(model, ids, proj, amp, probe=None):
    """One forward and backward; returns ``probe()`` taken between the two (what the forward left)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(**amp):
        h = model(input_ids=ids).last_hidden_state
    seen = probe() if probe else None
    (h.float() * proj).sum().backward()
    return seen


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run(device: str, precision: str, shape: dict, repeats: int, warmup: int = 2) -> dict:
    model = _model(shape, device)
    ids = torch.randint(0, 512, (shape["batch"], shape["seq"]), device=device)
    proj = torch.randn(shape["batch"], shape["seq"], shape["hidden"], device=device) / shape["hidden"] ** 0.5
    amp = dict(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16")
    lean = lean_layers(model)
    applied = lean.describe()
    lean.undo()

    def use(v):
        nonlocal lean
        if v == "lean" and not lean.mlps:
            lean = lean_layers(model)
        elif v == "eager" and lean.mlps:
            lean.undo()

    times = {v: [] for v in VARIANTS}
    grads, peaks, kept = {}, {}, {}
    for v in VARIANTS:
        use(v)
        for _ in range(warmup):
            _step(model, ids, proj, amp)
    for rep in range(repeats):
        for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
            use(v)
            _sync(device)
            t0 = time.perf_counter()
            _step(model, ids, proj, amp)
            _sync(device)
            times[v].append(time.perf_counter() - t0)
    for v in VARIANTS:
        use(v)
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            kept[v] = _step(model, ids, proj, amp, torch.cuda.memory_allocated) - base
            _sync(device)
            peaks[v] = torch.cuda.max_memory_allocated() - base
        else:
            keep = list(model.parameters()) + list(model.buffers()) + [ids, proj]
            with LiveTensorBytes({t.untyped_storage()._cdata for t in keep}) as tr:
                kept[v] = _step(model, ids, proj, amp, functools.partial(getattr, tr, "now"))
            peaks[v] = tr.peak
        grads[v] = {n: p.grad.clone() for n, p in model.named_parameters()}
    use("eager")
    tokens = shape["batch"] * shape["seq"]
    rows = []
    for v in VARIANTS:
        t = statistics.median(times[v])
        rows.append({"variant": v, "time_ms": round(1e3 * t, 3), "tokens_per_s": round(tokens / t, 1),
                     "speed_vs_eager": round(statistics.median(times["eager"]) / t, 4),
                     "peak_gib": round(peaks[v] / 2**30, 4), "peak_vs_eager": round(peaks[v] / peaks["eager"], 4),
                     # what the forward leaves for backward (the activations), per token and layer
                     "kept_bytes_per_token_layer": round(kept[v] / tokens / shape["layers"], 1),
                     "kept_vs_eager": round(kept[v] / kept["eager"], 4),
                     "grads_equal": all(torch.equal(g, grads["eager"][n]) for n, g in grads[v].items())})
    return {"precision": precision, "applied": applied, "rows": rows}


def markdown(res: dict) -> str:
    m, s = res["meta"], res["meta"]["shape"]
    out = [f"# Decoder layers: eager vs lean_layers — {m['device_name']}", "",
           f"{m['date']} · {s['layers']} Qwen2 layers (hidden {s['hidden']}, intermediate {s['intermediate']}, "
           f"{s['heads']}/{s['kv_heads']} heads) · {s['batch']} x {s['seq']} tokens · full fine-tune · median of "
           f"{m['repeats']} interleaved repeats · torch {m['torch']}", "",
           "peak: the step's, above the weights; kept: what the forward leaves for backward (its activations)", "",
           "| precision | variant | ms | vs eager (speed) | peak GiB | vs eager (peak) | kept bytes/token/layer "
           "| vs eager (kept) | gradients equal |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in res["precisions"]:
        for r in p["rows"]:
            out.append(f"| {p['precision']} | {r['variant']} | {r['time_ms']:.1f} | {r['speed_vs_eager']:.2f}x "
                       f"| {r['peak_gib']:.3f} | {r['peak_vs_eager']:.2f}x | {r['kept_bytes_per_token_layer']:,.0f} "
                       f"| {r['kept_vs_eager']:.2f}x | {'bit for bit' if r['grads_equal'] else 'NO'} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with the CPU-sized stack")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=None, help="default: 10 on CUDA, 5 on the CPU")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    shape = dict(SHAPES[device])
    if args.seq:
        shape["seq"] = args.seq
    repeats = args.repeats or (10 if device == "cuda" else 5)
    name = torch.cuda.get_device_name() if device == "cuda" else capabilities("cpu").name
    res = {"meta": {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "device": device,
                    "device_name": name, "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "shape": shape, "repeats": repeats},
           "precisions": [run(device, p, shape, repeats) for p in args.precisions.split(",")]}
    md = markdown(res)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"lean_layers_{device}"
        (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
        (out / f"{stem}.md").write_text(md)
        print(f"wrote {out / stem}.json (+ .md)")
    return res


if __name__ == "__main__":
    main()
