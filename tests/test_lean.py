"""lean_layers: equal to eager bit for bit, less kept for backward (traced and estimated), undone after a run."""

from __future__ import annotations

import copy

import pytest
import torch

import nbtrain as nbt
import nbtrain.engine.prepare as prepare_mod
from nbtrain.data.batching import MicroBatch
from nbtrain.engine.losses import micro_loss_sum
from nbtrain.precision import PRECISION_TABLE
from nbtrain.hardware import capabilities
from nbtrain.models import build_model, load_tokenizer
from nbtrain.models.lean import lean_layers

from .helpers import Collect


def _model(method: str, precision: str, **kw):
    cfg = nbt.TrainConfig(model="tiny", method=method, precision=precision, max_seq_len=64, **kw)
    torch.manual_seed(0)
    return build_model(cfg, load_tokenizer(cfg), None, precision, "cpu")


def _loss_and_grads(model, precision: str, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (4, 64))
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, n_targets=4 * 63,
                    n_tokens=ids.numel())
    torch.manual_seed(seed)    # LoRA dropout draws the same masks in both models
    loss = micro_loss_sum(model, mb, "causal-lm", PRECISION_TABLE[precision], "cpu")
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


_METHODS = [("full", "fp32", {}), ("full", "bf16", {}), ("lora", "bf16", {}),
            ("full", "fp32", {"gradient_checkpointing": True})]
if "qlora" in capabilities().allowed_methods:
    _METHODS.append(("qlora", "bf16", {}))


@pytest.mark.parametrize("method,precision,kw", _METHODS)
def test_equal_to_eager_bit_for_bit(method, precision, kw):
    """Same ops in eager autograd's order: the loss and every gradient are identical, not merely close."""
    eager = _model(method, precision, **kw)
    lean = copy.deepcopy(eager)
    applied = lean_layers(lean)
    assert len(applied.mlps) == 4 and applied.fused == (4 if method == "full" else 0)
    assert len(applied.norms) == (9 if method == "full" else 0)     # a frozen norm keeps nothing extra
    l1, g1 = _loss_and_grads(eager, precision)
    l2, g2 = _loss_and_grads(lean, precision)
    assert torch.equal(l1, l2)
    assert g1.keys() == g2.keys() and len(g1) > 0
    assert [n for n in g1 if not torch.equal(g1[n], g2[n])] == []


def test_undo_and_no_grad_use_the_class_forward():
    model = _model("full", "fp32")
    applied = lean_layers(model)
    ids = torch.randint(4, 2048, (2, 16))
    with torch.no_grad():
        out = model(input_ids=ids).logits
    applied.undo()
    assert all("forward" not in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(out, model(input_ids=ids).logits)
    assert lean_layers(model).mlps     # and it can be applied again


def test_lookalikes_with_other_arithmetic_are_left_alone():
    """A norm scaling by (1 + weight) (Gemma's) and a GELU MLP have the same attributes but other maths."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    class OnePlusRMSNorm(LlamaRMSNorm):
        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)) * (1 + self.weight)

    model = torch.nn.ModuleDict({
        "norm": OnePlusRMSNorm(32), "plain_norm": LlamaRMSNorm(32),
        "gelu_mlp": LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="gelu")),
        "silu_mlp": LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act="silu")),
    })
    applied = lean_layers(model)
    assert applied.norms == [model["plain_norm"]] and applied.mlps == [model["silu_mlp"]]
    assert sorted(applied.skipped) == ["LlamaMLP", "OnePlusRMSNorm"]
    assert "forward" not in model["norm"].__dict__ and "forward" not in model["gelu_mlp"].__dict__


def test_a_model_without_such_layers_is_unchanged_and_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    applied = lean_layers(model)
    assert not applied.mlps and not applied.norms
    assert "nothing changed" in applied.describe()


def test_training_with_lean_layers_gives_the_same_run_and_restores_the_model(tiny_cfg):
    base = tiny_cfg.replace(eval_fraction=0.1)
    plain = nbt.train(base)
    c = Collect()
    lean = nbt.train(base.replace(lean_layers=True), callbacks=[c])
    assert list(lean.history["loss"]) == list(plain.history["loss"])
    assert list(lean.history["grad_norm"]) == list(plain.history["grad_norm"])
    assert plain.summary["eval_loss"] is not None and lean.summary["eval_loss"] == plain.summary["eval_loss"]
    assert any(n.startswith("lean_layers: 4 MLPs") for n in lean.summary["notes"])
    assert all("forward" not in m.__dict__ for m in lean.model.modules())


def test_not_applied_under_compile(tiny_cfg, monkeypatch):
    """compile=True: the compiled layers already recompute; lean_layers says it is not applied."""
    seen = {}

    def fake_compile(model, **kw):    # the note, not inductor, is under test here
        seen["lean"] = any("forward" in m.__dict__ for m in model.modules())
        return []

    monkeypatch.setattr(prepare_mod, "compile_blocks", fake_compile)
    r = nbt.train(tiny_cfg.replace(max_steps=1, lean_layers=True, compile=True))
    assert seen == {"lean": False}
    assert any("not applied under compile" in n for n in r.summary["notes"])
