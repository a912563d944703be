"""Checks that need a CUDA GPU (marked `gpu`; skipped cleanly without one)."""

import gc

import pytest
import torch

import nbtrain as nbt

from .helpers import after_build

pytestmark = pytest.mark.gpu

SMALL = dict(model="tiny", subset=64, max_seq_len=64, max_steps=4, eval_fraction=0.0, lr=1e-3)


def test_capabilities_on_cuda():
    caps = nbt.capabilities()
    assert caps.device == "cuda" and caps.total_memory_gib > 1
    if caps.compute_capability >= (8, 0):
        assert caps.bf16_supported and caps.tf32_supported and caps.auto_precision == "bf16"
        assert {"fp32", "tf32", "fp16", "bf16", "bf16-pure"} <= set(caps.allowed_precisions)
        assert "paged_adamw_8bit" in caps.allowed_optimizers or "bitsandbytes" in caps.reasons["paged_adamw_8bit"]


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_each_precision_trains_on_cuda(precision):
    r = nbt.train(nbt.TrainConfig(**SMALL, precision=precision))
    h = r.history
    assert len(h) == 4 and h.loss.notna().all() and r.summary["device"] == "cuda"
    assert h.vram_allocated_gib.notna().all() and h.vram_peak_gib.notna().all()
    assert h.scale.notna().all() == (precision == "fp16")
    assert r.summary["peak_vram_gib"] > 0


def _scale_weights(monkeypatch, factor):
    @torch.no_grad()
    def scale(m):
        for n, p in m.named_parameters():
            if n.endswith("layers.0.mlp.down_proj.weight"):
                p.mul_(factor)

    after_build(monkeypatch, scale)


def test_real_fp16_overflow_is_skipped_and_bf16_is_not(monkeypatch):
    """Activations beyond 65504 overflow fp16 for real (no injected inf); bf16's range holds them."""
    _scale_weights(monkeypatch, 3e4)
    r16 = nbt.train(nbt.TrainConfig(**SMALL, precision="fp16"))
    assert r16.summary["skipped_steps"] >= 1
    assert r16.history.scale.min() < 65536.0
    assert "fp16_overflow" in {f.kind for f in r16.diagnose()}
    rbf = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16"))
    assert rbf.summary["nonfinite_steps"] == 0


def test_real_out_of_memory_keeps_history_and_releases_memory():
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(int(free * 0.97), dtype=torch.uint8, device="cuda")   # leave the run a sliver
    try:
        before = torch.cuda.memory_allocated()
        cfg = nbt.TrainConfig(**{**SMALL, "max_seq_len": 512, "subset": 512}, micro_batch_size=256,
                              precision="fp32")
        r = nbt.train(cfg)
        assert r.summary["stopped_reason"] == "out_of_memory"
        assert r.summary["advice"]
        del r
        gc.collect()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() - before < 64 * 2**20
        auto = nbt.train(cfg.replace(auto_batch_size=True, max_steps=1))
        assert auto.summary["stopped_reason"] == "max_steps"
        assert auto.config.micro_batch_size < 256
        assert auto.config.micro_batch_size * auto.config.grad_accum_steps == 256
    finally:
        del hog
        torch.cuda.empty_cache()


def test_qlora_on_cuda_and_merged_save(tmp_path):
    pytest.importorskip("bitsandbytes")
    r = nbt.train(nbt.TrainConfig(**SMALL, method="qlora", precision="bf16"))
    assert r.history.loss.notna().all()
    trainable, total = r.summary["trainable_params"], r.summary["total_params"]
    assert 0 < trainable < total
    out = r.save(tmp_path / "merged", merged=True)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in m.parameters()) > 0


def test_chunked_loss_cuts_peak_memory_on_cuda():
    cfg = nbt.TrainConfig(**{**SMALL, "max_seq_len": 512, "subset": 256}, micro_batch_size=32, precision="bf16",
                          max_grad_norm=1.0)
    plain = nbt.train(cfg)
    chunked = nbt.train(cfg.replace(chunked_loss=True, loss_chunk_tokens=2048))
    for a, b in zip(plain.history.loss, chunked.history.loss):
        assert b == pytest.approx(a, rel=2e-2)
    assert chunked.summary["peak_vram_gib"] < plain.summary["peak_vram_gib"]


def test_fused_loss_and_pinned_copy_do_not_sync_the_device():
    """The chunked (fused) loss, its backward and a pinned host-to-device batch copy queue work without a
    device synchronisation (torch raises on one under sync debug mode "error")."""
    from nbtrain.data.batching import MicroBatch
    from nbtrain.engine.losses import head_loss_sum

    head = torch.nn.Linear(256, 32000, bias=False, device="cuda")
    h = torch.randn(2048, 256, device="cuda", requires_grad=True)
    y = torch.randint(0, 32000, (2048,), device="cuda")
    ids = torch.randint(0, 32000, (8, 256))
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, n_targets=8 * 255,
                    n_tokens=8 * 256).pin_memory()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = head_loss_sum(head, h, y, chunk_tokens=512, fused=True)
        (loss / y.numel()).backward()
        mb.to("cuda", non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item() and h.grad is not None and head.weight.grad is not None


def test_compiled_layers_keep_the_eager_attention_kernel():
    """compile=True compiles the layers, not the mask logic: SDPA runs the same kernel (flash/cuDNN with
    is_causal) as in eager mode, not the explicit-mask one a whole-model compile would trace."""
    from torch.profiler import ProfilerActivity, profile

    from nbtrain.engine.prepare import compile_blocks, uncompile
    from nbtrain.models import build_model, load_tokenizer

    cfg = nbt.TrainConfig(precision="bf16")
    tok = load_tokenizer(cfg)
    model = build_model(cfg, tok, None, "bf16", "cuda")
    ids = torch.randint(4, 2000, (4, 256), device="cuda")

    def sdpa_ops():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))   # warm (and compile)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                model(input_ids=ids, attention_mask=torch.ones_like(ids))
        # the backend op SDPA dispatched to (flash / cuDNN / efficient / math), eager or called by inductor
        return {e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_")}

    eager = sdpa_ops()
    blocks = compile_blocks(model)
    try:
        compiled = sdpa_ops()
    finally:
        uncompile(blocks)
    assert eager and not any("efficient" in k or "math" in k for k in eager)
    assert compiled == eager


def test_lean_layers_on_cuda_equal_losses_lower_peak():
    """lean_layers on CUDA under bf16: the same run (cuBLAS may order a sum differently, hence approx) at a lower
    peak, and an MLP + norm forward and backward queue without a device synchronisation."""
    from nbtrain.models.lean import lean_layers

    cfg = nbt.TrainConfig(**{**SMALL, "max_seq_len": 512, "subset": 256}, micro_batch_size=32, precision="bf16",
                          max_grad_norm=1.0, chunked_loss=True)
    plain = nbt.train(cfg)
    lean = nbt.train(cfg.replace(lean_layers=True))
    for a, b in zip(plain.history.loss, lean.history.loss):
        assert b == pytest.approx(a, rel=1e-2)
    assert lean.summary["peak_vram_gib"] < plain.summary["peak_vram_gib"]
    layer = lean.model.model.layers[0]
    applied = lean_layers(layer)
    assert len(applied.mlps) == 1 and applied.fused == 1 and len(applied.norms) == 2
    x = torch.randn(8, 256, layer.mlp.gate_proj.in_features, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer.mlp(layer.post_attention_layernorm(x))
        y.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert x.grad is not None and torch.isfinite(x.grad).all()


# -- issue 27: the precision of every tensor on a GPU -------------------------------------------------------------
def test_fp8_runs_native_on_fp8_tensor_cores_and_emulated_below():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    caps = nbt.capabilities()
    r = nbt.train(nbt.TrainConfig(**SMALL, precision="fp8"))
    fp8 = [m for m in r.model.modules() if isinstance(m, Float8Linear)]
    assert fp8 and r.history.loss.notna().all() and r.summary["precision_used"] == "fp8"
    emulated = "emulated" in " ".join(r.summary["notes"])
    assert emulated == (not caps.fp8_native)
    assert all(m.config.emulate == emulated for m in fp8)


def test_paged_adamw_8bit_and_fused_adamw_step_on_cuda():
    import bitsandbytes as bnb

    paged = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16", optimizer="paged_adamw_8bit"))
    assert paged.summary["optimizer"] == "paged_adamw_8bit" and paged.history.loss.notna().all()
    from nbtrain.engine.prepare import prepare

    st = prepare(nbt.TrainConfig(**SMALL, precision="bf16"))
    try:
        assert isinstance(st.optimizer, torch.optim.AdamW) and st.optimizer.defaults["fused"] is True
    finally:
        st.restore.close()
    st = prepare(nbt.TrainConfig(**SMALL, precision="bf16", optimizer="paged_adamw_8bit"))
    try:
        assert isinstance(st.optimizer, bnb.optim.PagedAdamW8bit)
    finally:
        st.restore.close()


def test_bf16_pure_on_cuda_halves_the_weights_and_state():
    full = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16"))
    pure = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16-pure"))
    assert pure.summary["weights_dtype"] == "bf16" and pure.history.loss.notna().all()
    assert pure.summary["peak_vram_gib"] < full.summary["peak_vram_gib"]


@pytest.fixture
def one_rank_env(monkeypatch):
    """What torchrun --nproc_per_node 1 sets: with sharding='fsdp' the run joins a 1-rank group (FSDP over one
    GPU); monkeypatch puts the environment back."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    yield
    import torch.distributed as dist

    if dist.is_initialized():   # a failed run must not hand its group to the next test
        dist.destroy_process_group()


def test_fsdp_one_rank_bf16_on_cuda_matches_plain(one_rank_env, monkeypatch):
    import torch.distributed as dist

    fsdp = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16", sharding="fsdp"))
    assert not dist.is_initialized()   # finish() destroyed the group the run created
    assert fsdp.summary["world_size"] == 1 and fsdp.summary["device"] == "cuda"
    assert any("FSDP" in n for n in fsdp.summary["notes"])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k)
    plain = nbt.train(nbt.TrainConfig(**SMALL, precision="bf16"))
    a, b = fsdp.history, plain.history
    assert list(a.tokens) == list(b.tokens) and a.loss.notna().all()
    # FSDP gathers every parameter in bf16 (norm weights too, which autocast keeps in fp32): equal up to bf16
    # rounding, about 8 bits of mantissa, over 4 steps
    for x, y in zip(a.loss, b.loss):
        assert abs(x - y) <= 2e-2 * abs(y), (list(a.loss), list(b.loss))
    assert fsdp.summary["peak_vram_gib"] > 0


def test_fsdp_on_cuda_picks_nccl(one_rank_env):
    import torch.distributed as dist

    from nbtrain.engine.distributed import FSDPContext, init_distributed
    from nbtrain.precision import PRECISION_TABLE

    ctx = init_distributed("cuda", "fsdp", PRECISION_TABLE["bf16"])
    try:
        assert isinstance(ctx, FSDPContext) and ctx.created_group
        assert dist.get_backend() == "nccl" and ctx.world == 1 and ctx.param_dtype == torch.bfloat16
    finally:
        ctx.close()
    assert not dist.is_initialized()
