"""Issue 10: the chunked loss equals the plain loss (value and gradients) for full, LoRA, QLoRA and tied heads."""

import pytest
import torch

import nbtrain as nbt
from nbtrain.data import iter_steps, load_data
from nbtrain.engine.loop import loss_sum
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
