"""Bad inputs fail early and say why: offline Hub ids, config holes, the CLI, unreadable data and models."""

from __future__ import annotations

import json
import math
import socket
import threading

import pytest

from nbtrain import hub
from nbtrain.config import ConfigError, TrainConfig
from nbtrain.data import DataError, load_data
from nbtrain.models import ModelError, load_tokenizer

NO_SUCH_MODEL = "nbtrain-tests/no-such-model"   # in no cache, on no Hub


@pytest.fixture
def hub_model_cfg(monkeypatch):
    """A Hub model id on a machine where nobody set offline mode: the probe alone must notice there is no
    network."""
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_last", None)   # no probe result remembered from another test
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401 - import time is not what is measured

    return TrainConfig(model=NO_SUCH_MODEL)


# -- 5. offline Hub ids fail fast -------------------------------------------------------------------

def test_offline_hub_model_fails_fast_with_a_clear_error(hub_model_cfg, monkeypatch):
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    connects = []
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: connects.append(a) or (_ for _ in ()).throw(
        OSError("no network in this test")))
    with pytest.raises(ModelError, match=r"(?s)not reachable.*local directory"):
        load_tokenizer(hub_model_cfg)
    # fast: at most the probe's one connection attempt, bounded by its own timeout; nothing else waits on the network
    assert len(connects) <= 1 and all(timeout <= hub.PROBE_TIMEOUT_S for _, timeout in connects), connects


def test_hanging_network_is_bounded_by_the_probe(hub_model_cfg, monkeypatch):
    # a firewall that drops packets (or a DNS server that never answers): the probe gives up after 3 s
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)

    released, entered = threading.Event(), threading.Event()

    def hang(*args, **kwargs):   # a connection attempt that never answers until the test lets it go
        entered.set()
        released.wait(60)
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", hang)
    monkeypatch.setattr(hub, "_last", None)
    monkeypatch.setattr(hub.hub_reachable, "__defaults__", (0.5,))   # the probe's own bound, shortened here
    try:
        with pytest.raises(ModelError, match=NO_SUCH_MODEL):
            load_tokenizer(hub_model_cfg)
        # the error came while the connection attempt still hung: the probe's timeout bounded the wait, not the
        # network (no clock is read to say so)
        assert entered.is_set() and not released.is_set()
    finally:
        released.set()


def test_real_probe_without_offline_mode_is_fast(hub_model_cfg):
    # this machine has no Hub access (and the id exists nowhere): either way, a clear error (bounded by the probe,
    # test_hanging_network_is_bounded_by_the_probe; the suite's timeout bounds it here)
    with pytest.raises(ModelError, match=NO_SUCH_MODEL):
        load_tokenizer(hub_model_cfg)


def test_data_and_models_share_one_probe():
    from nbtrain.data import loading as data_loading
    from nbtrain.models import loading as model_loading

    assert data_loading.hub is hub and model_loading.hub is hub
    assert not hasattr(data_loading, "_hub_reachable")


def test_remote_code_is_never_trusted(monkeypatch, tmp_path):
    import transformers

    seen = []

    def spy(name):
        original = getattr(transformers, name).from_pretrained

        def from_pretrained(*args, **kwargs):
            seen.append((name, kwargs.get("trust_remote_code", "missing")))
            return original(*args, **kwargs)

        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", from_pretrained)

    # a real local model directory, written by the tiny preset
    from nbtrain.models import build_model, save_model

    cfg = TrainConfig(model="tiny", max_steps=1)
    tok = load_tokenizer(cfg)
    save_model(build_model(cfg, tok, None, "fp32", "cpu"), tok, cfg, tmp_path / "m")
    for name in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        spy(name)
    from nbtrain.models.loading import load_base_model, meta_model

    local = TrainConfig(model=str(tmp_path / "m"), max_steps=1)
    load_tokenizer(local)
    meta_model(local.model, "causal-lm")
    load_base_model(local, tok, None, "cpu")
    assert {n for n, _ in seen} == {"AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"}
    assert all(v is False for _, v in seen), seen


# -- 6. config holes ----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("epochs", math.inf), ("epochs", math.nan), ("weight_decay", math.inf), ("lora_alpha", math.inf),
    ("max_grad_norm", math.inf), ("lora_dropout", math.nan), ("eval_fraction", math.nan),
    ("micro_batch_size", True), ("max_steps", True), ("seed", False), ("lr", True),
    ("resume_from", ""), ("resume_from", "  "), ("output_dir", ""),
])
def test_config_holes_are_config_errors_naming_the_field(field, value):
    kw = {field: value}
    if field == "epochs":
        kw["max_steps"] = None
    with pytest.raises(ConfigError) as err:
        TrainConfig(**kw)
    assert err.value.field == field
    assert f"{field}: " in str(err.value)


def test_bools_stay_allowed_where_they_belong():
    cfg = TrainConfig(packing=True, gradient_checkpointing=True, max_steps=3, epochs=1.5)
    assert cfg.packing is True and cfg.max_steps == 3 and cfg.epochs == 1.5


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    TrainConfig(model="tiny", data="builtin:python-docs", max_steps=2, subset=32, max_seq_len=32,
                micro_batch_size=4, eval_fraction=0.0, precision="fp32").to_yaml(path)
    return path


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("override, expect", [
    ("lora_targets=[q_proj", "not valid YAML"),
    ("seed=!!python/object/apply:os.getpid []", "tags such as !!python"),
    ("output_dir=!!python/name:os.system", "tags such as !!python"),
])
def test_cli_refuses_bad_set_values_in_one_line(cfg_file, capsys, override, expect):
    from nbtrain.cli import main

    key = override.split("=")[0]
    assert main(["estimate", str(cfg_file), "--set", override]) == 2
    line = _one_error_line(capsys)
    assert f"--set {key}" in line and expect in line


def test_cli_bad_checkpoint_is_one_line_and_exit_2(cfg_file, tmp_path, capsys):
    from nbtrain.cli import main

    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    assert main(["train", str(cfg_file), "--output-dir", str(tmp_path / "out"),
                 "--set", f"resume_from={empty}"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("nbtrain train: error:") and str(empty) in line


# -- 8 (CLI). notes and advice after the summary ----------------------------------------------------

def test_cli_train_prints_notes_and_advice(cfg_file, tmp_path, monkeypatch, capsys):
    import nbtrain.engine as engine
    from nbtrain.cli import main

    class Result:
        summary = {"steps": 3, "final_loss": 2.5, "stopped_reason": "out_of_memory",
                   "notes": ["out of memory at step 4: OutOfMemoryError"],
                   "advice": ["set micro_batch_size=2 and grad_accum_steps=4", "set precision='bf16'"]}

    monkeypatch.setattr(engine, "train", lambda cfg, callbacks=None: Result())
    assert main(["train", str(cfg_file), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    summary_at = out.index("stopped_reason")
    for text in Result.summary["notes"] + Result.summary["advice"]:
        assert out.index(text) > summary_at


# -- 7. messages that name the cause -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TrainConfig())


def test_broken_jsonl_line_is_named(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    rows = [json.dumps({"text": f"row {i}"}) for i in range(8)]
    rows[4] = '{"text": "row 4"'   # the 5th line lost its closing brace
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl.*line 5 is not valid JSON"):
        load_data(TrainConfig(data=str(p)), tok)


def test_broken_json_list_is_named(tmp_path, tok):
    p = tmp_path / "d.json"
    p.write_text('[\n{"text": "a"},\n{"text": "b"}\n{"text": "c"}\n]\n')
    with pytest.raises(DataError, match=r"line 4 is not valid JSON"):
        load_data(TrainConfig(data=str(p)), tok)


def test_all_empty_text_column_says_empty(tmp_path, tok):
    p = tmp_path / "d.csv"
    p.write_text("text,label\n,pos\n,neg\n,pos\n")
    for task in ("causal-lm", "sequence-classification"):
        with pytest.raises(DataError, match=r"text column 'text' is empty in all 3 rows") as err:
            load_data(TrainConfig(data=str(p), task=task), tok)
        assert "float" not in str(err.value)


@pytest.mark.parametrize("content, expect", [
    ('{"model_type": "llama",', "config.json is not valid JSON"),
    ("[1, 2]", "config.json holds a JSON list"),
])
def test_broken_model_config_json_is_blamed(tmp_path, content, expect):
    from nbtrain.models.loading import meta_model

    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelError, match=expect):
        load_tokenizer(TrainConfig(model=str(tmp_path)))
    with pytest.raises(ModelError, match=expect):
        meta_model(str(tmp_path), "causal-lm")


def test_string_labels_name_the_classifier_outputs(tmp_path):
    import nbtrain as nbt
    from transformers import AutoModelForSequenceClassification

    p = tmp_path / "reviews.csv"
    p.write_text("text,label\n" + "".join(f"review number {i} was {'good' if i % 2 else 'bad'},"
                                          f"{'pos' if i % 2 else 'neg'}\n" for i in range(16)))
    cfg = TrainConfig(model="tiny", task="sequence-classification", data=str(p), max_steps=2,
                      micro_batch_size=4, max_seq_len=32, eval_fraction=0.0, precision="fp32")
    result = nbt.train(cfg)
    assert result.model.config.id2label == {0: "neg", 1: "pos"}
    assert result.model.config.label2id == {"neg": 0, "pos": 1}
    again = AutoModelForSequenceClassification.from_pretrained(result.save(tmp_path / "saved"))
    assert again.config.id2label == {0: "neg", 1: "pos"}


def test_bitsandbytes_messages_are_not_hidden_globally(caplog):
    """nbtrain drops bitsandbytes' note about a Hub kernel only while it imports bitsandbytes itself (its Hub
    lookup off); after ``import nbtrain`` every message of that logger, the note included, still shows."""
    import logging

    import nbtrain  # noqa: F401

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "offline")
        log.warning("something else went wrong")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Failed to load CPU gemm_4bit_forward from kernels-community: offline. Please ...",
                        "something else went wrong"]


def test_lora_memory_estimate_raises_no_future_warning():
    """estimate_memory() of a LoRA config builds a peft model on the meta device; peft reads a transformers
    attribute deprecated in 5.x, whose FutureWarning showed as a red box in notebook 05."""
    import warnings

    import nbtrain as nbt
    from nbtrain.memory import facts

    facts._adapters.cache_clear()   # an earlier test may have counted these adapters already
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        est = nbt.estimate_memory(nbt.TrainConfig(model="tiny", method="lora", lora_r=4, max_seq_len=32))
    assert 0 < est.trainable_params < est.total_params
