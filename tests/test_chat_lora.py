"""Issue 26 B: LoRA on chat data. The chat template's tokens that the run adds to the tokenizer (tiny gains
<|im_start|> / <|im_end|>) start untrained; their rows of the input embedding and of the untied output layer must
train under LoRA (peft's trainable_token_indices: those rows only), the other rows stay frozen, the run notes say
so, and the adapter and merged exports reproduce the trained model."""

import pytest
import torch

import nbtrain as nbt
from nbtrain.data.chat import ensure_chat_tokens
from nbtrain.models.loading import load_base_model, load_tokenizer
from nbtrain.models.methods import apply_lora, method_notes, new_token_ids, token_rows_target

NEW = [2048, 2049]   # tiny's vocabulary is 2,048 tokens; the two ChatML markers come after it


def _tiny(tok):
    return load_base_model(nbt.TrainConfig(model="tiny"), tok, None, "cpu")


class Snapshot:
    def on_run_start(self, info):
        m = info.model
        self.emb = _emb_weight(m).clone()
        self.head = _head_weight(m).clone()
        self.base = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
        self.trainable = {n for n, p in m.named_parameters() if p.requires_grad}


def _emb_weight(model) -> torch.Tensor:
    """The embedding table the model uses (the base rows with peft's trained deltas put in)."""
    emb = model.get_input_embeddings()
    rows = emb.token_adapter.base_layer.num_embeddings if hasattr(emb, "token_adapter") else emb.num_embeddings
    with torch.no_grad():
        return emb(torch.arange(rows)[None])[0].detach()


def _head_weight(model) -> torch.Tensor:
    """The output layer's weight as the model uses it: head(I) = I @ W.T."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        return head(torch.eye(128)).T.detach()


@pytest.fixture(scope="module")
def run():
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs-qa", method="lora", subset=16, max_seq_len=96,
                          micro_batch_size=4, max_steps=3, eval_fraction=0.0, precision="fp32", lr=1e-2,
                          lora_dropout=0.0)
    snap = Snapshot()
    return nbt.train(cfg, callbacks=[snap]), snap


def test_new_token_ids_only_for_added_tokens():
    cfg = nbt.TrainConfig(model="tiny", data="builtin:python-docs-qa", method="lora")
    tok = load_tokenizer(cfg)
    plain = load_base_model(cfg, tok, None, "cpu")
    assert new_token_ids(cfg, tok, plain) == []          # nothing added: plain LoRA, nothing more trains
    assert token_rows_target(plain, []) is None
    assert ensure_chat_tokens(tok, cfg) == ["<|im_start|>", "<|im_end|>"]
    chat = load_base_model(cfg, tok, None, "cpu")
    assert new_token_ids(cfg, tok, chat) == NEW
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == NEW
    # tiny's output layer is untied: both tables get the rows
    assert token_rows_target(chat, NEW) == {"model.embed_tokens": NEW, "lm_head": NEW}


def test_new_rows_train_old_rows_stay_frozen(run):
    result, snap = run
    # only LoRA's matrices and the two tables' new-row deltas train
    assert snap.trainable and all("lora_" in n or "trainable_tokens_delta" in n for n in snap.trainable)
    deltas = {n for n in snap.trainable if "trainable_tokens_delta" in n}
    assert len(deltas) == 2 and any("embed_tokens" in n for n in deltas) and any("lm_head" in n for n in deltas)
    emb, head = _emb_weight(result.model), _head_weight(result.model)
    for before, after in ((snap.emb, emb), (snap.head, head)):
        assert after.shape == (2050, 128)
        moved = (after[NEW] - before[NEW]).abs().amax(dim=1)
        assert (moved > 1e-4).all(), moved                         # each new row learned something
        assert torch.equal(after[:2048], before[:2048])            # every old row is bit for bit the same
    after = dict(result.model.named_parameters())
    assert all(torch.equal(snap.base[n], after[n].detach()) for n in snap.base)   # the frozen base did not move
    trainable = result.summary["trainable_params"]
    n_lora = sum(p.numel() for n, p in result.model.named_parameters() if "lora_" in n)
    assert trainable == n_lora + 2 * len(NEW) * 128                # 512 more, not two whole 2,050-row tables


def test_run_notes_say_what_trains(run):
    result, _ = run
    notes = method_notes(result.model)
    assert len(notes) == 1
    assert "ids 2048-2049" in notes[0] and "model.embed_tokens and lm_head" in notes[0] and "512 parameters" in notes[0]
    assert notes[0] in result.summary["notes"]   # the run says it too
    # plain-text LoRA (no token added) has no such note
    cfg = nbt.TrainConfig(model="tiny", method="lora")
    tok = load_tokenizer(cfg)
    plain = apply_lora(load_base_model(cfg, tok, None, "cpu"), cfg, "causal-lm", new_token_ids(cfg, tok, _tiny(tok)))
    assert method_notes(plain) == []
    assert not any("trainable_tokens" in n for n, _ in plain.named_parameters())


def test_exports_reproduce_the_trained_model(run, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    result, _ = run
    ids = torch.tensor([[2048, 882, 198, 2049, 2048, 17, 40, 2049]])
    model = result.model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    adapter = AutoPeftModelForCausalLM.from_pretrained(result.save(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(result.save(tmp_path / "merged", merged=True)).eval()
    with torch.no_grad():
        for m in (adapter, merged):
            got = m(input_ids=ids).logits
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # the merged model holds the trained rows in plain tables
    assert torch.allclose(merged.get_input_embeddings().weight[NEW], _emb_weight(model)[NEW], atol=1e-6)
    assert torch.allclose(merged.get_output_embeddings().weight[NEW], _head_weight(model)[NEW], atol=1e-6)
