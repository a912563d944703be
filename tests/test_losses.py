"""Issue 10: the chunked loss equals the plain loss (value and gradients) for full, LoRA, QLoRA and tied heads."""

import pytest
import torch
import torch.nn.functional as F

import nbtrain as nbt
from nbtrain.data import iter_steps, load_data
from nbtrain.engine.losses import loss_sum
from nbtrain.engine.losses import ChunkedLossError, chunked_loss_sum
from nbtrain.models import build_model, load_tokenizer


def _batch(cfg):
    tok = load_tokenizer(cfg)
    data = load_data(cfg, tok)
    _, (mb,) = next(iter_steps(data.train, 8, 1, 0, data.pad_token_id, data.task))
    return tok, mb


def _losses_and_grads(model, mb, chunk):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for chunked in (False, True):
        for p in params:
            p.grad = None
        if chunked:
            loss = chunked_loss_sum(model, mb.input_ids, mb.attention_mask, mb.labels, chunk)
        else:
            loss = loss_sum(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.labels,
                            "causal-lm")
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in params]))
    return out


def _tied_model_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    from nbtrain.models.presets import PRESETS  # noqa: F401  (the tiny tokenizer is reused)

    tok = load_tokenizer(nbt.TrainConfig())
    torch.manual_seed(0)
    base = build_model(nbt.TrainConfig(precision="fp32"), tok, None, "fp32", "cpu")
    conf = base.config
    conf.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(conf)
    model.save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    return str(tmp_path / "tied")


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "tied"])
def test_chunked_equals_plain(method, tmp_path):
    model_name = _tied_model_dir(tmp_path) if method == "tied" else "tiny"
    cfg = nbt.TrainConfig(model=model_name, subset=32, max_seq_len=48, precision="fp32",
                          method="full" if method == "tied" else method, lora_dropout=0.0)
    tok, mb = _batch(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "fp32", "cpu")
    if method == "tied":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    (l_plain, g_plain), (l_chunk, g_chunk) = _losses_and_grads(model, mb, chunk=37)
    assert l_chunk.item() == pytest.approx(l_plain.item(), rel=1e-4)
    assert len(g_plain) == len(g_chunk) > 0
    for a, b in zip(g_plain, g_chunk):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-8


def test_engine_with_chunked_loss_matches_plain():
    cfg = nbt.TrainConfig(model="tiny", subset=48, max_seq_len=40, max_steps=3, precision="fp32",
                          eval_fraction=0.0, lr=1e-3)
    plain = nbt.train(cfg)
    chunked = nbt.train(cfg.replace(chunked_loss=True, loss_chunk_tokens=64))
    for a, b in zip(plain.history.loss, chunked.history.loss):
        assert b == pytest.approx(a, rel=1e-4)
    bf = nbt.train(cfg.replace(chunked_loss=True, precision="bf16", max_steps=2))
    assert bf.history.loss.notna().all()


def test_chunked_loss_refuses_classification():
    with pytest.raises(nbt.ConfigError, match="chunked_loss"):
        nbt.TrainConfig(task="sequence-classification", chunked_loss=True)


def test_chunked_loss_refuses_softcapped_models():
    from nbtrain.engine.losses import split_for_chunked_loss

    tok = load_tokenizer(nbt.TrainConfig())
    model = build_model(nbt.TrainConfig(precision="fp32"), tok, None, "fp32", "cpu")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ChunkedLossError, match="softcapping"):
        split_for_chunked_loss(model)


# ---------------------------------------------------------------------------------------------------------------
# The fused path (gradients made in the forward) against the plain loss and the recompute path
# ---------------------------------------------------------------------------------------------------------------
def _head_case(bias: bool, seed: int = 0, n: int = 70, hidden: int = 24, vocab: int = 300):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.3)
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g) * 0.3)
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (n,), generator=g)
    return head, h, y


def _grads(head, h, y, fn, scale=1.0):
    head.zero_grad(set_to_none=True)
    h.grad = None
    loss = fn()
    (loss * scale).backward()
    return loss.detach(), [h.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if
                                                                       head.bias is not None else [])


@pytest.mark.parametrize("bias", [False, True])
def test_fused_and_recompute_equal_plain_fp32(bias):
    from nbtrain.engine.losses import head_loss_sum

    head, h, y = _head_case(bias)
    ref = _grads(head, h, y, lambda: F.cross_entropy(head(h), y, reduction="sum"), scale=0.37)
    for fused in (True, False):
        got = _grads(head, h, y, lambda f=fused: head_loss_sum(head, h, y, chunk_tokens=16, fused=f), scale=0.37)
        assert got[0].item() == pytest.approx(ref[0].item(), rel=1e-5)
        for a, b in zip(ref[1], got[1]):   # the incoming scale (1/n_targets x loss scale) reaches every gradient
            assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_fused_bf16_matches_the_plain_autocast_path():
    """Same rounding points as the plain path: bf16 matmuls, fp32 softmax and loss."""
    from nbtrain.engine.losses import head_loss_sum

    head, h, y = _head_case(False, n=96, hidden=64, vocab=1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grads(head, h, y, lambda: F.cross_entropy(head(h).float(), y, reduction="sum"))
        fused = _grads(head, h, y, lambda: head_loss_sum(head, h, y, chunk_tokens=32, fused=True))
        fp32 = _grads(head, h, y, lambda: head_loss_sum(head, h, y, chunk_tokens=32, fused=False))
    assert fused[0].item() == pytest.approx(ref[0].item(), rel=1e-5)   # the loss is exact given the bf16 logits
    assert fused[0].item() == pytest.approx(fp32[0].item(), rel=1e-5)
    for a, b in zip(ref[1], fused[1]):
        assert b.dtype == a.dtype == torch.float32
        # bf16 gradients: one bf16 rounding of a chunk's partial sum vs of the whole sum
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()


def test_fused_path_runs_the_head_once_recompute_twice():
    """FLOPs of loss + backward: the fused path's equal the plain path's; recompute adds one head forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nbtrain.engine.losses import head_loss_sum

    head, h, y = _head_case(False, n=128, hidden=32, vocab=512)
    aten = torch.ops.aten

    class MatmulFlops(TorchDispatchMode):   # torch's FlopCounterMode does not count the in-place addmm_
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (aten.mm.default, aten.addmm.default, aten.addmm_.default):
                a, b = (args[0], args[1]) if func is aten.mm.default else (args[1], args[2])
                self.total += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            return func(*args, **(kwargs or {}))

    def flops(fn):
        with MatmulFlops() as fc:
            fn().backward()
        return fc.total

    plain = flops(lambda: F.cross_entropy(head(h), y, reduction="sum"))
    fused = flops(lambda: head_loss_sum(head, h, y, chunk_tokens=32, fused=True))
    recompute = flops(lambda: head_loss_sum(head, h, y, chunk_tokens=32, fused=False))
    head_fwd = 2 * 128 * 32 * 512
    assert plain == 3 * head_fwd
    assert fused == plain
    assert recompute == plain + head_fwd


def test_unfusable_head_falls_back_to_recompute():
    from nbtrain.engine.losses import fusable, head_loss_sum

    head, h, y = _head_case(False)
    wrapped = torch.nn.Sequential(head)   # any head that is not a plain nn.Linear
    assert fusable(head) and not fusable(wrapped)
    ref = _grads(head, h, y, lambda: F.cross_entropy(head(h), y, reduction="sum"))
    got = _grads(head, h, y, lambda: head_loss_sum(wrapped, h, y, chunk_tokens=16))
    assert got[0].item() == pytest.approx(ref[0].item(), rel=1e-5)
    with pytest.raises(ChunkedLossError, match="nn.Linear"):
        head_loss_sum(wrapped, h, y, fused=True)


def test_frozen_head_makes_no_weight_gradient_and_no_grad_mode_makes_none():
    from nbtrain.engine.losses import head_loss_sum

    head, h, y = _head_case(False)
    head.weight.requires_grad_(False)
    ref = F.cross_entropy(head(h), y, reduction="sum")
    ref.backward()
    g_ref, h.grad = h.grad.clone(), None
    loss = head_loss_sum(head, h, y, chunk_tokens=16)
    loss.backward()
    assert head.weight.grad is None
    assert (h.grad - g_ref).abs().max() <= 1e-5 * g_ref.abs().max()
    with torch.no_grad():
        ev = head_loss_sum(head, h, y, chunk_tokens=16)
    assert not ev.requires_grad and ev.item() == pytest.approx(ref.item(), rel=1e-5)


def test_chunked_eval_loss_equals_plain_eval_loss(monkeypatch):
    """With chunked_loss on, the evaluation is chunked too (it must not need the full logits)."""
    import nbtrain.engine.losses as losses

    calls = {True: 0, False: 0}

    def spy(*a, **kw):
        calls[torch.is_grad_enabled()] += 1
        return chunked_loss_sum(*a, **kw)

    monkeypatch.setattr(losses, "chunked_loss_sum", spy)
    cfg = nbt.TrainConfig(model="tiny", subset=64, max_seq_len=40, max_steps=2, precision="fp32",
                          eval_fraction=0.25, eval_every=2, lr=1e-3)
    plain = nbt.train(cfg)
    assert calls == {True: 0, False: 0}
    chunked = nbt.train(cfg.replace(chunked_loss=True, loss_chunk_tokens=50))
    assert calls[True] == 2 and calls[False] > 0   # two training steps; the evaluation's batches
    a, b = plain.eval_history.iloc[-1], chunked.eval_history.iloc[-1]
    assert a["eval_tokens"] == b["eval_tokens"] > 0
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4)


def test_compile_blocks_one_graph_for_every_layer_and_causal_sdpa():
    """compile=True compiles each decoder layer in place: one graph serves all of them, parameter names are
    unchanged, the mask logic stays eager so SDPA gets is_causal (flash on a GPU) instead of an explicit mask,
    and the numbers equal the eager model's."""
    from nbtrain.engine.prepare import compile_blocks, uncompile

    tok = load_tokenizer(nbt.TrainConfig())
    torch.manual_seed(0)
    model = build_model(nbt.TrainConfig(precision="fp32"), tok, None, "fp32", "cpu")
    ids = torch.randint(4, 2000, (2, 24))
    keys = list(model.state_dict())
    eager = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits

    graphs = []

    def backend(gm, example_inputs):   # counts the graphs dynamo hands over; runs them as they are
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    blocks = compile_blocks(model, backend=backend)
    assert len(blocks) == model.config.num_hidden_layers
    assert type(blocks[0]).__name__ == "LlamaDecoderLayer"
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert len(graphs) == 1                          # traced once, reused by every layer
    sdpa = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    assert len(sdpa) == 1
    args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), sdpa[0].args))
    args.update(sdpa[0].kwargs)
    assert args.get("attn_mask") is None and args.get("is_causal") is True   # no explicit mask: is_causal
    assert torch.allclose(out, eager, atol=1e-5, rtol=1e-5)
    assert list(model.state_dict()) == keys
    uncompile(blocks)
    assert all(b._compiled_call_impl is None for b in blocks)
    torch._dynamo.reset()


@pytest.mark.slow
def test_real_compile_with_chunked_loss_trains_like_eager():
    """torch.compile (inductor, ~40 s to compile on 2 cores) of the decoder under the chunked loss."""
    cfg = nbt.TrainConfig(model="tiny", subset=48, max_seq_len=40, max_steps=3, precision="fp32",
                          eval_fraction=0.0, lr=1e-3, chunked_loss=True)
    from torch._dynamo.utils import counters

    eager = nbt.train(cfg)
    counters.clear()
    compiled = nbt.train(cfg.replace(compile=True))
    for a, b in zip(eager.history.loss, compiled.history.loss):
        assert b == pytest.approx(a, rel=1e-5)
    # dynamo compiled graphs for it (counted, not timed: no test asserts on a time)
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    # the model handed back runs eagerly again, under its own parameter names
    layers = compiled.model.model.layers
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in layers)
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    plain = nbt.train(cfg.replace(compile=True, chunked_loss=False))   # the plain loss path, compiled too
    for a, b in zip(eager.history.loss, plain.history.loss):
        assert b == pytest.approx(a, rel=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# No host read inside a step: nothing in the forward, loss or backward reads a device value back
# ---------------------------------------------------------------------------------------------------------------
class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records ops that read tensor data back to the host (.item(), bool(), data-dependent output shapes).
    On a GPU each of these is a device synchronisation."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.READS or (name == "aten.index" and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in torch.utils._pytree.tree_flatten(args)[0])):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunked", [False, True])
def test_loss_adds_no_host_read_to_the_models_own(chunked):
    """On a GPU a host read is a device sync. The loss and its backward add none to what the model's forward
    does itself (transformers' eager mask logic reads the mask once)."""
    from nbtrain.data.batching import MicroBatch
    from nbtrain.engine.losses import micro_loss_sum
    from nbtrain.precision import PRECISION_TABLE

    cfg = nbt.TrainConfig(precision="fp32")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "fp32", "cpu")
    ids = torch.randint(4, 2000, (2, 24))
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, n_targets=2 * 23, n_tokens=48)
    spec = PRECISION_TABLE["fp32"]
    chunk = 16 if chunked else None
    with _HostReads() as model_only:
        model(input_ids=ids, attention_mask=mb.attention_mask)
    with _HostReads() as step:
        (micro_loss_sum(model, mb, "causal-lm", spec, "cpu", chunk) / mb.n_targets).backward()
    assert step.seen == model_only.seen
    if chunked:   # the control: without the host-known target count the chunked loss selects on the device
        with _HostReads() as selecting:
            chunked_loss_sum(model, ids, mb.attention_mask, ids, 16).backward()
        assert len(selecting.seen) > len(model_only.seen)
    # a padded batch: the targets are selected (a read, by need) and the loss is the plain one
    padded = MicroBatch(input_ids=ids, attention_mask=torch.cat([torch.ones(2, 20), torch.zeros(2, 4)], 1).long(),
                        labels=torch.cat([ids[:, :20], torch.full((2, 4), -100)], 1), n_targets=2 * 19, n_tokens=40)
    loss = micro_loss_sum(model, padded, "causal-lm", spec, "cpu", chunk)
    ref = loss_sum(model(input_ids=ids, attention_mask=padded.attention_mask).logits, padded.labels, "causal-lm")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_compilable_chunk_gradient_equals_the_eager_one():
    """The out-of-place chunk function torch.compile fuses gives the eager in-place path's loss and gradient."""
    from nbtrain.engine.losses import _ce_and_grad, _eager_ce_and_grad

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(40, 500, generator=g) * 3).bfloat16()
    ys = torch.randint(0, 500, (40,), generator=g)
    loss_a, grad_a = _ce_and_grad(logits, ys)
    loss_b, grad_b = _eager_ce_and_grad(logits.float(), ys, torch.bfloat16, True, None)
    assert grad_a.dtype == grad_b.dtype == torch.bfloat16
    assert loss_a.item() == pytest.approx(loss_b.item(), rel=1e-6)
    assert (grad_a.float() - grad_b.float()).abs().max() <= 1e-2 * grad_b.float().abs().max()


def test_compile_option_reaches_the_chunked_loss(monkeypatch):
    """With compile=True (bf16, chunked loss) the loop uses the compiled chunk gradient; without it, not."""
    import nbtrain.engine.losses as losses
    import nbtrain.engine.prepare as prepare_mod

    calls = []

    def counting():
        def fn(logits, ys):
            calls.append(logits.dtype)
            return losses._ce_and_grad(logits, ys)
        return fn

    monkeypatch.setattr(losses, "_compiled_ce", counting)
    monkeypatch.setattr(prepare_mod, "compile_blocks", lambda model: [])   # the layers' compilation is tested above
    cfg = nbt.TrainConfig(model="tiny", subset=48, max_seq_len=40, max_steps=2, precision="bf16",
                          eval_fraction=0.0, chunked_loss=True, loss_chunk_tokens=64)
    plain = nbt.train(cfg)
    assert calls == []
    fast = nbt.train(cfg.replace(compile=True))
    assert calls and set(calls) == {torch.bfloat16}
    for a, b in zip(plain.history.loss, fast.history.loss):
        assert b == pytest.approx(a, rel=1e-3)


@pytest.mark.slow
def test_real_compiled_chunk_gradient_matches_eager_in_bf16():
    from nbtrain.engine.losses import head_loss_sum

    head, h, y = _head_case(False, n=96, hidden=64, vocab=1000)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = _grads(head, h, y, lambda: head_loss_sum(head, h, y, chunk_tokens=40))
        compiled = _grads(head, h, y, lambda: head_loss_sum(head, h, y, chunk_tokens=40, compiled=True))
    assert compiled[0].item() == pytest.approx(eager[0].item(), rel=1e-5)
    for a, b in zip(eager[1], compiled[1]):
        assert (a - b).abs().max() <= 2e-2 * a.abs().max()
