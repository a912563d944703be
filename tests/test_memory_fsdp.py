"""Issue 28.5: estimate_memory(cfg, world_size=N) per rank (FSDP shards, gathered groups, DDP buckets),
min_world_size, the CLI's --world-size, FSDP in the advice, and a 2-process CPU run's traced tensors against the
per-rank estimate."""

from __future__ import annotations

import dataclasses
import os
import re
import socket

import pandas as pd
import pytest

from nbtrain.config import TrainConfig
from nbtrain.memory import estimate_memory
from nbtrain.memory.advice import advise
from nbtrain.memory.estimate import Target
from nbtrain.memory.facts import architecture, parameter_bytes
from nbtrain.memory.sharding import fsdp_parts
from nbtrain.models import build_model, load_tokenizer

GIB = 2**30
# the fields that say how an estimate was asked for, not what it estimates
ASKED = {"config", "world_size", "sharding", "min_world_size", "fsdp_refused"}


def _cfg(**kw) -> TrainConfig:
    base = dict(model="tiny", max_seq_len=64, micro_batch_size=4, precision="fp32", max_steps=1)
    return TrainConfig(**{**base, **kw})


def _numbers(est) -> dict:
    d = dataclasses.asdict(est)
    return {k: v for k, v in d.items() if k not in ASKED}


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    """Qwen2.5-7B's config.json alone (no weights): the estimate builds it on the meta device."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen7b")
    Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                tie_word_embeddings=False).save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# one process: nothing changes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(method="lora", precision="bf16"), dict(grad_accum_steps=2)])
def test_world_size_1_is_the_one_process_estimate(kw):
    plain = estimate_memory(_cfg(**kw), device="cpu", device_total_gib=64)
    one = estimate_memory(_cfg(**kw), device="cpu", device_total_gib=64, world_size=1)
    fsdp_one = estimate_memory(_cfg(sharding="fsdp", **kw), device="cpu", device_total_gib=64, world_size=1)
    assert _numbers(one) == _numbers(plain)
    assert _numbers(fsdp_one) == _numbers(plain)   # one process has nothing to shard
    assert plain.gathered_gib == plain.buckets_gib == 0 and plain.world_size == 1
    assert "gathered" not in str(plain) and "per process" not in str(plain)


# ---------------------------------------------------------------------------------------------------------------
# FSDP: shards 1/N, the gathered groups
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_splits_weights_gradients_and_optimizer_state(method):
    cfg = _cfg(sharding="fsdp", method=method)
    one = estimate_memory(cfg, device="cpu", device_total_gib=64)
    model = build_model(cfg, load_tokenizer(cfg), None, "fp32", "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps = 4 * len(trainable)   # AdamW's per-tensor step: one per shard, not split
    for n in (2, 4):
        est = estimate_memory(cfg, device="cpu", device_total_gib=64, world_size=n)
        # rank 0's shard of each parameter: ceil(dim0 / n) rows (torch.chunk, as fully_shard pads)
        shard = sum(-(-p.shape[0] // n) * p[0].numel() * p.element_size() for p in model.parameters())
        assert est.weights_bytes == shard
        assert est.gradients_bytes == sum(-(-p.shape[0] // n) * p[0].numel() * 4 for p in trainable)
        assert est.optimizer_bytes - steps == 2 * est.gradients_bytes
        # tiny's dims divide by 4: exactly 1/N
        assert est.weights_bytes * n == one.weights_bytes
        assert est.gradients_bytes * n == one.gradients_bytes
        assert (est.optimizer_bytes - steps) * n == one.optimizer_bytes - steps
        assert est.activations_gib == one.activations_gib   # micro_batch_size rows per rank, as before
        assert est.world_size == n and est.sharding == "fsdp"
        # the root is freed from the end of the forward to the head's backward: a loss-phase peak has none
        assert (est.gathered_gib > 0) == ("loss" not in est.peak_phase), est.peak_phase


@pytest.mark.parametrize("precision,elem", [("fp32", 4), ("bf16", 2)])
def test_gathered_groups_are_the_layers_and_root_in_the_compute_dtype(precision, elem):
    cfg = _cfg(sharding="fsdp", precision=precision)
    model = build_model(cfg, load_tokenizer(cfg), None, "fp32", "cpu")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    arch = architecture(cfg.model, cfg.task)
    fs = fsdp_parts(cfg, arch, parameter_bytes(cfg, arch, precision=precision), elem, 2, 2)
    assert fs.layers == (elem * layer,) * len(model.model.layers)
    assert fs.root == elem * (total - len(model.model.layers) * layer)
    # without reshard_after_forward every group is gathered from its forward to its backward: at this model's
    # peak (the loss backward) that is the whole model, in the compute dtype
    est = estimate_memory(cfg.replace(reshard_after_forward=False), device="cuda", device_total_gib=80,
                          world_size=2)
    assert "loss" in est.peak_phase
    assert est.gathered_gib * GIB == fs.root + sum(fs.layers) == elem * total
    text = str(est)
    assert re.search(r"gathered\s+\d+\.\d\d\s+" + {4: "fp32", 2: "bf16"}[elem], text)
    assert "per process of 2 (fsdp" in text


def test_reshard_after_forward_false_keeps_every_layer_gathered():
    cfg = _cfg(sharding="fsdp", micro_batch_size=1, max_seq_len=16)
    on = estimate_memory(cfg, device="cuda", device_total_gib=80, world_size=2)
    off = estimate_memory(cfg.replace(reshard_after_forward=False), device="cuda", device_total_gib=80,
                          world_size=2)
    assert off.total_gib > on.total_gib and off.gathered_gib > on.gathered_gib


def test_ddp_keeps_a_whole_copy_and_its_gradient_buckets():
    one = estimate_memory(_cfg(), device="cuda", device_total_gib=80)
    ddp = estimate_memory(_cfg(), device="cuda", device_total_gib=80, world_size=4)
    assert (ddp.weights_bytes, ddp.gradients_bytes, ddp.optimizer_bytes) == \
        (one.weights_bytes, one.gradients_bytes, one.optimizer_bytes)
    assert ddp.buckets_gib == pytest.approx(one.gradients_gib)
    assert ddp.tensors_peak_gib == pytest.approx(one.tensors_peak_gib + one.gradients_gib)
    assert "ddp buckets" in str(ddp) and "DDP: a whole copy" in str(ddp)


# ---------------------------------------------------------------------------------------------------------------
# a real size: from how many GPUs it fits, the advice, the CLI
# ---------------------------------------------------------------------------------------------------------------
def test_min_world_size_of_a_7b_full_fine_tune(qwen7b):
    cfg = TrainConfig(model=qwen7b, precision="bf16", micro_batch_size=1, max_seq_len=1024,
                      gradient_checkpointing=True)
    est = estimate_memory(cfg, device="cuda", device_total_gib=80)
    assert not est.fits   # ~7.6B parameters: 16 B each for weights, gradients and AdamW alone
    n = est.min_world_size
    assert n is not None and 2 <= n <= 8
    sharded = cfg.replace(sharding="fsdp")
    assert estimate_memory(sharded, device="cuda", device_total_gib=80, world_size=n).fits
    assert not estimate_memory(sharded, device="cuda", device_total_gib=80, world_size=n // 2).fits
    assert f"{os.path.basename(qwen7b)} full fine-tune bf16: fits from {n} x 80 GiB" in str(est)
    assert f"fits from {n} x 80 GiB" in est._repr_html_()
    # more memory per device, fewer devices
    assert estimate_memory(cfg, device="cuda", device_total_gib=141).min_world_size <= n


def test_advice_names_fsdp_with_its_world_size(qwen7b):
    cfg = TrainConfig(model=qwen7b, precision="bf16", micro_batch_size=1, max_seq_len=1024,
                      gradient_checkpointing=True)
    est = estimate_memory(cfg, device="cuda", device_total_gib=80)
    last = est.advice[-1]
    assert last.fits and last.change.get("sharding") == "fsdp" and last.world_size == est.min_world_size
    assert f"sharding='fsdp' over {last.world_size} processes" in last.description
    assert f"needs {last.world_size} GPUs" in last.description
    assert "method" not in last.change   # sharding comes before changing the method
    assert f"on {last.world_size} processes" in str(est)
    # on the CPU the processes share one machine's memory: no fsdp advice, no min_world_size
    cpu = advise(cfg, Target("cpu", 80.0, "cpu", None))
    assert all("sharding" not in a.change for a in cpu)
    assert estimate_memory(cfg, device="cpu", device_total_gib=80).min_world_size is None


def test_cli_estimate_world_size_prints_per_rank_numbers(qwen7b, tmp_path, capsys):
    from nbtrain.cli import main

    path = tmp_path / "cfg.yaml"
    cfg = TrainConfig(model=qwen7b, precision="bf16", micro_batch_size=1, max_seq_len=256, sharding="fsdp")
    cfg.to_yaml(path)

    def weights_row(out: str) -> float:
        return float(re.search(r"^\s+weights\s+(\d+\.\d\d)", out, re.M).group(1))

    assert main(["estimate", str(path), "--world-size", "4"]) == 0
    out4 = capsys.readouterr().out
    assert main(["estimate", str(path)]) == 0
    out1 = capsys.readouterr().out
    per_rank = estimate_memory(cfg, world_size=4)
    assert "per process of 4" in out4 and "per process" not in out1
    assert weights_row(out4) == pytest.approx(per_rank.weights_gib, abs=0.006)
    assert weights_row(out4) == pytest.approx(weights_row(out1) / 4, abs=0.01)


# ---------------------------------------------------------------------------------------------------------------
# a 2-process CPU run: rank 0's traced run tensors against the per-rank estimate
# ---------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_run(method: str) -> TrainConfig:
    """The config tests/fsdp_worker.py's mem_<method> scenario ran (its BASE with MEMORY_RUN)."""
    from . import fsdp_worker

    return TrainConfig(**{**fsdp_worker.BASE, **fsdp_worker.MEMORY_RUN}, method=method)


@pytest.fixture(scope="module")
def fsdp_runs(fsdp_worker_runs):
    """{method: (rank 0's host_tensors_gib per step, the config)} of the 2-process FSDP runs (one torchrun for
    every 2-process test: conftest's fsdp_worker_runs)."""
    return {m: (pd.Series(fsdp_worker_runs[f"mem_{m}"]["host_tensors_gib"], dtype=float), _memory_run(m))
            for m in ("full", "lora")}


@pytest.mark.parametrize("method", ["full", "lora"])
def test_rank_traced_run_tensors_match_the_per_rank_estimate(fsdp_runs, method):
    history, cfg = fsdp_runs[method]
    traced = history.dropna().max()
    est = estimate_memory(cfg, device="cpu", device_total_gib=64, world_size=2)
    whole = estimate_memory(cfg, device="cpu", device_total_gib=64)
    print(f"\n{method}: traced {traced * 1024:.3f} MiB, per-rank estimate {est.run_tensors_gib * 1024:.3f} MiB, "
          f"ratio {traced / est.run_tensors_gib:.4f} (one process: {whole.run_tensors_gib * 1024:.3f} MiB)")
    assert traced == pytest.approx(est.run_tensors_gib, rel=0.05)
    # and it is the sharded number, not one process's
    assert abs(traced - est.run_tensors_gib) < abs(traced - whole.run_tensors_gib)
