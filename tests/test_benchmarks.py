"""The throughput suite (benchmarks/gpu_suite.py) at CI size on the CPU: it runs, writes its JSON and markdown,
every implementation sees the same tokens and ends at the same loss, and it prints the nbtrain/bare ratio.
No timed assertions: 2 shared CPU cores are too noisy for a pass/fail on speed."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from .helpers import frozen_heap, load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """The suite collects garbage before and after every row: it walks what this module makes, not the worker's heap."""
    yield from frozen_heap()


@pytest.fixture(scope="module")
def suite():
    return load_benchmark("gpu_suite")


@pytest.fixture(scope="module")
def cpu_result(suite, tmp_path_factory):
    """The CPU profile's quick rows (bare, nbtrain, nbtrain + dashboard, Trainer) on the tiny preset."""
    out = tmp_path_factory.mktemp("suite")
    res = suite.main(["--cpu", "--quick", "--warmup", "1", "--windows", "2", "--per-window", "2",
                      "--out", str(out)])
    return res, out


def test_cpu_suite_runs_and_writes(cpu_result):
    res, out = cpu_result
    assert (out / "cpu_suite.json").is_file() and (out / "cpu_suite.md").is_file()
    saved = json.loads((out / "cpu_suite.json").read_text())
    assert saved["meta"]["shape"] == "tiny" and saved["meta"]["versions"]["torch"]
    names = [r["name"] for r in res["rows"]]
    assert names == ["bare:fp32", "nbtrain:fp32", "nbtrain:fp32+dashboard", "trainer:fp32"]
    for r in res["rows"]:
        assert "error" not in r, r
        assert len(r["window_tokens_per_s"]) == 2   # how fast is the benchmark's business, not the test's
        assert r["same_tokens"], f"{r['name']} saw a different token stream"
        assert r["padding_share"] == 0.0   # packed blocks, cut to a multiple of the batch
    md = (out / "cpu_suite.md").read_text()
    assert "| nbtrain:fp32 |" in md and "| check |" in md
    ratio = next(c for c in res["checks"] if c["check"].startswith("nbtrain / bare (fp32"))["value"]
    print(f"\nCPU tiny fp32: nbtrain / bare = {ratio:.3f} (target >= 0.97; informational here)")
    assert ratio is not None and ratio > 0


def test_cpu_suite_same_loss_everywhere(cpu_result):
    """Same init, same batches, same optimizer and schedule: the three loops must land on the same loss."""
    res, _ = cpu_result
    rows = {r["name"]: r for r in res["rows"]}
    bare = rows["bare:fp32"]["final_loss"]
    assert math.isfinite(bare)
    assert rows["nbtrain:fp32"]["final_loss"] == pytest.approx(bare, rel=1e-4)
    assert rows["nbtrain:fp32+dashboard"]["final_loss"] == pytest.approx(bare, rel=1e-4)
    assert rows["trainer:fp32"]["final_loss"] == pytest.approx(bare, rel=2e-3)   # the Trainer logs 4 digits


def test_gpu_path_on_a_micro_qwen(suite, tmp_path):
    """The GPU profile's model path (a Qwen2 config with tied embeddings saved to a directory) and a LoRA group,
    shrunk to a CPU-sized shape; a row naming a missing field or a failing build is an error row, not a crash."""
    res = suite.main(["--cpu", "--shape", "qwen-micro", "--seq-len", "64", "--rows", "bare:lora,nbtrain:lora",
                      "--warmup", "1", "--windows", "2", "--per-window", "2", "--out", str(tmp_path)])
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"bare:lora", "nbtrain:lora"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["same_tokens"] and 0 < r["trainable_params"] < res["meta"]["params"]
    assert rows["nbtrain:lora"]["final_loss"] == pytest.approx(rows["bare:lora"]["final_loss"], rel=1e-3)


def test_gpu_plan_rows_run_on_cpu(suite, tmp_path):
    """--plan cuda runs GPU rows' code paths on a CPU, so a row that would crash (a TrainingArguments field this
    transformers lacks, QLoRA through the Trainer, padding, eager attention) shows before device time is spent."""
    names = ["nbtrain:bf16+padding", "bare:bf16-sdpa", "trainer:qlora", "trainer:fp16"]
    res = suite.main(["--cpu", "--plan", "cuda", "--shape", "qwen-micro", "--seq-len", "64", "--rows", ",".join(names),
                      "--warmup", "1", "--windows", "2", "--per-window", "1", "--no-warm-pass", "--out", str(tmp_path)])
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == set(names)
    for r in rows.values():
        assert "error" not in r, r
        assert math.isfinite(r["final_loss"]) and r["same_tokens"]
    assert rows["nbtrain:bf16+padding"]["padding_share"] > 0


def test_rows_past_the_budget_are_skipped_once(suite, tmp_path):
    """A row that would end past the time budget is reported skipped, once: the untimed warm pass of the
    first row is not a row of the results, skipped or not."""
    res = suite.main(["--cpu", "--shape", "qwen-micro", "--seq-len", "64", "--rows", "bare:lora,nbtrain:lora",
                      "--budget-s", "0.01", "--out", str(tmp_path)])
    assert [(r["name"], r["runs"]) for r in res["rows"]] == [("bare:lora", 1), ("nbtrain:lora", 1)]
    assert all(r["error"].startswith("time budget") for r in res["rows"])


def test_qwen_shape_is_0_5b(suite):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = dict(suite.SHAPES["qwen2.5-0.5b"])
    spec.pop("arch")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**spec))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"


def test_gpu_plan_fits_and_aggregates(suite):
    rows = suite.suite_rows("cuda")
    names = [r.name for r in rows]
    for impl in ("bare", "nbtrain", "trainer"):
        for g in ("fp32", "tf32", "bf16", "fp16", "lora", "qlora"):
            assert f"{impl}:{g}" in names
    for extra in ("nbtrain:bf16+dashboard", "nbtrain:bf16+chunked_loss", "nbtrain:bf16+padding",
                  "bare:bf16-fused_adamw", "bare:bf16-sdpa", "bare:bf16+host_sync", "nbtrain:bf16+chunked_loss+compile",
                  "nbtrain:bf16+chunked_loss+lean"):
        assert extra in names
    order = suite.run_order(rows, "cuda", 2)
    assert sum(r.est_s for r in order) < 360
    quick = suite.select_rows(rows, None, True, "cuda")
    assert sum(r.est_s for r in quick) < 120
    assert [r.name for r in suite.select_rows(rows, "nbtrain:bf16+*", False, "cuda")] == [
        "nbtrain:bf16+dashboard", "nbtrain:bf16+chunked_loss", "nbtrain:bf16+chunked_loss+lean",
        "nbtrain:bf16+padding", "nbtrain:bf16+chunked_loss+compile", "nbtrain:bf16+adamw_8bit",
        "nbtrain:bf16+paged_adamw_8bit", "nbtrain:bf16+adafactor", "nbtrain:bf16+sgd"]
    assert {r.name for r in suite.select_rows(rows, "tensors", False, "cuda")} == {
        "nbtrain:bf16-pure", "nbtrain:bf16-pure+sr", "nbtrain:fp8", "nbtrain:bf16+adamw_8bit",
        "nbtrain:bf16+paged_adamw_8bit", "nbtrain:bf16+adafactor", "nbtrain:bf16+sgd"}

    def run(name, impl, group, tps, peak, precision="bf16", method="full", **kw):
        return {"name": name, "impl": impl, "group": group, "precision": precision, "method": method,
                "options": {}, "note": "", "tokens_per_s": tps, "tokens_per_s_mean": tps,
                "window_tokens_per_s": [tps, tps], "peak_mem_gib": peak, "final_loss": 2.0, "step_time_s": 0.1,
                "warmup_s": 1.0, "setup_s": 1.0, "same_tokens": True, "trainable_params": 1, **kw}

    runs = [run("bare:bf16", "bare", "bf16", 100_000, 30.0), run("nbtrain:bf16", "nbtrain", "bf16", 99_000, 30.0),
            run("nbtrain:bf16+dashboard", "nbtrain", "bf16", 98_500, 30.0),
            run("trainer:bf16", "trainer", "bf16", 90_000, 31.0),
            run("nbtrain:bf16+chunked_loss", "nbtrain", "opt", 130_000, 19.0),
            run("nbtrain:bf16+chunked_loss+lean", "nbtrain", "opt", 126_000, 15.0),
            run("nbtrain:lora", "nbtrain", "lora", 120_000, 10.0, method="lora"),
            {"name": "nbtrain:qlora", "impl": "nbtrain", "group": "qlora", "precision": "bf16", "method": "qlora",
             "options": {}, "note": "", "error": "ImportError: bitsandbytes"},
            {"name": "nbtrain:fp32", "impl": "nbtrain", "group": "fp32", "precision": "fp32", "method": "full",
             "options": {}, "note": "", "skipped": "time budget"}]
    agg = suite.aggregate(runs, 6 * 494e6, suite.peak_tflops("NVIDIA H200"))
    by = {r["name"]: r for r in agg}
    assert by["nbtrain:bf16"]["vs_bare"] == pytest.approx(0.99)
    assert by["nbtrain:bf16+chunked_loss"]["vs_bare"] == pytest.approx(1.3)
    assert by["nbtrain:bf16"]["mfu"] == pytest.approx(6 * 494e6 * 99_000 / 989.4e12, rel=1e-3)
    assert by["nbtrain:qlora"]["error"].startswith("ImportError") and by["nbtrain:fp32"]["error"] == "time budget"
    checks = {c["check"]: c for c in suite.checks(agg, "cuda")}
    assert checks["nbtrain / bare (bf16)"]["pass"] is True
    assert checks["nbtrain / Trainer (bf16)"]["pass"] is True
    assert checks["dashboard cost (bf16, mean throughput)"]["value"] == pytest.approx(0.0051, abs=1e-4)
    assert checks["bf16 full with optimisations: tokens/s"]["pass"] is True
    assert checks["bf16 full with optimisations: peak GiB"]["pass"] is True
    # both targets are met by one configuration: the fastest row within the memory target, not the fastest row
    assert checks["bf16 full with optimisations: tokens/s"]["detail"] == "nbtrain:bf16+chunked_loss+lean"
    assert checks["QLoRA / LoRA throughput (nbtrain)"]["pass"] is None
    md = suite.markdown({"meta": {"device": "cuda", "device_name": "NVIDIA H200", "date": "d", "shape": "qwen2.5-0.5b",
                                  "params": 494e6, "batch": 8, "seq_len": 1024, "warmup": 3, "windows": 3,
                                  "per_window": 5, "slow_windows": 3, "slow_per_window": 3, "versions": {"torch": "x"},
                                  "peak_tflops": None, "wall_s": 1.0},
                         "rows": agg, "checks": list(checks.values())})
    assert "**ImportError: bitsandbytes**" in md and "| nbtrain:bf16 | 99,000 |" in md


def test_chunked_loss_benchmark_on_cpu(tmp_path):
    """benchmarks/chunked_loss.py at a small head: equal losses and gradients, and the traced peak memory of
    the fused path below the recompute path's, below the plain path's. Speed is printed, not asserted. Without
    the compiled variant: its compilation is most of the time here, and tests/test_losses.py checks the compiled
    chunk against eager."""
    spec = importlib.util.spec_from_file_location("chunked_loss_bench", ROOT / "benchmarks" / "chunked_loss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--cpu", "--tokens", "512", "--vocab", "8000", "--repeats", "2", "--no-compiled",
                    "--out", str(tmp_path)])
    assert (tmp_path / "chunked_loss_cpu.json").is_file() and (tmp_path / "chunked_loss_cpu.md").is_file()
    for p in res["precisions"]:
        rows = {r["variant"]: r for r in p["rows"]}
        assert list(rows) == ["plain", "recompute", "fused"]
        for r in rows.values():
            assert r["loss_rel_diff"] < 1e-5
            assert r["grad_h_rel_diff"] < (1e-5 if p["precision"] == "fp32" else 1e-2)
            assert r["grad_w_rel_diff"] < (1e-5 if p["precision"] == "fp32" else 1e-2)
        assert rows["fused"]["peak_gib"] < rows["recompute"]["peak_gib"] < rows["plain"]["peak_gib"]
        print(f"\n{p['precision']}: speed vs plain: recompute {rows['recompute']['speed_vs_plain']:.2f}x, "
              f"fused {rows['fused']['speed_vs_plain']:.2f}x; peak vs plain: recompute "
              f"{rows['recompute']['peak_vs_plain']:.2f}x, fused {rows['fused']['peak_vs_plain']:.2f}x")


def test_lean_layers_benchmark_on_cpu(tmp_path):
    """benchmarks/lean_layers.py at a small stack: gradients equal bit for bit, and the forward keeps less for
    backward (by the amounts nbtrain.memory models). Speed is printed, not asserted."""
    spec = importlib.util.spec_from_file_location("lean_layers_bench", ROOT / "benchmarks" / "lean_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.main(["--cpu", "--seq", "64", "--repeats", "2", "--out", str(tmp_path)])
    assert (tmp_path / "lean_layers_cpu.json").is_file() and (tmp_path / "lean_layers_cpu.md").is_file()
    h, i = mod.SHAPES["cpu"]["hidden"], mod.SHAPES["cpu"]["intermediate"]
    # per token and layer: the SiLU output and the product (2 x i each, in the autocast dtype) and the two norms'
    # fp32 normalised inputs (4h each); and the final norm's, shared by the layers
    final = 4 * h / mod.SHAPES["cpu"]["layers"]
    expect = {"fp32": 8 * i + 8 * h + final, "bf16": 4 * i + 8 * h + final}
    for p in res["precisions"]:
        eager, lean = p["rows"]
        assert eager["grads_equal"] and lean["grads_equal"]
        saved = eager["kept_bytes_per_token_layer"] - lean["kept_bytes_per_token_layer"]
        assert saved == pytest.approx(expect[p["precision"]], rel=0.01), saved
        print(f"\n{p['precision']}: lean vs eager: speed {lean['speed_vs_eager']:.2f}x, kept "
              f"{lean['kept_vs_eager']:.2f}x, peak {lean['peak_vs_eager']:.2f}x")


def test_fsdp_rows_run_on_cpu(suite, tmp_path):
    """--plan fsdp: nbtrain:bf16 beside sharding='fsdp' on a 1-rank gloo group the row creates (and destroys);
    the losses agree and the files are the plan's own."""
    import torch.distributed as dist

    res = suite.main(["--cpu", "--plan", "fsdp", "--shape", "qwen-micro", "--seq-len", "64", "--warmup", "1",
                      "--windows", "2", "--per-window", "1", "--no-warm-pass", "--out", str(tmp_path)])
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"nbtrain:bf16", "nbtrain:bf16@fsdp", "nbtrain:bf16@fsdp+no_reshard"}
    for r in rows.values():
        assert "error" not in r, r
    assert rows["nbtrain:bf16@fsdp"]["world_size"] == 1 and not dist.is_initialized()
    assert rows["nbtrain:bf16@fsdp"]["final_loss"] == pytest.approx(rows["nbtrain:bf16"]["final_loss"], rel=1e-3)
    assert (tmp_path / "cpu_suite_fsdp.json").exists() and not (tmp_path / "cpu_suite.json").exists()
    assert any(c["check"].startswith("bf16@fsdp / bf16") and c["value"] for c in res["checks"])
